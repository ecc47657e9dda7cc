package server

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
)

func q(p string) string { return url.QueryEscape(p) }

func TestFiles(t *testing.T) {
	ts := newTestServer(t)
	dir := t.TempDir()
	f := filepath.Join(dir, "a", "b", "f.txt")
	r := ts.want(ts.do("PUT", "/v1/files?path="+q(f), "hello\x00bytes"), 200)
	if r.str("type") != "file" || r.num("size") != 11 || r.str("mode") != "644" || r.str("path") != f || r.str("name") != "f.txt" {
		t.Fatalf("write: %s", r.body)
	}
	r = ts.want(ts.do("GET", "/v1/files?path="+q(f), nil), 200)
	if string(r.body) != "hello\x00bytes" || r.header.Get("Content-Type") != "application/octet-stream" {
		t.Fatalf("read: %q", r.body)
	}
	r = ts.want(ts.do("PUT", "/v1/files?path="+q(f)+"&mode=600", "x"), 200)
	if r.str("mode") != "600" {
		t.Fatalf("mode: %s", r.body)
	}
	r = ts.want(ts.do("PUT", "/v1/files?path="+q(f), "keep mode"), 200)
	if r.str("mode") != "600" {
		t.Fatalf("existing mode kept: %s", r.body)
	}
	ts.want(ts.do("PUT", "/v1/files?path="+q(filepath.Join(dir, "x", "y"))+"&parents=false", "x"), 404, "not_found")
	ts.want(ts.do("PUT", "/v1/files?path="+q(dir), "x"), 400, "is_a_directory")
	ts.want(ts.do("PUT", "/v1/files?path="+q(f)+"&mode=999", "x"), 400, "invalid_request")
	ts.want(ts.do("GET", "/v1/files?path="+q(dir), nil), 400, "is_a_directory")
	ts.want(ts.do("GET", "/v1/files?path="+q(dir+"/missing"), nil), 404, "not_found")
	ts.want(ts.do("GET", "/v1/files?path=", nil), 400, "invalid_path")
	ts.want(ts.do("GET", "/v1/files", nil), 400, "invalid_path")
	ts.want(ts.do("GET", "/v1/files/stat?path=a%00b", nil), 400, "invalid_path")
	entries, _ := os.ReadDir(filepath.Dir(f))
	if len(entries) != 1 {
		t.Fatalf("temp files left behind: %v", entries)
	}

	link := filepath.Join(dir, "link")
	os.Symlink(f, link)
	r = ts.want(ts.do("GET", "/v1/files/stat?path="+q(link), nil), 200)
	if r.str("type") != "symlink" || r.str("link_target") != f {
		t.Fatalf("stat symlink: %s", r.body)
	}
	r = ts.want(ts.do("GET", "/v1/files/stat?path="+q(dir), nil), 200)
	if r.str("type") != "directory" || r.json["link_target"] != nil {
		t.Fatalf("stat dir: %s", r.body)
	}
	ts.want(ts.do("GET", "/v1/files/stat?path="+q(dir+"/nope"), nil), 404, "not_found")

	r = ts.want(ts.do("GET", "/v1/files/list?path="+q(dir), nil), 200)
	list := r.json["entries"].([]any)
	var names []string
	for _, e := range list {
		names = append(names, e.(map[string]any)["name"].(string))
	}
	if len(names) != 2 || !sort.StringsAreSorted(names) || names[0] != "a" || names[1] != "link" {
		t.Fatalf("list: %s", r.body)
	}
	ts.want(ts.do("GET", "/v1/files/list?path="+q(f), nil), 400, "not_a_directory")
	ts.want(ts.do("GET", "/v1/files/list?path="+q(dir+"/nope"), nil), 404, "not_found")

	// mkdir
	d := filepath.Join(dir, "m", "n")
	ts.want(ts.do("POST", "/v1/files/mkdir", map[string]any{"path": d}), 404, "not_found")
	r = ts.want(ts.do("POST", "/v1/files/mkdir", map[string]any{"path": d, "parents": true, "mode": "750"}), 200)
	if r.str("type") != "directory" || r.str("mode") != "750" {
		t.Fatalf("mkdir: %s", r.body)
	}
	ts.want(ts.do("POST", "/v1/files/mkdir", map[string]any{"path": d, "parents": true}), 200)
	ts.want(ts.do("POST", "/v1/files/mkdir", map[string]any{"path": d}), 409, "already_exists")
	ts.want(ts.do("POST", "/v1/files/mkdir", map[string]any{"path": f, "parents": true}), 409, "already_exists")
	ts.want(ts.do("POST", "/v1/files/mkdir", `{"path":""}`), 400, "invalid_path")
	ts.want(ts.do("POST", "/v1/files/mkdir", `{}`), 400, "invalid_path")
	ts.want(ts.do("POST", "/v1/files/mkdir", `{"path":"/x","mode":"abc"}`), 400, "invalid_request")
	ts.want(ts.do("POST", "/v1/files/mkdir", `{"path":"/x","extra":1}`), 400, "invalid_request")

	// move
	g := filepath.Join(dir, "g.txt")
	r = ts.want(ts.do("POST", "/v1/files/move", map[string]any{"src": f, "dst": g}), 200)
	if r.str("path") != g {
		t.Fatalf("move: %s", r.body)
	}
	os.WriteFile(f, []byte("new"), 0o644)
	ts.want(ts.do("POST", "/v1/files/move", map[string]any{"src": f, "dst": g}), 409, "already_exists")
	ts.want(ts.do("POST", "/v1/files/move", map[string]any{"src": f, "dst": g, "overwrite": true}), 200)
	if data, _ := os.ReadFile(g); string(data) != "new" {
		t.Fatalf("overwrite: %q", data)
	}
	ts.want(ts.do("POST", "/v1/files/move", map[string]any{"src": f, "dst": g}), 404, "not_found")
	ts.want(ts.do("POST", "/v1/files/move", map[string]any{"src": g}), 400, "invalid_path")

	// delete
	ts.want(ts.do("DELETE", "/v1/files?path="+q(filepath.Join(dir, "m")), nil), 409, "directory_not_empty")
	ts.want(ts.do("DELETE", "/v1/files?path="+q(filepath.Join(dir, "m"))+"&recursive=true", nil), 204)
	ts.want(ts.do("DELETE", "/v1/files?path="+q(g), nil), 204)
	ts.want(ts.do("DELETE", "/v1/files?path="+q(g), nil), 404, "not_found")
	ts.want(ts.do("DELETE", "/v1/files?path="+q(dir)+"&recursive=perhaps", nil), 400, "invalid_request")
}

