package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
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

// binary is sandmand built once for the tests that run it as a process.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sandmand-bin-")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "sandmand")
	build := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w -X main.version=9.9.9", "-o", binary, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// daemon is a running sandmand.
type daemon struct {
	cmd    *exec.Cmd
	addrs  []string
	client *http.Client
	sock   string
	stderr *bytes.Buffer
	exited chan error
}

// unixClient speaks HTTP to the unix socket at path, whatever the URL's host.
func unixClient(path string) *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var dl net.Dialer
		return dl.DialContext(ctx, "unix", path)
	}}}
}

func startDaemon(t testing.TB, env []string, args ...string) *daemon {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "run", "d.sock")
	cmd := exec.Command(binary, append([]string{"--listen", "unix:" + sock, "--listen", "tcp:127.0.0.1:0"}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	pr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d := &daemon{cmd: cmd, sock: sock, stderr: &bytes.Buffer{}, exited: make(chan error, 1)}
	sc := bufio.NewScanner(pr)
	for len(d.addrs) < 2 && sc.Scan() {
		line := sc.Text()
		if a, ok := strings.CutPrefix(line, "sandmand: listening on "); ok {
			d.addrs = append(d.addrs, a)
		} else {
			d.stderr.WriteString(line + "\n")
		}
	}
	if len(d.addrs) != 2 {
		cmd.Process.Kill()
		t.Fatalf("daemon did not report its addresses: %s", d.stderr)
	}
	go func() {
		io.Copy(d.stderr, pr)
		d.exited <- cmd.Wait()
	}()
	d.client = unixClient(sock)
	t.Cleanup(func() {
		cmd.Process.Kill()
	})
	return d
}

func (d *daemon) post(t testing.TB, path, token string, body any) map[string]any {
	t.Helper()
	data, _ := json.Marshal(body)
	req, _ := http.NewRequest("POST", "http://d"+path, bytes.NewReader(data))
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := d.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode >= 300 {
		t.Fatalf("%s: %d %v", path, resp.StatusCode, out)
	}
	return out
}

// waitOutput long-polls a background process's stdout until it contains want.
func waitOutput(t testing.TB, d *daemon, id, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		req, _ := http.NewRequest("GET", "http://d/v1/processes/"+id+"/output?wait=1", nil)
		req.Header.Set("Authorization", "Bearer tok")
		resp, err := d.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var out map[string]any
		err = json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		if err == nil && strings.Contains(fmt.Sprint(out["stdout"]), want) {
			return
		}
	}
	t.Fatalf("process %s never printed %q", id, want)
}

func TestVersion(t *testing.T) {
	out, err := exec.Command(binary, "--version").Output()
	if err != nil || strings.TrimSpace(string(out)) != "9.9.9" {
		t.Fatalf("--version: %q %v", out, err)
	}
}

func TestRefusesToStartWithoutToken(t *testing.T) {
	cmd := exec.Command(binary, "--listen", "tcp:127.0.0.1:0")
	cmd.Env = []string{"PATH=/bin"}
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), "no token") {
		t.Fatalf("want exit 2 'no token', got %v: %s", err, out)
	}
	for _, args := range [][]string{{}, {"--listen", "udp:1"}, {"--listen", "tcp:nope"}} {
		cmd := exec.Command(binary, append(args, "--no-auth")...)
		if err := cmd.Run(); err == nil {
			t.Errorf("%v: started", args)
		}
	}
}

func TestTokenFileAndEnvScrubbing(t *testing.T) {
	tf := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tf, []byte("file-token\n"), 0o600)
	d := startDaemon(t, []string{"SANDMAND_TOKEN=env-token", "SANDMAND_OTHER=x"}, "--token-file", tf)
	res := d.post(t, "/v1/exec", "file-token", map[string]any{"argv": []string{"env"}})
	if strings.Contains(res["stdout"].(string), "SANDMAND_") {
		t.Fatalf("SANDMAND_* leaked into a child: %s", res["stdout"])
	}
	// TCP works too, with the token.
	req, _ := http.NewRequest("GET", "http://"+strings.TrimPrefix(d.addrs[1], "tcp:")+"/v1/processes", nil)
	req.Header.Set("Authorization", "Bearer env-token")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Fatalf("the env token must lose to --token-file: %d", resp.StatusCode)
	}
}

// SIGTERM to the daemon ends its children (SIGKILL after the grace for one
// that ignores SIGTERM), removes the socket and exits 0.
func TestSIGTERMStopsEverything(t *testing.T) {
	d := startDaemon(t, []string{"SANDMAND_TOKEN=tok"}, "--shutdown-grace", "300ms")
	p1 := d.post(t, "/v1/processes", "tok", map[string]any{"argv": []string{"sleep", "60"}})
	p2 := d.post(t, "/v1/processes", "tok", map[string]any{"cmd": "trap '' TERM; echo trapped; sleep 60 & wait"})
	// Until the shell has run `trap`, a SIGTERM would still end it.
	waitOutput(t, d, p2["id"].(string), "trapped")
	s := d.post(t, "/v1/shells", "tok", map[string]any{})
	pids := []int{int(p1["pid"].(float64)), int(p2["pid"].(float64)), int(s["pid"].(float64))}
	for _, pid := range pids {
		if err := syscall.Kill(pid, 0); err != nil {
			t.Fatalf("pid %d not running: %v", pid, err)
		}
	}
	t0 := time.Now()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-d.exited:
		if err != nil {
			t.Fatalf("daemon exit: %v\n%s", err, d.stderr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("daemon did not exit")
	}
	if time.Since(t0) < 250*time.Millisecond {
		t.Errorf("exited before the grace although a child ignores SIGTERM")
	}
	for _, pid := range pids {
		if err := syscall.Kill(-pid, 0); err != syscall.ESRCH {
			t.Errorf("process group %d still exists after shutdown", pid)
		}
	}
	if _, err := os.Lstat(d.sock); !os.IsNotExist(err) {
		t.Errorf("socket %s not removed", d.sock)
	}
}

func TestParseFlags(t *testing.T) {
	cfg, err := parseFlags([]string{"--listen", "unix:/a", "--listen", "tcp:127.0.0.1:0", "--kill-grace", "1s"}, "tok")
	if err != nil || len(cfg.listen) != 2 || cfg.token != "tok" || cfg.killGrace != time.Second || cfg.shutdownGrace != 5*time.Second {
		t.Fatalf("%+v %v", cfg, err)
	}
	if _, err := parseFlags([]string{"--listen", "unix:/a"}, ""); err == nil {
		t.Fatal("no token accepted")
	}
	if cfg, err := parseFlags([]string{"--listen", "unix:/a", "--no-auth"}, ""); err != nil || !cfg.noAuth {
		t.Fatal("--no-auth refused")
	}
	if cfg.readHeaderTimeout != defaultReadHeaderTimeout || cfg.idleTimeout != defaultIdleTimeout {
		t.Fatalf("timeouts %v %v", cfg.readHeaderTimeout, cfg.idleTimeout)
	}
	for _, bad := range []string{"--read-header-timeout=0", "--idle-timeout=-1s"} {
		if _, err := parseFlags([]string{"--listen", "unix:/a", "--no-auth", bad}, ""); err == nil {
			t.Fatalf("%s accepted: it would turn the bound off", bad)
		}
	}
}
