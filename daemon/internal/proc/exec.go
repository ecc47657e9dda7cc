package proc

import (
	"context"
	"errors"
	"io"
	"os"
	"syscall"
	"time"
)

// pipeLinger is how long we wait for stdout/stderr to reach EOF after the
// command exited: a background grandchild may hold them open forever.
const pipeLinger = 100 * time.Millisecond

// ExecOptions are the knobs of a one-shot exec.
type ExecOptions struct {
	Stdin     *string       // nil: /dev/null
	Timeout   time.Duration // <= 0: none
	KillGrace time.Duration
	MaxOutput int // bytes kept per stream
	// Started, if set, is called by ExecStream once the command runs (or is
	// known to be a 126/127), before any output: the point of no HTTP error.
	Started func()
}

// ExecResult is the outcome of a one-shot exec.
type ExecResult struct {
	Exit
	Stdout    []byte
	Stderr    []byte
	TimedOut  bool
	Truncated bool
	Duration  time.Duration
}

// capture keeps the first max bytes read from a pipe and drains the rest.
type capture struct {
	buf       []byte
	max       int
	truncated bool
}

func (c *capture) readFrom(f *os.File, done chan<- struct{}) {
	defer func() { done <- struct{}{} }()
	var scratch []byte
	for {
		var p []byte
		if len(c.buf) < c.max {
			if len(c.buf) == cap(c.buf) {
				nb := make([]byte, len(c.buf), min(max(512, 2*cap(c.buf)), c.max))
				copy(nb, c.buf)
				c.buf = nb
			}
			p = c.buf[len(c.buf):cap(c.buf)]
		} else {
			if scratch == nil {
				scratch = make([]byte, 32<<10)
			}
			p = scratch
		}
		n, err := f.Read(p)
		if n > 0 {
			if len(c.buf) < c.max {
				c.buf = c.buf[:len(c.buf)+n]
			} else {
				c.truncated = true
			}
		}
		if err != nil {
			return
		}
	}
}

// Exec runs c to completion and returns its output. ctx ending (the client
// went away) kills the process group.
func (r *Runner) Exec(ctx context.Context, c *Command, o ExecOptions) (*ExecResult, error) {
	t0 := time.Now()
	st, err := r.start(c, o.Stdin != nil)
	if err != nil {
		var le *LaunchError
		if errors.As(err, &le) {
			res := &ExecResult{Exit: Exit{Code: le.Code}, Duration: time.Since(t0)}
			if c.MergeStderr {
				res.Stdout = []byte(le.Msg)
			} else {
				res.Stderr = []byte(le.Msg)
			}
			return res, nil
		}
		return nil, err
	}
	if o.Stdin != nil {
		go feedStdin(st.stdin, *o.Stdin)
	}
	out := capture{max: o.MaxOutput}
	errc := capture{max: o.MaxOutput}
	done := make(chan struct{}, 2)
	pipes := []*os.File{st.stdout}
	go out.readFrom(st.stdout, done)
	if st.stderr != nil { // nil: merged into stdout
		pipes = append(pipes, st.stderr)
		go errc.readFrom(st.stderr, done)
	}

	k := killer{pid: st.child.Pid, grace: o.KillGrace}
	k.arm(o.Timeout)
	defer k.stop()
	child := st.child
	ctxDone := ctx.Done()
wait:
	for {
		select {
		case <-child.Done():
			break wait
		case <-k.timeoutC:
			k.timeout()
		case <-k.graceC:
			k.kill()
		case <-ctxDone:
			ctxDone = nil
			k.kill()
		}
	}
	if k.timedOut {
		// The leader is gone; whatever it left in its group goes too.
		_ = syscall.Kill(-child.Pid, syscall.SIGKILL)
	}
	lingerPipes(done, len(pipes), pipes...)
	for _, f := range pipes {
		f.Close()
	}
	return &ExecResult{
		Exit:      ExitOf(child.Status()),
		Stdout:    out.buf,
		Stderr:    errc.buf,
		TimedOut:  k.timedOut,
		Truncated: out.truncated || errc.truncated,
		Duration:  child.Ended().Sub(t0),
	}, nil
}

// lingerPipes waits for n readers to signal done, for at most pipeLinger,
// then forces the remaining reads to return.
func lingerPipes(done <-chan struct{}, n int, files ...*os.File) {
	for n > 0 {
		select {
		case <-done:
			n--
			continue
		default:
		}
		break
	}
	if n == 0 {
		return
	}
	t := time.NewTimer(pipeLinger)
	defer t.Stop()
	for n > 0 {
		select {
		case <-done:
			n--
		case <-t.C:
			for _, f := range files {
				_ = f.SetReadDeadline(time.Unix(1, 0))
			}
			for ; n > 0; n-- {
				<-done
			}
		}
	}
}

func feedStdin(w *os.File, data string) {
	_, _ = io.WriteString(w, data)
	w.Close()
}

// killer implements the timeout policy: SIGTERM to the group, SIGKILL to the
// group after the grace period. Timers exist only when a timeout was asked.
type killer struct {
	pid      int
	grace    time.Duration
	timedOut bool
	tTimeout *time.Timer
	tGrace   *time.Timer
	timeoutC <-chan time.Time
	graceC   <-chan time.Time
}

func (k *killer) arm(timeout time.Duration) {
	if timeout > 0 {
		k.tTimeout = time.NewTimer(timeout)
		k.timeoutC = k.tTimeout.C
	}
}

func (k *killer) timeout() {
	k.timedOut = true
	k.timeoutC = nil
	_ = syscall.Kill(-k.pid, syscall.SIGTERM)
	if k.grace <= 0 {
		k.kill()
		return
	}
	k.tGrace = time.NewTimer(k.grace)
	k.graceC = k.tGrace.C
}

func (k *killer) kill() {
	k.graceC = nil
	_ = syscall.Kill(-k.pid, syscall.SIGKILL)
}

func (k *killer) stop() {
	if k.tTimeout != nil {
		k.tTimeout.Stop()
	}
	if k.tGrace != nil {
		k.tGrace.Stop()
	}
}
