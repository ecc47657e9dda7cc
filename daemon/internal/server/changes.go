package server

import (
	"net/http"
	"time"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/archive"
)

// Snapshots of a sandbox's files where the host cannot reach its writable
// layer (Kubernetes): GET /v1/changes streams what changed since the daemon
// started, PUT /v1/changes applies such a stream to a new sandbox of the
// same image (see PROTOCOL.md and archive.WriteChanges).

// changesMargin moves the start a little back: a file's ctime comes from the
// kernel's coarse clock, which may lag the daemon's reading of the time by a
// tick. Nothing but the daemon runs in the sandbox before it serves, so
// nothing else is caught by it (but what the runtime made just before, which
// a new sandbox of the image gets from its own runtime anyway).
const changesMargin = 50 * time.Millisecond

type changesResult struct {
	Files   int   `json:"files"`
	Bytes   int64 `json:"bytes"`
	Removed int   `json:"removed"`
}

// changesExcluded is what no change may name: the mount points below the
// root (an unreadable mount table leaves only the device check) and the
// daemon's own directory.
func (s *Server) changesExcluded() map[string]bool {
	excluded, err := archive.MountPoints(s.changesRoot)
	if err != nil {
		s.log.Printf("reading the mount table: %v (only directories on another device are left out)", err)
		excluded = map[string]bool{}
	}
	excluded[archive.DaemonDir] = true
	return excluded
}

func (s *Server) checkChangesRoot() error {
	if s.changesRoot == "" {
		return apierr.InvalidRequest("this daemon keeps no changes (started without a root to walk)")
	}
	return nil
}

// firstByte sends the 200 with the first byte of the body, so that an error
// found before any (the root cannot be opened) is still an error answer.
type firstByte struct {
	w    http.ResponseWriter
	sent bool
}

func (f *firstByte) Write(p []byte) (int, error) {
	if !f.sent {
		f.sent = true
		f.w.Header().Set("Content-Type", "application/x-tar")
		f.w.WriteHeader(http.StatusOK)
	}
	return f.w.Write(p)
}

func (s *Server) changesDownload(w http.ResponseWriter, r *http.Request, _ string) error {
	if err := s.checkChangesRoot(); err != nil {
		return err
	}
	out := &firstByte{w: w}
	stats, err := archive.WriteChanges(out, s.changesRoot, s.started.Add(-changesMargin), s.changesExcluded())
	if err != nil {
		if !out.sent {
			return err
		}
		s.log.Printf("changes cut short after %d entries: %v", stats.Entries, err)
		return nil
	}
	if !out.sent { // nothing changed, not even the root: an empty archive is still one
		_, _ = out.Write(nil)
	}
	return nil
}

func (s *Server) changesApply(w http.ResponseWriter, r *http.Request, _ string) error {
	if err := s.checkChangesRoot(); err != nil {
		return err
	}
	res, err := archive.ExtractWith(s.changesRoot, r.Body, archive.Options{
		Faithful: true, OneFilesystem: true, Prune: true, Excluded: s.changesExcluded(),
	})
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, changesResult{res.Files, res.Bytes, res.Removed})
	return nil
}
