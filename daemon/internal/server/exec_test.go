package server

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestHealthAndSpecNeedNoAuth(t *testing.T) {
	ts := newTestServer(t)
	r := ts.want(ts.do("GET", "/v1/health", nil, noToken), 200)
	if r.str("status") != "ok" || r.str("protocol") != "v1" || r.str("version") != "test" || r.num("pid") != float64(os.Getpid()) {
		t.Fatalf("health: %s", r.body)
	}
	r = ts.want(ts.do("GET", "/v1/openapi.json", nil, noToken), 200)
	if !strings.Contains(string(r.body), `"openapi": "3.1.0"`) {
		t.Fatal("openapi.json not served")
	}
}

func TestAuth(t *testing.T) {
	ts := newTestServer(t)
	for _, path := range []string{"/v1/processes", "/v1/shells", "/v1/files/stat?path=/"} {
		ts.want(ts.do("GET", path, nil, noToken), 401, "unauthorized")
		ts.want(ts.do("GET", path, nil, withToken("wrong")), 401, "unauthorized")
		ts.want(ts.do("GET", path, nil, withToken(testToken+"x")), 401, "unauthorized")
	}
	ts.want(ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"true"}}, noToken), 401, "unauthorized")
}

func TestRoutingErrors(t *testing.T) {
	ts := newTestServer(t)
	ts.want(ts.do("GET", "/v1/nope", nil), 404, "unknown_route")
	ts.want(ts.do("GET", "/v1/processes/", nil), 404, "unknown_route")
	r := ts.want(ts.do("PUT", "/v1/exec", nil), 405, "method_not_allowed")
	if r.header.Get("Allow") != "POST" {
		t.Fatalf("Allow %q", r.header.Get("Allow"))
	}
}

func execOK(ts *testServer, body map[string]any) *response {
	ts.t.Helper()
	return ts.want(ts.do("POST", "/v1/exec", body), 200)
}

func TestExecBasics(t *testing.T) {
	ts := newTestServer(t)
	r := execOK(ts, map[string]any{"argv": []string{"echo", "hello"}})
	if r.num("exit_code") != 0 || r.str("stdout") != "hello\n" || r.json["signal"] != nil || r.boolean("timed_out") {
		t.Fatalf("echo: %s", r.body)
	}
	r = execOK(ts, map[string]any{"cmd": "echo out; echo err >&2; exit 3"})
	if r.num("exit_code") != 3 || r.str("stdout") != "out\n" || r.str("stderr") != "err\n" {
		t.Fatalf("cmd: %s", r.body)
	}
	r = execOK(ts, map[string]any{"cmd": "echo $0", "shell": "/bin/bash"})
	if r.str("stdout") != "/bin/bash\n" {
		t.Fatalf("shell: %s", r.body)
	}
	dir := t.TempDir()
	r = execOK(ts, map[string]any{"argv": []string{"pwd"}, "cwd": dir})
	if r.str("stdout") != dir+"\n" {
		t.Fatalf("cwd: %s", r.body)
	}
	r = execOK(ts, map[string]any{"cmd": "echo $FOO:${SANDMAND_SECRET:-unset}", "env": map[string]string{"FOO": "bar"}})
	if r.str("stdout") != "bar:unset\n" {
		t.Fatalf("env: %s", r.body)
	}
	r = execOK(ts, map[string]any{"argv": []string{"cat"}, "stdin": "in put"})
	if r.str("stdout") != "in put" {
		t.Fatalf("stdin: %s", r.body)
	}
	r = execOK(ts, map[string]any{"argv": []string{"cat"}})
	if r.str("stdout") != "" || r.num("exit_code") != 0 {
		t.Fatalf("stdin default must be /dev/null: %s", r.body)
	}
	r = execOK(ts, map[string]any{"argv": []string{"printf", "\\377ok"}, "encoding": "base64"})
	if r.str("encoding") != "base64" || r.str("stdout") != base64.StdEncoding.EncodeToString([]byte("\xffok")) {
		t.Fatalf("base64: %s", r.body)
	}
	r = execOK(ts, map[string]any{"argv": []string{"printf", "\\377ok"}})
	if r.str("stdout") != "\ufffdok" {
		t.Fatalf("utf-8 replacement: %s", r.body)
	}
	r = execOK(ts, map[string]any{"cmd": "kill -KILL $$"})
	if r.num("exit_code") != 137 || r.str("signal") != "KILL" {
		t.Fatalf("signal: %s", r.body)
	}
}

