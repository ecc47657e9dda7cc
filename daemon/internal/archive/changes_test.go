package archive

import (
	"archive/tar"
	"bytes"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"
)

// must fails the test on an error.
func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func write(t *testing.T, path, data string, mode os.FileMode) {
	t.Helper()
	must(t, os.MkdirAll(filepath.Dir(path), 0o755))
	must(t, os.WriteFile(path, []byte(data), mode))
	must(t, os.Chmod(path, mode)) // past the umask
}

// image builds the same tree in root: what a sandbox and a new sandbox of
// its image both start from.
func image(t *testing.T, root string) {
	t.Helper()
	write(t, filepath.Join(root, "bin/tool"), "#!/bin/sh\n", 0o755)
	write(t, filepath.Join(root, "etc/conf"), "a=1\n", 0o644)
	write(t, filepath.Join(root, "etc/gone.conf"), "gone\n", 0o644)
	write(t, filepath.Join(root, "data/keep/x"), "x", 0o644)
	write(t, filepath.Join(root, "data/drop/y"), "y", 0o644)
	write(t, filepath.Join(root, "data/drop/sub/z"), "z", 0o644)
	write(t, filepath.Join(root, "lib/real.so"), "elf", 0o644)
	must(t, os.Symlink("real.so", filepath.Join(root, "lib/link.so")))
	write(t, filepath.Join(root, "usr/share/doc/README"), "read me", 0o644)
	write(t, filepath.Join(root, "hardsrc"), "shared", 0o644)
	must(t, os.MkdirAll(filepath.Join(root, "tochange"), 0o755))
	write(t, filepath.Join(root, DaemonDir, "sandmand"), "daemon", 0o555)
	write(t, filepath.Join(root, "mnt/volume-file"), "volume", 0o644)
}

// settle waits until the clock the kernel stamps ctimes with has passed every
// entry of the trees, and returns that time: what changes from now on has a
// ctime at or after it, and nothing before.
func settle(t *testing.T, roots ...string) time.Time {
	t.Helper()
	var latest int64
	for _, root := range roots {
		must(t, filepath.WalkDir(root, func(p string, _ fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			var st syscall.Stat_t
			if err := syscall.Lstat(p, &st); err != nil {
				return err
			}
			latest = max(latest, ctime(&st))
			return nil
		}))
	}
	probe := filepath.Join(t.TempDir(), "probe")
	deadline := time.Now().Add(10 * time.Second)
	for {
		must(t, os.WriteFile(probe, nil, 0o644))
		var st syscall.Stat_t
		must(t, syscall.Lstat(probe, &st))
		if ctime(&st) > latest {
			return time.Unix(0, ctime(&st))
		}
		if time.Now().After(deadline) {
			t.Fatal("the ctime clock did not move in 10 s")
		}
		time.Sleep(time.Millisecond)
	}
}

// change does to the sandbox's tree what a workload may: every kind of change.
func change(t *testing.T, root string) {
	t.Helper()
	p := func(rel string) string { return filepath.Join(root, rel) }
	write(t, p("new/deep/file.txt"), "new file", 0o640)
	must(t, os.WriteFile(p("etc/conf"), []byte("a=2\n"), 0o644))
	must(t, os.Remove(p("etc/gone.conf")))
	must(t, os.RemoveAll(p("data/drop")))
	must(t, os.Symlink("etc/conf", p("top-link")))
	must(t, os.Symlink("../etc/conf", p("bin/rel-link")))
	must(t, os.Chmod(p("bin/tool"), 0o4755|os.ModeSetuid))
	must(t, syscall.Chmod(p("bin/tool"), 0o4755))
	if os.Geteuid() == 0 {
		must(t, os.Lchown(p("etc/conf"), 1234, 5678))
	}
	must(t, os.RemoveAll(p("data/keep")))
	must(t, os.Symlink("../tochange", p("data/keep"))) // a directory turned symlink
	must(t, os.Remove(p("lib/link.so")))
	write(t, p("lib/link.so"), "no longer a link", 0o644) // a symlink turned file
	must(t, os.Link(p("hardsrc"), p("hard2")))
	write(t, p("new/a"), "two names", 0o644)
	must(t, os.Link(p("new/a"), p("new/b")))
	must(t, os.Rename(p("usr/share/doc/README"), p("usr/share/doc/README.md")))
	must(t, syscall.Mkfifo(p("fifo"), 0o644))
	must(t, os.Chmod(p("tochange"), 0o700))
	must(t, os.Mkdir(p("emptydir"), 0o711))
	must(t, os.Chmod(p("emptydir"), 0o711))
	must(t, os.WriteFile(p(DaemonDir+"/sandmand"), []byte("changed daemon"), 0o555))
	must(t, os.WriteFile(p("mnt/volume-file"), []byte("changed volume"), 0o644))
}

