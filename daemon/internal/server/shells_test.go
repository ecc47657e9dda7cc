package server

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func run(ts *testServer, id, cmd string, extra ...map[string]any) *response {
	ts.t.Helper()
	body := map[string]any{"cmd": cmd}
	for _, e := range extra {
		for k, v := range e {
			body[k] = v
		}
	}
	return ts.want(ts.do("POST", "/v1/shells/"+id+"/run", body), 200)
}

// shells to check: bash, dash and busybox ash (reached via a symlink named
// sh, as busybox picks the applet from argv[0]).
func shells(t *testing.T) []string {
	out := []string{"/bin/bash", "/bin/dash"}
	if bb, err := os.Stat("/usr/bin/busybox"); err == nil && !bb.IsDir() {
		link := filepath.Join(t.TempDir(), "sh")
		if os.Symlink("/usr/bin/busybox", link) == nil {
			out = append(out, link)
		}
	}
	var have []string
	for _, s := range out {
		if _, err := os.Stat(s); err == nil {
			have = append(have, s)
		}
	}
	return have
}

func TestShellPersistsState(t *testing.T) {
	ts := newTestServer(t)
	for _, sh := range shells(t) {
		t.Run(filepath.Base(sh), func(t *testing.T) {
			ts.t = t
			r := ts.want(ts.do("POST", "/v1/shells", map[string]any{"shell": sh, "env": map[string]string{"GREETING": "hi"}}), 201)
			id := r.str("id")
			if !r.boolean("alive") || r.str("shell") != sh {
				t.Fatalf("create: %s", r.body)
			}
			dir := t.TempDir()
			run(ts, id, "cd "+dir+" && export A=1; B=2; f() { echo \"f:$1\"; }")
			r = run(ts, id, "pwd; echo $A $B $GREETING; f x")
			if r.str("stdout") != dir+"\n1 2 hi\nf:x\n" || r.num("exit_code") != 0 || !r.boolean("alive") {
				t.Fatalf("state: %s", r.body)
			}
			r = run(ts, id, "printf 'no newline'; printf 'err' >&2")
			if r.str("stdout") != "no newline" || r.str("stderr") != "err" {
				t.Fatalf("exact output: %s", r.body)
			}
			r = run(ts, id, "printf 'two\\n\\n'")
			if r.str("stdout") != "two\n\n" {
				t.Fatalf("trailing newlines: %q", r.str("stdout"))
			}
			r = run(ts, id, "echo 'it'\"'\"'s'; false")
			if r.str("stdout") != "it's\n" || r.num("exit_code") != 1 {
				t.Fatalf("quotes: %s", r.body)
			}
			r = run(ts, id, "if then fi (")
			if r.num("exit_code") != 2 || !r.boolean("alive") {
				t.Fatalf("syntax error: %s", r.body)
			}
			r = run(ts, id, "echo still $A")
			if r.str("stdout") != "still 1\n" {
				t.Fatalf("after syntax error: %s", r.body)
			}
			r = run(ts, id, "read x; echo \"[$x]\"")
			if r.str("stdout") != "[]\n" {
				t.Fatalf("stdin must be /dev/null: %s", r.body)
			}
			r = run(ts, id, "exit 7")
			if r.num("exit_code") != 7 || r.boolean("alive") {
				t.Fatalf("exit: %s", r.body)
			}
			ts.want(ts.do("POST", "/v1/shells/"+id+"/run", map[string]any{"cmd": "true"}), 409, "shell_closed")
			r = ts.want(ts.do("GET", "/v1/shells/"+id, nil), 200)
			if r.boolean("alive") {
				t.Fatalf("get: %s", r.body)
			}
			ts.want(ts.do("DELETE", "/v1/shells/"+id, nil), 204)
		})
	}
}

