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

// Session is a persistent shell; runs are evaluated in the shell itself so
// cd, variables and functions persist.
type Session struct {
	ID    string
	Shell string
	Pid   int

	seq        int
	stdinRedir string // "</dev/null", or "<&-" in a rootfs without /dev/null
	child      *reaper.Child
	stdin      *os.File
	stdout     *os.File
	stderr     *os.File
	pumpDone   chan struct{}
	runMu      sync.Mutex // held for a whole run; TryLock failing means busy

	mu       sync.Mutex
	cur      *sessRun
	progress chan struct{} // poked (non-blocking) when a scanner completes
}

type sessRun struct {
	out, err markScanner
}

// Alive reports whether the shell is still running.
func (s *Session) Alive() bool { return !s.child.Exited() }

func (s *Session) pump(f *os.File, stream int) {
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

// Run evaluates cmd in the shell. `command eval` keeps a syntax error from
// killing a POSIX shell; each stream ends with a fresh random marker line
// whose leading newline we strip again, so output without a final newline
// comes back unchanged.
func (s *Session) Run(ctx context.Context, cmd string, timeout time.Duration, maxOutput int) (*RunResult, error) {
	if !s.runMu.TryLock() {
		return nil, apierr.New(http.StatusConflict, "session_busy", "a run is already in progress on session %s", s.ID)
	}
	defer s.runMu.Unlock()
	if !s.Alive() {
		return nil, apierr.New(http.StatusConflict, "session_closed", "the shell of session %s has exited", s.ID)
	}
	var rb [16]byte
	_, _ = rand.Read(rb[:])
	mark := "__sandman_" + hex.EncodeToString(rb[:])
	run := &sessRun{
		out: markScanner{pat: []byte("\n" + mark + " "), wantRC: true, max: maxOutput},
		err: markScanner{pat: []byte("\n" + mark + "\n"), max: maxOutput},
	}
	script := "command eval " + shQuote(cmd) + " " + s.stdinRedir + "; __sandman_rc=$?; " +
		"printf '\\n%s %d\\n' " + mark + " \"$__sandman_rc\"; printf '\\n%s\\n' " + mark + " >&2\n"

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
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		deadline = t.C
		_ = s.stdin.SetWriteDeadline(t0.Add(timeout))
	}
	res := &RunResult{}
	if _, err := s.stdin.WriteString(script); err != nil && !errors.Is(err, syscall.EPIPE) {
		// Only a deadline can get here: the shell stopped reading.
		res.TimedOut = true
	}
	_ = s.stdin.SetWriteDeadline(time.Time{})

	var grace <-chan time.Time
	ended := false
	for !ended && !res.TimedOut {
		select {
		case <-s.progress:
			s.mu.Lock()
			o, e := run.out.complete, run.err.complete
			s.mu.Unlock()
			if o && e {
				ended = true
			} else if grace == nil {
				g := time.NewTimer(markerGrace)
				defer g.Stop()
				grace = g.C
			}
		case <-grace:
			ended = true
		case <-s.child.Done():
			ended = true
		case <-deadline:
			res.TimedOut = true
		case <-ctx.Done():
			res.TimedOut = true // nobody waits for the result; treat it the same
		}
	}
	if res.TimedOut {
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

// kill ends the shell and everything in its group.
func (s *Session) kill() {
	if !s.child.Exited() {
		_ = syscall.Kill(-s.Pid, syscall.SIGKILL)
	}
	s.stdin.Close()
	_ = s.stdout.SetReadDeadline(time.Unix(1, 0))
	_ = s.stderr.SetReadDeadline(time.Unix(1, 0))
}

// SessionManager holds the sessions by id.
type SessionManager struct {
	r        *Runner
	mu       sync.Mutex
	sessions map[string]*Session
	seq      int
}

// NewSessionManager returns an empty SessionManager.
func NewSessionManager(r *Runner) *SessionManager {
	return &SessionManager{r: r, sessions: make(map[string]*Session)}
}

// DefaultSessionShell is /bin/bash when the image has it, else /bin/sh.
func DefaultSessionShell() string {
	if checkExecutable("/bin/bash") == nil {
		return "/bin/bash"
	}
	return "/bin/sh"
}

// Start launches a shell. A shell that cannot be launched is not_found.
func (m *SessionManager) Start(shell, dir string, env map[string]string) (*Session, error) {
	if shell == "" {
		shell = DefaultSessionShell()
	}
	st, err := m.r.start(&Command{Argv: []string{shell}, Dir: dir, Env: env}, true)
	if err != nil {
		var le *LaunchError
		if errors.As(err, &le) {
			return nil, apierr.NotFound("shell %s cannot be started: %s", shell, strings.TrimSpace(le.Msg))
		}
		return nil, err
	}
	s := &Session{
		Shell: shell, Pid: st.child.Pid, child: st.child, stdinRedir: "</dev/null",
		stdin: st.stdin, stdout: st.stdout, stderr: st.stderr,
		pumpDone: make(chan struct{}, 2), progress: make(chan struct{}, 1),
	}
	if m.r.devNull == nil {
		s.stdinRedir = "<&-"
	}
	go s.pump(st.stdout, Stdout)
	go s.pump(st.stderr, Stderr)
	m.mu.Lock()
	m.seq++
	s.seq = m.seq
	s.ID = fmt.Sprintf("s-%d", m.seq)
	m.sessions[s.ID] = s
	m.mu.Unlock()
	return s, nil
}

// Get finds a session by id.
func (m *SessionManager) Get(id string) (*Session, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s := m.sessions[id]; s != nil {
		return s, nil
	}
	return nil, apierr.NotFound("no session %q", id)
}

// List returns the sessions in creation order.
func (m *SessionManager) List() []*Session {
	m.mu.Lock()
	ss := make([]*Session, 0, len(m.sessions))
	for _, s := range m.sessions {
		ss = append(ss, s)
	}
	m.mu.Unlock()
	sort.Slice(ss, func(i, j int) bool { return ss[i].seq < ss[j].seq })
	return ss
}

// Delete kills the session's process group and forgets it.
func (m *SessionManager) Delete(id string) error {
	m.mu.Lock()
	s := m.sessions[id]
	delete(m.sessions, id)
	m.mu.Unlock()
	if s == nil {
		return apierr.NotFound("no session %q", id)
	}
	s.kill()
	return nil
}
