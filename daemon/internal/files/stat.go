// Package files implements the file endpoints on the local filesystem:
// stat, list, read, atomic write, mkdir, remove, move.
package files

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"sandman/daemon/internal/apierr"
)

// Stat describes one filesystem entry (never following a final symlink).
type Stat struct {
	Path       string
	Name       string
	Type       string // file, directory, symlink, other
	Size       int64
	Mode       string // octal permission bits, e.g. "644"
	Mtime      float64
	LinkTarget *string
}

func statOf(path string, fi fs.FileInfo) *Stat {
	abs, err := filepath.Abs(path)
	if err != nil {
		abs = path
	}
	st := &Stat{Path: abs, Name: fi.Name(), Size: fi.Size(),
		Mtime: float64(fi.ModTime().UnixNano()) / 1e9}
	if st.Name == "/" || st.Name == "." {
		st.Name = filepath.Base(abs)
	}
	perm := uint32(fi.Mode().Perm())
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
		perm = sys.Mode & 0o7777
	}
	st.Mode = fmt.Sprintf("%o", perm)
	switch m := fi.Mode(); {
	case m.IsRegular():
		st.Type = "file"
	case m.IsDir():
		st.Type = "directory"
	case m&fs.ModeSymlink != 0:
		st.Type = "symlink"
		if t, err := os.Readlink(path); err == nil {
			st.LinkTarget = &t
		}
	default:
		st.Type = "other"
	}
	return st
}

// StatPath describes path without following a final symlink.
func StatPath(path string) (*Stat, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, apierr.FromOS(err)
	}
	return statOf(path, fi), nil
}

// List describes the entries of a directory, sorted by name.
func List(path string) ([]*Stat, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, apierr.FromOS(err)
	}
	if !fi.IsDir() {
		return nil, apierr.New(400, "not_a_directory", "%s is not a directory", path)
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil, apierr.FromOS(err)
	}
	out := make([]*Stat, 0, len(entries))
	for _, e := range entries {
		p := filepath.Join(path, e.Name())
		fi, err := os.Lstat(p)
		if err != nil {
			continue // removed while we listed
		}
		out = append(out, statOf(p, fi))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}
