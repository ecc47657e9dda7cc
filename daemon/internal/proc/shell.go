package proc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/reaper"
)

// markerGrace is how long a run waits for the second end marker once the
// first arrived; a command that closed one of the shell's outputs would
// otherwise hang the run.
const markerGrace = 500 * time.Millisecond

// Shell is a persistent shell (the API's /v1/shells, once called sessions); runs
// are evaluated in the shell itself so cd, variables and functions persist.
type Shell struct {
	ID   string
	Path string // the shell program
	Pid  int
	Who  Who // the user the shell runs as

	seq        int
	stdinRedir string // "</dev/null", or "<&-" in a rootfs without /dev/null
	child      *reaper.Child
	stdin      *os.File
	stdout     *os.File
	stderr     *os.File
	pumpDone   chan struct{}
	ready      chan struct{} // closed once the shell's first line (its trap) is done
	runMu      sync.Mutex    // held for a whole run; TryLock failing means busy

	mu       sync.Mutex
	cur      *shellRun
	progress chan struct{} // poked (non-blocking) when a scanner completes
}

type shellRun struct {
	out, err markScanner
}

// Alive reports whether the shell is still running.
func (s *Shell) Alive() bool { return !s.child.Exited() }

func (s *Shell) pump(f *os.File, stream int) {
	defer func() { s.pumpDone <- struct{}{} }()
	buf := make([]byte, 32<<10)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			s.mu.Lock()
			if r := s.cur; r != nil {
				sc := &r.out
				if stream == Stderr {
					sc = &r.err
				}
				if sc.feed(buf[:n]) {
					select {
					case s.progress <- struct{}{}:
					default:
					}
				}
			} // else: output of a background job between runs; dropped
			s.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

// RunResult is the outcome of one run.
type RunResult struct {
	ExitCode  int
	Stdout    []byte
	Stderr    []byte
	TimedOut  bool
	Truncated bool
	Duration  time.Duration
	Alive     bool
}

func shQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// interruptTrap is a Shell's SIGINT trap, set when the shell
// starts and again by every interruptible run: a SIGINT makes the shell
// leave every loop it is in (a run wraps its command in one), so the rest of
// the command line is skipped as Ctrl-C would, and the shell lives on. Its
// children get SIGINT's default action (a trap is not inherited), and break
// outside a loop does nothing.
const interruptTrap = "trap '__sandman_int=1; break 1000 2>/dev/null' INT"

// RunOptions are the knobs of one run in a shell.
type RunOptions struct {
	Cmd       string
	Timeout   time.Duration // <= 0: none
	MaxOutput int
	// MergeStderr sends the command's stderr to its stdout: one interleaved
	// stream, reported as stdout.
	MergeStderr bool
	// Interrupt, on timeout (or when the client goes away), sends SIGINT to
	// the shell's process group and waits up to Grace for the command line
	// to end, so the shell and its state survive; only then is the shell
	// killed. Otherwise the shell is killed at once.
	Interrupt bool
	Grace     time.Duration
}

// script is the line the shell is sent for a run. `command eval` keeps a
// syntax error from killing a POSIX shell; each stream ends with a fresh
// random marker line whose leading newline we strip again, so output without
// a final newline comes back unchanged.
func (s *Shell) script(o RunOptions, mark string) string {
	run := "command eval " + shQuote(o.Cmd) + " " + s.stdinRedir
	if o.MergeStderr {
		run += " 2>&1"
	}
	var b strings.Builder
	if o.Interrupt {
		b.WriteString(interruptTrap + "; __sandman_int=; for __sandman_once in 1; do " + run +
			"; done; __sandman_rc=$?; [ -z \"$__sandman_int\" ] || __sandman_rc=130; ")
	} else {
		b.WriteString(run + "; __sandman_rc=$?; ")
	}
	b.WriteString("printf '\\n%s %d\\n' " + mark + " \"$__sandman_rc\"; printf '\\n%s\\n' " + mark + " >&2\n")
	return b.String()
}

// Run evaluates o.Cmd in the shell.
func (s *Shell) Run(ctx context.Context, o RunOptions) (*RunResult, error) {
	<-s.ready // the shell reads its lines in order: this costs the run nothing
	if !s.runMu.TryLock() {
		return nil, apierr.New(http.StatusConflict, "shell_busy", "a run is already in progress in shell %s", s.ID)
	}
	defer s.runMu.Unlock()
	return s.run(ctx, o)
}

func (s *Shell) run(ctx context.Context, o RunOptions) (*RunResult, error) {
	if !s.Alive() {
		return nil, apierr.New(http.StatusConflict, "shell_closed", "shell %s has exited", s.ID)
	}
	var rb [16]byte
	_, _ = rand.Read(rb[:])
	mark := "__sandman_" + hex.EncodeToString(rb[:])
	run := &shellRun{
		out: markScanner{pat: []byte("\n" + mark + " "), wantRC: true, max: o.MaxOutput},
		err: markScanner{pat: []byte("\n" + mark + "\n"), max: o.MaxOutput},
	}
	script := s.script(o, mark)

	t0 := time.Now()
	s.mu.Lock()
	s.cur = run
	select { // a stale poke from an earlier run
	case <-s.progress:
	default:
	}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.cur = nil
		s.mu.Unlock()
	}()

	var deadline <-chan time.Time
	if o.Timeout > 0 {
		t := time.NewTimer(o.Timeout)
		defer t.Stop()
		deadline = t.C
		_ = s.stdin.SetWriteDeadline(t0.Add(o.Timeout))
	}
	res := &RunResult{}
	kill := false
	if _, err := s.stdin.WriteString(script); err != nil && !errors.Is(err, syscall.EPIPE) {
		// Only a deadline can get here: the shell stopped reading, and
		// may hold half a script; nothing short of killing it is safe.
		res.TimedOut, kill = true, true
	}
	_ = s.stdin.SetWriteDeadline(time.Time{})

	ctxDone := ctx.Done()
	var markerC, graceC <-chan time.Time
	ended := false
	for !ended && !kill {
		select {
		case <-s.progress:
			s.mu.Lock()
			outDone, errDone := run.out.complete, run.err.complete
			s.mu.Unlock()
			if outDone && errDone {
				ended = true
			} else if markerC == nil {
				g := time.NewTimer(markerGrace)
				defer g.Stop()
				markerC = g.C
			}
		case <-markerC:
			ended = true
		case <-s.child.Done():
			ended = true
		case <-deadline:
			res.TimedOut = true
			deadline, ctxDone = nil, nil
			kill = !s.interrupt(o)
			graceC = graceAfter(o, kill)
		case <-ctxDone: // nobody waits for the result; treat it as a timeout
			res.TimedOut = true
			deadline, ctxDone = nil, nil
			kill = !s.interrupt(o)
			graceC = graceAfter(o, kill)
		case <-graceC: // SIGINT did not end the command line in time
			kill = true
		}
	}
	if kill {
		_ = syscall.Kill(-s.Pid, syscall.SIGKILL)
		<-s.child.Done()
	}
	s.mu.Lock()
	done := run.out.complete
	s.mu.Unlock()
	if !done && s.child.Exited() {
		// The shell is gone (exit, timeout): collect what its pipes still hold.
		lingerPipes(s.pumpDone, 2, s.stdout, s.stderr)
		s.mu.Lock()
		run.out.flush()
		run.err.flush()
		s.mu.Unlock()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	res.Stdout, res.Stderr = run.out.kept, run.err.kept
	res.Truncated = run.out.truncated || run.err.truncated
	res.Duration = time.Since(t0)
	res.Alive = s.Alive()
	if done {
		res.ExitCode = run.out.rc
	} else {
		res.ExitCode = ExitOf(s.child.Status()).Code
	}
	return res, nil
}

// interrupt sends SIGINT to the shell's group when the run asked for it;
// false means "kill the shell now".
func (s *Shell) interrupt(o RunOptions) bool {
	return o.Interrupt && syscall.Kill(-s.Pid, syscall.SIGINT) == nil
}

// graceAfter is when an interrupted run gives up on the command line.
func graceAfter(o RunOptions, killing bool) <-chan time.Time {
	if killing {
		return nil
	}
	return time.After(o.Grace)
}

// kill ends the shell and everything in its group.
func (s *Shell) kill() {
	if !s.child.Exited() {
		_ = syscall.Kill(-s.Pid, syscall.SIGKILL)
	}
	s.stdin.Close()
	_ = s.stdout.SetReadDeadline(time.Unix(1, 0))
	_ = s.stderr.SetReadDeadline(time.Unix(1, 0))
}

// ShellManager holds the shells by id.
type ShellManager struct {
	r      *Runner
	mu     sync.Mutex
	shells map[string]*Shell
	seq    int
}

// NewShellManager returns an empty ShellManager.
func NewShellManager(r *Runner) *ShellManager {
	return &ShellManager{r: r, shells: make(map[string]*Shell)}
}

// DefaultShellProgram is what a Shell runs unless told: /bin/bash when the image has
// it, else /bin/sh.
func DefaultShellProgram() string {
	if checkExecutable("/bin/bash") == nil {
		return "/bin/bash"
	}
	return "/bin/sh"
}

// shellInitTimeout bounds the shell's first run, which sets its SIGINT trap.
const shellInitTimeout = 10 * time.Second

// Start launches a shell, as user if not empty, and has it set its SIGINT
// trap (see interruptTrap) before it takes any run, so that no interrupt can
// come before it; that first line runs in the background (the shell would
// read it before a run's anyway), so starting a shell costs no round trip.
// A shell that cannot be launched is not_found.
func (m *ShellManager) Start(shell, dir string, env map[string]string, user string) (*Shell, error) {
	if shell == "" {
		shell = DefaultShellProgram()
	}
	st, err := m.r.start(&Command{Argv: []string{shell}, Dir: dir, Env: env, User: user}, true)
	if err != nil {
		var le *LaunchError
		if errors.As(err, &le) {
			return nil, apierr.NotFound("shell %s cannot be started: %s", shell, strings.TrimSpace(le.Msg))
		}
		return nil, err
	}
	s := &Shell{
		Path: shell, Pid: st.child.Pid, Who: m.r.whoOf(st.id), child: st.child, stdinRedir: "</dev/null",
		stdin: st.stdin, stdout: st.stdout, stderr: st.stderr,
		pumpDone: make(chan struct{}, 2), progress: make(chan struct{}, 1),
		ready: make(chan struct{}),
	}
	if m.r.devNull == nil {
		s.stdinRedir = "<&-"
	}
	// Named before anything runs: a shell that dies at once says so by its id.
	m.mu.Lock()
	m.seq++
	s.seq = m.seq
	s.ID = fmt.Sprintf("s-%d", m.seq)
	m.shells[s.ID] = s
	m.mu.Unlock()
	go s.pump(st.stdout, Stdout)
	go s.pump(st.stderr, Stderr)
	s.runMu.Lock()
	go func() {
		defer close(s.ready)
		defer s.runMu.Unlock()
		// A shell that dies here (or hangs) is then reported with alive
		// false, as one that exits on its own.
		_, _ = s.run(context.Background(), RunOptions{Cmd: interruptTrap, Timeout: shellInitTimeout})
	}()
	return s, nil
}

// Get finds a shell by id.
func (m *ShellManager) Get(id string) (*Shell, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s := m.shells[id]; s != nil {
		return s, nil
	}
	return nil, apierr.NotFound("no shell %q", id)
}

// List returns the shells in creation order.
func (m *ShellManager) List() []*Shell {
	m.mu.Lock()
	ss := make([]*Shell, 0, len(m.shells))
	for _, s := range m.shells {
		ss = append(ss, s)
	}
	m.mu.Unlock()
	sort.Slice(ss, func(i, j int) bool { return ss[i].seq < ss[j].seq })
	return ss
}

// Delete kills the shell's process group and forgets it.
func (m *ShellManager) Delete(id string) error {
	m.mu.Lock()
	s := m.shells[id]
	delete(m.shells, id)
	m.mu.Unlock()
	if s == nil {
		return apierr.NotFound("no shell %q", id)
	}
	s.kill()
	return nil
}