type entry struct {
	name, body, link string
	typ              byte
}

func makeTar(t *testing.T, gz bool, entries ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	var w io.Writer = &buf
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(&buf)
		w = zw
	}
	tw := tar.NewWriter(w)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Linkname: e.link, Mode: 0o644, Size: int64(len(e.body))}
		if e.typ == tar.TypeDir {
			h.Mode = 0o755
		}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	if zw != nil {
		zw.Close()
	}
	return buf.Bytes()
}

func readTar(t *testing.T, data []byte) map[string]string {
	t.Helper()
	var r io.Reader = bytes.NewReader(data)
	if len(data) > 2 && data[0] == 0x1f && data[1] == 0x8b {
		zr, err := gzip.NewReader(r)
		if err != nil {
			t.Fatal(err)
		}
		r = zr
	}
	tr := tar.NewReader(r)
	out := map[string]string{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		out[h.Name] = string(b) + h.Linkname
	}
}

func TestArchiveRoundTrip(t *testing.T) {
	ts := newTestServer(t)
	for _, gz := range []bool{false, true} {
		dst := filepath.Join(t.TempDir(), "new", "dst")
		data := makeTar(t, gz,
			entry{name: "./", typ: tar.TypeDir},
			entry{name: "src/", typ: tar.TypeDir},
			entry{name: "src/main.py", body: "print(1)\n", typ: tar.TypeReg},
			entry{name: "deep/er/file", body: "x", typ: tar.TypeReg},
			entry{name: "src/link", link: "main.py", typ: tar.TypeSymlink},
			entry{name: "hard", link: "src/main.py", typ: tar.TypeLink},
		)
		r := ts.want(ts.do("PUT", "/v1/archive?path="+q(dst), data), 200)
		if r.num("files") != 4 || r.num("bytes") != 10 || r.str("path") != dst {
			t.Fatalf("upload: %s", r.body)
		}
		if b, _ := os.ReadFile(filepath.Join(dst, "src/link")); string(b) != "print(1)\n" {
			t.Fatalf("symlink: %q", b)
		}
		r = ts.want(ts.do("GET", "/v1/archive?path="+q(dst), nil), 200)
		got := readTar(t, r.body)
		if got["src/main.py"] != "print(1)\n" || got["src/"] != "" || got["src/link"] != "main.py" || got["deep/er/file"] != "x" {
			t.Fatalf("download: %v", got)
		}
		r = ts.want(ts.do("GET", "/v1/archive?path="+q(filepath.Join(dst, "src/main.py"))+"&gzip=true", nil), 200)
		if r.body[0] != 0x1f || readTar(t, r.body)["main.py"] != "print(1)\n" {
			t.Fatalf("single file: %v", readTar(t, r.body))
		}
	}
	ts.want(ts.do("GET", "/v1/archive?path=/no/such", nil), 404, "not_found")
	ts.want(ts.do("GET", "/v1/archive?path=/tmp&gzip=2", nil), 400, "invalid_request")
	ts.want(ts.do("PUT", "/v1/archive?path="+q(t.TempDir()), "this is not a tar archive at all, not even close......"), 400, "invalid_archive")
	f := filepath.Join(t.TempDir(), "file")
	os.WriteFile(f, nil, 0o644)
	ts.want(ts.do("PUT", "/v1/archive?path="+q(f), makeTar(t, false)), 400, "not_a_directory")
}

