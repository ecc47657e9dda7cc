package server

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// ptyFDs counts this process's descriptors on a pseudo-terminal (either side).
func ptyFDs(t *testing.T) int {
	t.Helper()
	links, err := filepath.Glob("/proc/self/fd/*")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range links {
		dst, err := os.Readlink(l)
		if err == nil && (dst == "/dev/ptmx" || strings.HasPrefix(dst, "/dev/pts/")) {
			n++
		}
	}
	return n
}

// pollUntil long-polls a process's stdout until it contains want.
func pollUntil(ts *testServer, id, want string) string {
	ts.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	var seen string
	next := 0
	for time.Now().Before(deadline) {
		r := output(ts, id, fmt.Sprintf("wait=1&stdout_offset=%d", next))
		seen += r.str("stdout")
		next = int(r.num("stdout_next_offset"))
		if strings.Contains(seen, want) {
			return seen
		}
		if !r.boolean("running") {
			break
		}
	}
	ts.t.Fatalf("stdout never showed %q: %q", want, seen)
	return ""
}

func TestProcessOnATerminal(t *testing.T) {
	ts := newTestServer(t)
	before := ptyFDs(t)
	r := startProc(ts, map[string]any{"tty": true, "rows": 30, "cols": 100,
		"cmd": `test -t 0 && test -t 1 && test -t 2 && echo all-ttys; stty size; read x; stty size; echo "got=$x" >&2`})
	id := r.str("id")
	if !r.boolean("tty") || !r.boolean("stdin_open") {
		t.Fatalf("start: %s", r.body)
	}
	// Both lines come before "30 100": the first shows all three are terminals.
	if s := pollUntil(ts, id, "30 100"); !strings.Contains(s, "all-ttys") {
		t.Fatalf("not on a terminal: %q", s)
	}
	ts.want(ts.do("POST", "/v1/processes/"+id+"/resize", map[string]any{"rows": 40, "cols": 120}), 204)
	ts.want(ts.do("POST", "/v1/processes/"+id+"/stdin", "hi\n"), 204)
	r = ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 10}), 200)
	if r.boolean("running") || r.num("exit_code") != 0 || r.boolean("stdin_open") {
		t.Fatalf("after exit: %s", r.body)
	}
	r = output(ts, id, "")
	// The terminal echoes what was typed, translates \n to \r\n, and carries
	// stderr on the same stream.
	out := r.str("stdout")
	for _, want := range []string{"hi\r\n", "40 120\r\n", "got=hi\r\n"} {
		if !strings.Contains(out, want) {
			t.Fatalf("output lacks %q: %q", want, out)
		}
	}
	if r.str("stderr") != "" {
		t.Fatalf("stderr on a terminal: %s", r.body)
	}
	eventually(t, 5*time.Second, "the terminal's descriptors to be closed",
		func() bool { return ptyFDs(t) == before })
	// Resizing a finished process is harmless; writing to it is a conflict.
	ts.want(ts.do("POST", "/v1/processes/"+id+"/resize", map[string]any{"rows": 1, "cols": 1}), 204)
	ts.want(ts.do("POST", "/v1/processes/"+id+"/stdin", "x"), 409, "stdin_closed")
}

// Ctrl-C on the terminal reaches its foreground group: the process is the
// session leader and the terminal is its controlling terminal.
func TestTerminalCtrlCSignalsTheForegroundGroup(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"tty": true, "argv": []string{"sleep", "30"}})
	id := r.str("id")
	ts.want(ts.do("POST", "/v1/processes/"+id+"/stdin", "\x03"), 204)
	r = ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 10}), 200)
	if r.boolean("running") || r.str("signal") != "INT" || r.num("exit_code") != 130 {
		t.Fatalf("after ^C: %s", r.body)
	}
}

// Deleting a running terminal process kills its group, grandchildren that
// hold the terminal included, and releases the terminal.
func TestDeleteTerminalProcessKillsGroupAndClosesPTY(t *testing.T) {
	ts := newTestServer(t)
	before := ptyFDs(t)
	r := startProc(ts, map[string]any{"tty": true, "cmd": "sleep 30 & echo started; wait"})
	id, pgid := r.str("id"), int(r.num("pid"))
	pollUntil(ts, id, "started")
	if ptyFDs(t) <= before {
		t.Fatal("no terminal descriptors while the process runs")
	}
	ts.want(ts.do("DELETE", "/v1/processes/"+id, nil), 204)
	eventually(t, 5*time.Second, "the group to be gone", func() bool { return groupGone(pgid) })
	eventually(t, 5*time.Second, "the terminal's descriptors to be closed",
		func() bool { return ptyFDs(t) == before })
}

// A grandchild keeping the terminal open does not keep the process running
// (the exit is reported after the linger), and a signal to the group still
// reaches everything on the terminal.
func TestTerminalGroupSignal(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"tty": true, "cmd": "sleep 30 & sleep 30; wait"})
	id, pgid := r.str("id"), int(r.num("pid"))
	ts.want(ts.do("POST", "/v1/processes/"+id+"/signal", map[string]any{"signal": "KILL"}), 200)
	r = ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 10}), 200)
	if r.boolean("running") || r.str("signal") != "KILL" {
		t.Fatalf("after KILL: %s", r.body)
	}
	eventually(t, 5*time.Second, "the group to be gone", func() bool { return groupGone(pgid) })
	ts.want(ts.do("DELETE", "/v1/processes/"+id, nil), 204)
}

func TestTerminalBadInput(t *testing.T) {
	ts := newTestServer(t)
	for _, bad := range []string{
		`{"argv":["true"],"rows":10}`,
		`{"argv":["true"],"tty":false,"cols":10}`,
		`{"argv":["true"],"tty":true,"rows":0}`,
		`{"argv":["true"],"tty":true,"cols":65536}`,
		`{"argv":["true"],"tty":true,"rows":-1}`,
		`{"argv":["true"],"tty":"yes"}`,
	} {
		ts.want(ts.do("POST", "/v1/processes", bad), 400, "invalid_request")
	}
	r := startProc(ts, map[string]any{"argv": []string{"sleep", "30"}})
	id := r.str("id")
	if r.boolean("tty") {
		t.Fatalf("tty by default: %s", r.body)
	}
	ts.want(ts.do("POST", "/v1/processes/"+id+"/resize", map[string]any{"rows": 10, "cols": 10}), 409, "not_a_tty")
	ts.want(ts.do("DELETE", "/v1/processes/"+id, nil), 204)

	r = startProc(ts, map[string]any{"tty": true, "argv": []string{"cat"}})
	id = r.str("id")
	for _, bad := range []string{`{}`, `{"rows":10}`, `{"rows":10,"cols":0}`, `{"rows":70000,"cols":10}`, `{"rows":10,"cols":10,"x":1}`} {
		ts.want(ts.do("POST", "/v1/processes/"+id+"/resize", bad), 400, "invalid_request")
	}
	ts.want(ts.do("POST", "/v1/processes/p-999/resize", map[string]any{"rows": 10, "cols": 10}), 404, "not_found")
	ts.want(ts.do("DELETE", "/v1/processes/"+id, nil), 204)

	// A command that is not there still starts "finished" with 127.
	r = startProc(ts, map[string]any{"tty": true, "argv": []string{"no-such-command"}})
	if r.boolean("running") || r.num("exit_code") != 127 || !r.boolean("tty") {
		t.Fatalf("missing command: %s", r.body)
	}
	ts.want(ts.do("POST", "/v1/processes/"+r.str("id")+"/resize", map[string]any{"rows": 10, "cols": 10}), 204)
}