func TestShellTimeoutClosesIt(t *testing.T) {
	ts := newTestServer(t)
	r := ts.want(ts.do("POST", "/v1/shells", nil), 201)
	id, pgid := r.str("id"), int(r.num("pid"))
	r = run(ts, id, "echo before; sleep 30", map[string]any{"timeout": 0.2})
	if !r.boolean("timed_out") || r.boolean("alive") || r.str("stdout") != "before\n" {
		t.Fatalf("timeout: %s", r.body)
	}
	eventually(t, 5*time.Second, "the shell's group to be gone", func() bool { return groupGone(pgid) })
	ts.want(ts.do("POST", "/v1/shells/"+id+"/run", map[string]any{"cmd": "true"}), 409, "shell_closed")
}

func TestShellBusy(t *testing.T) {
	ts := newTestServer(t)
	id := ts.want(ts.do("POST", "/v1/shells", map[string]any{}), 201).str("id")
	marker := filepath.Join(t.TempDir(), "started")
	var wg sync.WaitGroup
	wg.Add(1)
	var first *response
	go func() {
		defer wg.Done()
		first = ts.do("POST", "/v1/shells/"+id+"/run", map[string]any{"cmd": "touch " + marker + "; sleep 0.5; echo done"})
	}()
	eventually(t, 5*time.Second, "the first run to start", func() bool { _, err := os.Stat(marker); return err == nil })
	ts.want(ts.do("POST", "/v1/shells/"+id+"/run", map[string]any{"cmd": "true"}), 409, "shell_busy")
	wg.Wait()
	if first.status != 200 || !strings.Contains(string(first.body), `"stdout":"done\n"`) {
		t.Fatalf("first run: %d %s", first.status, first.body)
	}
}

func TestShellEndpoints(t *testing.T) {
	ts := newTestServer(t)
	r := ts.want(ts.do("POST", "/v1/shells", ""), 201)
	if r.str("shell") != "/bin/bash" {
		t.Fatalf("default shell: %s", r.body)
	}
	id := r.str("id")
	r = ts.want(ts.do("GET", "/v1/shells", nil), 200)
	if !strings.Contains(string(r.body), `"id":"`+id+`"`) {
		t.Fatalf("list: %s", r.body)
	}
	r = run(ts, id, "head -c 5000 /dev/zero | tr '\\0' x", map[string]any{"max_output": 100, "encoding": "base64"})
	if !r.boolean("truncated") || r.str("encoding") != "base64" || len(r.str("stdout")) != 136 {
		t.Fatalf("truncation: %s", r.body)
	}
	for _, bad := range []string{`{}`, `{"cmd":1}`, `{"cmd":"true","timeout":0}`, `{"cmd":"true","x":1}`, `{"cmd":"true","encoding":"x"}`} {
		ts.want(ts.do("POST", "/v1/shells/"+id+"/run", bad), 400, "invalid_request")
	}
	ts.want(ts.do("POST", "/v1/shells/s-999/run", map[string]any{"cmd": "true"}), 404, "not_found")
	ts.want(ts.do("POST", "/v1/shells", map[string]any{"shell": "/no/such/shell"}), 404, "not_found")
	ts.want(ts.do("POST", "/v1/shells", map[string]any{"cwd": "/no/such/dir"}), 404, "not_found")
	ts.want(ts.do("POST", "/v1/shells", `{"shell":5}`), 400, "invalid_request")
	ts.want(ts.do("DELETE", "/v1/shells/"+id, nil), 204)
	ts.want(ts.do("GET", "/v1/shells/"+id, nil), 404, "not_found")
	ts.want(ts.do("DELETE", "/v1/shells/"+id, nil), 404, "not_found")
}

func TestShellMergeStderr(t *testing.T) {
	ts := newTestServer(t)
	for _, sh := range shells(t) {
		t.Run(filepath.Base(sh), func(t *testing.T) {
			ts.t = t
			id := ts.want(ts.do("POST", "/v1/shells", map[string]any{"shell": sh}), 201).str("id")
			r := run(ts, id, "cd /; echo out1; echo err1 >&2; echo out2", map[string]any{"merge_stderr": true})
			if r.str("stdout") != "out1\nerr1\nout2\n" || r.str("stderr") != "" || r.num("exit_code") != 0 {
				t.Fatalf("merged: %s", r.body)
			}
			r = run(ts, id, "pwd; echo err >&2")
			if r.str("stdout") != "/\n" || r.str("stderr") != "err\n" {
				t.Fatalf("state kept, streams apart again: %s", r.body)
			}
		})
	}
}