type node struct {
	kind     uint32
	mode     uint32
	uid, gid uint32
	data     string
	mtime    int64
	ino      uint64
}

// tree reads every entry under root but those skipped.
func tree(t *testing.T, root string, skip map[string]bool) map[string]node {
	t.Helper()
	out := map[string]node{}
	must(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if skip[rel] {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		var st syscall.Stat_t
		must(t, syscall.Lstat(p, &st))
		n := node{kind: st.Mode & syscall.S_IFMT, mode: st.Mode & 0o7777, uid: st.Uid, gid: st.Gid, ino: st.Ino}
		mtimeNs := int64(st.Mtim.Sec)*1e9 + int64(st.Mtim.Nsec)
		switch n.kind {
		case syscall.S_IFREG:
			data, err := os.ReadFile(p)
			must(t, err)
			n.data = string(data)
			n.mtime = mtimeNs
		case syscall.S_IFLNK:
			n.data, _ = os.Readlink(p)
		case syscall.S_IFDIR:
			if rel != "." {
				n.mtime = mtimeNs
			}
		}
		out[rel] = n
		return nil
	}))
	return out
}

// names lists a stream's entry names in order.
func names(t *testing.T, stream []byte) []string {
	t.Helper()
	var out []string
	tr := tar.NewReader(bytes.NewReader(stream))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return out
		}
		must(t, err)
		out = append(out, hdr.Name)
	}
}

var applyOpts = func(excluded map[string]bool) Options {
	return Options{Faithful: true, OneFilesystem: true, Prune: true, Excluded: excluded}
}

// A sandbox's changes, applied to a copy of its image, make the same tree:
// new, changed, removed and retyped entries, owners, modes, times, links.
func TestChangesRoundTrip(t *testing.T) {
	src, dst := t.TempDir(), t.TempDir()
	image(t, src)
	// The copy is the same image: the same bytes, modes and times.
	if out, err := exec.Command("cp", "-a", src+"/.", dst).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	since := settle(t, src, dst)
	change(t, src)
	excluded := map[string]bool{DaemonDir: true, "mnt": true}

	var stream bytes.Buffer
	stats, err := WriteChanges(&stream, src, since, excluded)
	must(t, err)
	sent := names(t, stream.Bytes())
	for _, unchanged := range []string{"lib/real.so", "usr/", "usr/share/"} {
		for _, name := range sent {
			if name == unchanged {
				t.Errorf("unchanged %s is in the stream", unchanged)
			}
		}
	}
	for _, name := range sent {
		if strings.HasPrefix(name, "mnt") || strings.HasPrefix(name, DaemonDir+"/sandmand") || name == "fifo" {
			t.Errorf("%s is in the stream: a mount point, the daemon's or a fifo", name)
		}
	}
	if stats.Entries == 0 || stats.Bytes == 0 {
		t.Fatalf("stats %+v", stats)
	}

	res, err := ExtractWith(dst, bytes.NewReader(stream.Bytes()), applyOpts(excluded))
	must(t, err)
	if res.Removed != 4 { // etc/gone.conf, data/drop, data/keep (a directory), lib/link.so (a link)
		t.Errorf("removed %d, want 4", res.Removed)
	}
	skip := map[string]bool{"fifo": true, DaemonDir: true, "mnt": true}
	want, got := tree(t, src, skip), tree(t, dst, skip)
	var wantNames, gotNames []string
	for k := range want {
		wantNames = append(wantNames, k)
	}
	for k := range got {
		gotNames = append(gotNames, k)
	}
	sort.Strings(wantNames)
	sort.Strings(gotNames)
	if strings.Join(wantNames, " ") != strings.Join(gotNames, " ") {
		t.Fatalf("names differ:\nsandbox: %v\ncopy:    %v", wantNames, gotNames)
	}
	for name, w := range want {
		g := got[name]
		w.ino, g.ino = 0, 0
		if w != g {
			t.Errorf("%s: sandbox %+v, copy %+v", name, w, g)
		}
	}
	if got["hardsrc"].ino != got["hard2"].ino || got["new/a"].ino != got["new/b"].ino {
		t.Error("hard links were not kept")
	}
	// What is not the sandbox's own stays as it was in the copy.
	if data, _ := os.ReadFile(filepath.Join(dst, "mnt/volume-file")); string(data) != "volume" {
		t.Errorf("the mount point's file was written: %q", data)
	}
	if data, _ := os.ReadFile(filepath.Join(dst, DaemonDir, "sandmand")); string(data) != "daemon" {
		t.Errorf("the daemon's file was written: %q", data)
	}
}