func TestExecLaunchFailures(t *testing.T) {
	ts := newTestServer(t)
	r := execOK(ts, map[string]any{"argv": []string{"no-such-command-xyz"}})
	if r.num("exit_code") != 127 || r.str("stderr") != "sandmand: no-such-command-xyz: command not found\n" {
		t.Fatalf("not found: %s", r.body)
	}
	r = execOK(ts, map[string]any{"argv": []string{"/no/such/path"}})
	if r.num("exit_code") != 127 {
		t.Fatalf("missing path: %s", r.body)
	}
	f := filepath.Join(t.TempDir(), "noexec")
	os.WriteFile(f, []byte("#!/bin/sh\n"), 0o644)
	r = execOK(ts, map[string]any{"argv": []string{f}})
	if r.num("exit_code") != 126 || !strings.Contains(r.str("stderr"), "sandmand: ") {
		t.Fatalf("not executable: %s", r.body)
	}
	r = execOK(ts, map[string]any{"argv": []string{"tool"}, "env": map[string]string{"PATH": filepath.Dir(f) + ":/bin"}})
	if r.num("exit_code") != 127 {
		t.Fatalf("PATH of the child: %s", r.body)
	}
	os.WriteFile(filepath.Join(filepath.Dir(f), "tool"), []byte("#!/bin/sh\necho tool\n"), 0o755)
	r = execOK(ts, map[string]any{"argv": []string{"tool"}, "env": map[string]string{"PATH": filepath.Dir(f) + ":/bin"}})
	if r.num("exit_code") != 0 || r.str("stdout") != "tool\n" {
		t.Fatalf("PATH lookup: %s", r.body)
	}
	ts.want(ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"true"}, "cwd": "/no/such/dir"}), 404, "not_found")
	ts.want(ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"true"}, "cwd": f}), 400, "not_a_directory")
}

func TestExecBadInput(t *testing.T) {
	ts := newTestServer(t)
	cases := []struct {
		body string
		code string
	}{
		{`{"argv": [`, "invalid_json"},
		{`not json`, "invalid_json"},
		{`[1,2]`, "invalid_json"},
		{`{"argv":["true"]} {}`, "invalid_json"},
		{`{"argv":["true"],"bogus":1}`, "invalid_request"},
		{`{"argv":"true"}`, "invalid_request"},
		{`{"argv":[1]}`, "invalid_request"},
		{`{"argv":[]}`, "invalid_request"},
		{`{}`, "invalid_request"},
		{``, "invalid_request"},
		{`{"argv":["true"],"cmd":"true"}`, "invalid_request"},
		{`{"argv":["true"],"shell":"/bin/sh"}`, "invalid_request"},
		{`{"argv":["true"],"timeout":-1}`, "invalid_request"},
		{`{"argv":["true"],"timeout":0}`, "invalid_request"},
		{`{"argv":["true"],"timeout":"1"}`, "invalid_request"},
		{`{"argv":["true"],"max_output":-5}`, "invalid_request"},
		{`{"argv":["true"],"encoding":"latin1"}`, "invalid_request"},
		{`{"argv":["a\u0000b"]}`, "invalid_request"},
		{`{"argv":["true"],"env":{"A=B":"c"}}`, "invalid_request"},
		{`{"argv":["true"],"cwd":""}`, "invalid_path"},
	}
	for _, c := range cases {
		r := ts.do("POST", "/v1/exec", c.body)
		if r.status != 400 || r.errCode() != c.code {
			t.Errorf("%s: got %d %s, want 400 %s", c.body, r.status, r.body, c.code)
		}
	}
	big := `{"argv":["true"],"stdin":"` + strings.Repeat("x", maxJSONBody) + `"}`
	ts.want(ts.do("POST", "/v1/exec", big), 413, "payload_too_large")
}

