package archive

import (
	"archive/tar"
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"
	"unsafe"

	"sandman/daemon/internal/apierr"
)

// ErrorRecord is the PAX record of the global header that ends a stream of
// changes cut short: its value says why, and no end-of-archive marker follows.
const ErrorRecord = "SANDMAN.error"

// DaemonDir is the daemon's own directory at the root of a sandbox: never
// part of its files.
const DaemonDir = ".sandman"

// ChangesStats counts what a stream of changes held.
type ChangesStats struct {
	Entries int
	Bytes   int64
}

type changes struct {
	tw       *tar.Writer
	root     string
	since    int64 // ctime (unix ns) from which an entry counts as changed
	rootDev  uint64
	excluded map[string]bool
	links    map[[2]uint64]string // (dev, ino) of a file written -> its name
	stats    ChangesStats
}

// WriteChanges writes to w, as a tar stream, what changed under root since
// `since`: every entry whose ctime is at or after it (a write, a chmod, a
// chown, a rename, a new link all move an inode's ctime to now, and nothing
// can move it back), with its owner, mode and mtime. Each changed directory
// is followed by a PruneEntry listing every name it holds, so that what was
// removed from it is removed from the copy too. Only root's own filesystem
// is walked: directories on another device, the names of excluded (mount
// points, relative to root) and the daemon's own directory are left out, as
// are devices, fifos and sockets. Nothing is followed: every entry is
// reached from its directory's descriptor with O_NOFOLLOW. A file with
// several names that changed is sent once and linked (a hard link entry).
//
// An error before anything reached w is returned as it is. Once bytes have
// gone out, an error ends the stream with a global header whose ErrorRecord
// says why, and no end-of-archive marker, so the reader cannot take it for
// a whole snapshot.
func WriteChanges(w io.Writer, root string, since time.Time, excluded map[string]bool) (ChangesStats, error) {
	fd, err := syscall.Open(root, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return ChangesStats{}, apierr.FromOS(&os.PathError{Op: "open", Path: root, Err: err})
	}
	defer syscall.Close(fd)
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return ChangesStats{}, apierr.FromOS(err)
	}
	out := &counted{w: w}
	bw := bufio.NewWriterSize(out, 256<<10)
	c := &changes{
		tw: tar.NewWriter(bw), root: root, since: since.UnixNano(), rootDev: uint64(st.Dev),
		excluded: excluded, links: map[[2]uint64]string{},
	}
	changed := ctime(&st) >= c.since
	if changed {
		err = c.header(&tar.Header{Name: "./", Typeflag: tar.TypeDir}, &st)
	}
	if err == nil {
		err = c.walk(fd, "", changed)
	}
	if err == nil {
		if err = c.tw.Close(); err == nil {
			err = bw.Flush()
		}
		return c.stats, err
	}
	if out.n == 0 {
		return c.stats, err // nothing sent yet: the caller can still answer with an error
	}
	// Said in the stream itself: the answer's status went out with its first byte.
	_ = c.tw.WriteHeader(&tar.Header{
		Typeflag: tar.TypeXGlobalHeader, Format: tar.FormatPAX,
		PAXRecords: map[string]string{ErrorRecord: err.Error()},
	})
	_ = c.tw.Flush()
	_ = bw.Flush()
	return c.stats, err
}

// counted is a writer that knows whether anything went through it.
type counted struct {
	w io.Writer
	n int64
}

func (c *counted) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func ctime(st *syscall.Stat_t) int64 {
	return int64(st.Ctim.Sec)*1e9 + int64(st.Ctim.Nsec)
}

