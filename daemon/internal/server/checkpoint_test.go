package server

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// unixListeners is a Listeners over one unix socket, as the daemon's main
// loop lends its own.
type unixListeners struct {
	hs     *http.Server
	path   string
	mu     sync.Mutex
	ln     net.Listener
	opened int
}

func (u *unixListeners) Open() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.hs.SetKeepAlivesEnabled(true)
	ln, err := net.Listen("unix", u.path)
	if err != nil {
		return err
	}
	u.ln = ln
	u.opened++
	go u.hs.Serve(ln)
	return nil
}

func (u *unixListeners) Close() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.ln.Close()
	u.hs.SetKeepAlivesEnabled(false)
}

// newCheckpointServer is a testServer whose listener the server may close and reopen.
func newCheckpointServer(t *testing.T) (*testServer, *unixListeners) {
	t.Helper()
	dir := t.TempDir()
	hs := &http.Server{}
	ls := &unixListeners{hs: hs, path: filepath.Join(dir, "d.sock")}
	srv, err := New(Options{Token: testToken, Version: "test", KillGrace: 2 * time.Second,
		Reaper: testReaper, Listeners: ls})
	if err != nil {
		t.Fatal(err)
	}
	hs.Handler, hs.ConnState = srv, srv.ConnState
	if err := ls.Open(); err != nil {
		t.Fatal(err)
	}
	ts := &testServer{t: t, srv: srv, dir: dir, client: unixClient(ls.path)}
	t.Cleanup(func() {
		for _, p := range srv.procs.List() {
			_ = srv.procs.Delete(p.ID)
		}
		hs.Close()
	})
	return ts, ls
}

func TestCheckpointPrepareQuiescesAndResumeServesAgain(t *testing.T) {
	ts, ls := newCheckpointServer(t)
	ts.do("GET", "/v1/processes", nil) // an idle keep-alive connection
	r := ts.do("POST", "/v1/checkpoint/prepare", nil)
	if r.status != http.StatusNoContent {
		t.Fatalf("prepare: %d %v %s", r.status, r.header, r.body)
	}
	if !ts.srv.Quiesced() {
		t.Fatal("not quiesced")
	}
	if c, err := net.Dial("unix", ls.path); err == nil {
		c.Close()
		t.Fatal("still accepting")
	}
	if err := ts.srv.Resume(); err != nil || ls.opened != 2 || ts.srv.Quiesced() {
		t.Fatalf("resume: %v, opened %d", err, ls.opened)
	}
	if r := ts.do("GET", "/v1/processes", nil); r.status != 200 {
		t.Fatal(r.status)
	}
	// Resume without a prepare first does nothing.
	if err := ts.srv.Resume(); err != nil || ls.opened != 2 {
		t.Fatalf("resume again: %v, opened %d", err, ls.opened)
	}
}

func TestCheckpointPrepareRefusals(t *testing.T) {
	ts, ls := newCheckpointServer(t)
	// A command holding a TCP listener: named, with its pid.
	p := ts.do("POST", "/v1/processes", map[string]any{"argv": []string{"python3", "-c",
		"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print('up', flush=True); time.sleep(60)"}})
	id := p.str("id")
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(ts.do("GET", "/v1/processes/"+id+"/output?wait=1", nil).str("stdout"), "up") {
		if time.Now().After(deadline) {
			t.Fatal("the listener never came up")
		}
	}
	r := ts.do("POST", "/v1/checkpoint/prepare", nil)
	want := fmt.Sprintf("pid %d (python3): LISTEN 127.0.0.1:", int(p.num("pid")))
	if r.status != http.StatusConflict || r.errCode() != "not_checkpointable" || !strings.Contains(string(r.body), want) {
		t.Fatalf("want 409 not_checkpointable with %q: %d %s", want, r.status, r.body)
	}
	ts.do("DELETE", "/v1/processes/"+id, nil)
	// A request in flight on another connection.
	waiting := make(chan struct{})
	go func() {
		defer close(waiting)
		ts.do("POST", "/v1/exec", map[string]any{"argv": []string{"sleep", "1"}})
	}()
	time.Sleep(300 * time.Millisecond)
	r = ts.do("POST", "/v1/checkpoint/prepare", nil)
	if r.status != http.StatusConflict || !strings.Contains(string(r.body), "in flight") {
		t.Fatalf("want a refusal for the request in flight: %d %s", r.status, r.body)
	}
	<-waiting
	if ls.opened != 1 || ts.srv.Quiesced() {
		t.Fatalf("a refusal closed the listener: opened %d", ls.opened)
	}
	// Without listeners lent (an embedded server), no prepare.
	plain := newTestServer(t)
	if r := plain.do("POST", "/v1/checkpoint/prepare", nil); r.status != http.StatusConflict {
		t.Fatal(r.status)
	}
}

func TestTokenReplaceRefusesBadTokens(t *testing.T) {
	ts := newTestServer(t)
	for _, body := range []string{`{}`, `{"token": "short"}`, `{"token": "has a space in it, so no"}`,
		`{"token": 5}`, `{"token": "0123456789abcdef", "x": 1}`, `[`} {
		if r := ts.do("POST", "/v1/token", body); r.status != http.StatusBadRequest {
			t.Errorf("%s: %d %s", body, r.status, r.body)
		}
	}
	if r := ts.do("POST", "/v1/token", `{"token": "0123456789abcdef"}`); r.status != http.StatusNoContent {
		t.Fatal(r.status, string(r.body))
	}
	if r := ts.do("GET", "/v1/processes", nil); r.status != http.StatusUnauthorized {
		t.Fatal("old token still works", r.status)
	}
	if r := ts.do("GET", "/v1/processes", nil, withToken("0123456789abcdef")); r.status != 200 {
		t.Fatal(r.status)
	}
}

func unixClient(path string) *http.Client {
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}}
}
