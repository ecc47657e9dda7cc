// Package archive unpacks uploaded tar streams safely and packs paths into
// tar streams for download.
package archive

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"sandman/daemon/internal/apierr"
)

// Result counts what an upload wrote: non-directory entries and the bytes
// of regular files.
type Result struct {
	Files int
	Bytes int64
	// Removed counts the names prunes removed (Options.Prune).
	Removed int
}

func refuse(format string, args ...any) error {
	return apierr.New(http.StatusBadRequest, "unsafe_archive", format, args...)
}

func invalid(format string, args ...any) error {
	return apierr.New(http.StatusBadRequest, "invalid_archive", format, args...)
}

// Options change what Extract keeps; the zero value is an upload's (PUT /v1/archive).
type Options struct {
	// Faithful keeps what a snapshot's files need (PUT /v1/changes): owners,
	// the setuid, setgid and sticky bits, and the mode, owner and times of
	// every directory entry, existing ones too (set once all entries are in,
	// deepest first). An upload keeps none of that.
	Faithful bool
	// OneFilesystem refuses entries that would be written onto another
	// filesystem than dst's (through a mount point below it, such as /proc
	// or a volume) or that name one of Excluded.
	OneFilesystem bool
	// Excluded are paths relative to dst (its mount points and the daemon's
	// own directory): no entry may name one or pass through it, and a prune
	// never removes one.
	Excluded map[string]bool
	// Prune reads entries named PruneEntry as the listing of a directory
	// (see prune.go): what the directory holds and its listing lacks is
	// removed. Without it such an entry is refused like any under Excluded.
	Prune bool
}

type extractor struct {
	opts     Options
	rootDev  uint64 // dst's device, for OneFilesystem
	slash    bool   // dst is "/": ".." at the root stays there, as the kernel has it
	dirMeta  []dirMeta
	root     string   // destination as given
	absRoot  string   // its absolute form, for absolute symlink targets
	rootFd   int      // the destination, opened once; every entry is reached from it
	madeRoot []string // dst and ancestors this call created, removed on refusal
	created  []string // entries (relative) in creation order, undone in reverse on refusal
	links    []link   // symlinks created, checked again once all entries are in
	parent   string   // relative path of the cached parent directory
	parentFd int      // its descriptor, or -1
	res      Result
}

type link struct{ rel, target string }

// dirMeta is what a Faithful extraction sets on a directory once every entry is in.
type dirMeta struct {
	rel      string
	mode     uint32
	uid, gid int
	mtime    time.Time
}

// Extract unpacks a tar (optionally gzip'd) stream under dst, creating dst
// if missing. dst itself is opened as given; below it, every entry is
// reached from dst's descriptor one component at a time with O_NOFOLLOW,
// so nothing is ever written through a symlink, whether the archive made it
// or it was already in the tree (or is swapped in meanwhile). No entry may
// name, link or resolve outside dst, through any chain of symlinks; on any
// refusal, what this call created is removed again.
func Extract(dst string, r io.Reader) (Result, error) {
	return ExtractWith(dst, r, Options{})
}