// on_timeout=interrupt: SIGINT abandons the command line; the shell, its
// variables and its directory survive.
func TestShellTimeoutInterrupts(t *testing.T) {
	ts := newTestServer(t)
	interrupt := map[string]any{"timeout": 0.3, "on_timeout": "interrupt"}
	for _, sh := range shells(t) {
		t.Run(filepath.Base(sh), func(t *testing.T) {
			ts.t = t
			r := ts.want(ts.do("POST", "/v1/shells", map[string]any{"shell": sh}), 201)
			id, shellPid := r.str("id"), int(r.num("pid"))
			dir := t.TempDir()
			pidFile := filepath.Join(dir, "pid")
			for _, cmd := range []string{
				"cd " + dir + "; A=1; echo before; sleep 30 & echo $! > " + pidFile + "; wait; echo after",
				"B=2; while :; do sleep 0.05; done; echo after",
				"C=3; while :; do :; done; echo after",
				"for i in 1 2 3; do sleep 10; done; echo after",
			} {
				r = run(ts, id, cmd, interrupt)
				if !r.boolean("timed_out") || !r.boolean("alive") || r.num("exit_code") != 130 || strings.Contains(r.str("stdout"), "after") {
					t.Fatalf("%s: %s", cmd, r.body)
				}
			}
			r = run(ts, id, "pwd; echo $A $B $C", map[string]any{"timeout": 5})
			if r.str("stdout") != dir+"\n1 2 3\n" || !r.boolean("alive") {
				t.Fatalf("state after interrupts: %s", r.body)
			}
			if data, err := os.ReadFile(pidFile); err == nil {
				// A background job of the shell ignores SIGINT (it is not
				// the foreground job); killing it is the caller's business.
				run(ts, id, "kill "+strings.TrimSpace(string(data))+" 2>/dev/null; true")
			}
			if groupGone(shellPid) {
				t.Fatal("the shell's group is gone")
			}
			// A command that ignores SIGINT: the shell is killed kill_grace later.
			t0 := time.Now()
			r = run(ts, id, "sh -c \"trap '' INT; sleep 30\"", map[string]any{"timeout": 0.2, "on_timeout": "interrupt", "kill_grace": 0.2})
			if !r.boolean("timed_out") || r.boolean("alive") || r.num("exit_code") != 137 {
				t.Fatalf("stubborn: %s", r.body)
			}
			if d := time.Since(t0); d > 5*time.Second {
				t.Fatalf("stubborn took %v", d)
			}
			eventually(t, 5*time.Second, "the shell's group to be gone", func() bool { return groupGone(shellPid) })
		})
	}
}

// With interrupt, a client that goes away interrupts the run too, and the
// shell lives on.
func TestShellInterruptOnDisconnect(t *testing.T) {
	ts := newTestServer(t)
	id := ts.want(ts.do("POST", "/v1/shells", nil), 201).str("id")
	marker := filepath.Join(t.TempDir(), "started")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		body := `{"cmd":"X=1; touch ` + marker + `; sleep 30","on_timeout":"interrupt"}`
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://sandmand/v1/shells/"+id+"/run", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+testToken)
		resp, err := ts.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	eventually(t, 5*time.Second, "the run to start", func() bool { _, err := os.Stat(marker); return err == nil })
	cancel()
	<-done
	var r *response
	eventually(t, 5*time.Second, "the shell to be free again", func() bool {
		r = ts.do("POST", "/v1/shells/"+id+"/run", map[string]any{"cmd": "echo $X"})
		return r.status == 200
	})
	if r.str("stdout") != "1\n" || !r.boolean("alive") {
		t.Fatalf("after the disconnect: %s", r.body)
	}
}
