package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"sandman/daemon/internal/proc"
	"sandman/daemon/internal/reaper"
	"sandman/daemon/spec"
)

const testToken = "test-token"

var (
	testReaper *reaper.Reaper
	specDoc    *spec.Doc
	coverMu    sync.Mutex
	covered    = map[string]bool{} // "METHOD pattern" hit by a test
)

// TestMain makes this test process a subreaper with one reaper, as the
// daemon is, so orphans of commands come back to us and must be reaped.
func TestMain(m *testing.M) {
	flag.Parse()
	if err := reaper.BecomeSubreaper(); err != nil {
		fmt.Fprintln(os.Stderr, "subreaper:", err)
		os.Exit(1)
	}
	testReaper = reaper.New()
	os.Setenv("SANDMAND_SECRET", "leak")
	var err error
	if specDoc, err = spec.Load(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	if code == 0 && flag.Lookup("test.run").Value.String() == "" && !testing.Short() {
		// The whole suite ran: every route must have been driven.
		srv, _ := New(Options{NoAuth: true, Version: "t", Reaper: testReaper})
		for _, rt := range srv.Routes() {
			if !covered[rt.Method+" "+rt.Pattern] {
				fmt.Fprintf(os.Stderr, "route %s %s not exercised by any test\n", rt.Method, rt.Pattern)
				code = 1
			}
		}
	}
	os.Exit(code)
}

// testServer is a Server on a real unix socket.
type testServer struct {
	t      *testing.T
	srv    *Server
	client *http.Client
	dir    string
}

// newTestServer serves a new Server; each setup changes it before it serves (a
// change made later would race with the serving goroutines).
func newTestServer(t *testing.T, setup ...func(*Server)) *testServer {
	t.Helper()
	srv, err := New(Options{Token: testToken, Version: "test", KillGrace: 2 * time.Second,
		Reaper: testReaper, Env: proc.DaemonEnv()})
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "sandmand-test-")
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "d.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	for _, change := range setup {
		change(srv)
	}
	hs := &http.Server{Handler: srv}
	go hs.Serve(ln)
	ts := &testServer{t: t, srv: srv, dir: dir, client: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}}}}
	t.Cleanup(func() {
		for _, p := range srv.procs.List() {
			_ = srv.procs.Delete(p.ID)
		}
		for _, s := range srv.shells.List() {
			_ = srv.shells.Delete(s.ID)
		}
		hs.Close()
		os.RemoveAll(dir)
	})
	return ts
}

// response is a finished request.
type response struct {
	status int
	header http.Header
	body   []byte
	json   map[string]any
}

func (r *response) str(key string) string {
	s, _ := r.json[key].(string)
	return s
}

func (r *response) num(key string) float64 {
	switch v := r.json[key].(type) {
	case json.Number:
		f, _ := v.Float64()
		return f
	case float64:
		return v
	}
	return -1
}

func (r *response) boolean(key string) bool {
	b, _ := r.json[key].(bool)
	return b
}

func (r *response) errCode() string {
	e, _ := r.json["error"].(map[string]any)
	c, _ := e["code"].(string)
	return c
}

type reqOpt func(*http.Request)

func noToken(r *http.Request) { r.Header.Del("Authorization") }
func withToken(tok string) reqOpt {
	return func(r *http.Request) { r.Header.Set("Authorization", "Bearer "+tok) }
}
func withCtx(ctx context.Context) reqOpt { return func(r *http.Request) { *r = *r.WithContext(ctx) } }

// do sends a request; body is marshalled unless it is []byte or string.
// Every JSON response is validated against the spec for its route/status.
func (ts *testServer) do(method, path string, body any, opts ...reqOpt) *response {
	ts.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		rd = bytes.NewReader(b)
	case string:
		rd = strings.NewReader(b)
	default:
		data, err := json.Marshal(b)
		if err != nil {
			ts.t.Fatal(err)
		}
		rd = bytes.NewReader(data)
	}
	req, err := http.NewRequest(method, "http://sandmand"+path, rd)
	if err != nil {
		ts.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+testToken)
	for _, o := range opts {
		o(req)
	}
	resp, err := ts.client.Do(req)
	if err != nil {
		ts.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		ts.t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	r := &response{status: resp.StatusCode, header: resp.Header, body: data}
	ts.check(method, req.URL.Path, r)
	return r
}