// ExtractWith is Extract with Options (a snapshot's files: see Options).
func ExtractWith(dst string, r io.Reader, opts Options) (res Result, err error) {
	abs, err := filepath.Abs(dst)
	if err != nil {
		return res, apierr.FromOS(err)
	}
	x := &extractor{opts: opts, root: dst, absRoot: abs, slash: abs == "/", rootFd: -1, parentFd: -1}
	defer func() {
		x.dropParent()
		if err != nil {
			x.rollback()
		}
		if x.rootFd >= 0 {
			syscall.Close(x.rootFd)
		}
	}()
	if err := x.makeRoot(); err != nil {
		return res, err
	}
	x.rootFd, err = syscall.Open(dst, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return res, apierr.FromOS(&os.PathError{Op: "open", Path: dst, Err: err})
	}
	var rootSt syscall.Stat_t
	if err := syscall.Fstat(x.rootFd, &rootSt); err != nil {
		return res, apierr.FromOS(err)
	}
	x.rootDev = uint64(rootSt.Dev)
	br := bufio.NewReader(r)
	var src io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		gz, err := gzip.NewReader(br)
		if err != nil {
			return res, invalid("bad gzip header: %v", err)
		}
		defer gz.Close()
		src = gz
	}
	tr := tar.NewReader(src)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return res, invalid("not a tar stream: %v", err)
		}
		if err := x.entry(hdr, tr); err != nil {
			return res, err
		}
	}
	// A later entry can change what an earlier symlink resolves to
	// (a -> d/.. first, d -> . after): check them all against the final tree.
	for _, l := range x.links {
		if x.escapes(l.rel, l.target) {
			return res, refuse("symlink %q -> %q resolves outside the destination once the whole archive is unpacked", l.rel, l.target)
		}
	}
	if err := x.setDirMeta(); err != nil {
		return res, err
	}
	return x.res, nil
}

// setDirMeta gives the directories of a Faithful extraction their owner, mode
// and times, deepest first: a directory made read-only does not block the
// entries below it, and writing those does not move its mtime again.
func (x *extractor) setDirMeta() error {
	slices.SortStableFunc(x.dirMeta, func(a, b dirMeta) int {
		return strings.Count(b.rel, "/") - strings.Count(a.rel, "/")
	})
	for _, m := range x.dirMeta {
		fd, err := x.openDir(m.rel, false)
		if err != nil {
			return err
		}
		// EPERM: a daemon that is not root cannot give away, nor change the mode or
		// times of, a directory it does not own (/tmp, the root): it keeps them.
		err = chown(syscall.Fchown(fd, m.uid, m.gid))
		if err == nil {
			err = chown(syscall.Fchmod(fd, m.mode))
		}
		if err == nil {
			err = chown(futimens(fd, m.mtime))
		}
		syscall.Close(fd)
		if err != nil {
			return apierr.FromOS(&os.PathError{Op: "set metadata of", Path: filepath.Join(x.root, m.rel), Err: err})
		}
	}
	return nil
}

// chown passes on an error but EPERM: a daemon that is not root keeps the
// entries its own, as tar does for an unprivileged user.
func chown(err error) error {
	if err == syscall.EPERM {
		return nil
	}
	return err
}

// excluded reports whether rel is, or is below, a path of Options.Excluded.
func (x *extractor) excluded(rel string) bool {
	if len(x.opts.Excluded) == 0 || rel == "" {
		return false
	}
	for i := 0; i <= len(rel); i++ {
		if (i == len(rel) || rel[i] == '/') && x.opts.Excluded[rel[:i]] {
			return true
		}
	}
	return false
}

// makeRoot creates dst and missing ancestors, remembering which.
func (x *extractor) makeRoot() error {
	var missing []string
	for p := filepath.Clean(x.root); ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err == nil {
			if !fi.IsDir() {
				return apierr.New(http.StatusBadRequest, "not_a_directory", "%s is not a directory", p)
			}
			break
		}
		if !errors.Is(err, os.ErrNotExist) {
			return apierr.FromOS(err)
		}
		missing = append(missing, p)
		if filepath.Dir(p) == p {
			break
		}
	}
	for i := len(missing) - 1; i >= 0; i-- {
		if err := os.Mkdir(missing[i], 0o755); err != nil {
			return apierr.FromOS(err)
		}
		x.madeRoot = append(x.madeRoot, missing[i])
	}
	return nil
}

func (x *extractor) rollback() {
	x.dropParent()
	if x.rootFd >= 0 {
		for i := len(x.created) - 1; i >= 0; i-- {
			dir, name := splitRel(x.created[i])
			fd, err := x.openDir(dir, false)
			if err != nil {
				continue
			}
			var st syscall.Stat_t
			if lstatat(fd, name, &st) == nil {
				flags := 0
				if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
					flags = atRemoveDir
				}
				_ = unlinkat(fd, name, flags)
			}
			syscall.Close(fd)
		}
	}
	x.created = nil
	for i := len(x.madeRoot) - 1; i >= 0; i-- {
		_ = os.Remove(x.madeRoot[i])
	}
	x.madeRoot = nil
}

