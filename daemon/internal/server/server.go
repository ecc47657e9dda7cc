// Package server is the HTTP face of the daemon: routing, auth, request
// decoding, error mapping. The work happens in proc, files and archive.
package server

import (
	"crypto/subtle"
	"errors"
	"log"
	"net/http"
	"os"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/freeze"
	"sandman/daemon/internal/proc"
	"sandman/daemon/internal/reaper"
	"sandman/daemon/spec"
)

// Options configure a Server. New refuses the dangerous empty ones.
type Options struct {
	// Token every request but health must present. Empty is refused unless
	// NoAuth is set: the daemon fails closed.
	Token  string
	NoAuth bool
	// Version is reported by health.
	Version string
	// KillGrace is the default time between SIGTERM and SIGKILL on timeout.
	KillGrace time.Duration
	// Reaper starts and reaps every child; required.
	Reaper *reaper.Reaper
	// Env is the base environment of children (SANDMAND_* already removed).
	Env []string
	// Log receives internal errors; nil discards them.
	Log *log.Logger
	// ChildOOMScoreAdj, when not zero, is written to every child's
	// oom_score_adj, so that under memory pressure the kernel kills the
	// commands rather than the daemon (PID 1: the whole sandbox).
	ChildOOMScoreAdj int
	// Listeners lets POST /v1/checkpoint/prepare stop the serving (and
	// Resume restart it); nil: the daemon refuses to prepare.
	Listeners Listeners
	// ChangesRoot is the tree /v1/changes reads and writes ("/" in a
	// sandbox); empty: those routes refuse (400 invalid_request).
	ChangesRoot string
	// Freezer pauses and resumes the sandbox (POST /v1/pause, /v1/resume);
	// nil: one that stops the daemon's descendants only.
	Freezer *freeze.Freezer
}

// Server implements the v1 protocol.
type Server struct {
	auth      atomic.Pointer[[]byte] // "Bearer <token>"; nil with NoAuth; POST /v1/token replaces it
	version   string
	killGrace time.Duration
	started   time.Time
	log       *log.Logger
	runner    *proc.Runner
	procs     *proc.Manager
	shells    *proc.ShellManager
	tunnels   tunnels
	routes    []route
	conns     conns
	listeners Listeners
	ckptMu    sync.Mutex // one prepare or resume at a time
	quiesced  bool       // prepared for a checkpoint: not serving
	// changesRoot is Options.ChangesRoot.
	changesRoot string
	freezer     *freeze.Freezer
}

