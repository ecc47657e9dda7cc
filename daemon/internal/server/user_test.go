package server

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const (
	userPasswd = "root:x:0:0:root:/root:/bin/sh\nagent:x:4321:4322:Agent:/home/agent:/bin/sh\n"
	userGroup  = "root:x:0:\nagentg:x:4322:\nextra:x:4500:agent\n"
)

// userServer is a test server whose users come from a passwd and group of
// the test's own; switching users needs root (CAP_SETUID, CAP_SETGID).
func userServer(t *testing.T) *testServer {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("running commands as another user needs root")
	}
	ts := newTestServer(t)
	etc := t.TempDir()
	os.WriteFile(filepath.Join(etc, "passwd"), []byte(userPasswd), 0o644)
	os.WriteFile(filepath.Join(etc, "group"), []byte(userGroup), 0o644)
	ts.srv.runner.Etc = etc
	return ts
}

const whoami = `echo "$(id -u) $(id -g) $(id -G) $HOME"`

func TestExecAsUser(t *testing.T) {
	ts := userServer(t)
	for _, c := range []struct{ user, want string }{
		{"agent", "4321 4322 4322 4500 /home/agent\n"},
		{"4321", "4321 4322 4322 4500 /home/agent\n"},
		{"agent:extra", "4321 4500 4500 /home/agent\n"},
		{"777:778", "777 778 778 /\n"},
		{"root", "0 0 0 /root\n"},
	} {
		r := execOK(ts, map[string]any{"cmd": whoami, "user": c.user})
		if r.str("stdout") != c.want || r.num("exit_code") != 0 {
			t.Errorf("user %s: %s", c.user, r.body)
		}
	}
	// The request's env still wins over the user's HOME.
	r := execOK(ts, map[string]any{"cmd": "echo $HOME", "user": "agent", "env": map[string]string{"HOME": "/elsewhere"}})
	if r.str("stdout") != "/elsewhere\n" {
		t.Errorf("env HOME: %s", r.body)
	}
	// Streamed, background, on a terminal and in a session: the same user.
	resp, sc := ts.stream(map[string]any{"cmd": "id -u", "user": "agent"})
	var out string
	for sc.Scan() {
		if ev := validateEvent(t, sc.Bytes()); ev["event"] == "stdout" {
			out += ev["data"].(string)
		}
	}
	resp.Body.Close()
	if out != "4321\n" {
		t.Errorf("stream: %q", out)
	}
	for _, tty := range []bool{false, true} {
		p := ts.want(ts.do("POST", "/v1/processes", map[string]any{"cmd": "id -u", "user": "agent", "tty": tty}), 201)
		id := p.str("id")
		ts.want(ts.do("POST", "/v1/processes/"+id+"/wait", map[string]any{"timeout": 10}), 200)
		o := ts.want(ts.do("GET", "/v1/processes/"+id+"/output", nil), 200)
		if strings.TrimSpace(o.str("stdout")) != "4321" {
			t.Errorf("process (tty %v): %s", tty, o.body)
		}
	}
	s := ts.want(ts.do("POST", "/v1/sessions", map[string]any{"user": "agent:extra"}), 201)
	r = run(ts, s.str("id"), whoami)
	if r.str("stdout") != "4321 4500 4500 /home/agent\n" {
		t.Errorf("session: %s", r.body)
	}
}

func TestUnknownUserAndBadUser(t *testing.T) {
	ts := userServer(t)
	for _, user := range []string{"nobody-here", "agent:nogroup"} {
		r := ts.want(ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"true"}, "user": user}), 404, "unknown_user")
		if user == "nobody-here" && !strings.Contains(string(r.body), "unable to find user nobody-here: no matching entries in passwd file") {
			t.Errorf("message: %s", r.body)
		}
		ts.want(ts.do("POST", "/v1/exec/stream", map[string]any{"argv": []string{"true"}, "user": user}), 404, "unknown_user")
		ts.want(ts.do("POST", "/v1/processes", map[string]any{"argv": []string{"true"}, "user": user}), 404, "unknown_user")
		ts.want(ts.do("POST", "/v1/sessions", map[string]any{"user": user}), 404, "unknown_user")
	}
	for _, user := range []any{"", "a:b:c", ":x", "99999999999", 5} {
		ts.want(ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"true"}, "user": user}), 400, "invalid_request")
		ts.want(ts.do("POST", "/v1/sessions", map[string]any{"user": user}), 400, "invalid_request")
	}
}