func TestExecTruncates(t *testing.T) {
	ts := newTestServer(t)
	r := execOK(ts, map[string]any{"cmd": "head -c 3000000 /dev/zero | tr '\\0' a; echo done >&2", "max_output": 1000})
	if !r.boolean("truncated") || len(r.str("stdout")) != 1000 || r.str("stderr") != "done\n" || r.num("exit_code") != 0 {
		t.Fatalf("truncated=%v len=%d stderr=%q", r.boolean("truncated"), len(r.str("stdout")), r.str("stderr"))
	}
	r = execOK(ts, map[string]any{"cmd": "echo 123456", "max_output": 0})
	if !r.boolean("truncated") || r.str("stdout") != "" {
		t.Fatalf("max_output 0: %s", r.body)
	}
}

func groupGone(pgid int) bool {
	return syscall.Kill(-pgid, 0) == syscall.ESRCH
}

// A command whose whole group ignores SIGTERM is SIGKILLed after the grace,
// group and all.
func TestExecTimeoutKillsStubbornGroup(t *testing.T) {
	ts := newTestServer(t)
	pidFile := filepath.Join(t.TempDir(), "pid")
	t0 := time.Now()
	r := execOK(ts, map[string]any{
		"cmd":        "trap '' TERM; sleep 30 & echo $$ > " + pidFile + "; wait",
		"timeout":    0.3,
		"kill_grace": 0.3,
	})
	if !r.boolean("timed_out") || r.num("exit_code") != 137 || r.str("signal") != "KILL" {
		t.Fatalf("timeout: %s", r.body)
	}
	if d := time.Since(t0); d < 600*time.Millisecond || d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
	data, _ := os.ReadFile(pidFile)
	pgid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the process group to be gone", func() bool { return groupGone(pgid) })
}

func TestExecTimeoutTermSuffices(t *testing.T) {
	ts := newTestServer(t)
	r := execOK(ts, map[string]any{"argv": []string{"sleep", "30"}, "timeout": 0.1})
	if !r.boolean("timed_out") || r.str("signal") != "TERM" || r.num("exit_code") != 143 {
		t.Fatalf("%s", r.body)
	}
}

// A background grandchild holding the pipes delays the result by at most
// about 100 ms.
func TestExecDoesNotWaitForGrandchildPipes(t *testing.T) {
	ts := newTestServer(t)
	t0 := time.Now()
	r := execOK(ts, map[string]any{"cmd": "sleep 1 & echo started"})
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("took %v", d)
	}
	if r.str("stdout") != "started\n" {
		t.Fatalf("%s", r.body)
	}
}

