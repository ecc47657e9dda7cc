package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

func TestParseUsernsRefusesRootAndOverflow(t *testing.T) {
	good, err := parseUserns("1073741824:65536:/a:b")
	if err != nil || good.base != 1<<30 || good.size != 65536 || good.path != "/a:b" {
		t.Fatalf("got %+v, %v", good, err)
	}
	for _, bad := range []string{"0:65536:/p", "1:0:/p", "4294901760:65536:/p", "x:1:/p", "1:1:", "1:1"} {
		if _, err := parseUserns(bad); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}

// TestOverlayExecInAUserNamespace runs overlay-exec as a create does: the image's file
// reads as its own owner inside and base+owner on the host, and what container root
// writes is stored as 0, the work directory too.
func TestOverlayExecInAUserNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if _, err := exec.LookPath("nsenter"); err != nil {
		t.Skip("needs nsenter")
	}
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} { // searchable by container root
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"lower", "l/upper", "l/work", "root"} {
		if err := os.MkdirAll(filepath.Join(dir, name), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	image := filepath.Join(dir, "lower", "f")
	if err := os.WriteFile(image, []byte("f"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(image, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	ns := filepath.Join(dir, "userns")
	if err := os.WriteFile(ns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	const base = 1<<31 + 1<<16
	root := filepath.Join(dir, "root")
	script := "stat -c %u " + root + "/f; nsenter --user=" + ns + " -- sh -c 'stat -c %u " + root +
		"/f; id -u; echo x > " + root + "/new'"
	out, err := exec.Command(binary, "overlay-exec", "--userns="+strconv.Itoa(base)+":65536:"+ns,
		filepath.Join(dir, "lower"), filepath.Join(dir, "l/upper"), filepath.Join(dir, "l/work"), root,
		"--", "sh", "-c", script).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if got, want := strings.Fields(string(out)), []string{strconv.Itoa(base + 1000), "1000", "0"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("owners (host, inside) and id inside: got %v, want %v", got, want)
	}
	for _, path := range []string{"l/upper/new", "l/work/work"} {
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(dir, path), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%s is stored as %d:%d, not 0:0", path, st.Uid, st.Gid)
		}
	}
	// Nothing was mounted on the host: the namespace's file is the empty one made here.
	if st, err := os.Stat(ns); err != nil || st.Size() != 0 {
		t.Fatalf("%s: %v %v", ns, st, err)
	}
	if mounts, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mounts), dir) {
		t.Fatalf("a mount of %s is left on the host", dir)
	}
}
