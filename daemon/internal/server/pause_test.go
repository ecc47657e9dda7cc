package server

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// cpuTicks is a process's CPU time (utime + stime, in clock ticks).
func cpuTicks(t *testing.T, pid int) string {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	fields := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
	return fields[11] + "+" + fields[12]
}

func TestPauseStopsProcessesAndRefusesToStartMore(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"cmd": "while :; do :; done"})
	id, pid := r.str("id"), int(r.num("pid"))
	shell := ts.want(ts.do("POST", "/v1/shells", nil), 201).str("id")
	defer func() {
		ts.do("POST", "/v1/resume", nil)
		ts.do("DELETE", "/v1/processes/"+id, nil)
		ts.do("DELETE", "/v1/shells/"+shell, nil)
	}()

	if n := ts.want(ts.do("POST", "/v1/pause", nil), 200).num("processes"); n < 2 {
		t.Fatalf("paused %v processes, want the loop and the shell", n)
	}
	before := cpuTicks(t, pid)
	// What would start, signal or feed a process is refused meanwhile.
	for _, call := range []struct {
		method, path string
		body         any
	}{
		{"POST", "/v1/exec", map[string]any{"cmd": "true"}},
		{"POST", "/v1/exec/stream", map[string]any{"cmd": "true"}},
		{"POST", "/v1/processes", map[string]any{"cmd": "true"}},
		{"POST", "/v1/processes/" + id + "/signal", map[string]any{"signal": "CONT"}},
		{"POST", "/v1/processes/" + id + "/stdin", map[string]any{"data": "x"}},
		{"POST", "/v1/processes/" + id + "/resize", map[string]any{"rows": 1, "cols": 1}},
		{"DELETE", "/v1/processes/" + id, nil},
		{"POST", "/v1/shells", nil},
		{"POST", "/v1/shells/" + shell + "/run", map[string]any{"cmd": "true"}},
		{"DELETE", "/v1/shells/" + shell, nil},
		{"GET", "/v1/ports/80/connect", nil},
		{"POST", "/v1/checkpoint/prepare", nil},
	} {
		ts.want(ts.do(call.method, call.path, call.body), 409, "sandbox_paused")
	}
	// Reading goes on; pausing again changes nothing.
	ts.want(ts.do("GET", "/v1/health", nil), 200)
	ts.want(ts.do("GET", "/v1/processes/"+id, nil), 200)
	ts.want(ts.do("GET", "/v1/files/stat?path=/", nil), 200)
	ts.want(ts.do("POST", "/v1/pause", nil), 200)
	time.Sleep(300 * time.Millisecond)
	if after := cpuTicks(t, pid); after != before {
		t.Fatalf("the loop ran while paused: %s -> %s", before, after)
	}

	if n := ts.want(ts.do("POST", "/v1/resume", nil), 200).num("processes"); n < 2 {
		t.Fatalf("resumed %v processes", n)
	}
	if n := ts.want(ts.do("POST", "/v1/resume", nil), 200).num("processes"); n != 0 {
		t.Fatalf("a second resume continued %v processes", n)
	}
	deadline := time.Now().Add(10 * time.Second)
	for cpuTicks(t, pid) == before {
		if time.Now().After(deadline) {
			t.Fatal("the loop did not run again after the resume")
		}
		time.Sleep(20 * time.Millisecond)
	}
	r = ts.want(ts.do("POST", "/v1/shells/"+shell+"/run", map[string]any{"cmd": "echo on"}), 200)
	if r.str("stdout") != "on\n" {
		t.Fatalf("run after resume: %s", r.body)
	}
}
