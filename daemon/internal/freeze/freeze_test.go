package freeze

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"sandman/daemon/internal/reaper"
)

// TestMain makes the test process a subreaper, as the daemon is, so that the
// orphans of the shells below stay its descendants.
func TestMain(m *testing.M) {
	if os.Getenv("FREEZE_TEST_HELPER") == "zombie-leader" {
		zombieLeader()
	}
	if err := reaper.BecomeSubreaper(); err != nil {
		fmt.Fprintln(os.Stderr, "subreaper:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// start runs a shell script in a process group of its own, killed (with
// everything in it) at the test's end.
func start(t *testing.T, script string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGCONT)
		_ = cmd.Wait()
		// Orphans re-parented to us: reap them.
		for {
			if pid, _ := syscall.Wait4(-1, nil, syscall.WNOHANG, nil); pid <= 0 {
				break
			}
		}
	})
	return cmd
}

// cpu is the CPU time, in clock ticks, that the test's descendants have
// used, and how many there are.
func cpu(t *testing.T, f *Freezer) (ticks uint64, n int) {
	t.Helper()
	for _, p := range f.scan() {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.pid))
		if err != nil {
			continue
		}
		fields := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
		u, _ := strconv.ParseUint(fields[11], 10, 64)
		s, _ := strconv.ParseUint(fields[12], 10, 64)
		ticks += u + s
		n++
	}
	return ticks, n
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestPauseStopsBusyLoopsAndForkersUntilResume(t *testing.T) {
	f := New(Options{Self: os.Getpid(), Watch: 50 * time.Millisecond})
	start(t, "while :; do :; done")
	// A spawner that forks all the time (each subshell a new process), and
	// leaves busy loops behind.
	start(t, "while :; do (:); sh -c 'i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done' & sleep 0.05; done")
	waitFor(t, "the loops to run", func() bool { _, n := cpu(t, f); return n >= 4 })

	n, err := f.Pause(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if n < 4 || !f.Paused() {
		t.Fatalf("paused %d processes (paused=%v)", n, f.Paused())
	}
	before, count := cpu(t, f)
	time.Sleep(1500 * time.Millisecond)
	after, countAfter := cpu(t, f)
	if after != before || countAfter != count {
		t.Fatalf("paused, the processes still ran: %d -> %d ticks, %d -> %d processes", before, after, count, countAfter)
	}
	for _, p := range f.scan() {
		if !p.quiet {
			t.Fatalf("pid %d runs while paused", p.pid)
		}
	}
	if f.Escapes() != 0 {
		t.Fatalf("the watch found %d escapes with nobody resuming", f.Escapes())
	}
	// Pausing again changes nothing.
	if _, err := f.Pause(time.Second); err != nil {
		t.Fatal(err)
	}

	if got := f.Resume(); got < count {
		t.Fatalf("resumed %d of %d processes", got, count)
	}
	if f.Paused() {
		t.Fatal("still paused after Resume")
	}
	waitFor(t, "the loops to run again", func() bool { now, _ := cpu(t, f); return now > after })
	if f.Resume() != 0 {
		t.Fatal("a second resume continued something")
	}
}

func TestAProcessContinuedWhilePausedIsStoppedAgain(t *testing.T) {
	f := New(Options{Self: os.Getpid(), Watch: 20 * time.Millisecond})
	busy := start(t, "while :; do :; done")
	if _, err := f.Pause(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	defer f.Resume()
	// What a SIGCONT that raced the stop would leave: a process running.
	if err := syscall.Kill(busy.Process.Pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the watch to stop it again", func() bool { return f.Escapes() > 0 })
	waitFor(t, "it to be stopped", func() bool {
		st, _ := readStat(fmt.Sprintf("/proc/%d/stat", busy.Process.Pid))
		return st.state == 'T'
	})
}

func TestAProcessStoppedBeforeThePauseStaysStopped(t *testing.T) {
	f := New(Options{Self: os.Getpid()})
	suspended := start(t, "sleep 1000")
	running := start(t, "sleep 1000")
	if err := syscall.Kill(suspended.Process.Pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	state := func(c *exec.Cmd) byte {
		st, _ := readStat(fmt.Sprintf("/proc/%d/stat", c.Process.Pid))
		return st.state
	}
	waitFor(t, "it to stop", func() bool { return state(suspended) == 'T' })
	if _, err := f.Pause(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if state(running) != 'T' {
		t.Fatalf("paused, sleep is %c", state(running))
	}
	f.Resume()
	waitFor(t, "the other to continue", func() bool { return state(running) == 'S' })
	if state(suspended) != 'T' {
		t.Fatalf("the suspended process was continued: %c", state(suspended))
	}
}

// zombieLeader spins on another thread and ends the process's first thread
// alone: the process's state (its first thread's) reads Z while it burns.
func zombieLeader() {
	runtime.LockOSThread() // this goroutine's thread is the first one: keep it here
	go func() {
		for {
		}
	}()
	time.Sleep(50 * time.Millisecond)
	syscall.RawSyscall(syscall.SYS_EXIT, 0, 0, 0)
}

func TestAProcessWhoseFirstThreadExitedIsStopped(t *testing.T) {
	f := New(Options{Self: os.Getpid()})
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "FREEZE_TEST_HELPER=zombie-leader")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(cmd.Process.Pid, syscall.SIGKILL)
		_ = syscall.Kill(cmd.Process.Pid, syscall.SIGCONT)
		_ = cmd.Wait()
	})
	pid := cmd.Process.Pid
	waitFor(t, "its first thread to exit while another spins", func() bool {
		st, _ := readStat(fmt.Sprintf("/proc/%d/stat", pid))
		ticks, _ := cpu(t, f)
		return st.state == 'Z' && ticks > 0
	})
	if _, err := f.Pause(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	defer f.Resume()
	before, _ := cpu(t, f)
	time.Sleep(500 * time.Millisecond)
	if after, _ := cpu(t, f); after != before {
		t.Fatalf("its other thread ran while paused: %d -> %d ticks", before, after)
	}
}

func TestParseStat(t *testing.T) {
	line := "42 (a) (b c) S 7 42 42 0 -1 4194304 1 0 0 0 3 4 0 0 20 0 1 0 12345 1000 1 18446744073709551615\n"
	st, err := parseStat([]byte(line))
	if err != nil || st.state != 'S' || st.ppid != 7 || st.start != 12345 {
		t.Fatalf("%+v %v", st, err)
	}
	for _, bad := range []string{"", "42 (x", "42 (x) S", "42 (x) SS 7 " + strings.Repeat("0 ", 20)} {
		if _, err := parseStat([]byte(bad)); err == nil {
			t.Fatalf("%q parsed", bad)
		}
	}
}

func TestCgroupUsage(t *testing.T) {
	dir := t.TempDir()
	if _, ok := CgroupUsage(dir)(); ok {
		t.Fatal("an empty directory gave a usage")
	}
	if err := os.WriteFile(dir+"/cpu.stat", []byte("usage_usec 1500\nuser_usec 1000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if d, ok := CgroupUsage(dir)(); !ok || d != 1500*time.Microsecond {
		t.Fatalf("v2: %v %v", d, ok)
	}
	os.Remove(dir + "/cpu.stat")
	os.Mkdir(dir+"/cpuacct", 0o700)
	if err := os.WriteFile(dir+"/cpuacct/cpuacct.usage", []byte("2500\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if d, ok := CgroupUsage(dir)(); !ok || d != 2500 {
		t.Fatalf("v1: %v %v", d, ok)
	}
}
