package server

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// listenPort serves handle on each connection to a fresh 127.0.0.1 port,
// until the test ends.
func listenPort(t *testing.T, handle func(net.Conn)) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

func echo(c net.Conn) { _, _ = io.Copy(c, c) }

// closedPort is a port nothing listens on.
func closedPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return port
}

// upgrade opens a connection to the daemon, asks for port and returns the
// connection (after the 101) and what the daemon answered otherwise.
// early is sent in the same write as the request.
func (ts *testServer) upgrade(port int, token string, early []byte) (net.Conn, *bufio.Reader, *http.Response) {
	ts.t.Helper()
	c, err := net.Dial("unix", filepath.Join(ts.dir, "d.sock"))
	if err != nil {
		ts.t.Fatal(err)
	}
	ts.t.Cleanup(func() { c.Close() })
	head := fmt.Sprintf("GET /v1/ports/%d/connect HTTP/1.1\r\nHost: sandmand\r\n"+
		"Authorization: Bearer %s\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n", port, token)
	if _, err := c.Write(append([]byte(head), early...)); err != nil {
		ts.t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		ts.t.Fatal(err)
	}
	coverMu.Lock()
	covered["GET /v1/ports/{id}/connect"] = true
	coverMu.Unlock()
	if resp.StatusCode != http.StatusSwitchingProtocols {
		data, _ := io.ReadAll(resp.Body)
		r := &response{status: resp.StatusCode, header: resp.Header, body: data}
		ts.check("GET", fmt.Sprintf("/v1/ports/%d/connect", port), r)
		return nil, nil, resp
	}
	if resp.Header.Get("Upgrade") != "tcp" || !hasToken(resp.Header, "Connection", "upgrade") {
		ts.t.Fatalf("101 without Upgrade: tcp: %v", resp.Header)
	}
	return c, br, resp
}

func TestPortConnectCarriesBytesBothWays(t *testing.T) {
	ts := newTestServer(t)
	port := listenPort(t, echo)
	// Bytes right behind the request are the tunnel's first.
	c, br, _ := ts.upgrade(port, testToken, []byte("early "))
	if _, err := c.Write([]byte("late\n")); err != nil {
		t.Fatal(err)
	}
	line, err := br.ReadString('\n')
	if err != nil || line != "early late\n" {
		t.Fatalf("echo %q, %v", line, err)
	}
	// Bulk, both ways at once: 8 MiB out, the same back.
	data := bytes.Repeat([]byte("0123456789abcdef"), 1<<19)
	go func() { _, _ = c.Write(data) }()
	back := make([]byte, len(data))
	if _, err := io.ReadFull(br, back); err != nil {
		t.Fatal(err)
	}
	if sha256.Sum256(back) != sha256.Sum256(data) {
		t.Fatal("the bytes came back changed")
	}
	if ts.srv.Tunnels() != 1 {
		t.Fatalf("%d tunnels open, want 1", ts.srv.Tunnels())
	}
	c.Close()
	eventually(t, 5*time.Second, "the tunnel to close", func() bool { return ts.srv.Tunnels() == 0 })
}

func TestPortConnectPassesHalfCloseOn(t *testing.T) {
	ts := newTestServer(t)
	// Reads to the end, then answers how much it got: it needs the half-close.
	port := listenPort(t, func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		fmt.Fprintf(c, "got %d", n)
	})
	c, br, _ := ts.upgrade(port, testToken, nil)
	if _, err := c.Write(bytes.Repeat([]byte("x"), 100000)); err != nil {
		t.Fatal(err)
	}
	if err := c.(*net.UnixConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	answer, err := io.ReadAll(br) // to the port's own end
	if err != nil || string(answer) != "got 100000" {
		t.Fatalf("answer %q, %v", answer, err)
	}
	eventually(t, 5*time.Second, "the tunnel to close", func() bool { return ts.srv.Tunnels() == 0 })
}

func TestPortConnectEndsWhenThePortCloses(t *testing.T) {
	ts := newTestServer(t)
	port := listenPort(t, func(c net.Conn) { _, _ = c.Write([]byte("bye")) })
	_, br, _ := ts.upgrade(port, testToken, nil)
	got, err := io.ReadAll(br)
	if err != nil || string(got) != "bye" {
		t.Fatalf("got %q, %v", got, err)
	}
}

