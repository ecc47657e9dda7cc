// Package freeze pauses a sandbox from inside it, where no freezer cgroup is
// writable (a Kubernetes pod): every process of the sandbox but the daemon
// is stopped with SIGSTOP, and continued with SIGCONT on resume.
//
// The sandbox is hostile and may be root in it, so a pause is not one
// signal per process seen once:
//   - As PID 1 the daemon first sends SIGSTOP to every process of its pid
//     namespace at once (kill(-1)): the kernel holds the task list meanwhile
//     and delivers it to children still being forked, so no fork escapes.
//     Then it scans /proc, stopping again whatever is not stopped, until a
//     scan and the one after find every thread of every process stopped (or
//     dead, or asleep in the kernel with the stop pending): processes that
//     run make more processes, and a process not yet stopped may SIGCONT one
//     that was.
//   - Every thread counts: a process whose first thread has exited
//     (a zombie leader) may go on running in its others.
//   - While paused, a watch reads the sandbox's CPU time (its cgroup's,
//     less the daemon's own) a few times a second; any growth means a
//     process escaped (a SIGCONT sent while the stop was being delivered)
//     and everything is stopped again.
//
// A process the sandbox had stopped itself before the pause (a suspended
// job) stays stopped after the resume.
package freeze

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Options configure a Freezer.
type Options struct {
	// Proc is where procfs is mounted ("/proc").
	Proc string
	// Self is the daemon's pid; it is never stopped.
	Self int
	// All: every process of the pid namespace is the sandbox's (the daemon
	// is PID 1). Otherwise only the daemon's descendants are (tests).
	All bool
	// Usage reads the CPU time of the whole sandbox, daemon included (its
	// cgroup); ok false when it cannot. Nil: the watch scans /proc instead.
	Usage func() (time.Duration, bool)
	// Watch is how often a paused sandbox's CPU time is checked (default
	// 250 ms).
	Watch time.Duration
}

// Freezer pauses and resumes the sandbox. Safe for concurrent use.
type Freezer struct {
	o      Options
	mu     sync.Mutex     // one pause or resume at a time
	paused atomic.Bool    // from the start of a pause to the end of a resume
	kept   map[int]uint64 // stopped before the pause: pid to start time
	stop   chan struct{}  // closes the watch
	done   chan struct{}  // closed when the watch has ended
	// escapes counts the watch's stops of processes found running while
	// paused.
	escapes int
}

// New builds a Freezer.
func New(o Options) *Freezer {
	if o.Proc == "" {
		o.Proc = "/proc"
	}
	if o.Watch <= 0 {
		o.Watch = 250 * time.Millisecond
	}
	return &Freezer{o: o}
}

// NotStopped is a pause that could not stop every process in time; what it
// had stopped is continued.
type NotStopped struct{ Pids []int }

func (e *NotStopped) Error() string {
	return fmt.Sprintf("processes still running after the pause's deadline: %v", e.Pids)
}

// Paused reports whether the sandbox is paused.
// A pause under way counts: what starts meanwhile is refused.
func (f *Freezer) Paused() bool { return f.paused.Load() }

// Escapes is how many times the watch found a process running while paused.
func (f *Freezer) Escapes() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.escapes
}

// Pause stops every process of the sandbox and returns how many it holds
// stopped. Pausing a paused sandbox changes nothing. A process it cannot
// stop within timeout fails the pause (*NotStopped), and every process it
// stopped is continued.
func (f *Freezer) Pause(timeout time.Duration) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.paused.Load() {
		return f.count(), nil
	}
	f.paused.Store(true)
	kept := map[int]uint64{}
	for _, p := range f.scan() {
		if p.state == 'T' {
			kept[p.pid] = p.start
		}
	}
	f.kept = kept
	if err := f.stopAll(time.Now().Add(timeout)); err != nil {
		f.cont()
		f.paused.Store(false)
		return 0, err
	}
	f.stop, f.done = make(chan struct{}), make(chan struct{})
	go f.watch(f.stop, f.done)
	return f.count(), nil
}

