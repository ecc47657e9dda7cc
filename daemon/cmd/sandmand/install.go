package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// install is `sandmand install DEST`: copy this very binary to DEST (mode
// 0555, atomically through a temporary file beside it). A Kubernetes init
// container runs it from the daemon image, which is FROM scratch and has no
// cp, to deliver the daemon into an emptyDir that the task's container
// mounts at /.sandman.
func install(args []string) error {
	if len(args) != 1 || args[0] == "" {
		return fmt.Errorf("usage: sandmand install DEST")
	}
	dest := args[0]
	src, err := os.Open("/proc/self/exe")
	if err != nil {
		return err
	}
	defer src.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dest), ".sandmand-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // a no-op once renamed
	if _, err := io.Copy(tmp, src); err != nil {
		tmp.Close()
		return fmt.Errorf("copy to %s: %w", tmp.Name(), err)
	}
	if err := tmp.Chmod(0o555); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dest)
}