// check validates a response against the spec and records route coverage.
func (ts *testServer) check(method, path string, r *response) {
	ts.t.Helper()
	ct := r.header.Get("Content-Type")
	rt, _, ferr := ts.srv.find(method, path)
	if ferr != nil {
		// 404 unknown_route / 405: the Error schema.
		ts.validate(r, "", "", ct)
		return
	}
	coverMu.Lock()
	covered[method+" "+rt.pattern] = true
	coverMu.Unlock()
	if r.status == http.StatusNoContent {
		if len(r.body) != 0 {
			ts.t.Errorf("%s %s: 204 with a body", method, path)
		}
		return
	}
	schema, err := specDoc.ResponseSchema(rt.pattern, method, r.status, ct)
	if err != nil {
		ts.t.Fatalf("%s %s -> %d %s: %v (body %s)", method, path, r.status, ct, err, r.body)
	}
	if ct == "application/json" {
		ts.validateWith(r, schema)
	}
}

func (ts *testServer) validate(r *response, _, _ string, ct string) {
	ts.t.Helper()
	if ct != "application/json" {
		ts.t.Fatalf("error response with content type %q", ct)
	}
	s, _ := specDoc.Schema("Error")
	ts.validateWith(r, s)
}

func (ts *testServer) validateWith(r *response, schema map[string]any) {
	ts.t.Helper()
	v, err := spec.DecodeValue(r.body)
	if err != nil {
		ts.t.Fatalf("response is not JSON: %v: %s", err, r.body)
	}
	if err := specDoc.Validate(schema, v); err != nil {
		ts.t.Fatalf("response does not match the spec: %v\nbody: %s", err, r.body)
	}
	r.json, _ = v.(map[string]any)
}

// want fails unless r has the status (and, for errors, the code).
func (ts *testServer) want(r *response, status int, code ...string) *response {
	ts.t.Helper()
	if r.status != status {
		ts.t.Fatalf("status %d, want %d; body %s", r.status, status, r.body)
	}
	if len(code) > 0 && r.errCode() != code[0] {
		ts.t.Fatalf("error code %q, want %q; body %s", r.errCode(), code[0], r.body)
	}
	return r
}

// stream posts to /v1/exec/stream and returns the events, each validated.
func (ts *testServer) stream(body any, opts ...reqOpt) (*http.Response, *bufio.Scanner) {
	ts.t.Helper()
	data, _ := json.Marshal(body)
	req, _ := http.NewRequest("POST", "http://sandmand/v1/exec/stream", bytes.NewReader(data))
	req.Header.Set("Authorization", "Bearer "+testToken)
	for _, o := range opts {
		o(req)
	}
	resp, err := ts.client.Do(req)
	if err != nil {
		ts.t.Fatal(err)
	}
	coverMu.Lock()
	covered["POST /v1/exec/stream"] = true
	coverMu.Unlock()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	return resp, sc
}

func validateEvent(t *testing.T, line []byte) map[string]any {
	t.Helper()
	s, _ := specDoc.ResponseSchema("/v1/exec/stream", "POST", 200, "application/x-ndjson")
	v, err := spec.DecodeValue(line)
	if err != nil {
		t.Fatalf("event is not JSON: %s", line)
	}
	if err := specDoc.Validate(s, v); err != nil {
		t.Fatalf("event does not match the spec: %v: %s", err, line)
	}
	return v.(map[string]any)
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestRoutesMatchSpec(t *testing.T) {
	srv, err := New(Options{NoAuth: true, Version: "t", Reaper: testReaper})
	if err != nil {
		t.Fatal(err)
	}
	var routes []string
	for _, rt := range srv.Routes() {
		routes = append(routes, rt.Method+" "+rt.Pattern)
	}
	sort.Strings(routes)
	ops := specDoc.Operations()
	if strings.Join(routes, "\n") != strings.Join(ops, "\n") {
		t.Fatalf("server routes and spec operations differ:\nserver:\n%s\nspec:\n%s",
			strings.Join(routes, "\n"), strings.Join(ops, "\n"))
	}
}

func TestNewRefusesDangerousDefaults(t *testing.T) {
	if _, err := New(Options{Version: "t", Reaper: testReaper}); err == nil {
		t.Error("empty token accepted without NoAuth")
	}
	if _, err := New(Options{Token: "x", Version: "t"}); err == nil {
		t.Error("nil reaper accepted")
	}
	if _, err := New(Options{Token: "x", Reaper: testReaper}); err == nil {
		t.Error("empty version accepted")
	}
}