// Resume continues every process the pause stopped; how many. Resuming a
// sandbox that is not paused changes nothing.
func (f *Freezer) Resume() int {
	f.mu.Lock()
	stop, done := f.stop, f.done
	f.stop, f.done = nil, nil
	f.mu.Unlock()
	if stop != nil {
		close(stop)
		<-done // the watch takes mu: wait for it outside
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.paused.Load() {
		return 0
	}
	n := f.cont()
	f.paused.Store(false)
	return n
}

func (f *Freezer) count() int { return len(f.scan()) }

// cont continues every process but those stopped before the pause.
func (f *Freezer) cont() int {
	n := 0
	for _, p := range f.scan() {
		if start, ok := f.kept[p.pid]; ok && start == p.start {
			continue
		}
		if syscall.Kill(p.pid, syscall.SIGCONT) == nil {
			n++
		}
	}
	f.kept = nil
	return n
}

// stopAll stops every process until two scans in a row find all of them
// stopped (see the package comment), or deadline.
func (f *Freezer) stopAll(deadline time.Time) error {
	if f.o.All {
		// ESRCH: nothing but us to stop.
		_ = syscall.Kill(-1, syscall.SIGSTOP)
	}
	calm, delay := 0, 200*time.Microsecond
	for {
		var running []int
		for _, p := range f.scan() {
			if !p.quiet {
				running = append(running, p.pid)
				_ = syscall.Kill(p.pid, syscall.SIGSTOP)
			}
		}
		if len(running) == 0 {
			if calm++; calm == 2 {
				return nil
			}
		} else {
			calm = 0
			if f.o.All && len(running) > 1 {
				_ = syscall.Kill(-1, syscall.SIGSTOP)
			}
		}
		if time.Now().After(deadline) && len(running) > 0 {
			sort.Ints(running)
			return &NotStopped{running}
		}
		time.Sleep(delay)
		delay = min(delay*2, 10*time.Millisecond)
	}
}

// watch stops again whatever runs while the sandbox is paused.
func (f *Freezer) watch(stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(f.o.Watch)
	defer t.Stop()
	last, known := f.sandboxUsage()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		now, ok := f.sandboxUsage()
		// Without a cgroup to read, or with CPU used that is not ours: scan.
		// A millisecond of slack: the two counters are read one after the
		// other while the daemon itself runs.
		if !ok || !known || now-last > time.Millisecond {
			f.mu.Lock()
			if f.paused.Load() {
				if f.resweep() {
					f.escapes++
				}
			}
			f.mu.Unlock()
			now, ok = f.sandboxUsage()
		}
		last, known = now, ok
	}
}

// resweep stops whatever runs; whether anything did.
func (f *Freezer) resweep() bool {
	for _, p := range f.scan() {
		if !p.quiet {
			_ = f.stopAll(time.Now().Add(time.Second))
			return true
		}
	}
	return false
}

// sandboxUsage is the CPU time of the sandbox but the daemon.
func (f *Freezer) sandboxUsage() (time.Duration, bool) {
	if f.o.Usage == nil {
		return 0, false
	}
	var self syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &self) != nil {
		return 0, false
	}
	all, ok := f.o.Usage()
	if !ok {
		return 0, false
	}
	own := time.Duration(self.Utime.Nano() + self.Stime.Nano())
	return all - own, true
}

// CgroupUsage reads the CPU time of the cgroup the daemon is in, as a
// container sees it at /sys/fs/cgroup: cgroup v2's cpu.stat, else v1's
// cpuacct.usage. ok false when neither is readable.
func CgroupUsage(root string) func() (time.Duration, bool) {
	return func() (time.Duration, bool) {
		if data, err := os.ReadFile(root + "/cpu.stat"); err == nil {
			for _, line := range strings.Split(string(data), "\n") {
				if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
					us, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
					return time.Duration(us) * time.Microsecond, err == nil
				}
			}
		}
		if data, err := os.ReadFile(root + "/cpuacct/cpuacct.usage"); err == nil {
			ns, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
			return time.Duration(ns), err == nil
		}
		return 0, false
	}
}

