package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

// rawRequest sends one request on a connection of its own and reads until
// the daemon closes it; returns the status line's code and the whole answer.
func rawRequest(t *testing.T, network, addr, method, target, token, body string) (int, string) {
	t.Helper()
	c, err := net.Dial(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		method, target, token, len(body), body)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("%s %s: %v", method, target, err)
	}
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(data)
}

func tcpAddr(t *testing.T, d *daemon) string {
	t.Helper()
	for _, a := range d.addrs {
		if addr, ok := strings.CutPrefix(a, "tcp:"); ok {
			return addr
		}
	}
	t.Fatalf("no tcp address in %v", d.addrs)
	return ""
}

// A prepared daemon listens nowhere and holds no connection; SIGUSR2 makes it
// serve again on the same addresses, with its processes and state as they were.
func TestCheckpointPrepareAndSIGUSR2(t *testing.T) {
	d := startDaemon(t, []string{"SANDMAND_TOKEN=tok"})
	addr := tcpAddr(t, d)
	idle := dial(t, d.sock)
	if resp, _ := idle.do("GET", "/v1/health", ""); resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	proc := d.post(t, "/v1/processes", "tok", map[string]any{"argv": []string{"sleep", "60"}})

	code, body := rawRequest(t, "tcp", addr, "POST", "/v1/checkpoint/prepare", "tok", "")
	if code != http.StatusNoContent {
		t.Fatalf("prepare: %d %s", code, body)
	}
	idle.closedWithin(5 * time.Second) // idle keep-alive connections are closed
	for _, n := range [][2]string{{"tcp", addr}, {"unix", d.sock}} {
		if c, err := net.Dial(n[0], n[1]); err == nil {
			c.Close()
			t.Fatalf("%s %s still accepts while prepared", n[0], n[1])
		}
	}

	if err := d.cmd.Process.Signal(syscall.SIGUSR2); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not listening again after SIGUSR2: %v\n%s", err, d.stderr)
		}
		time.Sleep(5 * time.Millisecond)
	}
	code, body = rawRequest(t, "unix", d.sock, "GET", "/v1/processes/"+proc["id"].(string), "tok", "")
	if code != 200 || !strings.Contains(body, `"running":true`) {
		t.Fatalf("the process after SIGUSR2: %d %s", code, body)
	}
	// A SIGUSR2 out of turn changes nothing.
	_ = d.cmd.Process.Signal(syscall.SIGUSR2)
	time.Sleep(50 * time.Millisecond)
	if code, _ := rawRequest(t, "tcp", addr, "GET", "/v1/health", "tok", ""); code != 200 {
		t.Fatal(code)
	}
}

// A process of the sandbox that holds a TCP socket makes the prepare refuse,
// naming it; the daemon goes on serving.
func TestCheckpointPrepareRefusesWhileTheWorkloadHoldsTCP(t *testing.T) {
	d := startDaemon(t, []string{"SANDMAND_TOKEN=tok"})
	addr := tcpAddr(t, d)
	server := d.post(t, "/v1/processes", "tok", map[string]any{"argv": []string{"python3", "-c",
		"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print('up', flush=True); time.sleep(60)"}})
	waitOutput(t, d, server["id"].(string), "up")
	code, body := rawRequest(t, "tcp", addr, "POST", "/v1/checkpoint/prepare", "tok", "")
	pid := fmt.Sprint(int(server["pid"].(float64)))
	if code != http.StatusConflict || !strings.Contains(body, "not_checkpointable") ||
		!strings.Contains(body, "pid "+pid+" ") || !strings.Contains(body, "LISTEN 127.0.0.1:") {
		t.Fatalf("want 409 not_checkpointable naming pid %s: %d %s", pid, code, body)
	}
	if code, _ := rawRequest(t, "tcp", addr, "GET", "/v1/health", "tok", ""); code != 200 {
		t.Fatal(code)
	}
}

// POST /v1/token replaces the token at once: the old one is refused after.
func TestTokenReplace(t *testing.T) {
	d := startDaemon(t, []string{"SANDMAND_TOKEN=tok"})
	addr := tcpAddr(t, d)
	code, body := rawRequest(t, "tcp", addr, "POST", "/v1/token", "tok", `{"token": "a-new-token-0123456789"}`)
	if code != http.StatusNoContent {
		t.Fatalf("%d %s", code, body)
	}
	if code, _ := rawRequest(t, "tcp", addr, "GET", "/v1/processes", "tok", ""); code != http.StatusUnauthorized {
		t.Fatalf("old token: %d", code)
	}
	if code, _ := rawRequest(t, "unix", d.sock, "GET", "/v1/processes", "a-new-token-0123456789", ""); code != 200 {
		t.Fatalf("new token: %d", code)
	}
}
