package server

import (
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"
)

func startProc(ts *testServer, body map[string]any) *response {
	ts.t.Helper()
	return ts.want(ts.do("POST", "/v1/processes", body), 201)
}

func output(ts *testServer, id string, query string) *response {
	ts.t.Helper()
	return ts.want(ts.do("GET", "/v1/processes/"+id+"/output?"+query, nil), 200)
}

func TestProcessLifecycle(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"cmd": "echo a; sleep 0.1; echo b; echo e >&2; exit 5"})
	id := r.str("id")
	if !strings.HasPrefix(id, "p-") || !r.boolean("running") || r.json["argv"] != nil || r.str("cmd") == "" {
		t.Fatalf("start: %s", r.body)
	}
	r = ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 10}), 200)
	if r.boolean("running") || r.num("exit_code") != 5 || r.json["ended_at"] == nil {
		t.Fatalf("wait: %s", r.body)
	}
	r = output(ts, id, "")
	if r.str("stdout") != "a\nb\n" || r.str("stderr") != "e\n" || r.num("stdout_next_offset") != 4 || r.boolean("running") {
		t.Fatalf("output: %s", r.body)
	}
	r = output(ts, id, "stdout_offset=2&stderr_offset=2")
	if r.str("stdout") != "b\n" || r.num("stdout_offset") != 2 || r.str("stderr") != "" || r.num("stderr_offset") != 2 {
		t.Fatalf("offsets: %s", r.body)
	}
	r = output(ts, id, "stdout_offset=99")
	if r.str("stdout") != "" || r.num("stdout_offset") != 4 {
		t.Fatalf("past the end: %s", r.body)
	}
	r = ts.want(ts.do("GET", "/v1/processes", nil), 200)
	if !strings.Contains(string(r.body), `"id":"`+id+`"`) {
		t.Fatalf("list: %s", r.body)
	}
	ts.want(ts.do("GET", "/v1/processes/"+id, nil), 200)
	ts.want(ts.do("DELETE", "/v1/processes/"+id, nil), 204)
	ts.want(ts.do("GET", "/v1/processes/"+id, nil), 404, "not_found")
	ts.want(ts.do("DELETE", "/v1/processes/"+id, nil), 404, "not_found")
	ts.want(ts.do("GET", "/v1/processes/p-999/output", nil), 404, "not_found")
}

func TestProcessLongPollAndStdin(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"argv": []string{"cat"}, "stdin": true})
	id := r.str("id")
	if !r.boolean("stdin_open") || r.json["cmd"] != nil {
		t.Fatalf("start: %s", r.body)
	}
	t0 := time.Now()
	r = output(ts, id, "wait=0.2")
	if d := time.Since(t0); d < 150*time.Millisecond || r.str("stdout") != "" || !r.boolean("running") {
		t.Fatalf("idle long-poll returned after %v: %s", d, r.body)
	}
	done := make(chan *response, 1)
	go func() { done <- ts.do("GET", "/v1/processes/"+id+"/output?wait=30", nil) }()
	time.Sleep(20 * time.Millisecond) // let the poll park; correctness does not depend on it
	ts.want(ts.do("POST", "/v1/processes/"+id+"/stdin", "hello"), 204)
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("long-poll did not wake")
	}
	if r.status != 200 || !strings.HasPrefix("hello", r.str("stdout")) || r.str("stdout") == "" {
		t.Fatalf("woken poll: %d %s", r.status, r.body)
	}
	ts.want(ts.do("POST", "/v1/processes/"+id+"/stdin?close=true", " world"), 204)
	r = ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 10}), 200)
	if r.boolean("running") || r.num("exit_code") != 0 || r.boolean("stdin_open") {
		t.Fatalf("after close: %s", r.body)
	}
	if r = output(ts, id, ""); r.str("stdout") != "hello world" {
		t.Fatalf("cat: %s", r.body)
	}
	ts.want(ts.do("POST", "/v1/processes/"+id+"/stdin", "more"), 409, "stdin_closed")
	ts.want(ts.do("POST", "/v1/processes/"+id+"/stdin?close=maybe", "x"), 400, "invalid_request")

	r = startProc(ts, map[string]any{"argv": []string{"true"}})
	ts.want(ts.do("POST", "/v1/processes/"+r.str("id")+"/stdin", "x"), 409, "stdin_closed")
}

