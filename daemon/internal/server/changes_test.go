package server

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"sandman/daemon/internal/archive"
)

// settleAt waits until the kernel's ctime clock has passed every entry made so
// far, and returns that time.
func settleAt(t *testing.T) time.Time {
	t.Helper()
	probe := filepath.Join(t.TempDir(), "probe")
	var first int64
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := os.WriteFile(probe, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		var st syscall.Stat_t
		if err := syscall.Lstat(probe, &st); err != nil {
			t.Fatal(err)
		}
		at := int64(st.Ctim.Sec)*1e9 + int64(st.Ctim.Nsec)
		if first == 0 {
			first = at
		} else if at > first {
			return time.Unix(0, at)
		}
		if time.Now().After(deadline) {
			t.Fatal("the ctime clock did not move in 10 s")
		}
		time.Sleep(time.Millisecond)
	}
}

func TestChangesRoutes(t *testing.T) {
	ts := newTestServer(t)
	// A daemon without a root keeps no changes.
	ts.want(ts.do("GET", "/v1/changes", nil), 400, "invalid_request")
	ts.want(ts.do("PUT", "/v1/changes", []byte{}), 400, "invalid_request")

	src, dst := t.TempDir(), t.TempDir()
	for _, root := range []string{src, dst} {
		for _, name := range []string{"keep", "gone"} {
			if err := os.WriteFile(filepath.Join(root, name), []byte(name), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	ts.srv.started = settleAt(t).Add(changesMargin) // what is there now is the image
	ts.srv.changesRoot = src
	if err := os.WriteFile(filepath.Join(src, "new.txt"), []byte("new"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(src, "gone")); err != nil {
		t.Fatal(err)
	}
	r := ts.want(ts.do("GET", "/v1/changes", nil), 200)
	if ct := r.header.Get("Content-Type"); ct != "application/x-tar" {
		t.Fatalf("content type %q", ct)
	}
	var got []string
	tr := tar.NewReader(bytes.NewReader(r.body))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, hdr.Name)
	}
	if len(got) != 3 || got[0] != "./" || got[1] != archive.PruneEntry || got[2] != "new.txt" {
		t.Fatalf("entries %q", got)
	}

	ts.srv.changesRoot = dst
	applied := ts.want(ts.do("PUT", "/v1/changes", r.body), 200)
	if applied.num("files") != 1 || applied.num("bytes") != 3 || applied.num("removed") != 1 {
		t.Fatalf("applied: %s", applied.body)
	}
	if data, _ := os.ReadFile(filepath.Join(dst, "new.txt")); string(data) != "new" {
		t.Fatalf("new.txt: %q", data)
	}
	if _, err := os.Lstat(filepath.Join(dst, "gone")); err == nil {
		t.Fatal("gone was not removed")
	}
	// A hostile stream is refused like an upload's.
	evil := makeTar(t, false, entry{name: "../escape", body: "x", typ: tar.TypeReg})
	ts.want(ts.do("PUT", "/v1/changes", evil), 400, "unsafe_archive")
	if _, err := os.Lstat(filepath.Join(filepath.Dir(dst), "escape")); err == nil {
		t.Fatal("written outside the root")
	}
	// A root that is gone: an error answer, not a cut stream.
	ts.srv.changesRoot = filepath.Join(t.TempDir(), "nope")
	ts.want(ts.do("GET", "/v1/changes", nil), 404, "not_found")
}
