package files

import (
	"errors"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"syscall"

	"sandman/daemon/internal/apierr"
)

// Open opens path for reading; it must be a regular file once symlinks are
// followed. Devices, fifos and sockets are refused: /dev/zero or a fifo would
// stream (or block) forever, and a workload can point any path at one.
func Open(path string) (*os.File, fs.FileInfo, error) {
	// O_NONBLOCK: opening a fifo must not wait for a writer before the refusal.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, apierr.FromOS(err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, apierr.FromOS(err)
	}
	if fi.IsDir() {
		f.Close()
		return nil, nil, apierr.New(http.StatusBadRequest, "is_a_directory", "%s is a directory", path)
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, nil, NotRegular(path, fi.Mode())
	}
	return f, fi, nil
}

// NotRegular is the refusal to read what is not a regular file.
func NotRegular(path string, mode fs.FileMode) *apierr.Error {
	kind := "special file"
	switch {
	case mode&fs.ModeCharDevice != 0:
		kind = "character device"
	case mode&fs.ModeDevice != 0:
		kind = "block device"
	case mode&fs.ModeNamedPipe != 0:
		kind = "fifo"
	case mode&fs.ModeSocket != 0:
		kind = "socket"
	}
	return apierr.New(http.StatusBadRequest, "not_a_regular_file",
		"%s is a %s, not a regular file: it is never read", path, kind)
}

// Write replaces path with body atomically: a temp file in the same
// directory renamed over it, so readers never see a half-written file. mode
// nil keeps an existing file's mode, else 0644.
func Write(path string, body io.Reader, mode *uint32, parents bool) (*Stat, error) {
	perm := uint32(0o644)
	if fi, err := os.Stat(path); err == nil {
		if fi.IsDir() {
			return nil, apierr.New(http.StatusBadRequest, "is_a_directory", "%s is a directory", path)
		}
		if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
			perm = sys.Mode & 0o7777
		}
	}
	if mode != nil {
		perm = *mode
	}
	dir := filepath.Dir(path)
	if parents {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, apierr.FromOS(err)
		}
	} else if fi, err := os.Stat(dir); err != nil {
		return nil, apierr.FromOS(err)
	} else if !fi.IsDir() {
		return nil, apierr.New(http.StatusBadRequest, "not_a_directory", "%s is not a directory", dir)
	}
	tmp, err := os.CreateTemp(dir, ".sandman-"+filepath.Base(path)+"-*")
	if err != nil {
		return nil, apierr.FromOS(err)
	}
	ok := false
	defer func() {
		if !ok {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err := io.Copy(tmp, body); err != nil {
		// A write error (disk full, quota) names the file; anything else is the body's.
		var pe *fs.PathError
		if errors.As(err, &pe) && pe.Path == tmp.Name() {
			return nil, apierr.FromOS(err)
		}
		return nil, apierr.InvalidRequest("reading body: %v", err)
	}
	// Chmod, not the create mode, so the umask does not interfere.
	if err := tmp.Chmod(fs.FileMode(perm&0o777) | setBits(perm)); err != nil {
		return nil, apierr.FromOS(err)
	}
	if err := tmp.Close(); err != nil {
		return nil, apierr.FromOS(err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return nil, apierr.FromOS(err)
	}
	ok = true
	return StatPath(path)
}

// setBits maps unix setuid/setgid/sticky bits to fs.FileMode.
func setBits(perm uint32) fs.FileMode {
	var m fs.FileMode
	if perm&0o4000 != 0 {
		m |= fs.ModeSetuid
	}
	if perm&0o2000 != 0 {
		m |= fs.ModeSetgid
	}
	if perm&0o1000 != 0 {
		m |= fs.ModeSticky
	}
	return m
}

// Remove deletes path; a non-empty directory needs recursive.
func Remove(path string, recursive bool) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return apierr.FromOS(err)
	}
	if recursive && fi.IsDir() {
		if err := os.RemoveAll(path); err != nil {
			return apierr.FromOS(err)
		}
		return nil
	}
	if err := os.Remove(path); err != nil {
		if errors.Is(err, syscall.EEXIST) || errors.Is(err, syscall.ENOTEMPTY) {
			return apierr.New(http.StatusConflict, "directory_not_empty", "%s is not empty", path)
		}
		return apierr.FromOS(err)
	}
	return nil
}

// Mkdir creates a directory with exactly mode. With parents, missing
// parents are created and an existing directory is fine.
func Mkdir(path string, parents bool, mode uint32) (*Stat, error) {
	if fi, err := os.Lstat(path); err == nil {
		if parents && fi.IsDir() {
			return statOf(path, fi), nil
		}
		return nil, apierr.New(http.StatusConflict, "already_exists", "%s already exists", path)
	}
	if parents {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return nil, apierr.FromOS(err)
		}
	}
	if err := os.Mkdir(path, 0o700); err != nil {
		return nil, apierr.FromOS(err)
	}
	if err := os.Chmod(path, fs.FileMode(mode&0o777)|setBits(mode)); err != nil {
		return nil, apierr.FromOS(err)
	}
	return StatPath(path)
}

// Move renames src to dst; an existing dst needs overwrite.
func Move(src, dst string, overwrite bool) (*Stat, error) {
	if _, err := os.Lstat(src); err != nil {
		return nil, apierr.FromOS(err)
	}
	if !overwrite {
		if _, err := os.Lstat(dst); err == nil {
			return nil, apierr.New(http.StatusConflict, "already_exists", "%s already exists", dst)
		}
	}
	if err := os.Rename(src, dst); err != nil {
		if errors.Is(err, syscall.EXDEV) {
			if err := copyAcross(src, dst); err != nil {
				return nil, err
			}
			return StatPath(dst)
		}
		return nil, apierr.FromOS(err)
	}
	return StatPath(dst)
}

// copyAcross moves a regular file between filesystems (rename cannot).
func copyAcross(src, dst string) error {
	in, fi, err := Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if !fi.Mode().IsRegular() {
		return apierr.New(http.StatusBadRequest, "invalid_request", "only regular files can be moved across filesystems")
	}
	perm := uint32(fi.Mode().Perm())
	if _, err := Write(dst, in, &perm, false); err != nil {
		return err
	}
	if err := os.Remove(src); err != nil {
		return apierr.FromOS(err)
	}
	return nil
}
