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
	"strings"
	"syscall"

	"sandman/daemon/internal/apierr"
)

// Result counts what an upload wrote: non-directory entries and the bytes
// of regular files.
type Result struct {
	Files int
	Bytes int64
}

func unsafe(format string, args ...any) error {
	return apierr.New(http.StatusBadRequest, "unsafe_archive", format, args...)
}

func invalid(format string, args ...any) error {
	return apierr.New(http.StatusBadRequest, "invalid_archive", format, args...)
}

type extractor struct {
	root    string   // destination as given
	absRoot string   // its absolute form, for symlink-target checks
	created []string // in creation order, undone in reverse on refusal
	res     Result
}

// Extract unpacks a tar (optionally gzip'd) stream under dst, creating dst
// if missing. Nothing is ever written through a symlink and no entry may
// name or link outside dst; on any refusal, what this call created is
// removed again.
func Extract(dst string, r io.Reader) (res Result, err error) {
	abs, err := filepath.Abs(dst)
	if err != nil {
		return res, apierr.FromOS(err)
	}
	x := &extractor{root: dst, absRoot: abs}
	defer func() {
		if err != nil {
			x.rollback()
		}
	}()
	if err := x.makeRoot(); err != nil {
		return res, err
	}
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
			return x.res, nil
		}
		if err != nil {
			return res, invalid("not a tar stream: %v", err)
		}
		if err := x.entry(hdr, tr); err != nil {
			return res, err
		}
	}
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
		x.created = append(x.created, missing[i])
	}
	return nil
}

func (x *extractor) rollback() {
	for i := len(x.created) - 1; i >= 0; i-- {
		_ = os.Remove(x.created[i])
	}
	x.created = nil
}

// cleanName validates an archive path and returns it cleaned and relative.
func cleanName(name string) (string, error) {
	if strings.IndexByte(name, 0) >= 0 {
		return "", unsafe("entry name contains NUL")
	}
	if strings.HasPrefix(name, "/") {
		return "", unsafe("absolute entry name %q", name)
	}
	var parts []string
	for _, p := range strings.Split(name, "/") {
		switch p {
		case "..":
			return "", unsafe("entry %q has a .. component", name)
		case "", ".":
		default:
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, "/"), nil
}

// within reports whether absolute path p is root or below it.
func within(root, p string) bool {
	rel, err := filepath.Rel(root, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// parents makes sure every directory above rel exists under root as a real
// directory (never a symlink), creating missing ones.
func (x *extractor) parents(rel string) error {
	parts := strings.Split(rel, "/")
	p := x.root
	for _, part := range parts[:len(parts)-1] {
		p = filepath.Join(p, part)
		fi, err := os.Lstat(p)
		switch {
		case err == nil && fi.Mode()&os.ModeSymlink != 0:
			return unsafe("entry %q would be written through symlink %s", rel, p)
		case err == nil && !fi.IsDir():
			return apierr.New(http.StatusBadRequest, "not_a_directory", "%s is not a directory", p)
		case err == nil:
		case errors.Is(err, os.ErrNotExist):
			if err := os.Mkdir(p, 0o755); err != nil {
				return apierr.FromOS(err)
			}
			x.created = append(x.created, p)
		default:
			return apierr.FromOS(err)
		}
	}
	return nil
}

// clear removes a non-directory at target so the new entry replaces it
// rather than writing through it; a directory there is an error.
func clear(target, name string) error {
	fi, err := os.Lstat(target)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return apierr.FromOS(err)
	}
	if fi.IsDir() {
		return apierr.New(http.StatusBadRequest, "is_a_directory", "entry %q: %s is a directory", name, target)
	}
	if err := os.Remove(target); err != nil {
		return apierr.FromOS(err)
	}
	return nil
}

func (x *extractor) entry(hdr *tar.Header, body io.Reader) error {
	rel, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	if rel == "" {
		if hdr.Typeflag == tar.TypeDir {
			return nil // the root itself, "./"
		}
		return invalid("entry %q has no name", hdr.Name)
	}
	if err := x.parents(rel); err != nil {
		return err
	}
	target := filepath.Join(x.root, rel)
	mode := os.FileMode(hdr.Mode & 0o777)
	switch hdr.Typeflag {
	case tar.TypeDir:
		fi, err := os.Lstat(target)
		switch {
		case err == nil && fi.IsDir():
			return nil
		case err == nil && fi.Mode()&os.ModeSymlink != 0:
			return unsafe("entry %q would be written through a symlink", hdr.Name)
		case err == nil:
			return apierr.New(http.StatusConflict, "already_exists", "entry %q: %s exists and is not a directory", hdr.Name, target)
		}
		if err := os.Mkdir(target, 0o700); err != nil {
			return apierr.FromOS(err)
		}
		x.created = append(x.created, target)
		if mode == 0 {
			mode = 0o755 // some tar writers leave directory modes empty
		}
		return apierr.FromOSOrNil(os.Chmod(target, mode))
	case tar.TypeReg, tar.TypeRegA:
		if isSparse(hdr) {
			// A sparse entry's holes are made up by the reader: a few bytes
			// of archive could ask for terabytes of zeros.
			return invalid("entry %q: sparse files are not supported", hdr.Name)
		}
		if err := clear(target, hdr.Name); err != nil {
			return err
		}
		f, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return apierr.FromOS(err)
		}
		x.created = append(x.created, target)
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
		if err := f.Chmod(mode); err != nil {
			f.Close()
			return apierr.FromOS(err)
		}
		if err := f.Close(); err != nil {
			return apierr.FromOS(err)
		}
		_ = os.Chtimes(target, hdr.ModTime, hdr.ModTime)
		x.res.Files++
		return nil
	case tar.TypeSymlink:
		if hdr.Linkname == "" || strings.IndexByte(hdr.Linkname, 0) >= 0 {
			return invalid("symlink %q has a bad target", hdr.Name)
		}
		dest := hdr.Linkname
		if !filepath.IsAbs(dest) {
			dest = filepath.Join(x.absRoot, filepath.Dir(rel), dest)
		}
		if !within(x.absRoot, filepath.Clean(dest)) {
			return unsafe("symlink %q points outside the destination (%s)", hdr.Name, hdr.Linkname)
		}
		if err := clear(target, hdr.Name); err != nil {
			return err
		}
		if err := os.Symlink(hdr.Linkname, target); err != nil {
			return apierr.FromOS(err)
		}
		x.created = append(x.created, target)
		x.res.Files++
		return nil
	case tar.TypeLink:
		srcRel, err := cleanName(hdr.Linkname)
		if err != nil || srcRel == "" {
			return unsafe("hard link %q points outside the destination (%s)", hdr.Name, hdr.Linkname)
		}
		if err := x.parents(srcRel); err != nil {
			return err
		}
		src := filepath.Join(x.root, srcRel)
		fi, err := os.Lstat(src)
		if err != nil {
			return invalid("hard link %q: target %q not in archive", hdr.Name, hdr.Linkname)
		}
		if fi.IsDir() {
			return invalid("hard link %q points to a directory", hdr.Name)
		}
		if err := clear(target, hdr.Name); err != nil {
			return err
		}
		if err := os.Link(src, target); err != nil {
			return apierr.FromOS(err)
		}
		x.created = append(x.created, target)
		x.res.Files++
		return nil
	default:
		// Devices, fifos and the like are skipped: creating them needs
		// privileges and is never what an upload of source code means.
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
