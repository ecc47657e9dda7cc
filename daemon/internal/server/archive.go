package server

import (
	"net/http"

	"sandman/daemon/internal/archive"
)

type archiveResult struct {
	Path  string `json:"path"`
	Files int    `json:"files"`
	Bytes int64  `json:"bytes"`
}

func (s *Server) archiveUpload(w http.ResponseWriter, r *http.Request, _ string) error {
	p, err := queryPath(r)
	if err != nil {
		return err
	}
	res, err := archive.Extract(p, r.Body)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, archiveResult{p, res.Files, res.Bytes})
	return nil
}

func (s *Server) archiveDownload(w http.ResponseWriter, r *http.Request, _ string) error {
	p, err := queryPath(r)
	if err != nil {
		return err
	}
	gz, err := queryBool(r, "gzip", false)
	if err != nil {
		return err
	}
	if err := archive.Check(p); err != nil {
		return err
	}
	ct := "application/x-tar"
	if gz {
		ct = "application/gzip"
	}
	w.Header().Set("Content-Type", ct)
	w.WriteHeader(http.StatusOK)
	if err := archive.Write(w, p, gz); err != nil {
		s.log.Printf("archive of %s cut short: %v", p, err)
	}
	return nil
}
