package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// envSecretPrefix marks variables meant for the daemon alone; none of them
// may reach a command, nor stay in the daemon's /proc/<pid>/environ.
const envSecretPrefix = "SANDMAND_"

// reexecWithoutSecrets runs this binary again with every SANDMAND_*
// variable removed from its environment, passing $SANDMAND_TOKEN on a pipe
// (--env-token-fd). Unsetenv alone is not enough: the kernel shows the
// environment block the process was started with in /proc/<pid>/environ,
// and the Kubernetes provider starts the daemon with its token there.
// Returns nil at once when there is nothing to hide.
func reexecWithoutSecrets() error {
	var kept []string
	token, found := "", false
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(k, envSecretPrefix) {
			kept = append(kept, kv)
			continue
		}
		found = true
		if k == envSecretPrefix+"TOKEN" {
			token = v
		}
	}
	if !found {
		return nil
	}
	args := append([]string(nil), os.Args...)
	if token != "" {
		var p [2]int
		// No O_CLOEXEC on the read end: the new image inherits it.
		if err := syscall.Pipe(p[:]); err != nil {
			return fmt.Errorf("pipe for the token: %w", err)
		}
		syscall.CloseOnExec(p[1])
		// A token fits the pipe's buffer many times over: the write cannot block.
		if _, err := syscall.Write(p[1], []byte(token)); err != nil {
			return fmt.Errorf("passing the token: %w", err)
		}
		syscall.Close(p[1])
		args = append(args[:1], append([]string{"--env-token-fd", strconv.Itoa(p[0])}, args[1:]...)...)
	}
	return syscall.Exec("/proc/self/exe", args, kept)
}

// readTokenFD reads the token from descriptor fd to its end and closes it.
func readTokenFD(fd int) (string, error) {
	f := os.NewFile(uintptr(fd), "token-fd")
	if f == nil {
		return "", fmt.Errorf("--token-fd %d: not a descriptor", fd)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return "", fmt.Errorf("reading the token from descriptor %d: %w", fd, err)
	}
	token := strings.TrimSpace(string(data))
	if token == "" {
		return "", fmt.Errorf("descriptor %d held no token", fd)
	}
	return token, nil
}

// prSetDumpable is PR_SET_DUMPABLE from linux/prctl.h.
const prSetDumpable = 4

// becomeUndumpable keeps the workload, root in the same pid namespace, from
// reading or tracing the daemon: /proc/<pid>/mem, environ, fd/ (where the
// listening socket is) then need CAP_SYS_PTRACE, which sandboxes lack.
// Commands it starts are dumpable again: execve resets the flag.
func becomeUndumpable() error {
	if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetDumpable, 0, 0); errno != 0 {
		return errno
	}
	return nil
}
