package archive

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"sandman/daemon/internal/apierr"
)

// PruneEntry names the pseudo-entries of a snapshot's stream (GET and PUT
// /v1/changes) that list a changed directory: no file of the sandbox can
// have this name, since /.sandman is the daemon's own (a mount, never walked).
// The body is the directory's path relative to the root, then for each name
// it holds one kind byte (KindDir, KindFile, KindLink or KindOther) and the
// name, every field ended by a NUL.
const PruneEntry = ".sandman/prune"

// The kinds of a prune listing's names: what matters is whether the name
// is a directory (a prune removes a name whose kind changed to or from one).
const (
	KindDir   = 'd'
	KindFile  = 'f'
	KindLink  = 'l'
	KindOther = 'o'
)

// maxPruneList bounds one listing: a directory of a million long names.
const maxPruneList = 64 << 20

// prune reads a listing and removes, from the directory it names, every
// name the listing lacks, or lists with a kind of the other side of
// directory/non-directory. What it removes it never follows (a symlink goes,
// not what it names) and never leaves dst's filesystem: a mount point, or a
// name under Excluded, stays. The directory must exist already (its own
// entry comes first in the stream).
func (x *extractor) prune(hdr *tar.Header, body io.Reader) error {
	if hdr.Size > maxPruneList {
		return invalid("a directory listing of %d bytes (at most %d)", hdr.Size, maxPruneList)
	}
	data, err := io.ReadAll(io.LimitReader(body, maxPruneList+1))
	if err != nil {
		return invalid("a directory listing: %v", err)
	}
	fields := bytes.Split(data, []byte{0})
	if len(fields) < 2 || len(fields[len(fields)-1]) != 0 {
		return invalid("a directory listing must end with a NUL")
	}
	dirRel, err := cleanName(string(fields[0]))
	if err != nil {
		return err
	}
	if x.excluded(dirRel) {
		return refuse("a listing of %q: not the sandbox's own files", fields[0])
	}
	keep := map[string]bool{} // name -> is a directory
	for _, f := range fields[1 : len(fields)-1] {
		if len(f) < 2 || !validName(string(f[1:])) {
			return invalid("a directory listing names %q", f)
		}
		switch f[0] {
		case KindDir, KindFile, KindLink, KindOther:
		default:
			return invalid("a directory listing has kind %q", f[0])
		}
		keep[string(f[1:])] = f[0] == KindDir
	}
	x.dropParent() // the cached parent may be under what goes
	fd, err := x.openDir(dirRel, false)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	names, err := readNames(fd, filepath.Join(x.root, dirRel))
	if err != nil {
		return err
	}
	for _, name := range names {
		var st syscall.Stat_t
		if err := lstatat(fd, name, &st); err != nil {
			continue // gone meanwhile
		}
		isDir := st.Mode&syscall.S_IFMT == syscall.S_IFDIR
		if wantDir, listed := keep[name]; listed && wantDir == isDir {
			continue
		}
		rel := name
		if dirRel != "" {
			rel = dirRel + "/" + name
		}
		removed, err := x.removeAll(fd, name, rel, &st)
		if err != nil {
			return err
		}
		if removed {
			x.res.Removed++
		}
	}
	return nil
}

// readNames lists the directory open as fd (through a copy of it, which the
// *os.File owns and closes; fd stays the caller's).
func readNames(fd int, shown string) ([]string, error) {
	dup, err := syscall.Dup(fd)
	if err != nil {
		return nil, apierr.FromOS(err)
	}
	lister := os.NewFile(uintptr(dup), shown)
	defer lister.Close()
	names, err := lister.Readdirnames(-1)
	if err != nil {
		return nil, apierr.FromOS(&os.PathError{Op: "list", Path: shown, Err: err})
	}
	return names, nil
}

// validName is a single path component: no slash, no NUL, not "." or "..".
func validName(name string) bool {
	return name != "" && name != "." && name != ".." && len(name) <= 255 &&
		!bytes.ContainsAny([]byte(name), "/\x00")
}

// removeAll removes name (whose lstat is st) from dirfd, and what it holds,
// never following a symlink and never crossing onto another filesystem:
// mount points and Excluded names are left where they are, and so are the
// directories that hold them. It reports whether name is gone.
func (x *extractor) removeAll(dirfd int, name, rel string, st *syscall.Stat_t) (bool, error) {
	if x.excluded(rel) {
		return false, nil
	}
	gone := func(err error) (bool, error) {
		switch err {
		case nil, syscall.ENOENT:
			return true, nil
		case syscall.EBUSY, syscall.ENOTEMPTY: // a mount point, or what holds one
			return false, nil
		}
		return false, apierr.FromOS(&os.PathError{Op: "remove", Path: filepath.Join(x.root, rel), Err: err})
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		return gone(unlinkat(dirfd, name, 0))
	}
	if uint64(st.Dev) != x.rootDev {
		return false, nil // a mount point
	}
	fd, err := syscall.Openat(dirfd, name, dirFlags, 0)
	if err != nil {
		return gone(err)
	}
	names, err := readNames(fd, filepath.Join(x.root, rel))
	for i := 0; err == nil && i < len(names); i++ {
		var cst syscall.Stat_t
		if lstatat(fd, names[i], &cst) == nil {
			_, err = x.removeAll(fd, names[i], rel+"/"+names[i], &cst)
		}
	}
	syscall.Close(fd)
	if err != nil {
		return false, err
	}
	return gone(unlinkat(dirfd, name, atRemoveDir))
}