func TestProcessSignalAndWait(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"cmd": "sleep 30 & sleep 30; wait"})
	id, pgid := r.str("id"), int(r.num("pid"))
	r = ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 0.05}), 200)
	if !r.boolean("running") {
		t.Fatalf("wait timeout: %s", r.body)
	}
	ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 0}), 200)
	for _, bad := range []string{`{}`, `{"signal":"NOPE"}`, `{"signal":0}`, `{"signal":1.5}`, `{"signal":true}`, `{"signal":"TERM","x":1}`} {
		ts.want(ts.do("POST", "/v1/processes/"+id+"/signal", bad), 400, "invalid_request")
	}
	ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", `{"timeout":-1}`), 400, "invalid_request")
	r = ts.want(ts.do("POST", "/v1/processes/"+id+"/signal", map[string]any{"signal": "TERM"}), 200)
	r = ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", nil), 200)
	if r.boolean("running") || r.str("signal") != "TERM" || r.num("exit_code") != 143 {
		t.Fatalf("after TERM: %s", r.body)
	}
	eventually(t, 5*time.Second, "the group to be gone", func() bool { return groupGone(pgid) })
	// Signalling a finished process is harmless.
	ts.want(ts.do("POST", "/v1/processes/"+id+"/signal", map[string]any{"signal": 9}), 200)

	r = startProc(ts, map[string]any{"argv": []string{"sleep", "30"}})
	ts.want(ts.do("POST", "/v1/processes/"+r.str("id")+"/signal", map[string]any{"signal": "SIGKILL", "group": false}), 200)
	r = ts.want(ts.do("POST", "/v1/processes/"+r.str("id")+"/wait", map[string]any{"timeout": nil}), 200)
	if r.str("signal") != "KILL" {
		t.Fatalf("KILL: %s", r.body)
	}
}

func TestProcessDeleteKillsGroup(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"cmd": "sleep 30 & sleep 30"})
	pgid := int(r.num("pid"))
	ts.want(ts.do("DELETE", "/v1/processes/"+r.str("id"), nil), 204)
	eventually(t, 5*time.Second, "the group to be gone", func() bool { return syscall.Kill(-pgid, 0) == syscall.ESRCH })
}

func TestProcessNotFoundIs127(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"argv": []string{"no-such-cmd-xyz"}})
	if r.boolean("running") || r.num("exit_code") != 127 || r.num("pid") != 0 {
		t.Fatalf("%s", r.body)
	}
	r = output(ts, r.str("id"), "")
	if !strings.Contains(r.str("stderr"), "command not found") {
		t.Fatalf("%s", r.body)
	}
	ts.want(ts.do("POST", "/v1/processes", map[string]any{"argv": []string{"true"}, "cwd": "/no/such"}), 404, "not_found")
	ts.want(ts.do("POST", "/v1/processes", `{"argv":["true"],"stdin":"yes"}`), 400, "invalid_request")
	ts.want(ts.do("POST", "/v1/processes", `{"cmd":"true","max_buffer":-1}`), 400, "invalid_request")
}

func TestProcessBufferDropsOldOutput(t *testing.T) {
	ts := newTestServer(t)
	r := startProc(ts, map[string]any{"cmd": "for i in $(seq 1 100); do echo line$i; done", "max_buffer": 32})
	id := r.str("id")
	ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 10}), 200)
	r = output(ts, id, "")
	total := 0
	for i := 1; i <= 100; i++ {
		total += len(fmt.Sprintf("line%d\n", i))
	}
	if r.num("stdout_next_offset") != float64(total) || r.num("stdout_offset") != float64(total-32) || len(r.str("stdout")) != 32 {
		t.Fatalf("ring: %s", r.body)
	}
	if !strings.HasSuffix(r.str("stdout"), "line100\n") {
		t.Fatalf("tail: %s", r.body)
	}
	for _, q := range []string{"stdout_offset=-1", "stdout_offset=x", "wait=-1", "encoding=latin1"} {
		ts.want(ts.do("GET", "/v1/processes/"+id+"/output?"+q, nil), 400, "invalid_request")
	}
	r = output(ts, id, "encoding=base64")
	if r.str("encoding") != "base64" {
		t.Fatal(string(r.body))
	}
	var raw map[string]any
	_ = json.Unmarshal(r.body, &raw)
}
