package proc

import (
	"context"
	"errors"
	"os"
	"syscall"
	"time"
)

// Stream numbers passed to an Emit function.
const (
	Stdout = 1
	Stderr = 2
)

// Emit receives output as it happens. An error (the client is gone) kills
// the command.
type Emit func(stream int, data []byte) error

type chunk struct {
	stream int
	data   []byte // nil: EOF
}

func pump(f *os.File, stream int, ch chan<- chunk) {
	buf := make([]byte, 32<<10)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			ch <- chunk{stream, append([]byte(nil), buf[:n]...)}
		}
		if err != nil {
			ch <- chunk{stream, nil}
			return
		}
	}
}

// ExecStream runs c and hands its output to emit as it arrives. Only the
// first MaxOutput bytes of each stream are emitted; Stdout/Stderr of the
// result stay empty.
func (r *Runner) ExecStream(ctx context.Context, c *Command, o ExecOptions, emit Emit) (*ExecResult, error) {
	t0 := time.Now()
	st, err := r.start(c, o.Stdin != nil)
	if err != nil {
		var le *LaunchError
		if errors.As(err, &le) {
			res := &ExecResult{Exit: Exit{Code: le.Code}, Duration: time.Since(t0)}
			if o.Started != nil {
				o.Started()
			}
			stream := Stderr
			if c.MergeStderr {
				stream = Stdout
			}
			_ = emit(stream, []byte(le.Msg))
			return res, nil
		}
		return nil, err
	}
	if o.Started != nil {
		o.Started()
	}
	if o.Stdin != nil {
		go feedStdin(st.stdin, *o.Stdin)
	}
	ch := make(chan chunk, 16)
	pipes := []*os.File{st.stdout}
	go pump(st.stdout, Stdout, ch)
	if st.stderr != nil { // nil: merged into stdout
		pipes = append(pipes, st.stderr)
		go pump(st.stderr, Stderr, ch)
	}

	res := &ExecResult{}
	sent := [3]int{}
	open := len(pipes)
	deliver := func(ck chunk) {
		if ck.data == nil {
			open--
			return
		}
		room := o.MaxOutput - sent[ck.stream]
		d := ck.data
		if len(d) > room {
			d = d[:max(room, 0)]
			res.Truncated = true
		}
		if len(d) == 0 {
			return
		}
		sent[ck.stream] += len(d)
		if emit(ck.stream, d) != nil {
			_ = syscall.Kill(-st.child.Pid, syscall.SIGKILL)
		}
	}

	k := killer{pid: st.child.Pid, grace: o.KillGrace}
	k.arm(o.Timeout)
	defer k.stop()
	child := st.child
	ctxDone := ctx.Done()
	exited := child.Done()
	var linger <-chan time.Time
	for open > 0 {
		select {
		case ck := <-ch:
			deliver(ck)
		case <-exited:
			exited = nil
			if k.timedOut {
				_ = syscall.Kill(-child.Pid, syscall.SIGKILL)
			}
			t := time.NewTimer(pipeLinger)
			defer t.Stop()
			linger = t.C
		case <-linger:
			linger = nil
			for _, f := range pipes {
				_ = f.SetReadDeadline(time.Unix(1, 0))
			}
		case <-k.timeoutC:
			k.timeout()
		case <-k.graceC:
			k.kill()
		case <-ctxDone:
			ctxDone = nil
			k.kill()
		}
	}
	if exited != nil {
		// Both pipes closed before the exit arrived; the exit is imminent
		// unless the command closed its outputs and kept running.
		for waiting := true; waiting; {
			select {
			case <-exited:
				waiting = false
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
			_ = syscall.Kill(-child.Pid, syscall.SIGKILL)
		}
	}
	for _, f := range pipes {
		f.Close()
	}
	res.Exit = ExitOf(child.Status())
	res.TimedOut = k.timedOut
	res.Duration = child.Ended().Sub(t0)
	return res, nil
}
