package server

import (
	"io"
	"net/http"
	"strconv"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/files"
)

type fileStat struct {
	Path       string  `json:"path"`
	Name       string  `json:"name"`
	Type       string  `json:"type"`
	Size       int64   `json:"size"`
	Mode       string  `json:"mode"`
	Mtime      float64 `json:"mtime"`
	LinkTarget *string `json:"link_target"`
}

func statJSON(s *files.Stat) fileStat {
	return fileStat{s.Path, s.Name, s.Type, s.Size, s.Mode, s.Mtime, s.LinkTarget}
}

func (s *Server) fileRead(w http.ResponseWriter, r *http.Request, _ string) error {
	p, err := queryPath(r)
	if err != nil {
		return err
	}
	limit, err := queryMaxBytes(r)
	if err != nil {
		return err
	}
	f, fi, err := files.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	size := fi.Size()
	if limit >= 0 && size > limit {
		return apierr.New(http.StatusRequestEntityTooLarge, "file_too_large",
			"%s has %d bytes, more than max_bytes=%d", p, size, limit)
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	// procfs and sysfs files say size 0 but have content: stream those.
	if size > 0 {
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		w.WriteHeader(http.StatusOK)
		// A file that grew since the stat must not overrun the declared length.
		_, _ = io.CopyN(w, f, size)
		return nil
	}
	w.WriteHeader(http.StatusOK)
	if limit >= 0 {
		// One byte past the limit tells the client the file was larger; the
		// daemon stops there instead of streaming whatever the file yields.
		_, _ = io.CopyN(w, f, limit+1)
		return nil
	}
	_, _ = io.Copy(w, f)
	return nil
}

// queryMaxBytes is the optional ?max_bytes= of a read; -1 when absent.
func queryMaxBytes(r *http.Request) (int64, error) {
	v := r.URL.Query().Get("max_bytes")
	if v == "" {
		return -1, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, apierr.InvalidRequest("query parameter max_bytes: %q is not a number >= 0", v)
	}
	return n, nil
}

func (s *Server) fileWrite(w http.ResponseWriter, r *http.Request, _ string) error {
	p, err := queryPath(r)
	if err != nil {
		return err
	}
	mode, hasMode, err := queryMode(r)
	if err != nil {
		return err
	}
	parents, err := queryBool(r, "parents", true)
	if err != nil {
		return err
	}
	var mp *uint32
	if hasMode {
		mp = &mode
	}
	st, err := files.Write(p, r.Body, mp, parents)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, statJSON(st))
	return nil
}

func (s *Server) fileDelete(w http.ResponseWriter, r *http.Request, _ string) error {
	p, err := queryPath(r)
	if err != nil {
		return err
	}
	recursive, err := queryBool(r, "recursive", false)
	if err != nil {
		return err
	}
	if err := files.Remove(p, recursive); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) fileStat(w http.ResponseWriter, r *http.Request, _ string) error {
	p, err := queryPath(r)
	if err != nil {
		return err
	}
	st, err := files.StatPath(p)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, statJSON(st))
	return nil
}

type fileList struct {
	Entries []fileStat `json:"entries"`
}

func (s *Server) fileList(w http.ResponseWriter, r *http.Request, _ string) error {
	p, err := queryPath(r)
	if err != nil {
		return err
	}
	entries, err := files.List(p)
	if err != nil {
		return err
	}
	out := fileList{Entries: make([]fileStat, 0, len(entries))}
	for _, e := range entries {
		out.Entries = append(out.Entries, statJSON(e))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// MkdirRequest is the body of POST /v1/files/mkdir.
type MkdirRequest struct {
	Path    *string `json:"path"`
	Parents *bool   `json:"parents"`
	Mode    *string `json:"mode"`
}

type mkdirArgs struct {
	path    string
	parents bool
	mode    uint32
}

func parseMkdir(data []byte) (mkdirArgs, error) {
	var req MkdirRequest
	a := mkdirArgs{mode: 0o755}
	if err := decodeJSON(data, &req); err != nil {
		return a, err
	}
	if req.Path == nil {
		return a, checkPath("path", "")
	}
	if err := checkPath("path", *req.Path); err != nil {
		return a, err
	}
	a.path = *req.Path
	a.parents = req.Parents != nil && *req.Parents
	if req.Mode != nil {
		m, err := parseMode(*req.Mode)
		if err != nil {
			return a, err
		}
		a.mode = m
	}
	return a, nil
}

func (s *Server) fileMkdir(w http.ResponseWriter, r *http.Request, _ string) error {
	a, err := readParsed(w, r, parseMkdir)
	if err != nil {
		return err
	}
	st, err := files.Mkdir(a.path, a.parents, a.mode)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, statJSON(st))
	return nil
}

// MoveRequest is the body of POST /v1/files/move.
type MoveRequest struct {
	Src       *string `json:"src"`
	Dst       *string `json:"dst"`
	Overwrite *bool   `json:"overwrite"`
}

func parseMove(data []byte) (src, dst string, overwrite bool, err error) {
	var req MoveRequest
	if err := decodeJSON(data, &req); err != nil {
		return "", "", false, err
	}
	if req.Src == nil || req.Dst == nil {
		return "", "", false, checkPath("src and dst", "")
	}
	if err := checkPath("src", *req.Src); err != nil {
		return "", "", false, err
	}
	if err := checkPath("dst", *req.Dst); err != nil {
		return "", "", false, err
	}
	return *req.Src, *req.Dst, req.Overwrite != nil && *req.Overwrite, nil
}

func (s *Server) fileMove(w http.ResponseWriter, r *http.Request, _ string) error {
	body, err := readBody(w, r)
	if err != nil {
		return err
	}
	src, dst, overwrite, err := parseMove(body)
	if err != nil {
		return err
	}
	st, err := files.Move(src, dst, overwrite)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, statJSON(st))
	return nil
}
