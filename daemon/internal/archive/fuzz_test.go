package archive

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"sandman/daemon/internal/apierr"
)

// FuzzExtract unpacks archives written from a small script, one entry a
// line, so that the fuzzer mutates what an archive says (names, types, link
// targets, order) rather than tar's bytes: a mutated tar header fails its
// checksum and never reaches Extract's own logic, and the 1-3 KB of a raw
// tar made every input that found new coverage cost the engine a long
// minimization (of ~n² runs) during which nothing else was fuzzed.
//
// A script line is "<type><name>[ <rest>]":
//
//	f name body    regular file holding body
//	d name         directory
//	l name target  symlink; an absolute target is taken under the
//	               destination (/x is <dst>/x, /../x is beside it)
//	h name target  hard link
//	p name         fifo (Extract skips it)
//
// any other type letter is a regular file. Bit 1 of layout gzips the stream;
// bit 2 makes the destination exist beforehand, as a sandbox's tree may:
// a file f, a directory d holding symlinks up -> .. and top -> <dst>, and
// symlinks out -> ../sibling and abs -> <sibling>, which lead outside.
// A non-zero cut truncates the stream to cut%len bytes: an upload broken
// mid-way.
//
// Whatever the archive: Extract never panics; it refuses only with a 4xx
// protocol error, after which nothing it created is left; nothing outside
// the destination is written, linked or replaced; every symlink it made
// resolves inside the destination (through any chain, taking missing
// components literally, as a later mkdir could make them); and an accepted
// archive is counted and written as it says.
func FuzzExtract(f *testing.F) {
	for _, s := range []struct {
		layout uint8
		cut    uint16
		script string
	}{
		{0, 0, "da/\nfa/b data"},
		{0, 0, "f../x data"},
		{0, 0, "f/abs data"},
		{0, 0, "ll ../..\nfl/x data"},
		{0, 0, "ll .\nfl/x data"},
		{0, 0, "hh a\ndd/"},
		{0, 0, "fa data\nhh a\nfa other"},
		{0, 0, "ld .\nla d/.."},
		{0, 0, "dx/\nlx/up ..\nla x/up/x/up/.."},
		{0, 0, "la d/../sibling\nld ."},
		{0, 0, "la b\nlb a"},
		{0, 0, "ld .\nla d/..\nfa/sibling/victim data"},
		{0, 0, "dlib/\nflib/real data\nllib/cur real\nld lib\nle d/cur\nlabs /lib/real\nldangling nowhere/../lib\nhhard lib/real"},
		{0, 0, "lx /../sibling"},
		{0, 0, "dx/\nlx/top /\nla x/top/x/top/.."},
		{0, 0, "dx/\nlx/up ..\nl0 /x/up/.."},
		{0, 0, "pfifo\nf./ data\nd./"},
		{1, 0, "fz data"},
		{0, 700, "fa data\nfb data"},
		{1, 40, "fa data\nfb data"},
		{2, 0, "fout/x data"},
		{2, 0, "fabs/victim data"},
		{2, 0, "hx out/victim"},
		{2, 0, "ly out/..\nfy/z data"},
		{2, 0, "ly d/up/d/top\nla y/.."},
		{2, 0, "ff replaced\nfd/g data\nl d"},
		{2, 0, "fd data"},
	} {
		f.Add(s.layout, s.cut, s.script)
	}
	base, err := filepath.EvalSymlinks(scratchDir(f))
	if err != nil {
		f.Fatal(err)
	}
	// One destination per worker, emptied after each input: a t.TempDir per
	// input costs more than the extraction.
	dst := filepath.Join(base, "dst")
	sibling := filepath.Join(base, "sibling")
	victim := filepath.Join(sibling, "victim")
	if err := os.Mkdir(sibling, 0o755); err != nil {
		f.Fatal(err)
	}
	if err := os.WriteFile(victim, []byte("original"), 0o644); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, layout uint8, cut uint16, script string) {
		if err := os.RemoveAll(dst); err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(dst)
		planted := map[string]string{} // path under dst -> symlink target, "" if not a link
		if layout&2 != 0 {
			planted = plant(t, dst, sibling)
		}
		stream, wants := archiveOf(script, dst)
		if layout&1 != 0 {
			var gz bytes.Buffer
			zw, _ := gzip.NewWriterLevel(&gz, gzip.BestSpeed)
			zw.Write(stream)
			zw.Close()
			stream = gz.Bytes()
		}
		if cut != 0 && len(stream) > 0 {
			stream = stream[:int(cut)%len(stream)]
		}

		res, err := Extract(dst, bytes.NewReader(stream))

		if err != nil {
			var ae *apierr.Error
			if !errors.As(err, &ae) || ae.Status < 400 || ae.Status > 499 {
				t.Fatalf("error %v is not a 4xx protocol error", err)
			}
		}
		// Nothing outside: no new name beside dst, the sibling and its file
		// as they were, and no hard link to that file.
		names := dirNames(base)
		if len(names) == 0 || len(names) > 2 || names[len(names)-1] != "sibling" || len(names) == 2 && names[0] != "dst" {
			t.Fatalf("names beside the destination: %v", names)
		}
		if names := dirNames(sibling); len(names) != 1 || names[0] != "victim" {
			t.Fatalf("wrote into the sibling: %v", names)
		}
		var st syscall.Stat_t
		if data, rerr := os.ReadFile(victim); rerr != nil || string(data) != "original" || syscall.Lstat(victim, &st) != nil || st.Nlink != 1 {
			t.Fatalf("the file outside was changed or linked: %q %v nlink=%d", data, rerr, st.Nlink)
		}
		tree := walk(t, dst)
		if err != nil {
			// Refused: what this call created is gone (what stood there may
			// have been replaced, and so be gone too).
			if layout&2 == 0 {
				if _, serr := os.Lstat(dst); serr == nil {
					t.Fatalf("refused upload (%v) left %s behind", err, dst)
				}
			}
			for rel := range tree {
				if _, ok := planted[rel]; !ok {
					t.Fatalf("refused upload (%v) left %s behind", err, rel)
				}
			}
		}
		for rel, target := range tree {
			if target == "" {
				continue
			}
			if was, ok := planted[rel]; ok && was == target {
				continue
			}
			if !resolvesInside(dst, rel, target) {
				t.Fatalf("symlink %s -> %s resolves outside %s (err %v)", rel, target, dst, err)
			}
		}
		if err == nil {
			want := wants[len(wants)-1]
			if cut != 0 {
				// tar has an end marker, but archive/tar takes a stream that
				// stops at an entry's end (its padding or the marker cut
				// off) for a shorter archive: the entries before the cut.
				for _, w := range wants {
					if w.files == res.Files && w.bytes == res.Bytes {
						want = w
					}
				}
			}
			if res.Files != want.files || res.Bytes != want.bytes {
				t.Fatalf("result %+v, the archive has %d files of %d bytes", res, want.files, want.bytes)
			}
			for rel, body := range want.content {
				if data, rerr := os.ReadFile(filepath.Join(dst, rel)); rerr != nil || string(data) != body {
					t.Fatalf("%s holds %q (%v), the archive says %q", rel, data, rerr, body)
				}
			}
		}
	})
}

