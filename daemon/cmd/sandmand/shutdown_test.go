package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// conn is one raw HTTP/1.1 connection to a daemon, for tests that care
// which connection a request goes on and when it closes.
type conn struct {
	t  *testing.T
	c  net.Conn
	br *bufio.Reader
}

func dial(t *testing.T, sock string) *conn {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &conn{t, c, bufio.NewReader(c)}
}

// do sends one request and reads its answer, keeping the connection.
func (c *conn) do(method, target, body string) (*http.Response, map[string]any) {
	c.t.Helper()
	fmt.Fprintf(c.c, "%s %s HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer tok\r\nContent-Length: %d\r\n\r\n%s", method, target, len(body), body)
	c.c.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(c.br, nil)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, target, err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		c.t.Fatalf("%s %s: %v", method, target, err)
	}
	return resp, out
}

// closedWithin waits up to limit for the daemon to close the connection,
// and fails if it sends anything first; it returns when the close came.
func (c *conn) closedWithin(limit time.Duration) time.Time {
	c.t.Helper()
	c.c.SetReadDeadline(time.Now().Add(limit))
	buf := make([]byte, 64)
	n, err := c.br.Read(buf)
	at := time.Now()
	var ne net.Error
	switch {
	case n > 0:
		c.t.Fatalf("the daemon sent bytes instead of closing: %q", buf[:n])
	case errors.As(err, &ne) && ne.Timeout():
		c.t.Fatalf("connection still open after %v", limit)
	case err != io.EOF && !errors.Is(err, syscall.ECONNRESET):
		c.t.Fatalf("want the connection closed, got %v", err)
	}
	return at
}

// A client that trickles its headers, or connects and says nothing, is cut
// after --read-header-timeout.
func TestSlowHeadersAreCut(t *testing.T) {
	d := startDaemon(t, []string{"SANDMAND_TOKEN=tok"}, "--read-header-timeout", "500ms")
	silent := dial(t, d.sock)
	slow := dial(t, d.sock)
	t0 := time.Now()
	go func() {
		if _, err := io.WriteString(slow.c, "GET /v1/health HTTP/1.1\r\nHost: d\r\n"); err != nil {
			return
		}
		for {
			time.Sleep(100 * time.Millisecond)
			if _, err := io.WriteString(slow.c, "X-Slow: 1\r\n"); err != nil {
				return
			}
		}
	}()
	for _, c := range []*conn{slow, silent} {
		if at := c.closedWithin(5 * time.Second); at.Sub(t0) < 400*time.Millisecond {
			t.Errorf("cut after %v, before the timeout", at.Sub(t0))
		}
	}
	// A request sent at once is served as before.
	if resp, _ := dial(t, d.sock).do("GET", "/v1/health", ""); resp.StatusCode != 200 {
		t.Fatalf("health: %d", resp.StatusCode)
	}
}

// A keep-alive connection is closed after --idle-timeout without a
// request, and only then: not while requests keep coming, nor while one
// runs longer than the timeout.
func TestIdleConnectionsAreClosed(t *testing.T) {
	d := startDaemon(t, []string{"SANDMAND_TOKEN=tok"}, "--idle-timeout", "1s")
	c := dial(t, d.sock)
	for i := 0; i < 4; i++ {
		if resp, _ := c.do("GET", "/v1/health", ""); resp.StatusCode != 200 {
			t.Fatalf("health: %d", resp.StatusCode)
		}
		time.Sleep(300 * time.Millisecond)
	}
	resp, out := c.do("POST", "/v1/exec", `{"argv": ["sleep", "1.5"]}`)
	if resp.StatusCode != 200 || out["exit_code"] != 0.0 {
		t.Fatalf("exec longer than the idle timeout: %d %v", resp.StatusCode, out)
	}
	t0 := time.Now()
	if at := c.closedWithin(10 * time.Second); at.Sub(t0) < 900*time.Millisecond {
		t.Errorf("idle connection closed after %v, before the timeout", at.Sub(t0))
	}
}

