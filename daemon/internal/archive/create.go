package archive

import (
	"archive/tar"
	"compress/gzip"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"sandman/daemon/internal/apierr"
)

// Check resolves what Write would pack, so a missing path is a 404 before
// the response starts.
func Check(src string) error {
	if _, err := os.Stat(src); err != nil {
		return apierr.FromOS(err)
	}
	return nil
}

// Write packs src into w as a tar stream: a directory's contents with names
// relative to it, or a single file under its base name. Errors after the
// first byte can only cut the stream short.
func Write(w io.Writer, src string, gz bool) error {
	if gz {
		zw := gzip.NewWriter(w)
		defer zw.Close()
		w = zw
	}
	tw := tar.NewWriter(w)
	fi, err := os.Stat(src)
	if err != nil {
		return apierr.FromOS(err)
	}
	if !fi.IsDir() {
		if err := addEntry(tw, src, filepath.Base(src), fi, true); err != nil {
			return err
		}
		return tw.Close()
	}
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil // unreadable entries are skipped, not fatal
		}
		if p == src {
			return nil
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil
		}
		return addEntry(tw, p, filepath.ToSlash(rel), info, false)
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// addEntry packs one entry. Only directories, symlinks and regular files are
// packed: devices, fifos and sockets are skipped (a character device such as
// /dev/zero would never end). follow opens a final symlink (the path asked
// for); entries met while walking a tree are never followed.
func addEntry(tw *tar.Writer, path, name string, fi fs.FileInfo, follow bool) error {
	hdr := &tar.Header{Name: name, ModTime: fi.ModTime(), Mode: int64(fi.Mode().Perm())}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		hdr.Mode = int64(st.Mode & 0o7777)
		hdr.Uid, hdr.Gid = int(st.Uid), int(st.Gid)
	}
	m := fi.Mode()
	switch {
	case m.IsDir():
		hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
		return tw.WriteHeader(hdr)
	case m&fs.ModeSymlink != 0:
		target, err := os.Readlink(path)
		if err != nil {
			return nil
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		return tw.WriteHeader(hdr)
	case m.IsRegular():
		// O_NONBLOCK: a fifo swapped in since the walk's lstat must not block
		// the open; what was opened is checked to be a regular file again.
		flags := os.O_RDONLY | syscall.O_NONBLOCK | syscall.O_CLOEXEC
		if !follow {
			flags |= syscall.O_NOFOLLOW
		}
		f, err := os.OpenFile(path, flags, 0)
		if err != nil {
			return nil
		}
		defer f.Close()
		if fi, err = f.Stat(); err != nil || !fi.Mode().IsRegular() {
			return nil
		}
		hdr.Typeflag, hdr.Size = tar.TypeReg, fi.Size()
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		n, err := io.CopyN(tw, f, hdr.Size)
		if err != nil && err != io.EOF {
			return err
		}
		// The file shrank while we read it: pad so the stream stays valid.
		for ; n < hdr.Size; n++ {
			if _, err := tw.Write([]byte{0}); err != nil {
				return err
			}
		}
		return nil
	}
	return nil // sockets, devices, fifos
}