// Nothing changed: a stream with no entry, which applies to nothing.
func TestNoChanges(t *testing.T) {
	src := t.TempDir()
	image(t, src)
	since := settle(t, src)
	var stream bytes.Buffer
	stats, err := WriteChanges(&stream, src, since, nil)
	must(t, err)
	if stats.Entries != 0 || len(names(t, stream.Bytes())) != 0 {
		t.Fatalf("entries %v", names(t, stream.Bytes()))
	}
}

func TestChangesOfAMissingRootIsAnErrorBeforeAnyByte(t *testing.T) {
	var stream bytes.Buffer
	_, err := WriteChanges(&stream, filepath.Join(t.TempDir(), "nope"), time.Now(), nil)
	wantRefused(t, err, "not_found", "nope")
	if stream.Len() != 0 {
		t.Fatalf("%d bytes written", stream.Len())
	}
}

// pruneOf is a listing entry for directory rel holding names (kind + name).
func pruneOf(rel string, names ...string) []byte {
	var body bytes.Buffer
	body.WriteString(rel)
	body.WriteByte(0)
	for _, n := range names {
		body.WriteString(n)
		body.WriteByte(0)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	_ = tw.WriteHeader(&tar.Header{Name: PruneEntry, Typeflag: tar.TypeReg, Mode: 0o600, Size: int64(body.Len())})
	_, _ = tw.Write(body.Bytes())
	tw.Close()
	return buf.Bytes()
}

// A listing removes what it lacks, never through a symlink, never a name
// that is not the sandbox's own; a bad listing is refused.
func TestPruneIsConfined(t *testing.T) {
	dst, victim := layout(t)
	must(t, os.MkdirAll(filepath.Join(dst, "mnt"), 0o755))
	write(t, filepath.Join(dst, "mnt/keep"), "volume", 0o644)
	must(t, os.Symlink("../sibling", filepath.Join(dst, "out")))
	write(t, filepath.Join(dst, "sub/old"), "old", 0o644)
	excluded := map[string]bool{"mnt": true}

	res, err := ExtractWith(dst, bytes.NewReader(pruneOf("", "dsub")), applyOpts(excluded))
	must(t, err)
	if res.Removed != 1 {
		t.Fatalf("removed %d, want 1 (the symlink)", res.Removed)
	}
	untouched(t, victim)
	if _, err := os.Lstat(filepath.Join(dst, "out")); err == nil {
		t.Fatal("the symlink the listing lacks is still there")
	}
	if data, _ := os.ReadFile(filepath.Join(dst, "mnt/keep")); string(data) != "volume" {
		t.Fatal("a listing removed a name that is not the sandbox's own")
	}
	// A listing that reaches through a symlink, out of the tree, or names badly.
	must(t, os.Symlink("../sibling", filepath.Join(dst, "out")))
	for name, c := range map[string]struct {
		stream     []byte
		code, says string
	}{
		"through a symlink": {pruneOf("out"), "unsafe_archive", "through symlink"},
		"dotdot directory":  {pruneOf("../sibling"), "unsafe_archive", ".."},
		"absolute":          {pruneOf("/etc"), "unsafe_archive", "absolute"},
		"slash in a name":   {pruneOf("", "fa/b"), "invalid_archive", "names"},
		"dotdot name":       {pruneOf("", "f.."), "invalid_archive", "names"},
		"unknown kind":      {pruneOf("", "xname"), "invalid_archive", "kind"},
		"an excluded dir":   {pruneOf("mnt"), "unsafe_archive", "not the sandbox's own"},
		"an excluded entry": {tarOf(reg("mnt/new")), "unsafe_archive", "not the sandbox's own"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ExtractWith(dst, bytes.NewReader(c.stream), applyOpts(excluded))
			wantRefused(t, err, c.code, c.says)
			untouched(t, victim)
			if _, err := os.Lstat(filepath.Join(dst, "mnt/new")); err == nil {
				t.Fatal("written under an excluded name")
			}
		})
	}
	// Without Prune, a listing is an ordinary name: refused as the daemon's own.
	_, err = ExtractWith(dst, bytes.NewReader(pruneOf("")), Options{OneFilesystem: true, Excluded: map[string]bool{DaemonDir: true}})
	wantRefused(t, err, "unsafe_archive", "not the sandbox's own")
}

