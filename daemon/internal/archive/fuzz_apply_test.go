package archive

import (
	"archive/tar"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"sandman/daemon/internal/apierr"
)

// FuzzApply applies streams of changes (PUT /v1/changes: Faithful, Prune,
// OneFilesystem) written from a script as FuzzExtract's, plus listings:
//
//	P dir kn,kn   a PruneEntry for dir: kind k (d, f, l, o or another byte)
//	              and name n, comma-separated
//
// onto a tree that holds what a sandbox may: symlinks out of it (out, abs,
// d/up, d/top) and an excluded directory (mnt, as a mount point would be).
//
// Whatever the stream: ExtractWith never panics; it refuses only with a 4xx
// protocol error; nothing outside the destination is written, linked,
// replaced or removed; nothing under the excluded directory is touched; and
// every symlink it made resolves inside the destination.
func FuzzApply(f *testing.F) {
	for _, s := range []string{
		"P  dd,ff",
		"P  ",
		"P d dup",
		"P d ",
		"P .. fx",
		"P out fx",
		"P mnt ",
		"fmnt/x data",
		"P  fout,fabs,dd,ff",
		"dd/\nP d fnew\nfd/new data",
		"lf d\nP  ld",
		"P  fd\nfd data",
		"P d f..\nP d f/\nP d q",
		"fa data\nha a\nP  fa",
	} {
		f.Add(s)
	}
	base, err := filepath.EvalSymlinks(scratchDir(f))
	if err != nil {
		f.Fatal(err)
	}
	dst := filepath.Join(base, "dst")
	sibling := filepath.Join(base, "sibling")
	victim := filepath.Join(sibling, "victim")
	if err := os.Mkdir(sibling, 0o755); err != nil {
		f.Fatal(err)
	}
	if err := os.WriteFile(victim, []byte("original"), 0o644); err != nil {
		f.Fatal(err)
	}
	excluded := map[string]bool{"mnt": true}
	f.Fuzz(func(t *testing.T, script string) {
		if err := os.RemoveAll(dst); err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(dst)
		planted := plant(t, dst, sibling)
		must(t, os.MkdirAll(filepath.Join(dst, "mnt"), 0o755))
		must(t, os.WriteFile(filepath.Join(dst, "mnt", "keep"), []byte("volume"), 0o644))

		_, err := ExtractWith(dst, bytes.NewReader(changesOf(script, dst)), applyOpts(excluded))

		if err != nil {
			var ae *apierr.Error
			if !errors.As(err, &ae) || ae.Status < 400 || ae.Status > 499 {
				t.Fatalf("error %v is not a 4xx protocol error", err)
			}
		}
		if names := dirNames(base); len(names) != 2 || names[0] != "dst" || names[1] != "sibling" {
			t.Fatalf("names beside the destination: %v", names)
		}
		if names := dirNames(sibling); len(names) != 1 || names[0] != "victim" {
			t.Fatalf("wrote into the sibling: %v", names)
		}
		var st syscall.Stat_t
		if data, rerr := os.ReadFile(victim); rerr != nil || string(data) != "original" || syscall.Lstat(victim, &st) != nil || st.Nlink != 1 {
			t.Fatalf("the file outside was changed or linked: %q %v nlink=%d", data, rerr, st.Nlink)
		}
		if names := dirNames(filepath.Join(dst, "mnt")); len(names) != 1 || names[0] != "keep" {
			t.Fatalf("the excluded directory was changed: %v (err %v)", names, err)
		}
		if data, _ := os.ReadFile(filepath.Join(dst, "mnt", "keep")); string(data) != "volume" {
			t.Fatalf("the excluded file was changed: %q", data)
		}
		for rel, target := range walk(t, dst) {
			if was, ok := planted[rel]; target == "" || ok && was == target {
				continue
			}
			if !resolvesInside(dst, rel, target) {
				t.Fatalf("symlink %s -> %s resolves outside %s (err %v)", rel, target, dst, err)
			}
		}
	})
}

// changesOf writes the stream a FuzzApply script describes.
func changesOf(script, dst string) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i, line := range strings.Split(script, "\n") {
		if i == 64 || line == "" {
			break
		}
		if line[0] == 'P' {
			dir, names, _ := strings.Cut(strings.TrimPrefix(line[1:], " "), " ")
			body := dir + "\x00"
			for _, n := range strings.Split(names, ",") {
				if n != "" {
					body += n + "\x00"
				}
			}
			h := tar.Header{Name: PruneEntry, Typeflag: tar.TypeReg, Mode: 0o600, Size: int64(len(body))}
			if tw.WriteHeader(&h) == nil {
				tw.Write([]byte(body))
			}
			continue
		}
		name, rest, _ := strings.Cut(line[1:], " ")
		h := tar.Header{Name: name, Mode: 0o4755, Uid: 1234, Gid: 5678, Typeflag: tar.TypeReg}
		switch line[0] {
		case 'd':
			h.Typeflag = tar.TypeDir
		case 'l', 'h':
			h.Typeflag = tar.TypeSymlink
			if line[0] == 'h' {
				h.Typeflag = tar.TypeLink
			}
			h.Linkname = rest
			if strings.HasPrefix(rest, "/") {
				h.Linkname = dst + rest
			}
		default:
			h.Size = int64(len(rest))
		}
		if tw.WriteHeader(&h) == nil && h.Typeflag == tar.TypeReg {
			tw.Write([]byte(rest))
		}
	}
	tw.Close()
	return buf.Bytes()
}
