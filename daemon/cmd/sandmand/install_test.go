package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

func TestInstallCopiesItself(t *testing.T) {
	dest := filepath.Join(t.TempDir(), "sandmand")
	if out, err := exec.Command(binary, "install", dest).CombinedOutput(); err != nil {
		t.Fatalf("install: %v\n%s", err, out)
	}
	want, _ := os.ReadFile(binary)
	got, err := os.ReadFile(dest)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("copy differs from the binary (err %v)", err)
	}
	info, _ := os.Stat(dest)
	if info.Mode().Perm() != 0o555 {
		t.Fatalf("mode %v, want 0555", info.Mode().Perm())
	}
	out, err := exec.Command(dest, "--version").Output()
	if err != nil || string(out) != "9.9.9\n" {
		t.Fatalf("installed copy does not run: %q %v", out, err)
	}
	entries, _ := os.ReadDir(filepath.Dir(dest))
	if len(entries) != 1 {
		t.Fatalf("temporary file left: %v", entries)
	}
}

func TestInstallNeedsOneDestination(t *testing.T) {
	if err := exec.Command(binary, "install").Run(); err == nil {
		t.Fatal("install without DEST succeeded")
	}
}