// scratchDir is a directory for f's files, in memory when it can be: an
// input is a dozen metadata calls (mkdir, symlink, unlink), which cost ~5 us
// each on tmpfs and ~60 us on a disk shared with other work, so tmpfs is
// most of the difference between hundreds of inputs a second and thousands.
func scratchDir(f *testing.F) string {
	if dir, err := os.MkdirTemp("/dev/shm", "FuzzExtract"); err == nil {
		f.Cleanup(func() { os.RemoveAll(dir) })
		return dir
	}
	return f.TempDir()
}

// expected is what an archive says, for when Extract accepts it.
type expected struct {
	files   int               // non-directory entries Extract writes
	bytes   int64             // bytes of regular files
	content map[string]string // path -> body, where a regular file is the last entry
}

// archiveOf writes the tar a FuzzExtract script describes, with what Extract
// should report after each entry (the first for none, the last for all).
func archiveOf(script, dst string) ([]byte, []expected) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	wants := []expected{{}}
	want := expected{content: map[string]string{}}
	for i, line := range strings.Split(script, "\n") {
		if i == 64 || line == "" {
			break
		}
		name, rest, _ := strings.Cut(line[1:], " ")
		h := tar.Header{Name: name, Mode: 0o644, Typeflag: tar.TypeReg}
		switch line[0] {
		case 'd':
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		case 'l', 'h':
			h.Typeflag = tar.TypeSymlink
			if line[0] == 'h' {
				h.Typeflag = tar.TypeLink
			}
			h.Linkname = rest
			if strings.HasPrefix(rest, "/") {
				h.Linkname = dst + rest
			}
		case 'p':
			h.Typeflag = tar.TypeFifo
		default:
			h.Size = int64(len(rest))
		}
		if tw.WriteHeader(&h) != nil {
			continue // a header tar cannot encode
		}
		rel, _ := cleanName(name)
		switch h.Typeflag {
		case tar.TypeReg:
			tw.Write([]byte(rest))
			want.files++
			want.bytes += h.Size
			want.content[rel] = rest
		case tar.TypeSymlink, tar.TypeLink:
			want.files++
			delete(want.content, rel)
		case tar.TypeDir:
			delete(want.content, rel)
		}
		wants = append(wants, want)
		want.content = maps.Clone(want.content)
	}
	tw.Close()
	return buf.Bytes(), wants
}