func TestPortConnectRefusals(t *testing.T) {
	ts := newTestServer(t)
	port := listenPort(t, echo)
	for _, tok := range []string{"", "wrong"} {
		_, _, resp := ts.upgrade(port, tok, nil)
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("token %q: status %d", tok, resp.StatusCode)
		}
	}
	_, _, resp := ts.upgrade(closedPort(t), testToken, nil)
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("closed port: status %d", resp.StatusCode)
	}
	r := ts.do("GET", fmt.Sprintf("/v1/ports/%d/connect", closedPort(t)), nil, func(r *http.Request) {
		r.Header.Set("Connection", "Upgrade")
		r.Header.Set("Upgrade", "tcp")
	})
	ts.want(r, http.StatusBadGateway, "connection_refused")
	if !strings.Contains(string(r.body), "nothing listens on port") {
		t.Errorf("message: %s", r.body)
	}
	upgrade := func(r *http.Request) {
		r.Header.Set("Connection", "keep-alive, Upgrade")
		r.Header.Set("Upgrade", "TCP")
	}
	for _, bad := range []string{"0", "65536", "x", "-1", "80.5"} {
		ts.want(ts.do("GET", "/v1/ports/"+bad+"/connect", nil, upgrade), http.StatusBadRequest, "invalid_request")
	}
	// Not an upgrade, or one to something else, or with a body.
	ts.want(ts.do("GET", fmt.Sprintf("/v1/ports/%d/connect", port), nil), http.StatusBadRequest, "invalid_request")
	ts.want(ts.do("GET", fmt.Sprintf("/v1/ports/%d/connect", port), nil, func(r *http.Request) {
		r.Header.Set("Connection", "Upgrade")
		r.Header.Set("Upgrade", "websocket")
	}), http.StatusBadRequest, "invalid_request")
	ts.want(ts.do("GET", fmt.Sprintf("/v1/ports/%d/connect", port), "body", upgrade), http.StatusBadRequest, "invalid_request")
	ts.want(ts.do("POST", fmt.Sprintf("/v1/ports/%d/connect", port), nil, upgrade), http.StatusMethodNotAllowed, "method_not_allowed")
	if ts.srv.Tunnels() != 0 {
		t.Fatalf("%d tunnels open after refusals", ts.srv.Tunnels())
	}
}

func TestPortConnectManyAtOnce(t *testing.T) {
	ts := newTestServer(t)
	port := listenPort(t, echo)
	const n = 64
	conns := make([]net.Conn, n)
	readers := make([]*bufio.Reader, n)
	for i := range conns {
		conns[i], readers[i], _ = ts.upgrade(port, testToken, nil)
	}
	eventually(t, 5*time.Second, "every tunnel open", func() bool { return ts.srv.Tunnels() == n })
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range conns {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			msg := fmt.Sprintf("tunnel %d says %s\n", i, strings.Repeat("x", i*1000))
			if _, err := conns[i].Write([]byte(msg)); err != nil {
				errs <- err
				return
			}
			line, err := readers[i].ReadString('\n')
			if err != nil || line != msg {
				errs <- fmt.Errorf("tunnel %d: %.40q, %v", i, line, err)
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for _, c := range conns {
		c.Close()
	}
	eventually(t, 5*time.Second, "every tunnel closed", func() bool { return ts.srv.Tunnels() == 0 })
}

func TestCloseTunnelsEndsThemAndRefusesNewOnes(t *testing.T) {
	ts := newTestServer(t)
	port := listenPort(t, echo)
	_, br, _ := ts.upgrade(port, testToken, nil)
	ts.srv.CloseTunnels()
	if _, err := br.ReadByte(); err != io.EOF {
		t.Fatalf("read after CloseTunnels: %v, want EOF", err)
	}
	// A connection asked for after it is closed at once, without a 101.
	c, err := net.Dial("unix", filepath.Join(ts.dir, "d.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /v1/ports/%d/connect HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"+
		"Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n", port, testToken)
	if got, _ := io.ReadAll(c); len(got) != 0 {
		t.Fatalf("answered %q after CloseTunnels", got)
	}
	if ts.srv.Tunnels() != 0 {
		t.Fatalf("%d tunnels open", ts.srv.Tunnels())
	}
}