// cleanName validates an archive path and returns it cleaned and relative.
func cleanName(name string) (string, error) {
	if strings.IndexByte(name, 0) >= 0 {
		return "", refuse("entry name contains NUL")
	}
	if strings.HasPrefix(name, "/") {
		return "", refuse("absolute entry name %q", name)
	}
	var parts []string
	for _, p := range strings.Split(name, "/") {
		switch p {
		case "..":
			return "", refuse("entry %q has a .. component", name)
		case "", ".":
		default:
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, "/"), nil
}

// splitRel splits a cleaned relative path into its directory ("" for the
// root) and its last component.
func splitRel(rel string) (string, string) {
	if i := strings.LastIndexByte(rel, '/'); i >= 0 {
		return rel[:i], rel[i+1:]
	}
	return "", rel
}

const dirFlags = syscall.O_RDONLY | syscall.O_DIRECTORY | syscall.O_NOFOLLOW | syscall.O_CLOEXEC

// openDir opens directory rel under the root one component at a time,
// never following a symlink; with create, missing directories are made
// (and remembered). The caller closes the descriptor.
func (x *extractor) openDir(rel string, create bool) (int, error) {
	fd, err := syscall.Dup(x.rootFd)
	if err != nil {
		return -1, apierr.FromOS(err)
	}
	if rel == "" {
		return fd, nil
	}
	parts := strings.Split(rel, "/")
	for i, part := range parts {
		child, err := syscall.Openat(fd, part, dirFlags, 0)
		if err == syscall.ENOENT && create {
			if err = syscall.Mkdirat(fd, part, 0o755); err == nil || err == syscall.EEXIST {
				if err == nil {
					x.created = append(x.created, strings.Join(parts[:i+1], "/"))
				}
				child, err = syscall.Openat(fd, part, dirFlags, 0)
			}
		}
		if err != nil {
			shown := strings.Join(parts[:i+1], "/")
			var st syscall.Stat_t
			statErr := lstatat(fd, part, &st)
			syscall.Close(fd)
			switch {
			case statErr == nil && st.Mode&syscall.S_IFMT == syscall.S_IFLNK:
				return -1, refuse("an entry would be written through symlink %s", filepath.Join(x.root, shown))
			case statErr == nil && st.Mode&syscall.S_IFMT != syscall.S_IFDIR:
				return -1, apierr.New(http.StatusBadRequest, "not_a_directory", "%s is not a directory", filepath.Join(x.root, shown))
			}
			return -1, apierr.FromOS(&os.PathError{Op: "open", Path: filepath.Join(x.root, shown), Err: err})
		}
		syscall.Close(fd)
		fd = child
		if x.opts.OneFilesystem {
			var st syscall.Stat_t
			if err := syscall.Fstat(fd, &st); err != nil || uint64(st.Dev) != x.rootDev {
				syscall.Close(fd)
				return -1, refuse("an entry would be written onto another filesystem (%s is a mount point)", filepath.Join(x.root, strings.Join(parts[:i+1], "/")))
			}
		}
	}
	return fd, nil
}

// parentOf is the (cached) descriptor of the directory holding rel, made
// where missing, and rel's last component. The extractor owns the descriptor.
func (x *extractor) parentOf(rel string) (int, string, error) {
	dir, name := splitRel(rel)
	if x.parentFd >= 0 && x.parent == dir {
		return x.parentFd, name, nil
	}
	x.dropParent()
	fd, err := x.openDir(dir, true)
	if err != nil {
		return -1, "", err
	}
	x.parent, x.parentFd = dir, fd
	return fd, name, nil
}

func (x *extractor) dropParent() {
	if x.parentFd >= 0 {
		syscall.Close(x.parentFd)
		x.parentFd = -1
	}
}

// clear removes a non-directory at name so the new entry replaces it
// rather than writing through it; a directory there is an error.
func (x *extractor) clear(dirfd int, name, entry string) error {
	var st syscall.Stat_t
	err := lstatat(dirfd, name, &st)
	if err == syscall.ENOENT {
		return nil
	}
	if err != nil {
		return apierr.FromOS(err)
	}
	if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
		return apierr.New(http.StatusBadRequest, "is_a_directory", "entry %q: a directory stands at its name", entry)
	}
	return apierr.FromOSOrNil(unlinkat(dirfd, name, 0))
}

