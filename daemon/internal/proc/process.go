package proc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"sync"
	"syscall"
	"time"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/reaper"
)

// Process is a background command that outlives the request that started it.
type Process struct {
	ID      string
	Argv    []string // nil when started from Cmd
	Cmd     *string
	Pid     int // 0 when it could not be launched
	Started time.Time
	TTY     bool // on a pseudo-terminal: stdout is the terminal, stderr stays empty
	Who     Who  // the user it was started as

	seq      int
	child    *reaper.Child
	stdout   *os.File
	stderr   *os.File   // nil on a terminal
	stdinMu  sync.Mutex // serialises writers so bodies do not interleave
	finished chan struct{}

	mu      sync.Mutex
	out     ring
	errb    ring
	stdin   *os.File      // nil when never opened or closed
	ttyGone bool          // the terminal's master is closed (Resize checks it)
	changed chan struct{} // closed and replaced on new output or exit
	running bool
	exit    Exit
	ended   time.Time
}

// ProcessInfo is a snapshot of a Process.
type ProcessInfo struct {
	ID        string
	Pid       int
	Argv      []string
	Cmd       *string
	Running   bool
	Exit      *Exit // nil while running
	StartedAt time.Time
	EndedAt   *time.Time
	StdinOpen bool
	TTY       bool
	Who       Who
}

// Info snapshots p.
func (p *Process) Info() ProcessInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	info := ProcessInfo{ID: p.ID, Pid: p.Pid, Argv: p.Argv, Cmd: p.Cmd,
		Running: p.running, StartedAt: p.Started, StdinOpen: p.stdin != nil, TTY: p.TTY, Who: p.Who}
	if !p.running {
		e, t := p.exit, p.ended
		info.Exit, info.EndedAt = &e, &t
	}
	return info
}

