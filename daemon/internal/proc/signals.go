package proc

import (
	"strconv"
	"strings"
	"syscall"
)

// signalNames maps the signals a client may name (and that we report) to
// names without the SIG prefix. Built from syscall constants so numbering is
// right for the architecture.
var signalNames = map[syscall.Signal]string{
	syscall.SIGHUP: "HUP", syscall.SIGINT: "INT", syscall.SIGQUIT: "QUIT",
	syscall.SIGILL: "ILL", syscall.SIGTRAP: "TRAP", syscall.SIGABRT: "ABRT",
	syscall.SIGBUS: "BUS", syscall.SIGFPE: "FPE", syscall.SIGKILL: "KILL",
	syscall.SIGUSR1: "USR1", syscall.SIGSEGV: "SEGV", syscall.SIGUSR2: "USR2",
	syscall.SIGPIPE: "PIPE", syscall.SIGALRM: "ALRM", syscall.SIGTERM: "TERM",
	syscall.SIGCHLD: "CHLD", syscall.SIGCONT: "CONT", syscall.SIGSTOP: "STOP",
	syscall.SIGTSTP: "TSTP", syscall.SIGTTIN: "TTIN", syscall.SIGTTOU: "TTOU",
	syscall.SIGURG: "URG", syscall.SIGXCPU: "XCPU", syscall.SIGXFSZ: "XFSZ",
	syscall.SIGVTALRM: "VTALRM", syscall.SIGPROF: "PROF", syscall.SIGWINCH: "WINCH",
	syscall.SIGIO: "IO", syscall.SIGPWR: "PWR", syscall.SIGSYS: "SYS",
}

// SignalName is the name without SIG, or the number for realtime signals.
func SignalName(s syscall.Signal) string {
	if n, ok := signalNames[s]; ok {
		return n
	}
	return strconv.Itoa(int(s))
}

// ParseSignal accepts a name with or without SIG (any case) or a number 1..64.
func ParseSignal(s string) (syscall.Signal, bool) {
	if n, err := strconv.Atoi(s); err == nil {
		if n < 1 || n > 64 {
			return 0, false
		}
		return syscall.Signal(n), true
	}
	name := strings.TrimPrefix(strings.ToUpper(s), "SIG")
	for sig, n := range signalNames {
		if n == name {
			return sig, true
		}
	}
	return 0, false
}

// Exit is how a process ended, in protocol terms.
type Exit struct {
	Code   int
	Signal string // "" when not killed by a signal
}

// ExitOf converts a wait status: 128+signo for a signal death.
func ExitOf(ws syscall.WaitStatus) Exit {
	if ws.Signaled() {
		return Exit{Code: 128 + int(ws.Signal()), Signal: SignalName(ws.Signal())}
	}
	return Exit{Code: ws.ExitStatus()}
}