// futimens sets the atime and mtime of what fd is open on to t, to the
// nanosecond (utimes' microseconds would round a copy's times off).
func futimens(fd int, t time.Time) error {
	ts := [2]syscall.Timespec{syscall.NsecToTimespec(t.UnixNano()), syscall.NsecToTimespec(t.UnixNano())}
	_, _, e := syscall.Syscall6(syscall.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func mtime(st *syscall.Stat_t) time.Time {
	return time.Unix(int64(st.Mtim.Sec), int64(st.Mtim.Nsec))
}

func (c *changes) header(hdr *tar.Header, st *syscall.Stat_t) error {
	hdr.Mode = int64(st.Mode & 0o7777)
	hdr.Uid, hdr.Gid = int(st.Uid), int(st.Gid)
	hdr.ModTime = mtime(st)
	hdr.Format = tar.FormatPAX // sub-second mtimes, long names
	c.stats.Entries++
	return c.tw.WriteHeader(hdr)
}

type child struct {
	name string
	st   syscall.Stat_t
}

// walk writes what changed below the directory open as dirfd (rel to the
// root); changed says whether the directory itself did, and so is listed.
func (c *changes) walk(dirfd int, rel string, changed bool) error {
	shown := filepath.Join(c.root, rel)
	names, err := readNames(dirfd, shown)
	if err != nil {
		return err
	}
	slices.Sort(names)
	kids := make([]child, 0, len(names))
	for _, name := range names {
		var st syscall.Stat_t
		if err := lstatat(dirfd, name, &st); err != nil {
			if err == syscall.ENOENT {
				continue // removed meanwhile
			}
			return apierr.FromOS(&os.PathError{Op: "lstat", Path: filepath.Join(shown, name), Err: err})
		}
		kids = append(kids, child{name, st})
	}
	if changed {
		if err := c.listing(rel, kids); err != nil {
			return err
		}
	}
	for i := range kids {
		k := &kids[i]
		crel := k.name
		if rel != "" {
			crel = rel + "/" + k.name
		}
		if (rel == "" && k.name == DaemonDir) || c.excluded[crel] {
			continue
		}
		isChanged := ctime(&k.st) >= c.since
		switch k.st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			if uint64(k.st.Dev) != c.rootDev {
				continue // a mount point the mount table did not name
			}
			if isChanged {
				if err := c.header(&tar.Header{Name: crel + "/", Typeflag: tar.TypeDir}, &k.st); err != nil {
					return err
				}
			}
			fd, err := syscall.Openat(dirfd, k.name, dirFlags, 0)
			if err == syscall.ENOENT || err == syscall.ENOTDIR || err == syscall.ELOOP {
				continue // replaced meanwhile
			}
			if (err == syscall.EACCES || err == syscall.EPERM) && !isChanged {
				// A daemon that is not root cannot read /root and the like; nor
				// could the workload, which runs as the daemon does, write there.
				continue
			}
			if err != nil {
				return apierr.FromOS(&os.PathError{Op: "open", Path: filepath.Join(c.root, crel), Err: err})
			}
			err = c.walk(fd, crel, isChanged)
			syscall.Close(fd)
			if err != nil {
				return err
			}
		case syscall.S_IFREG:
			if isChanged {
				if err := c.file(dirfd, k.name, crel); err != nil {
					return err
				}
			}
		case syscall.S_IFLNK:
			if isChanged {
				target, err := readlinkat(dirfd, k.name)
				if err == syscall.ENOENT || err == syscall.EINVAL {
					continue // replaced meanwhile
				}
				if err != nil {
					return apierr.FromOS(&os.PathError{Op: "readlink", Path: filepath.Join(c.root, crel), Err: err})
				}
				if err := c.header(&tar.Header{Name: crel, Typeflag: tar.TypeSymlink, Linkname: target}, &k.st); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// listing writes the PruneEntry of directory rel.
func (c *changes) listing(rel string, kids []child) error {
	var body bytes.Buffer
	body.WriteString(rel)
	body.WriteByte(0)
	for i := range kids {
		kind := byte(KindOther)
		switch kids[i].st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			kind = KindDir
		case syscall.S_IFREG:
			kind = KindFile
		case syscall.S_IFLNK:
			kind = KindLink
		}
		body.WriteByte(kind)
		body.WriteString(kids[i].name)
		body.WriteByte(0)
	}
	if body.Len() > maxPruneList {
		return apierr.New(413, "file_too_large", "directory %s lists more than %d bytes of names", filepath.Join(c.root, rel), maxPruneList)
	}
	hdr := &tar.Header{
		Name: PruneEntry, Typeflag: tar.TypeReg, Mode: 0o600, Size: int64(body.Len()),
		ModTime: time.Unix(0, 0), Format: tar.FormatPAX,
	}
	if err := c.tw.WriteHeader(hdr); err != nil {
		return err
	}
	_, err := c.tw.Write(body.Bytes())
	return err
}

// file writes the changed regular file name of dirfd: its bytes, or a hard
// link to the name it was written under already.
func (c *changes) file(dirfd int, name, rel string) error {
	fd, err := syscall.Openat(dirfd, name, syscall.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err == syscall.ENOENT || err == syscall.ELOOP {
		return nil // removed or replaced meanwhile
	}
	path := filepath.Join(c.root, rel)
	if err != nil {
		return apierr.FromOS(&os.PathError{Op: "cannot read", Path: path, Err: err})
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return apierr.FromOS(err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil // replaced by something else meanwhile
	}
	if st.Nlink > 1 {
		key := [2]uint64{uint64(st.Dev), st.Ino}
		if first, ok := c.links[key]; ok {
			return c.header(&tar.Header{Name: rel, Typeflag: tar.TypeLink, Linkname: first}, &st)
		}
		c.links[key] = rel
	}
	if err := c.header(&tar.Header{Name: rel, Typeflag: tar.TypeReg, Size: st.Size}, &st); err != nil {
		return err
	}
	n, err := io.CopyN(c.tw, f, st.Size)
	c.stats.Bytes += n
	if err != nil && err != io.EOF {
		var pe *os.PathError
		if errors.As(err, &pe) && pe.Path == path {
			return apierr.FromOS(fmt.Errorf("cannot read %s: %w", path, pe.Err))
		}
		return err
	}
	// The file shrank while it was read: pad, so that the stream stays whole.
	for zero := make([]byte, 32<<10); n < st.Size; {
		m, err := c.tw.Write(zero[:min(int64(len(zero)), st.Size-n)])
		n += int64(m)
		if err != nil {
			return err
		}
	}
	return nil
}