// New builds a Server.
func New(o Options) (*Server, error) {
	if o.Token == "" && !o.NoAuth {
		return nil, errors.New("server: empty token (set NoAuth to run without auth)")
	}
	if o.Version == "" {
		return nil, errors.New("server: empty version")
	}
	if o.KillGrace < 0 {
		return nil, errors.New("server: negative kill grace")
	}
	runner, err := proc.NewRunner(o.Reaper, o.Env)
	if err != nil {
		return nil, err
	}
	runner.ChildOOMScoreAdj = o.ChildOOMScoreAdj
	s := &Server{
		version: o.Version, killGrace: o.KillGrace, started: time.Now(), log: o.Log,
		runner: runner, procs: proc.NewManager(runner), shells: proc.NewShellManager(runner),
		listeners: o.Listeners, changesRoot: o.ChangesRoot, freezer: o.Freezer,
	}
	if s.freezer == nil {
		s.freezer = freeze.New(freeze.Options{Self: os.Getpid()})
	}
	if s.log == nil {
		s.log = log.New(discard{}, "", 0)
	}
	if !o.NoAuth {
		auth := []byte("Bearer " + o.Token)
		s.auth.Store(&auth)
	}
	s.routes = []route{
		{"GET", "/v1/health", true, s.health},
		{"GET", "/v1/openapi.json", true, s.openapi},
		{"POST", "/v1/token", false, s.tokenReplace},
		{"POST", "/v1/checkpoint/prepare", false, s.checkpointPrepare},
		{"POST", "/v1/pause", false, s.pauseProcesses},
		{"POST", "/v1/resume", false, s.resumeProcesses},
		{"POST", "/v1/exec", false, s.exec},
		{"POST", "/v1/exec/stream", false, s.execStream},
		{"POST", "/v1/processes", false, s.processStart},
		{"GET", "/v1/processes", false, s.processList},
		{"GET", "/v1/processes/{id}", false, s.processGet},
		{"DELETE", "/v1/processes/{id}", false, s.processDelete},
		{"GET", "/v1/processes/{id}/output", false, s.processOutput},
		{"POST", "/v1/processes/{id}/stdin", false, s.processStdin},
		{"POST", "/v1/processes/{id}/signal", false, s.processSignal},
		{"POST", "/v1/processes/{id}/wait", false, s.processWait},
		{"POST", "/v1/processes/{id}/resize", false, s.processResize},
		{"POST", "/v1/shells", false, s.shellCreate},
		{"GET", "/v1/shells", false, s.shellList},
		{"GET", "/v1/shells/{id}", false, s.shellGet},
		{"DELETE", "/v1/shells/{id}", false, s.shellDelete},
		{"POST", "/v1/shells/{id}/run", false, s.shellRun},
		{"GET", "/v1/files", false, s.fileRead},
		{"PUT", "/v1/files", false, s.fileWrite},
		{"DELETE", "/v1/files", false, s.fileDelete},
		{"GET", "/v1/files/stat", false, s.fileStat},
		{"GET", "/v1/files/list", false, s.fileList},
		{"POST", "/v1/files/mkdir", false, s.fileMkdir},
		{"POST", "/v1/files/move", false, s.fileMove},
		{"PUT", "/v1/archive", false, s.archiveUpload},
		{"GET", "/v1/archive", false, s.archiveDownload},
		{"GET", "/v1/changes", false, s.changesDownload},
		{"PUT", "/v1/changes", false, s.changesApply},
		{"GET", "/v1/ports/{id}/connect", false, s.portConnect},
	}
	return s, nil
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// ServeHTTP routes, authenticates and turns handler errors and panics into
// protocol errors.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			s.log.Printf("panic serving %s %s: %v\n%s", r.Method, r.URL.Path, v, debug.Stack())
			writeError(w, apierr.Internal("internal error"))
		}
	}()
	rt, id, err := s.find(r.Method, r.URL.Path)
	if err != nil {
		if id != "" { // the Allow list of a 405
			w.Header().Set("Allow", id)
		}
		writeError(w, err)
		return
	}
	if auth := s.auth.Load(); !rt.public && auth != nil &&
		subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), *auth) != 1 {
		writeError(w, apierr.New(http.StatusUnauthorized, "unauthorized", "missing or wrong bearer token"))
		return
	}
	if pausedRefuses[rt.method+" "+rt.pattern] && s.freezer.Paused() {
		writeError(w, sandboxPaused())
		return
	}
	if err := rt.h(w, r, id); err != nil {
		var ae *apierr.Error
		if errors.As(err, &ae) && ae.Status == http.StatusInternalServerError || !errors.As(err, &ae) {
			s.log.Printf("%s %s: %v", r.Method, r.URL.Path, err)
		}
		writeError(w, err)
	}
}

type healthResponse struct {
	Status        string  `json:"status"`
	Version       string  `json:"version"`
	Protocol      string  `json:"protocol"`
	Pid           int     `json:"pid"`
	UptimeSeconds float64 `json:"uptime_seconds"`
}

func (s *Server) health(w http.ResponseWriter, r *http.Request, _ string) error {
	writeJSON(w, http.StatusOK, healthResponse{"ok", s.version, "v1", os.Getpid(), time.Since(s.started).Seconds()})
	return nil
}

func (s *Server) openapi(w http.ResponseWriter, r *http.Request, _ string) error {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(spec.JSON)
	return nil
}
