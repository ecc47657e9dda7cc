package server

import (
	"net/http"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/proc"
)

// ShellCreateRequest is the body of POST /v1/shells.
type ShellCreateRequest struct {
	Shell *string           `json:"shell"`
	Cwd   *string           `json:"cwd"`
	Env   map[string]string `json:"env"`
	User  *string           `json:"user"`
}

type shellArgs struct {
	shell, cwd, user string
	env              map[string]string
}

func parseShellCreate(data []byte) (shellArgs, error) {
	var req ShellCreateRequest
	var a shellArgs
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

// ShellRunRequest is the body of POST /v1/shells/{id}/run.
type ShellRunRequest struct {
	Cmd         *string  `json:"cmd"`
	Timeout     *float64 `json:"timeout"`
	MaxOutput   *int64   `json:"max_output"`
	Encoding    *string  `json:"encoding"`
	MergeStderr *bool    `json:"merge_stderr"`
	OnTimeout   *string  `json:"on_timeout"`
	KillGrace   *float64 `json:"kill_grace"`
}

// What a run in a shell does on timeout.
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

func parseShellRun(data []byte) (runArgs, error) {
	var req ShellRunRequest
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

type shellInfo struct {
	ID    string  `json:"id"`
	Pid   int     `json:"pid"`
	Shell string  `json:"shell"`
	Alive bool    `json:"alive"`
	UID   uint32  `json:"uid"`
	GID   uint32  `json:"gid"`
	User  *string `json:"user"`
}

func shellInfoOf(s *proc.Shell) shellInfo {
	return shellInfo{s.ID, s.Pid, s.Path, s.Alive(), s.Who.UID, s.Who.GID, userName(s.Who)}
}

func (s *Server) shellCreate(w http.ResponseWriter, r *http.Request, _ string) error {
	a, err := readParsed(w, r, parseShellCreate)
	if err != nil {
		return err
	}
	ss, err := s.shells.Start(a.shell, a.cwd, a.env, a.user)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, shellInfoOf(ss))
	return nil
}

type shellList struct {
	Shells []shellInfo `json:"shells"`
}

func (s *Server) shellList(w http.ResponseWriter, r *http.Request, _ string) error {
	out := shellList{Shells: []shellInfo{}}
	for _, ss := range s.shells.List() {
		out.Shells = append(out.Shells, shellInfoOf(ss))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) shellGet(w http.ResponseWriter, r *http.Request, id string) error {
	ss, err := s.shells.Get(id)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, shellInfoOf(ss))
	return nil
}

func (s *Server) shellDelete(w http.ResponseWriter, r *http.Request, id string) error {
	if err := s.shells.Delete(id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

type shellRunResult struct {
	ExitCode        int     `json:"exit_code"`
	Stdout          string  `json:"stdout"`
	Stderr          string  `json:"stderr"`
	TimedOut        bool    `json:"timed_out"`
	Truncated       bool    `json:"truncated"`
	DurationSeconds float64 `json:"duration_seconds"`
	Alive           bool    `json:"alive"`
	Encoding        string  `json:"encoding"`
}

func (s *Server) shellRun(w http.ResponseWriter, r *http.Request, id string) error {
	ss, err := s.shells.Get(id)
	if err != nil {
		return err
	}
	a, err := readParsed(w, r, parseShellRun)
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
	writeJSON(w, http.StatusOK, shellRunResult{
		ExitCode: res.ExitCode, Stdout: encodeOutput(res.Stdout, a.enc), Stderr: encodeOutput(res.Stderr, a.enc),
		TimedOut: res.TimedOut, Truncated: res.Truncated, DurationSeconds: seconds(res.Duration),
		Alive: res.Alive, Encoding: a.enc,
	})
	return nil
}