func TestExecStream(t *testing.T) {
	ts := newTestServer(t)
	resp, sc := ts.stream(map[string]any{"cmd": "echo one; sleep 0.05; echo two >&2; printf '\\342\\202'; sleep 0.05; printf '\\254\\n'; exit 4"})
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/x-ndjson" {
		t.Fatalf("status %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	var out, errs string
	var exit map[string]any
	for sc.Scan() {
		ev := validateEvent(t, sc.Bytes())
		switch ev["event"] {
		case "stdout":
			out += ev["data"].(string)
		case "stderr":
			errs += ev["data"].(string)
		case "exit":
			exit = ev
		}
	}
	if out != "one\n€\n" || errs != "two\n" || exit == nil || exit["exit_code"].(json.Number).String() != "4" {
		t.Fatalf("out %q errs %q exit %v", out, errs, exit)
	}
	// Errors before the start are plain JSON errors.
	ts.want(ts.do("POST", "/v1/exec/stream", `{"argv":["true"],"cwd":"/no/such"}`), 404, "not_found")
	ts.want(ts.do("POST", "/v1/exec/stream", `{"argv":1}`), 400, "invalid_request")
	resp, sc = ts.stream(map[string]any{"argv": []string{"no-such-cmd-xyz"}})
	defer resp.Body.Close()
	var lines []map[string]any
	for sc.Scan() {
		lines = append(lines, validateEvent(t, sc.Bytes()))
	}
	if len(lines) != 2 || lines[1]["exit_code"].(json.Number).String() != "127" {
		t.Fatalf("not found stream: %v", lines)
	}
}

func TestExecStreamClientDisconnectKills(t *testing.T) {
	ts := newTestServer(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp, sc := ts.stream(map[string]any{"cmd": "echo $$; exec sleep 60"}, withCtx(ctx))
	defer resp.Body.Close()
	if !sc.Scan() {
		t.Fatal("no first event")
	}
	ev := validateEvent(t, sc.Bytes())
	pid, err := strconv.Atoi(strings.TrimSpace(ev["data"].(string)))
	if err != nil {
		t.Fatalf("event %v", ev)
	}
	if syscall.Kill(pid, 0) != nil {
		t.Fatal("command not running")
	}
	cancel()
	eventually(t, 5*time.Second, "the command to be killed", func() bool { return syscall.Kill(pid, 0) == syscall.ESRCH })
}

// Orphans of a fork-heavy command are re-parented to us (a subreaper, as
// the daemon is PID 1) and must all be reaped: a zombie stays in /proc.
func TestNoZombiesLeft(t *testing.T) {
	ts := newTestServer(t)
	var orphans []string
	for i := 0; i < 3; i++ {
		r := execOK(ts, map[string]any{"cmd": "for i in 1 2 3 4 5; do (sleep 0.05 & echo $!) ; done"})
		orphans = append(orphans, strings.Fields(r.str("stdout"))...)
	}
	if len(orphans) != 15 {
		t.Fatalf("orphans %v", orphans)
	}
	eventually(t, 5*time.Second, "every orphan reaped", func() bool {
		for _, pid := range orphans {
			if _, err := os.Stat("/proc/" + pid); err == nil {
				return false
			}
		}
		return true
	})
	for _, c := range childrenOf(os.Getpid(), t) {
		if strings.HasSuffix(c, " Z") {
			t.Errorf("zombie child %s", c)
		}
	}
}

// childrenOf lists "pid state" of the processes whose parent is ppid.
func childrenOf(ppid int, t *testing.T) []string {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(data)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) > 1 && f[1] == strconv.Itoa(ppid) {
			out = append(out, e.Name()+" "+f[0])
		}
	}
	return out
}