// On SIGTERM the daemon stops in order: it stops accepting (new
// connections refused, idle ones closed at once), stops its processes
// (SIGTERM, then SIGKILL after the grace for those that ignore it),
// requests waiting on them answer, and a request still running after that
// has its connection closed.
func TestShutdownOrder(t *testing.T) {
	d := startDaemon(t, []string{"SANDMAND_TOKEN=tok"}, "--shutdown-grace", "2s")
	idle := dial(t, d.sock)
	idle.do("GET", "/v1/health", "")
	stubborn := d.post(t, "/v1/processes", "tok", map[string]any{"cmd": "trap '' TERM; echo trapped; sleep 60 & wait"})
	waitOutput(t, d, stubborn["id"].(string), "trapped")

	// An exec in flight, on a keep-alive connection.
	marker := filepath.Join(t.TempDir(), "started")
	execConn := dial(t, d.sock)
	type answer struct {
		resp *http.Response
		out  map[string]any
		at   time.Time
	}
	answered := make(chan answer, 1)
	go func() {
		resp, out := execConn.do("POST", "/v1/exec", fmt.Sprintf(`{"cmd": "touch %s; exec sleep 60"}`, marker))
		answered <- answer{resp, out, time.Now()}
	}()
	// An upload whose body never comes.
	upload := dial(t, d.sock)
	fmt.Fprintf(upload.c, "PUT /v1/files?path=%s HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer tok\r\nContent-Length: 1000000\r\n\r\nsome", filepath.Join(t.TempDir(), "f"))
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(marker); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the exec never started")
		}
	}

	t0 := time.Now()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Stops accepting: the idle connection is closed at once, long before
	// the grace is over, and nobody can connect.
	if at := idle.closedWithin(5 * time.Second); at.Sub(t0) > time.Second {
		t.Errorf("idle connection closed %v after SIGTERM", at.Sub(t0))
	}
	if c, err := net.Dial("unix", d.sock); err == nil {
		c.Close()
		t.Error("a new connection was accepted during shutdown")
	}
	// The exec's command got SIGTERM; its request answered, and said the
	// connection closes.
	select {
	case a := <-answered:
		if a.resp.StatusCode != 200 || a.out["signal"] != "TERM" || !a.resp.Close {
			t.Errorf("exec answered %d %v (close: %v)", a.resp.StatusCode, a.out, a.resp.Close)
		}
		if a.at.Sub(t0) > time.Second {
			t.Errorf("exec answered %v after SIGTERM", a.at.Sub(t0))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the exec in flight got no answer")
	}
	// The upload outlives the processes (stopped after the 2 s grace), then
	// its connection is closed without an answer.
	if at := upload.closedWithin(10 * time.Second); at.Sub(t0) < 2*time.Second {
		t.Errorf("upload cut %v after SIGTERM, before the processes were stopped", at.Sub(t0))
	}
	select {
	case err := <-d.exited:
		if err != nil {
			t.Fatalf("daemon exit: %v\n%s", err, d.stderr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("daemon did not exit")
	}
	if pid := int(stubborn["pid"].(float64)); syscall.Kill(-pid, 0) != syscall.ESRCH {
		t.Errorf("process group %d survived the shutdown", pid)
	}
	if !strings.Contains(d.stderr.String(), "closing their connections") {
		t.Errorf("the forced close was not logged:\n%s", d.stderr)
	}
}

// A socket passed as fd:N may have other holders (here the test itself):
// once the daemon stops, connecting is refused rather than queued with no
// one to accept.
func TestPassedSocketRefusesAfterShutdown(t *testing.T) {
	path := filepath.Join(t.TempDir(), "host.sock")
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	sock := os.NewFile(uintptr(fd), "sock")
	defer sock.Close()
	cmd := exec.Command(binary, "--listen", "fd:3", "--no-auth")
	cmd.ExtraFiles = []*os.File{sock}
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	sc := bufio.NewScanner(stderr)
	if !sc.Scan() || !strings.HasPrefix(sc.Text(), "sandmand: listening on fd:3") {
		t.Fatalf("want 'listening on fd:3 (...)', got %q", sc.Text())
	}
	go io.Copy(io.Discard, stderr)
	if resp, _ := dial(t, path).do("GET", "/v1/health", ""); resp.StatusCode != 200 {
		t.Fatalf("health: %d", resp.StatusCode)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("daemon exit: %v", err)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		t.Fatal("connected to the socket of a daemon that stopped: the client would wait for an answer forever")
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("want ECONNREFUSED, got %v", err)
	}
}
