package archive

import (
	"archive/tar"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sandman/daemon/internal/apierr"
)

func sym(name, target string) tar.Header {
	return tar.Header{Name: name, Typeflag: tar.TypeSymlink, Linkname: target}
}

func reg(name string) tar.Header { return tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644} }

func dir(name string) tar.Header { return tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: 0o755} }

// layout is a destination with a sibling holding a file no upload may touch.
func layout(t *testing.T) (dst, victim string) {
	t.Helper()
	parent := t.TempDir()
	victim = filepath.Join(parent, "sibling", "victim")
	if err := os.MkdirAll(filepath.Dir(victim), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(victim, []byte("original"), 0o644); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(parent, "dst"), victim
}

func untouched(t *testing.T, victim string) {
	t.Helper()
	if data, _ := os.ReadFile(victim); string(data) != "original" {
		t.Fatalf("the file outside was changed: %q", data)
	}
	if left, _ := os.ReadDir(filepath.Dir(victim)); len(left) != 1 {
		t.Fatalf("something was written beside the file outside: %v", left)
	}
}

func wantRefused(t *testing.T, err error, code, fragment string) {
	t.Helper()
	var ae *apierr.Error
	if !errors.As(err, &ae) || ae.Code != code || !strings.Contains(ae.Message, fragment) {
		t.Fatalf("want %s mentioning %q, got %v", code, fragment, err)
	}
}

// Chains of symlinks that each look inside on their own, but resolve outside.
func TestSymlinkChainsAreResolved(t *testing.T) {
	cases := map[string][]tar.Header{
		"dot then dotdot":        {sym("d", "."), sym("a", "d/..")},
		"dotdot through a chain": {dir("x/"), sym("x/up", ".."), sym("a", "x/up/x/up/..")},
		"made by a later entry":  {sym("a", "d/../sibling/victim"), sym("d", ".")},
		"loop":                   {sym("a", "b"), sym("b", "a")},
		"absolute through chain": {sym("d", "."), sym("a", "d/../sibling")},
		"file after the chain":   {sym("d", "."), sym("a", "d/.."), reg("a/sibling/victim")},
	}
	for name, entries := range cases {
		t.Run(name, func(t *testing.T) {
			dst, victim := layout(t)
			_, err := Extract(dst, bytes.NewReader(tarOf(entries...)))
			wantRefused(t, err, "unsafe_archive", "outside the destination")
			untouched(t, victim)
			if _, err := os.Lstat(dst); err == nil {
				t.Fatalf("a refused upload left %s behind", dst)
			}
		})
	}
}

// Symlinks already in the sandbox's tree are never followed, and a new
// symlink is resolved through them.
func TestSymlinksAlreadyInTheTree(t *testing.T) {
	dst, victim := layout(t)
	if err := os.MkdirAll(filepath.Join(dst, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../sibling", filepath.Join(dst, "pre")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(".", filepath.Join(dst, "sub", "here")); err != nil {
		t.Fatal(err)
	}
	_, err := Extract(dst, bytes.NewReader(tarOf(reg("pre/victim"))))
	wantRefused(t, err, "unsafe_archive", "through symlink")
	_, err = Extract(dst, bytes.NewReader(tarOf(sym("b", "pre"))))
	wantRefused(t, err, "unsafe_archive", "outside the destination")
	_, err = Extract(dst, bytes.NewReader(tarOf(sym("c", "sub/here/here/../.."))))
	wantRefused(t, err, "unsafe_archive", "outside the destination")
	_, err = Extract(dst, bytes.NewReader(tarOf(tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "pre/victim"})))
	wantRefused(t, err, "unsafe_archive", "through symlink")
	untouched(t, victim)
	for _, name := range []string{"b", "c", "h"} {
		if _, err := os.Lstat(filepath.Join(dst, name)); err == nil {
			t.Fatalf("refused entry %s was kept", name)
		}
	}
}

// The shape of CVE-2025-4517: a chain whose expansion passes PATH_MAX.
func TestDeepChainPastPathMax(t *testing.T) {
	dst, victim := layout(t)
	comp := strings.Repeat("d", 247)
	var entries []tar.Header
	path := ""
	for _, step := range "abcdefghijklmnop" {
		entries = append(entries, dir(filepath.Join(path, comp)+"/"), sym(filepath.Join(path, string(step)), comp))
		path = filepath.Join(path, comp)
	}
	chain := filepath.Join(strings.Split("abcdefghijklmnop", "")...)
	linkpath := filepath.Join(chain, strings.Repeat("l", 254))
	entries = append(entries,
		sym(linkpath, strings.Repeat("../", 16)),
		sym("escape", linkpath+"/../sibling"),
		tar.Header{Name: "flaglink", Typeflag: tar.TypeLink, Linkname: "escape/victim"},
		reg("flaglink"),
	)
	_, err := Extract(dst, bytes.NewReader(tarOf(entries...)))
	wantRefused(t, err, "unsafe_archive", "symlink")
	untouched(t, victim)
}

// What honest archives do still works: links inside, through chains, and
// absolute ones under the destination.
func TestHonestLinks(t *testing.T) {
	dst, _ := layout(t)
	abs, _ := filepath.Abs(dst)
	res, err := Extract(dst, bytes.NewReader(tarOf(
		dir("lib/"), reg("lib/real"), sym("lib/cur", "real"), sym("d", "lib"),
		sym("e", "d/cur"), sym("abs", abs+"/lib/real"), sym("dangling", "nowhere/../lib"),
		tar.Header{Name: "hard", Typeflag: tar.TypeLink, Linkname: "lib/real"},
	)))
	if err != nil {
		t.Fatal(err)
	}
	if res.Files != 7 {
		t.Fatalf("files = %d", res.Files)
	}
	for _, name := range []string{"e", "abs", "hard"} {
		if data, err := os.ReadFile(filepath.Join(dst, name)); err != nil || string(data) != "data" {
			t.Fatalf("%s: %q %v", name, data, err)
		}
	}
}

// tarOf writes entries as a tar stream; regular files hold "data".
func tarOf(entries ...tar.Header) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range entries {
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