// merge_stderr: one pipe for both streams, so the order of writes is kept.
func TestExecMergeStderr(t *testing.T) {
	ts := newTestServer(t)
	script := "echo out1; echo err1 >&2; echo out2; echo err2 >&2"
	r := execOK(ts, map[string]any{"cmd": script, "merge_stderr": true})
	if r.str("stdout") != "out1\nerr1\nout2\nerr2\n" || r.str("stderr") != "" {
		t.Fatalf("exec: %s", r.body)
	}
	r = execOK(ts, map[string]any{"cmd": "echo 0123456789; echo abc >&2", "merge_stderr": true, "max_output": 12})
	if r.str("stdout") != "0123456789\na" || !r.boolean("truncated") {
		t.Fatalf("one cap for the merged stream: %s", r.body)
	}
	resp, sc := ts.stream(map[string]any{"cmd": script, "merge_stderr": true})
	defer resp.Body.Close()
	var out string
	for sc.Scan() {
		ev := validateEvent(t, sc.Bytes())
		switch ev["event"] {
		case "stdout":
			out += ev["data"].(string)
		case "stderr":
			t.Fatalf("a stderr event with merge_stderr: %v", ev)
		}
	}
	if out != "out1\nerr1\nout2\nerr2\n" {
		t.Fatalf("stream: %q", out)
	}
	p := ts.want(ts.do("POST", "/v1/processes", map[string]any{"cmd": script, "merge_stderr": true}), 201)
	ts.want(ts.do("POST", "/v1/processes/"+p.str("id")+"/wait", map[string]any{"timeout": 10}), 200)
	o := ts.want(ts.do("GET", "/v1/processes/"+p.str("id")+"/output", nil), 200)
	if o.str("stdout") != "out1\nerr1\nout2\nerr2\n" || o.str("stderr") != "" {
		t.Fatalf("process: %s", o.body)
	}
	// A launch failure still reports its reason, on the one stream there is.
	r = execOK(ts, map[string]any{"argv": []string{"no-such-command-xyz"}, "merge_stderr": true})
	if r.num("exit_code") != 127 || r.str("stdout") != "sandmand: no-such-command-xyz: command not found\n" || r.str("stderr") != "" {
		t.Fatalf("not found: %s", r.body)
	}
}

// stdin_encoding base64 carries any bytes to stdin.
func TestExecBinaryStdin(t *testing.T) {
	ts := newTestServer(t)
	data := []byte("\x00\xff\xfe binary\r\n\x80")
	b64 := base64.StdEncoding.EncodeToString(data)
	r := execOK(ts, map[string]any{"argv": []string{"cat"}, "stdin": b64, "stdin_encoding": "base64", "encoding": "base64"})
	if r.str("stdout") != b64 {
		t.Fatalf("round trip: %s", r.body)
	}
	resp, sc := ts.stream(map[string]any{"argv": []string{"wc", "-c"}, "stdin": b64, "stdin_encoding": "base64"})
	defer resp.Body.Close()
	var out string
	for sc.Scan() {
		if ev := validateEvent(t, sc.Bytes()); ev["event"] == "stdout" {
			out += ev["data"].(string)
		}
	}
	if strings.TrimSpace(out) != strconv.Itoa(len(data)) {
		t.Fatalf("stream: %q", out)
	}
	r = execOK(ts, map[string]any{"argv": []string{"cat"}, "stdin": "as text", "stdin_encoding": "utf-8"})
	if r.str("stdout") != "as text" {
		t.Fatalf("utf-8: %s", r.body)
	}
	ts.want(ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"cat"}, "stdin": "not base64!", "stdin_encoding": "base64"}), 400, "invalid_request")
	ts.want(ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"cat"}, "stdin": "x", "stdin_encoding": "latin1"}), 400, "invalid_request")
}

// A plain exec whose client goes away is killed, group and all, as a
// streamed one is.
func TestExecClientDisconnectKills(t *testing.T) {
	ts := newTestServer(t)
	pidFile := filepath.Join(t.TempDir(), "pid")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		body := `{"cmd":"sleep 60 & echo $$ > ` + pidFile + `; wait"}`
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://sandmand/v1/exec", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+testToken)
		resp, err := ts.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	var pgid int
	eventually(t, 5*time.Second, "the command to start", func() bool {
		data, err := os.ReadFile(pidFile)
		if err != nil || !strings.HasSuffix(string(data), "\n") {
			return false
		}
		pgid, err = strconv.Atoi(strings.TrimSpace(string(data)))
		return err == nil
	})
	if groupGone(pgid) {
		t.Fatal("command not running")
	}
	cancel()
	if err := <-done; err == nil {
		t.Fatal("the request was not cut")
	}
	eventually(t, 5*time.Second, "the process group to be killed", func() bool { return groupGone(pgid) })
	coverMu.Lock()
	covered["POST /v1/exec"] = true
	coverMu.Unlock()
}