// Bounds of a symlink check: the kernel gives up after 40 links, and no
// honest tree needs more steps than this.
const (
	maxLinks        = 40
	maxResolveSteps = 4096
)

// escapes reports whether symlink rel -> target resolves outside the root.
// It walks the target as the kernel would, from the link's directory,
// reading every symlink met on the way from the tree as it is now (through
// descriptors, never by path); components that do not exist are taken
// literally. An absolute target counts as inside only if it names a path
// under the destination. A chain the kernel would give up on, or one too
// long to check, counts as escaping.
func (x *extractor) escapes(rel, target string) bool {
	dir, _ := splitRel(rel)
	todo, ok := x.rebase(target)
	if !ok {
		return true
	}
	if !strings.HasPrefix(target, "/") && dir != "" {
		todo = append(strings.Split(dir, "/"), todo...)
	}
	var fds []int // -1 for a component that is not an existing directory
	defer func() {
		for _, fd := range fds {
			if fd >= 0 {
				syscall.Close(fd)
			}
		}
	}()
	links, steps := 0, 0
	for len(todo) > 0 {
		steps++
		if steps > maxResolveSteps {
			return true
		}
		part := todo[0]
		todo = todo[1:]
		switch part {
		case "", ".":
			continue
		case "..":
			if len(fds) == 0 {
				if x.slash && x.opts.Faithful {
					continue // "/.." is "/": nothing is outside the whole tree
				}
				return true
			}
			if fd := fds[len(fds)-1]; fd >= 0 {
				syscall.Close(fd)
			}
			fds = fds[:len(fds)-1]
			continue
		}
		here := x.rootFd
		if len(fds) > 0 {
			here = fds[len(fds)-1]
		}
		if here >= 0 {
			if body, err := readlinkat(here, part); err == nil {
				links++
				if links > maxLinks {
					return true
				}
				next, ok := x.rebase(body)
				if !ok {
					return true
				}
				if strings.HasPrefix(body, "/") {
					// Absolute: resolution restarts at the root.
					for _, fd := range fds {
						if fd >= 0 {
							syscall.Close(fd)
						}
					}
					fds = fds[:0]
				}
				todo = append(next, todo...)
				continue
			}
		}
		child := -1
		if here >= 0 {
			if fd, err := syscall.Openat(here, part, dirFlags, 0); err == nil {
				child = fd
			}
		}
		fds = append(fds, child)
	}
	return false
}

// rebase splits a symlink body into components to walk from the link's
// directory, or for an absolute body from the root; false if an absolute
// body does not name the destination literally. Only "" and "." are
// dropped on the way: folding ".." as filepath.Clean does would read
// "<dst>/x/up/.." as "<dst>/x", where the kernel follows x/up first and, if
// it is a link to "..", ends beside the destination.
func (x *extractor) rebase(body string) ([]string, bool) {
	if !strings.HasPrefix(body, "/") {
		return strings.Split(body, "/"), true
	}
	var parts []string
	for _, p := range strings.Split(body, "/") {
		if p != "" && p != "." {
			parts = append(parts, p)
		}
	}
	var root []string
	if trimmed := strings.Trim(x.absRoot, "/"); trimmed != "" {
		root = strings.Split(trimmed, "/")
	}
	if len(parts) < len(root) || !slices.Equal(parts[:len(root)], root) {
		return nil, false
	}
	return parts[len(root):], true
}

