package reaper

import (
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var r *Reaper

func TestMain(m *testing.M) {
	if err := BecomeSubreaper(); err != nil {
		panic(err)
	}
	r = New()
	os.Exit(m.Run())
}

func wait(t *testing.T, c *Child) syscall.WaitStatus {
	t.Helper()
	select {
	case <-c.Done():
		return c.Status()
	case <-time.After(10 * time.Second):
		t.Fatalf("pid %d never reaped", c.Pid)
	}
	return 0
}

func TestStatusesReachTheirChild(t *testing.T) {
	var wg sync.WaitGroup
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func(code int) {
			defer wg.Done()
			c, err := r.Start("/bin/sh", []string{"sh", "-c", "exit " + string(rune('0'+code%10))}, nil, "", []uintptr{0, 1, 2}, nil)
			if err != nil {
				t.Error(err)
				return
			}
			if ws := wait(t, c); ws.ExitStatus() != code%10 {
				t.Errorf("exit %d, want %d", ws.ExitStatus(), code%10)
			}
		}(i)
	}
	wg.Wait()
	select {
	case <-r.Idle():
	case <-time.After(5 * time.Second):
		t.Fatalf("not idle with %d live", r.Live())
	}
}

func TestChildHasItsOwnGroup(t *testing.T) {
	c, err := r.Start("/bin/sleep", []string{"sleep", "10"}, nil, "", []uintptr{0, 1, 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pgid, err := syscall.Getpgid(c.Pid)
	if err != nil || pgid != c.Pid {
		t.Errorf("pgid %d (%v), want %d", pgid, err, c.Pid)
	}
	syscall.Kill(-c.Pid, syscall.SIGKILL)
	if ws := wait(t, c); !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Errorf("status %v", ws)
	}
}

func TestStartFailure(t *testing.T) {
	if _, err := r.Start("/no/such", []string{"x"}, nil, "", []uintptr{0, 1, 2}, nil); err == nil {
		t.Fatal("started a missing binary")
	}
	// The loop must still be alive after an idle period.
	c, err := r.Start("/bin/true", []string{"true"}, nil, "", []uintptr{0, 1, 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	wait(t, c)
}

func TestOrphansAreReaped(t *testing.T) {
	rd, wr, _ := os.Pipe()
	c, err := r.Start("/bin/sh", []string{"sh", "-c", "for i in 1 2 3 4 5; do (sleep 0.05 & echo $!); done"}, nil, "", []uintptr{0, wr.Fd(), 2}, nil)
	wr.Close()
	if err != nil {
		t.Fatal(err)
	}
	wait(t, c)
	buf := make([]byte, 4096)
	var out []byte
	for {
		n, err := rd.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			break
		}
	}
	pids := strings.Fields(string(out))
	if len(pids) != 5 {
		t.Fatalf("orphans: %q", out)
	}
	deadline := time.Now().Add(5 * time.Second)
	for _, pid := range pids {
		for {
			if _, err := os.Stat("/proc/" + pid); err != nil {
				break // gone: reaped (a zombie would still be listed)
			}
			if time.Now().After(deadline) {
				t.Fatalf("orphan %s not reaped", pid)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}