// process is one process of the sandbox as a scan found it.
type process struct {
	pid   int
	start uint64 // start time, in clock ticks since boot: tells reused pids apart
	state byte   // its first thread's
	quiet bool   // every thread stopped, dead, or bound to stop before it runs again
}

// scan lists the sandbox's processes (not the daemon).
func (f *Freezer) scan() []process {
	entries, err := os.ReadDir(f.o.Proc)
	if err != nil {
		return nil
	}
	var out []process
	parents := map[int]int{}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == f.o.Self {
			continue
		}
		st, ok := readStat(fmt.Sprintf("%s/%d/stat", f.o.Proc, pid))
		if !ok {
			continue // gone meanwhile
		}
		parents[pid] = st.ppid
		out = append(out, process{pid: pid, start: st.start, state: st.state})
	}
	if !f.o.All {
		out = f.descendants(out, parents)
	}
	for i := range out {
		out[i].quiet = f.quiet(out[i].pid)
	}
	return out
}

func (f *Freezer) descendants(all []process, parents map[int]int) []process {
	var out []process
	for _, p := range all {
		for pid, hops := p.pid, 0; hops < 4096; hops++ {
			ppid, ok := parents[pid]
			if !ok || ppid == 0 {
				break
			}
			if ppid == f.o.Self {
				out = append(out, p)
				break
			}
			pid = ppid
		}
	}
	return out
}

// quiet reports whether no thread of pid can run user code: each is
// stopped (T), stopped by a tracer (t), dead (Z, X), or asleep in the
// kernel with SIGSTOP pending (D: it stops before returning).
func (f *Freezer) quiet(pid int) bool {
	dir := fmt.Sprintf("%s/%d/task", f.o.Proc, pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return true // gone
	}
	for _, t := range tasks {
		st, ok := readStat(dir + "/" + t.Name() + "/stat")
		if !ok {
			continue
		}
		switch st.state {
		case 'T', 't', 'Z', 'X', 'x':
		case 'D':
			if !stopPending(dir + "/" + t.Name() + "/status") {
				return false
			}
		default:
			return false
		}
	}
	return true
}

// stopPending reports whether SIGSTOP is pending for the thread or its
// process (/proc/PID/task/TID/status: SigPnd, ShdPnd).
func stopPending(path string) bool {
	data, err := os.ReadFile(path)
	if err != nil {
		return false
	}
	for _, line := range bytes.Split(data, []byte("\n")) {
		for _, key := range []string{"SigPnd:", "ShdPnd:"} {
			if v, ok := bytes.CutPrefix(line, []byte(key)); ok {
				mask, err := strconv.ParseUint(string(bytes.TrimSpace(v)), 16, 64)
				if err == nil && mask&(1<<(uint(syscall.SIGSTOP)-1)) != 0 {
					return true
				}
			}
		}
	}
	return false
}

type stat struct {
	state byte
	ppid  int
	start uint64
}

var errStat = errors.New("malformed stat")

// readStat parses /proc/PID/stat (the name may hold spaces and parens: the
// fields start after the last ')').
func readStat(path string) (stat, bool) {
	data, err := os.ReadFile(path)
	if err != nil {
		return stat{}, false
	}
	st, err := parseStat(data)
	return st, err == nil
}

func parseStat(data []byte) (stat, error) {
	i := bytes.LastIndexByte(data, ')')
	if i < 0 || i+2 >= len(data) {
		return stat{}, errStat
	}
	fields := strings.Fields(string(data[i+2:]))
	// state is field 3 of stat(5), ppid 4, starttime 22.
	if len(fields) < 20 || len(fields[0]) != 1 {
		return stat{}, errStat
	}
	ppid, err := strconv.Atoi(fields[1])
	if err != nil {
		return stat{}, errStat
	}
	start, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return stat{}, errStat
	}
	return stat{state: fields[0][0], ppid: ppid, start: start}, nil
}
