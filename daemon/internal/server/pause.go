package server

import (
	"errors"
	"net/http"
	"time"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/freeze"
)

// A pause where no freezer cgroup is writable (a Kubernetes pod): POST
// /v1/pause stops every process of the sandbox but the daemon (package
// freeze), POST /v1/resume continues them. Meanwhile the daemon serves on,
// but refuses what would start, signal or feed a process (pausedRefuses):
// a process started then would run while the sandbox is paused.

// pauseTimeout bounds how long a pause may take to stop every process.
const pauseTimeout = 10 * time.Second

// pausedRefuses are the routes a paused sandbox answers with 409
// sandbox_paused.
var pausedRefuses = map[string]bool{
	"POST /v1/exec":                  true,
	"POST /v1/exec/stream":           true,
	"POST /v1/processes":             true,
	"DELETE /v1/processes/{id}":      true,
	"POST /v1/processes/{id}/stdin":  true,
	"POST /v1/processes/{id}/signal": true,
	"POST /v1/processes/{id}/resize": true,
	"POST /v1/shells":                true,
	"DELETE /v1/shells/{id}":         true,
	"POST /v1/shells/{id}/run":       true,
	"GET /v1/ports/{id}/connect":     true,
	"POST /v1/checkpoint/prepare":    true,
}

func sandboxPaused() *apierr.Error {
	return apierr.New(http.StatusConflict, "sandbox_paused",
		"the sandbox is paused (POST /v1/pause): resume it first")
}

type pauseResponse struct {
	Processes int `json:"processes"`
}

// pauseProcesses serves POST /v1/pause.
func (s *Server) pauseProcesses(w http.ResponseWriter, r *http.Request, _ string) error {
	n, err := s.freezer.Pause(pauseTimeout)
	var ns *freeze.NotStopped
	if errors.As(err, &ns) {
		return apierr.New(http.StatusConflict, "not_pausable",
			"could not stop every process within %v (a process that forks faster than they are stopped?): pids %v; every process goes on",
			pauseTimeout, ns.Pids)
	}
	if err != nil {
		return apierr.Internal("pausing: %v", err)
	}
	writeJSON(w, http.StatusOK, pauseResponse{n})
	return nil
}

// resumeProcesses serves POST /v1/resume.
func (s *Server) resumeProcesses(w http.ResponseWriter, r *http.Request, _ string) error {
	writeJSON(w, http.StatusOK, pauseResponse{s.freezer.Resume()})
	return nil
}

// Unpause continues a paused sandbox's processes, so that a shutdown's
// SIGTERM reaches them.
func (s *Server) Unpause() { s.freezer.Resume() }
