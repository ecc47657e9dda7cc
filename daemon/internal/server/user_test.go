package server

import (
	"fmt"
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
	etc := t.TempDir()
	os.WriteFile(filepath.Join(etc, "passwd"), []byte(userPasswd), 0o644)
	os.WriteFile(filepath.Join(etc, "group"), []byte(userGroup), 0o644)
	return newTestServer(t, func(s *Server) { s.runner.Etc = etc })
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
	// Streamed, background, on a terminal and in a shell: the same user.
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
	s := ts.want(ts.do("POST", "/v1/shells", map[string]any{"user": "agent:extra"}), 201)
	r = run(ts, s.str("id"), whoami)
	if r.str("stdout") != "4321 4500 4500 /home/agent\n" {
		t.Errorf("shell: %s", r.body)
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
		ts.want(ts.do("POST", "/v1/shells", map[string]any{"user": user}), 404, "unknown_user")
	}
	for _, user := range []any{"", "a:b:c", ":x", "99999999999", 5} {
		ts.want(ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"true"}, "user": user}), 400, "invalid_request")
		ts.want(ts.do("POST", "/v1/shells", map[string]any{"user": user}), 400, "invalid_request")
	}
}

// whoIn is "uid gid user" of an info object (user "null" when unknown).
func whoIn(info map[string]any) string {
	user := "null"
	if name, ok := info["user"].(string); ok {
		user = name
	}
	return fmt.Sprintf("%v %v %s", info["uid"], info["gid"], user)
}

func TestInfoSaysWhichUser(t *testing.T) {
	ts := userServer(t)
	for _, c := range []struct {
		req  map[string]any
		want string
	}{
		{map[string]any{"cmd": "sleep 30", "user": "agent"}, "4321 4322 agent"},
		{map[string]any{"cmd": "sleep 30", "user": "4321"}, "4321 4322 agent"},
		{map[string]any{"cmd": "sleep 30", "user": "agent:extra"}, "4321 4500 agent"},
		{map[string]any{"cmd": "sleep 30", "user": "777:778"}, "777 778 null"},
		{map[string]any{"cmd": "sleep 30"}, "0 0 root"},
		{map[string]any{"cmd": "sleep 30", "user": "agent", "tty": true}, "4321 4322 agent"},
		// Never launched: the user it would have run as.
		{map[string]any{"argv": []string{"/no/such/program"}, "user": "agent"}, "4321 4322 agent"},
	} {
		p := ts.want(ts.do("POST", "/v1/processes", c.req), 201)
		if got := whoIn(p.json); got != c.want {
			t.Errorf("%v: started %s, want %s", c.req, got, c.want)
		}
		if got := whoIn(ts.want(ts.do("GET", "/v1/processes/"+p.str("id"), nil), 200).json); got != c.want {
			t.Errorf("%v: get %s, want %s", c.req, got, c.want)
		}
		ts.want(ts.do("DELETE", "/v1/processes/"+p.str("id"), nil), 204)
	}
	listed := ts.want(ts.do("POST", "/v1/processes", map[string]any{"cmd": "sleep 30", "user": "agent"}), 201)
	for _, p := range ts.want(ts.do("GET", "/v1/processes", nil), 200).json["processes"].([]any) {
		if got := whoIn(p.(map[string]any)); got != "4321 4322 agent" {
			t.Errorf("list: %s", got)
		}
	}
	ts.want(ts.do("DELETE", "/v1/processes/"+listed.str("id"), nil), 204)

	for _, c := range []struct {
		req  map[string]any
		want string
	}{
		{map[string]any{"user": "agent:extra"}, "4321 4500 agent"},
		{map[string]any{"user": "777"}, "777 0 null"},
		{map[string]any{}, "0 0 root"},
	} {
		s := ts.want(ts.do("POST", "/v1/shells", c.req), 201)
		if got := whoIn(s.json); got != c.want {
			t.Errorf("shell %v: started %s, want %s", c.req, got, c.want)
		}
		if got := whoIn(ts.want(ts.do("GET", "/v1/shells/"+s.str("id"), nil), 200).json); got != c.want {
			t.Errorf("shell %v: get %s, want %s", c.req, got, c.want)
		}
		// The reported uid is the shell's.
		if r := run(ts, s.str("id"), "id -u"); r.str("stdout") != strings.Fields(c.want)[0]+"\n" {
			t.Errorf("shell %v: id -u %s", c.req, r.body)
		}
		ts.want(ts.do("DELETE", "/v1/shells/"+s.str("id"), nil), 204)
	}
	for _, s := range ts.want(ts.do("GET", "/v1/shells", nil), 200).json["shells"].([]any) {
		t.Errorf("shell left: %v", s)
	}
}

// A daemon that is not root reports itself, by the name its passwd gives.
func TestInfoSaysTheDaemonsOwnUser(t *testing.T) {
	etc := t.TempDir()
	uid, gid := os.Getuid(), os.Getgid()
	os.WriteFile(filepath.Join(etc, "passwd"), []byte(fmt.Sprintf("me:x:%d:%d::/home/me:/bin/sh\n", uid, gid)), 0o644)
	ts := newTestServer(t, func(s *Server) { s.runner.Etc = etc })
	want := fmt.Sprintf("%d %d me", uid, gid)
	p := ts.want(ts.do("POST", "/v1/processes", map[string]any{"cmd": "true"}), 201)
	s := ts.want(ts.do("POST", "/v1/shells", map[string]any{}), 201)
	if got := whoIn(p.json); got != want {
		t.Errorf("process: %s, want %s", got, want)
	}
	if got := whoIn(s.json); got != want {
		t.Errorf("shell: %s, want %s", got, want)
	}
	ts.want(ts.do("DELETE", "/v1/shells/"+s.str("id"), nil), 204)
	// Without a passwd entry the name is unknown.
	os.WriteFile(filepath.Join(etc, "passwd"), []byte(""), 0o644)
	p = ts.want(ts.do("POST", "/v1/processes", map[string]any{"cmd": "true"}), 201)
	if got, want := whoIn(p.json), fmt.Sprintf("%d %d null", uid, gid); got != want {
		t.Errorf("process without passwd entry: %s, want %s", got, want)
	}
}
