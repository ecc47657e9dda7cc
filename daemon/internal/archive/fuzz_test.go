package archive

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sandman/daemon/internal/apierr"
)

func tarOf(entries ...tar.Header) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range entries {
		h := h
		body := ""
		if h.Typeflag == tar.TypeReg {
			body = "data"
			h.Size = 4
		}
		_ = tw.WriteHeader(&h)
		_, _ = tw.Write([]byte(body))
	}
	tw.Close()
	return buf.Bytes()
}

// FuzzExtract: whatever the stream, Extract never panics, never writes
// outside the destination, and refuses only with a protocol error.
func FuzzExtract(f *testing.F) {
	f.Add(tarOf(tar.Header{Name: "a/b", Typeflag: tar.TypeReg, Mode: 0o644}))
	f.Add(tarOf(tar.Header{Name: "../x", Typeflag: tar.TypeReg}))
	f.Add(tarOf(tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "../.."}, tar.Header{Name: "l/x", Typeflag: tar.TypeReg}))
	f.Add(tarOf(tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "."}, tar.Header{Name: "l/x", Typeflag: tar.TypeReg}))
	f.Add(tarOf(tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "a"}, tar.Header{Name: "d/", Typeflag: tar.TypeDir}))
	f.Add(tarOf(tar.Header{Name: "/abs", Typeflag: tar.TypeReg}))
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tarOf(tar.Header{Name: "z", Typeflag: tar.TypeReg}))
	zw.Close()
	f.Add(gz.Bytes())
	f.Add([]byte("garbage"))
	f.Fuzz(func(t *testing.T, data []byte) {
		parent := t.TempDir()
		sibling := filepath.Join(parent, "sibling")
		if err := os.Mkdir(sibling, 0o755); err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(parent, "dst")
		_, err := Extract(dst, bytes.NewReader(data))
		if err != nil {
			var ae *apierr.Error
			if !errors.As(err, &ae) || ae.Status >= 500 {
				t.Fatalf("error %v is not a 4xx protocol error", err)
			}
			if _, serr := os.Lstat(dst); serr == nil {
				t.Fatalf("refused upload left %s behind", dst)
			}
		}
		entries, _ := os.ReadDir(parent)
		for _, e := range entries {
			if e.Name() != "dst" && e.Name() != "sibling" {
				t.Fatalf("wrote %s outside the destination", e.Name())
			}
		}
		if left, _ := os.ReadDir(sibling); len(left) != 0 {
			t.Fatalf("wrote into a sibling: %v", left)
		}
		// Every symlink created must point inside dst.
		_ = filepath.Walk(dst, func(p string, fi os.FileInfo, err error) error {
			if err == nil && fi.Mode()&os.ModeSymlink != 0 {
				target, _ := os.Readlink(p)
				if !filepath.IsAbs(target) {
					target = filepath.Join(filepath.Dir(p), target)
				}
				if !strings.HasPrefix(filepath.Clean(target)+"/", dst+"/") {
					t.Fatalf("symlink %s -> %s escapes", p, target)
				}
			}
			return nil
		})
	})
}