// plant makes dst with what a sandbox may already hold, links out included.
func plant(t *testing.T, dst, sibling string) map[string]string {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dst, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dst, "f"), []byte("planted"), 0o644); err != nil {
		t.Fatal(err)
	}
	tree := map[string]string{"d": "", "f": "", "d/up": "..", "d/top": dst, "out": "../sibling", "abs": sibling}
	for name, target := range tree {
		if target != "" {
			if err := os.Symlink(target, filepath.Join(dst, name)); err != nil {
				t.Fatal(err)
			}
		}
	}
	return tree
}

func dirNames(dir string) []string {
	entries, _ := os.ReadDir(dir) // sorted
	names := make([]string, len(entries))
	for i, e := range entries {
		names[i] = e.Name()
	}
	return names
}

// walk lists everything under root, never following a symlink: path ->
// symlink target, "" for anything else.
func walk(t *testing.T, root string) map[string]string {
	tree := map[string]string{}
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		tree[rel] = ""
		if d.Type()&fs.ModeSymlink != 0 {
			target, rerr := os.Readlink(p)
			if rerr != nil {
				t.Fatal(rerr)
			}
			tree[rel] = target
		}
		return nil
	})
	return tree
}

// resolvesInside follows symlink rel -> target under root, by path, as the
// kernel would: every symlink on the way is read from the tree, components
// that do not exist are taken literally. A chain the kernel would refuse
// (more than 40 links) leads nowhere, so not outside either.
func resolvesInside(root, rel, target string) bool {
	cur := filepath.Dir(filepath.Join(root, rel))
	todo := strings.Split(target, "/")
	if strings.HasPrefix(target, "/") {
		cur = "/"
	}
	for links := 0; len(todo) > 0; {
		part := todo[0]
		todo = todo[1:]
		switch part {
		case "", ".":
			continue
		case "..":
			cur = filepath.Dir(cur)
			continue
		}
		next := filepath.Join(cur, part)
		body, err := os.Readlink(next)
		if err != nil { // not a symlink, or not there: literal
			cur = next
			continue
		}
		if links++; links > 40 {
			return true
		}
		if strings.HasPrefix(body, "/") {
			cur = "/"
		}
		todo = append(strings.Split(body, "/"), todo...)
	}
	return cur == root || strings.HasPrefix(cur, root+"/")
}