// notify wakes long-pollers; p.mu must be held.
func (p *Process) notify() {
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *Process) pump(f *os.File, r *ring, done chan<- struct{}) {
	defer func() { done <- struct{}{} }()
	defer func() {
		// Under mu, so Resize never runs its ioctl on a closing master.
		p.mu.Lock()
		if p.TTY {
			p.ttyGone = true
		}
		f.Close()
		p.mu.Unlock()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			p.mu.Lock()
			r.write(buf[:n])
			p.notify()
			p.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

// Output is a slice of a process's retained output.
type Output struct {
	Stdout, Stderr             []byte
	StdoutOffset, StderrOffset int64
	StdoutNext, StderrNext     int64
	Running                    bool
	Exit                       *Exit
}

// Output returns the output after the given offsets. With wait > 0 it blocks
// until there is something new, the process ends, or wait passes.
func (p *Process) Output(ctx context.Context, outOff, errOff int64, wait time.Duration) Output {
	p.mu.Lock()
	if wait > 0 && p.running && p.out.total <= outOff && p.errb.total <= errOff {
		ch := p.changed
		p.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-ch:
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
		p.mu.Lock()
	}
	defer p.mu.Unlock()
	var o Output
	o.Stdout, o.StdoutOffset = p.out.read(outOff)
	o.Stderr, o.StderrOffset = p.errb.read(errOff)
	o.StdoutNext = o.StdoutOffset + int64(len(o.Stdout))
	o.StderrNext = o.StderrOffset + int64(len(o.Stderr))
	o.Running = p.running
	if !p.running {
		e := p.exit
		o.Exit = &e
	}
	return o
}

// Wait blocks until the process has finished or timeout (<= 0: forever)
// passes.
func (p *Process) Wait(ctx context.Context, timeout time.Duration) {
	var tc <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		tc = t.C
	}
	select {
	case <-p.finished:
	case <-tc:
	case <-ctx.Done():
	}
}

// Signal sends sig to the process (or its group). A finished process is
// left alone: its pid may already belong to someone else.
func (p *Process) Signal(sig syscall.Signal, group bool) error {
	if p.child == nil || p.child.Exited() {
		return nil
	}
	pid := p.Pid
	if group {
		pid = -pid
	}
	if err := syscall.Kill(pid, sig); err != nil && err != syscall.ESRCH {
		return apierr.FromOS(err)
	}
	return nil
}

var errNotATTY = apierr.New(http.StatusConflict, "not_a_tty", "the process is not on a terminal")

// Resize sets the size of the process's terminal. A finished process is
// left alone, like Signal does.
func (p *Process) Resize(size WinSize) error {
	if !p.TTY {
		return errNotATTY
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stdout == nil || p.ttyGone {
		return nil // never launched, or the terminal is gone
	}
	if err := setSize(p.stdout, size); err != nil {
		return apierr.Internal("%v", err)
	}
	return nil
}

var errStdinClosed = apierr.New(http.StatusConflict, "stdin_closed", "stdin is not open")

// WriteStdin copies body to the process's stdin, then closes it if asked.
func (p *Process) WriteStdin(ctx context.Context, body io.Reader, closeAfter bool) error {
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	p.mu.Lock()
	w := p.stdin
	p.mu.Unlock()
	if w == nil {
		return errStdinClosed
	}
	// A reader that never reads must not pin this request forever once the
	// client gives up.
	stop := context.AfterFunc(ctx, func() { _ = w.SetWriteDeadline(time.Unix(1, 0)) })
	_, err := io.Copy(w, body)
	stop()
	_ = w.SetWriteDeadline(time.Time{})
	if err != nil {
		// EIO: a terminal whose other side every process has closed.
		if errors.Is(err, syscall.EPIPE) || (p.TTY && errors.Is(err, syscall.EIO)) {
			p.closeStdin()
			return apierr.New(http.StatusConflict, "stdin_closed", "the process closed its stdin")
		}
		return apierr.InvalidRequest("writing stdin: %v", err)
	}
	if closeAfter {
		p.closeStdin()
	}
	return nil
}

func (p *Process) closeStdin() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
}

// finish records the exit once the leader is reaped and its pipes have
// drained (or pipeLinger passed), so a client seeing running=false has all
// the output the process wrote.
func (p *Process) finish(done <-chan struct{}) {
	<-p.child.Done()
	t := time.NewTimer(pipeLinger)
	for n := 2; n > 0; {
		select {
		case <-done:
			n--
			continue
		case <-t.C:
		}
		break
	}
	t.Stop()
	if p.TTY {
		// Nobody is left to read the keyboard; do not hold the terminal open
		// for a process that is over.
		p.closeStdin()
	}
	p.mu.Lock()
	p.exit = ExitOf(p.child.Status())
	p.ended = p.child.Ended()
	p.running = false
	p.notify()
	p.mu.Unlock()
	close(p.finished)
}

// ProcessOptions are the knobs of a background process.
type ProcessOptions struct {
	Stdin     bool
	MaxBuffer int
	// TTY runs the process on a pseudo-terminal of Size (stdin always open).
	TTY  bool
	Size WinSize
}

// Manager holds the background processes by id.
type Manager struct {
	r     *Runner
	mu    sync.Mutex
	procs map[string]*Process
	seq   int
}

// NewManager returns an empty Manager.
func NewManager(r *Runner) *Manager {
	return &Manager{r: r, procs: make(map[string]*Process)}
}

// Start launches c in the background. A command that cannot be launched
// still yields a Process, already finished with 126/127.
func (m *Manager) Start(c *Command, o ProcessOptions) (*Process, error) {
	p := &Process{
		Argv: c.Argv, Cmd: c.Cmd, Started: time.Now(), TTY: o.TTY,
		out: ring{max: o.MaxBuffer}, errb: ring{max: o.MaxBuffer},
		changed: make(chan struct{}), finished: make(chan struct{}),
	}
	var st *started
	var err error
	if o.TTY {
		st, err = m.r.startTTY(c, o.Size)
	} else {
		st, err = m.r.start(c, o.Stdin)
	}
	var le *LaunchError
	switch {
	case errors.As(err, &le):
		if c.MergeStderr {
			p.out.write([]byte(le.Msg))
		} else {
			p.errb.write([]byte(le.Msg))
		}
		p.exit, p.ended = Exit{Code: le.Code}, time.Now()
		p.Who = m.r.WhoWouldRun(c)
		close(p.finished)
	case err != nil:
		return nil, err
	default:
		p.child, p.Pid, p.Started = st.child, st.child.Pid, st.child.Started()
		p.stdout, p.stderr, p.stdin = st.stdout, st.stderr, st.stdin
		p.Who = m.r.whoOf(st.id)
		p.running = true
		done := make(chan struct{}, 2)
		go p.pump(st.stdout, &p.out, done)
		if st.stderr != nil {
			go p.pump(st.stderr, &p.errb, done)
		} else {
			done <- struct{}{} // a terminal has one output stream
		}
		go p.finish(done)
	}
	m.mu.Lock()
	m.seq++
	p.seq = m.seq
	p.ID = fmt.Sprintf("p-%d", m.seq)
	m.procs[p.ID] = p
	m.mu.Unlock()
	return p, nil
}

// Get finds a process by id.
func (m *Manager) Get(id string) (*Process, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if p := m.procs[id]; p != nil {
		return p, nil
	}
	return nil, apierr.NotFound("no process %q", id)
}

// List returns the processes in start order.
func (m *Manager) List() []*Process {
	m.mu.Lock()
	ps := make([]*Process, 0, len(m.procs))
	for _, p := range m.procs {
		ps = append(ps, p)
	}
	m.mu.Unlock()
	sort.Slice(ps, func(i, j int) bool { return ps[i].seq < ps[j].seq })
	return ps
}

// Delete kills the process's group if it is running and forgets it.
func (m *Manager) Delete(id string) error {
	m.mu.Lock()
	p := m.procs[id]
	delete(m.procs, id)
	m.mu.Unlock()
	if p == nil {
		return apierr.NotFound("no process %q", id)
	}
	_ = p.Signal(syscall.SIGKILL, true)
	p.closeStdin()
	if p.stdout != nil {
		// Unblock the pumps even if a grandchild still holds the pipes.
		_ = p.stdout.SetReadDeadline(time.Unix(1, 0))
	}
	if p.stderr != nil {
		_ = p.stderr.SetReadDeadline(time.Unix(1, 0))
	}
	return nil
}