func (x *extractor) entry(hdr *tar.Header, body io.Reader) error {
	rel, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	if rel == "" {
		if hdr.Typeflag == tar.TypeDir {
			if x.opts.Faithful {
				x.dirMeta = append(x.dirMeta, dirMeta{"", uint32(hdr.Mode & 0o7777), hdr.Uid, hdr.Gid, hdr.ModTime})
			}
			return nil // the root itself, "./"
		}
		return invalid("entry %q has no name", hdr.Name)
	}
	if rel == PruneEntry && x.opts.Prune && (hdr.Typeflag == tar.TypeReg || hdr.Typeflag == tar.TypeRegA) {
		return x.prune(hdr, body)
	}
	if x.opts.OneFilesystem && x.excluded(rel) {
		return refuse("entry %q is not the sandbox's own files (a mount point, or below one)", hdr.Name)
	}
	target := filepath.Join(x.root, rel)
	mode := uint32(hdr.Mode & 0o777)
	if x.opts.Faithful {
		mode = uint32(hdr.Mode & 0o7777)
	}
	switch hdr.Typeflag {
	case tar.TypeDir, tar.TypeReg, tar.TypeRegA, tar.TypeSymlink, tar.TypeLink:
	default:
		// Devices, fifos and the like are skipped: creating them needs
		// privileges and is never what an upload of source code means.
		return nil
	}
	dirfd, name, err := x.parentOf(rel)
	if err != nil {
		return err
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		var st syscall.Stat_t
		err := lstatat(dirfd, name, &st)
		if x.opts.Faithful {
			x.dirMeta = append(x.dirMeta, dirMeta{rel, mode, hdr.Uid, hdr.Gid, hdr.ModTime})
		}
		switch {
		case err == nil && st.Mode&syscall.S_IFMT == syscall.S_IFDIR:
			return nil
		case err == nil && st.Mode&syscall.S_IFMT == syscall.S_IFLNK:
			return refuse("entry %q would be written through a symlink", hdr.Name)
		case err == nil:
			return apierr.New(http.StatusConflict, "already_exists", "entry %q: %s exists and is not a directory", hdr.Name, target)
		}
		if err := syscall.Mkdirat(dirfd, name, 0o700); err != nil {
			return apierr.FromOS(&os.PathError{Op: "mkdir", Path: target, Err: err})
		}
		x.created = append(x.created, rel)
		if x.opts.Faithful {
			return nil // its mode, owner and times come last (setDirMeta)
		}
		if mode == 0 {
			mode = 0o755 // some tar writers leave directory modes empty
		}
		// Through a descriptor: a chmod by name could follow a symlink swapped in.
		fd, err := syscall.Openat(dirfd, name, dirFlags, 0)
		if err != nil {
			return apierr.FromOS(&os.PathError{Op: "open", Path: target, Err: err})
		}
		defer syscall.Close(fd)
		return apierr.FromOSOrNil(syscall.Fchmod(fd, mode))
	case tar.TypeReg, tar.TypeRegA:
		if isSparse(hdr) {
			// A sparse entry's holes are made up by the reader: a few bytes
			// of archive could ask for terabytes of zeros.
			return invalid("entry %q: sparse files are not supported", hdr.Name)
		}
		if err := x.clear(dirfd, name, hdr.Name); err != nil {
			return err
		}
		fd, err := syscall.Openat(dirfd, name, syscall.O_WRONLY|syscall.O_CREAT|syscall.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
		if err != nil {
			return apierr.FromOS(&os.PathError{Op: "open", Path: target, Err: err})
		}
		x.created = append(x.created, rel)
		f := os.NewFile(uintptr(fd), target)
		n, err := io.Copy(f, body)
		x.res.Bytes += n
		if err != nil {
			f.Close()
			// A write error (disk full) names the file; anything else is the archive's.
			var pe *fs.PathError
			if errors.As(err, &pe) && pe.Path == target {
				return apierr.FromOS(err)
			}
			return invalid("entry %q: %v", hdr.Name, err)
		}
		if x.opts.Faithful {
			// Owner first: a chown clears the setuid and setgid bits.
			if err := chown(f.Chown(hdr.Uid, hdr.Gid)); err != nil {
				f.Close()
				return apierr.FromOS(err)
			}
			if err := syscall.Fchmod(fd, mode); err != nil {
				f.Close()
				return apierr.FromOS(&os.PathError{Op: "chmod", Path: target, Err: err})
			}
		} else if err := f.Chmod(os.FileMode(mode)); err != nil {
			f.Close()
			return apierr.FromOS(err)
		}
		if x.opts.Faithful {
			_ = futimens(fd, hdr.ModTime)
		} else {
			tv := syscall.NsecToTimeval(hdr.ModTime.UnixNano())
			_ = syscall.Futimes(fd, []syscall.Timeval{tv, tv})
		}
		if err := f.Close(); err != nil {
			return apierr.FromOS(err)
		}
		x.res.Files++
		return nil
	case tar.TypeSymlink:
		if hdr.Linkname == "" || strings.IndexByte(hdr.Linkname, 0) >= 0 {
			return invalid("symlink %q has a bad target", hdr.Name)
		}
		if x.escapes(rel, hdr.Linkname) {
			return refuse("symlink %q points outside the destination (%s)", hdr.Name, hdr.Linkname)
		}
		if err := x.clear(dirfd, name, hdr.Name); err != nil {
			return err
		}
		if err := symlinkat(hdr.Linkname, dirfd, name); err != nil {
			return apierr.FromOS(&os.PathError{Op: "symlink", Path: target, Err: err})
		}
		x.created = append(x.created, rel)
		x.links = append(x.links, link{rel, hdr.Linkname})
		x.res.Files++
		if x.opts.Faithful {
			if err := chown(syscall.Fchownat(dirfd, name, hdr.Uid, hdr.Gid, atSymlinkNoFollow)); err != nil {
				return apierr.FromOS(&os.PathError{Op: "chown", Path: target, Err: err})
			}
		}
		return nil
	default: // tar.TypeLink
		srcRel, err := cleanName(hdr.Linkname)
		if err != nil || srcRel == "" {
			return refuse("hard link %q points outside the destination (%s)", hdr.Name, hdr.Linkname)
		}
		srcDir, srcName := splitRel(srcRel)
		srcFd, err := x.openDir(srcDir, false)
		if err != nil {
			var ae *apierr.Error
			if errors.As(err, &ae) && ae.Code == "unsafe_archive" {
				return err
			}
			return invalid("hard link %q: target %q not in archive", hdr.Name, hdr.Linkname)
		}
		defer syscall.Close(srcFd)
		var st syscall.Stat_t
		if err := lstatat(srcFd, srcName, &st); err != nil {
			return invalid("hard link %q: target %q not in archive", hdr.Name, hdr.Linkname)
		}
		if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
			return invalid("hard link %q points to something other than a regular file", hdr.Name)
		}
		if err := x.clear(dirfd, name, hdr.Name); err != nil {
			return err
		}
		if err := linkat(srcFd, srcName, dirfd, name); err != nil {
			return apierr.FromOS(&os.PathError{Op: "link", Path: target, Err: err})
		}
		x.created = append(x.created, rel)
		x.res.Files++
		return nil
	}
}

// isSparse tells GNU and PAX sparse entries apart from plain files.
func isSparse(hdr *tar.Header) bool {
	if hdr.Typeflag == tar.TypeGNUSparse {
		return true
	}
	for key := range hdr.PAXRecords {
		if strings.HasPrefix(key, "GNU.sparse.") {
			return true
		}
	}
	return false
}