// A mount point below the root that no one named: entries never go onto it,
// and a listing never empties it.
func TestOneFilesystemStopsAtAMountPoint(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dst, victim := layout(t)
	mnt := filepath.Join(dst, "mnt")
	must(t, os.MkdirAll(mnt, 0o755))
	if err := syscall.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount a tmpfs here: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(mnt, syscall.MNT_DETACH) })
	write(t, filepath.Join(mnt, "keep"), "volume", 0o644)
	mounts, err := MountPoints(dst)
	must(t, err)
	if !mounts["mnt"] {
		t.Fatalf("the mount table does not name mnt: %v", mounts)
	}
	_, err = ExtractWith(dst, bytes.NewReader(tarOf(reg("mnt/new"))), applyOpts(nil))
	wantRefused(t, err, "unsafe_archive", "another filesystem")
	res, err := ExtractWith(dst, bytes.NewReader(pruneOf("")), applyOpts(nil))
	must(t, err)
	if data, _ := os.ReadFile(filepath.Join(mnt, "keep")); string(data) != "volume" {
		t.Fatalf("a listing emptied a mount point (removed %d)", res.Removed)
	}
	untouched(t, victim)
	// And the changes of the tree leave it out.
	var stream bytes.Buffer
	_, err = WriteChanges(&stream, dst, time.Unix(0, 0), nil)
	must(t, err)
	for _, name := range names(t, stream.Bytes()) {
		if strings.HasPrefix(name, "mnt/") {
			t.Fatalf("%s of a mount point is in the changes", name)
		}
	}
}

func TestUnescapeMount(t *testing.T) {
	if got := unescapeMount(`/a\040b\134c\011`); got != "/a b\\c\t" {
		t.Fatalf("%q", got)
	}
	if got := unescapeMount(`/plain\04`); got != `/plain\04` {
		t.Fatalf("%q", got)
	}
}

// At "/" (a sandbox's root), an absolute symlink names something inside, and
// ".." at the root stays there, as the kernel has it; elsewhere neither holds.
func TestSymlinksAtTheRootOfTheTree(t *testing.T) {
	fd, err := syscall.Open("/", syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	must(t, err)
	defer syscall.Close(fd)
	slash := &extractor{opts: Options{Faithful: true}, root: "/", absRoot: "/", slash: true, rootFd: fd, parentFd: -1}
	for _, target := range []string{"/etc/passwd", "../../../etc", "/nonexistent/../../x"} {
		if slash.escapes("usr/bin/link", target) {
			t.Errorf("%s counts as outside /", target)
		}
	}
	upload := &extractor{root: "/", absRoot: "/", slash: true, rootFd: fd, parentFd: -1}
	if !upload.escapes("link", "../etc") {
		t.Error("an upload's .. above its root counts as inside")
	}
}
