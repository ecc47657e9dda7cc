package main

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// The env token is gone from the daemon's /proc/<pid>/environ (not only
// from its children's), and still works.
func TestEnvTokenLeavesNoTraceInProcEnviron(t *testing.T) {
	d := startDaemon(t, []string{"SANDMAND_TOKEN=env-secret-token", "SANDMAND_OTHER=x"})
	environ, err := os.ReadFile("/proc/" + strconv.Itoa(d.cmd.Process.Pid) + "/environ")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(environ), "env-secret-token") || strings.Contains(string(environ), "SANDMAND_") {
		t.Fatalf("the token is still in /proc/<pid>/environ: %q", environ)
	}
	res := d.post(t, "/v1/exec", "env-secret-token", map[string]any{"argv": []string{"true"}})
	if res["exit_code"].(float64) != 0 {
		t.Fatalf("exec with the env token: %v", res)
	}
}

// fd:N serves on a socket the host bound (not listening yet), the token
// comes from --token-fd, and SO_PEERCRED names the daemon itself.
func TestListenOnPassedDescriptor(t *testing.T) {
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
	tokR, tokW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	tokW.WriteString("fd-token\n")
	tokW.Close()
	cmd := exec.Command(binary, "--listen", "fd:3", "--token-fd", "4")
	cmd.ExtraFiles = []*os.File{sock, tokR}
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	tokR.Close()
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	sc := bufio.NewScanner(stderr)
	if !sc.Scan() || !strings.HasPrefix(sc.Text(), "sandmand: listening on fd:3") {
		t.Fatalf("want 'listening on fd:3 (...)', got %q", sc.Text())
	}
	go io.Copy(io.Discard, stderr)
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := conn.(*net.UnixConn).SyscallConn()
	var cred *syscall.Ucred
	raw.Control(func(s uintptr) { cred, err = syscall.GetsockoptUcred(int(s), syscall.SOL_SOCKET, syscall.SO_PEERCRED) })
	conn.Close()
	if err != nil || int(cred.Pid) != cmd.Process.Pid {
		t.Fatalf("SO_PEERCRED: want the daemon's pid %d, got %+v (%v)", cmd.Process.Pid, cred, err)
	}
	client := unixClient(path)
	req, _ := http.NewRequest("GET", "http://sandmand/v1/processes", nil)
	req.Header.Set("Authorization", "Bearer fd-token")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("the --token-fd token: status %d", resp.StatusCode)
	}
}

func TestBadDescriptorsAreRefused(t *testing.T) {
	for _, args := range [][]string{{"--listen", "fd:1", "--no-auth"}, {"--listen", "fd:x", "--no-auth"}, {"--listen", "fd:9", "--no-auth"}, {"--listen", "tcp:127.0.0.1:0", "--token-fd", "9"}} {
		out, err := exec.Command(binary, args...).CombinedOutput()
		if err == nil {
			t.Fatalf("%v accepted: %s", args, out)
		}
	}
}