func TestArchiveRefusesUnsafeEntries(t *testing.T) {
	ts := newTestServer(t)
	outside := t.TempDir()
	cases := map[string][]entry{
		"dotdot":         {{name: "../evil", body: "x", typ: tar.TypeReg}},
		"nested dotdot":  {{name: "a/../../evil", body: "x", typ: tar.TypeReg}},
		"absolute":       {{name: filepath.Join(outside, "evil"), body: "x", typ: tar.TypeReg}},
		"symlink out":    {{name: "l", link: outside, typ: tar.TypeSymlink}},
		"symlink up":     {{name: "a/l", link: "../../x", typ: tar.TypeSymlink}},
		"hardlink out":   {{name: "h", link: "../x", typ: tar.TypeLink}},
		"hardlink abs":   {{name: "h", link: "/etc/passwd", typ: tar.TypeLink}},
		"through a link": {{name: "l", link: ".", typ: tar.TypeSymlink}, {name: "l/f", body: "x", typ: tar.TypeReg}},
	}
	for name, entries := range cases {
		parent := t.TempDir()
		dst := filepath.Join(parent, "dst")
		data := makeTar(t, false, append([]entry{{name: "ok.txt", body: "fine", typ: tar.TypeReg}}, entries...)...)
		r := ts.do("PUT", "/v1/archive?path="+q(dst), data)
		if r.status != 400 || r.errCode() != "unsafe_archive" {
			t.Errorf("%s: %d %s", name, r.status, r.body)
		}
		if _, err := os.Lstat(dst); !os.IsNotExist(err) {
			t.Errorf("%s: what the upload created was not removed", name)
		}
		if left, _ := os.ReadDir(outside); len(left) != 0 {
			t.Fatalf("%s: wrote outside: %v", name, left)
		}
	}
	// A symlink that already exists in the destination is never written through.
	dst := t.TempDir()
	os.Symlink(outside, filepath.Join(dst, "pre"))
	r := ts.do("PUT", "/v1/archive?path="+q(dst), makeTar(t, false, entry{name: "pre/f", body: "x", typ: tar.TypeReg}))
	if r.status != 400 || r.errCode() != "unsafe_archive" {
		t.Fatalf("pre-existing symlink: %d %s", r.status, r.body)
	}
	if left, _ := os.ReadDir(outside); len(left) != 0 {
		t.Fatalf("wrote outside: %v", left)
	}
}

// A workload can point any path at a device or a fifo: the daemon refuses
// to read them instead of streaming forever (or blocking on the open).
func TestReadRefusesWhatIsNotARegularFile(t *testing.T) {
	ts := newTestServer(t)
	dir := t.TempDir()
	zero := filepath.Join(dir, "zero")
	if err := os.Symlink("/dev/zero", zero); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{zero, fifo, "/dev/null"} {
		r := ts.want(ts.do("GET", "/v1/files?path="+q(p), nil), 400, "not_a_regular_file")
		if !strings.Contains(string(r.body), p) {
			t.Fatalf("message does not name the path: %s", r.body)
		}
	}
	// An archive of a tree holding them skips them, and ends.
	if err := os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := ts.want(ts.do("GET", "/v1/archive?path="+q(dir), nil), 200)
	var names []string
	tr := tar.NewReader(bytes.NewReader(r.body))
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		names = append(names, h.Name+":"+string(h.Typeflag))
	}
	if strings.Join(names, " ") != "f:0 zero:2" {
		t.Fatalf("archive entries: %v", names)
	}
	r = ts.want(ts.do("GET", "/v1/archive?path="+q(zero), nil), 200)
	if h, err := tar.NewReader(bytes.NewReader(r.body)).Next(); err != io.EOF {
		t.Fatalf("archive of a device: %v %v", h, err)
	}
}

func TestReadMaxBytes(t *testing.T) {
	ts := newTestServer(t)
	f := filepath.Join(t.TempDir(), "big")
	if err := os.WriteFile(f, bytes.Repeat([]byte("x"), 1000), 0o644); err != nil {
		t.Fatal(err)
	}
	r := ts.want(ts.do("GET", "/v1/files?path="+q(f)+"&max_bytes=999", nil), 413, "file_too_large")
	if !strings.Contains(string(r.body), "max_bytes=999") {
		t.Fatalf("message: %s", r.body)
	}
	if r = ts.want(ts.do("GET", "/v1/files?path="+q(f)+"&max_bytes=1000", nil), 200); len(r.body) != 1000 {
		t.Fatalf("read %d bytes", len(r.body))
	}
	// A file that says size 0 is cut one byte past the limit.
	if r = ts.want(ts.do("GET", "/v1/files?path=/proc/self/status&max_bytes=10", nil), 200); len(r.body) != 11 {
		t.Fatalf("read %d bytes of a procfs file", len(r.body))
	}
	ts.want(ts.do("GET", "/v1/files?path="+q(f)+"&max_bytes=-1", nil), 400, "invalid_request")
}
