package server

import (
	"net/http"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/proc"
)

// SessionCreateRequest is the body of POST /v1/sessions.
type SessionCreateRequest struct {
	Shell *string           `json:"shell"`
	Cwd   *string           `json:"cwd"`
	Env   map[string]string `json:"env"`
	User  *string           `json:"user"`
}

type sessionArgs struct {
	shell, cwd, user string
	env              map[string]string
}

func parseSessionCreate(data []byte) (sessionArgs, error) {
	var req SessionCreateRequest
	var a sessionArgs
	if err := decodeJSON(data, &req); err != nil {
		return a, err
	}
	if req.Shell != nil {
		if err := checkPath("shell", *req.Shell); err != nil {
			return a, err
		}
		a.shell = *req.Shell
	}
	if req.Cwd != nil {
		if err := checkPath("cwd", *req.Cwd); err != nil {
			return a, err
		}
		a.cwd = *req.Cwd
	}
	if req.User != nil {
		if err := proc.CheckUserSpec(*req.User); err != nil {
			return a, err
		}
		a.user = *req.User
	}
	a.env = req.Env
	return a, checkEnv(req.Env)
}

// SessionRunRequest is the body of POST /v1/sessions/{id}/run.
type SessionRunRequest struct {
	Cmd         *string  `json:"cmd"`
	Timeout     *float64 `json:"timeout"`
	MaxOutput   *int64   `json:"max_output"`
	Encoding    *string  `json:"encoding"`
	MergeStderr *bool    `json:"merge_stderr"`
	OnTimeout   *string  `json:"on_timeout"`
	KillGrace   *float64 `json:"kill_grace"`
}

// What a session run does on timeout.
const (
	onTimeoutKill      = "kill"
	onTimeoutInterrupt = "interrupt"
)

type runArgs struct {
	cmd       string
	timeout   float64
	maxOutput int
	enc       string
	merge     bool
	interrupt bool
	killGrace *float64 // nil: the daemon's --kill-grace
}

func parseSessionRun(data []byte) (runArgs, error) {
	var req SessionRunRequest
	var a runArgs
	if err := decodeJSON(data, &req); err != nil {
		return a, err
	}
	if req.Cmd == nil {
		return a, apierr.InvalidRequest("cmd is required")
	}
	if hasNUL(*req.Cmd) {
		return a, apierr.InvalidRequest("cmd contains NUL")
	}
	a.cmd = *req.Cmd
	var err error
	if _, err = duration("timeout", req.Timeout, true); err != nil {
		return a, err
	}
	if req.Timeout != nil {
		a.timeout = *req.Timeout
	}
	if _, err = duration("kill_grace", req.KillGrace, false); err != nil {
		return a, err
	}
	a.killGrace = req.KillGrace
	if a.maxOutput, err = nonNegative("max_output", req.MaxOutput, defaultMaxOutput); err != nil {
		return a, err
	}
	a.merge = req.MergeStderr != nil && *req.MergeStderr
	if req.OnTimeout != nil {
		switch *req.OnTimeout {
		case onTimeoutKill:
		case onTimeoutInterrupt:
			a.interrupt = true
		default:
			return a, apierr.InvalidRequest("on_timeout must be %q or %q", onTimeoutKill, onTimeoutInterrupt)
		}
	}
	a.enc, err = encoding(req.Encoding)
	return a, err
}

type sessionInfo struct {
	ID    string  `json:"id"`
	Pid   int     `json:"pid"`
	Shell string  `json:"shell"`
	Alive bool    `json:"alive"`
	UID   uint32  `json:"uid"`
	GID   uint32  `json:"gid"`
	User  *string `json:"user"`
}

func sessionInfoOf(s *proc.Session) sessionInfo {
	return sessionInfo{s.ID, s.Pid, s.Shell, s.Alive(), s.Who.UID, s.Who.GID, userName(s.Who)}
}

func (s *Server) sessionCreate(w http.ResponseWriter, r *http.Request, _ string) error {
	a, err := readParsed(w, r, parseSessionCreate)
	if err != nil {
		return err
	}
	ss, err := s.sessions.Start(a.shell, a.cwd, a.env, a.user)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, sessionInfoOf(ss))
	return nil
}

type sessionList struct {
	Sessions []sessionInfo `json:"sessions"`
}

func (s *Server) sessionList(w http.ResponseWriter, r *http.Request, _ string) error {
	out := sessionList{Sessions: []sessionInfo{}}
	for _, ss := range s.sessions.List() {
		out.Sessions = append(out.Sessions, sessionInfoOf(ss))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) sessionGet(w http.ResponseWriter, r *http.Request, id string) error {
	ss, err := s.sessions.Get(id)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, sessionInfoOf(ss))
	return nil
}

func (s *Server) sessionDelete(w http.ResponseWriter, r *http.Request, id string) error {
	if err := s.sessions.Delete(id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

type sessionRunResult struct {
	ExitCode        int     `json:"exit_code"`
	Stdout          string  `json:"stdout"`
	Stderr          string  `json:"stderr"`
	TimedOut        bool    `json:"timed_out"`
	Truncated       bool    `json:"truncated"`
	DurationSeconds float64 `json:"duration_seconds"`
	Alive           bool    `json:"alive"`
	Encoding        string  `json:"encoding"`
}

func (s *Server) sessionRun(w http.ResponseWriter, r *http.Request, id string) error {
	ss, err := s.sessions.Get(id)
	if err != nil {
		return err
	}
	a, err := readParsed(w, r, parseSessionRun)
	if err != nil {
		return err
	}
	timeout, _ := duration("timeout", &a.timeout, false)
	grace := s.killGrace
	if a.killGrace != nil {
		grace, _ = duration("kill_grace", a.killGrace, false)
	}
	res, err := ss.Run(r.Context(), proc.RunOptions{
		Cmd: a.cmd, Timeout: timeout, MaxOutput: a.maxOutput,
		MergeStderr: a.merge, Interrupt: a.interrupt, Grace: grace,
	})
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, sessionRunResult{
		ExitCode: res.ExitCode, Stdout: encodeOutput(res.Stdout, a.enc), Stderr: encodeOutput(res.Stderr, a.enc),
		TimedOut: res.TimedOut, Truncated: res.Truncated, DurationSeconds: seconds(res.Duration),
		Alive: res.Alive, Encoding: a.enc,
	})
	return nil
}
