// Package reaper owns every wait4 call of the daemon.
//
// The daemon runs as PID 1 (or as a child subreaper), so orphans of any
// command are re-parented to it and must be reaped, or a pids-limited
// container fills with zombies. A per-child wait (os/exec's cmd.Wait) races
// with such a reaper, so children are started here and one goroutine loops on
// wait4(-1), handing each status to the child it belongs to; statuses of
// pids nobody started (orphans) are dropped.
package reaper

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Child is a process started by the Reaper. Done is closed once it has been
// reaped; Status and Ended are valid after that.
type Child struct {
	Pid     int
	done    chan struct{}
	status  syscall.WaitStatus
	ended   time.Time
	started time.Time
}

// Done is closed when the child has exited and been reaped.
func (c *Child) Done() <-chan struct{} { return c.done }

// Status is the wait status; only valid after Done is closed.
func (c *Child) Status() syscall.WaitStatus { return c.status }

// Ended is when the child was reaped; only valid after Done is closed.
func (c *Child) Ended() time.Time { return c.ended }

// Started is when the child was forked.
func (c *Child) Started() time.Time { return c.started }

// Exited reports without blocking whether the child has been reaped.
func (c *Child) Exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// Reaper starts children and reaps all processes re-parented to us.
type Reaper struct {
	mu       sync.Mutex
	children map[int]*Child
	idle     chan struct{} // closed and replaced when children becomes empty
	spawned  chan struct{} // poked after each fork so an idle loop resumes
}

// New returns a Reaper whose wait loop is already running. There must be
// only one per process.
func New() *Reaper {
	r := &Reaper{
		children: make(map[int]*Child),
		idle:     make(chan struct{}),
		spawned:  make(chan struct{}, 1),
	}
	go r.loop()
	return r
}

// Start forks and execs path. The lock is held across fork and registration
// so the wait loop can never see the exit of a pid not yet registered.
// Every child gets its own process group (pgid = pid). cred, if not nil,
// is the uid, gid and groups the child runs as (set before it changes to dir).
func (r *Reaper) Start(path string, argv, env []string, dir string, files []uintptr, cred *syscall.Credential) (*Child, error) {
	return r.start(path, argv, env, dir, files, &syscall.SysProcAttr{Setpgid: true, Credential: cred})
}

// StartTTY is Start for a child on a terminal: files[0] must be the
// terminal's slave side. The child leads a new session (so its pgid is
// still its pid) with that terminal as its controlling terminal.
func (r *Reaper) StartTTY(path string, argv, env []string, dir string, files []uintptr, cred *syscall.Credential) (*Child, error) {
	return r.start(path, argv, env, dir, files,
		&syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0, Credential: cred})
}

func (r *Reaper) start(path string, argv, env []string, dir string, files []uintptr, sys *syscall.SysProcAttr) (*Child, error) {
	attr := &syscall.ProcAttr{Dir: dir, Env: env, Files: files, Sys: sys}
	r.mu.Lock()
	pid, err := syscall.ForkExec(path, argv, attr)
	if err != nil {
		r.mu.Unlock()
		return nil, err
	}
	c := &Child{Pid: pid, done: make(chan struct{}), started: time.Now()}
	r.children[pid] = c
	r.mu.Unlock()
	select {
	case r.spawned <- struct{}{}:
	default:
	}
	return c, nil
}

func (r *Reaper) loop() {
	var status syscall.WaitStatus
	for {
		pid, err := syscall.Wait4(-1, &status, 0, nil)
		if err != nil {
			if errors.Is(err, syscall.ECHILD) {
				// No children at all: sleep until the next fork.
				<-r.spawned
			}
			// EINTR and the like: just wait again.
			continue
		}
		r.mu.Lock()
		c := r.children[pid]
		if c != nil {
			delete(r.children, pid)
			c.status = status
			c.ended = time.Now()
			close(c.done)
			if len(r.children) == 0 {
				close(r.idle)
				r.idle = make(chan struct{})
			}
		}
		r.mu.Unlock()
	}
}

// SignalAll sends sig to the process group of every live child.
func (r *Reaper) SignalAll(sig syscall.Signal) {
	r.mu.Lock()
	pids := make([]int, 0, len(r.children))
	for pid := range r.children {
		pids = append(pids, pid)
	}
	r.mu.Unlock()
	for _, pid := range pids {
		_ = syscall.Kill(-pid, sig)
	}
}

// Idle returns a channel that is closed once no child started here is left
// alive (already closed if there are none).
func (r *Reaper) Idle() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.children) == 0 {
		c := make(chan struct{})
		close(c)
		return c
	}
	return r.idle
}

// Live is the number of children started here that are still running.
func (r *Reaper) Live() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.children)
}

// Drain SIGKILLs every remaining child of this process — orphans that were
// re-parented to us included, whatever their process group — and waits until
// the wait loop has reaped them all, or until timeout. Used at shutdown, so
// that nothing outlives the daemon, not even as a zombie.
func (r *Reaper) Drain(timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for {
		kids := children()
		if len(kids) == 0 || time.Now().After(deadline) {
			return
		}
		for _, pid := range kids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// children lists this process's children (zombies included) from
// /proc/self/task/*/children: a child is listed under the thread that forked
// it, or under the thread group leader when it was re-parented.
func children() []int {
	tasks, _ := filepath.Glob("/proc/self/task/*/children")
	var pids []int
	for _, task := range tasks {
		data, err := os.ReadFile(task)
		if err != nil {
			continue
		}
		for _, field := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(field); err == nil {
				pids = append(pids, pid)
			}
		}
	}
	return pids
}
