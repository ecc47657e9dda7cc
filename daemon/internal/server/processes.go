package server

import (
	"encoding/json"
	"net/http"
	"syscall"
	"time"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/proc"
)

// defaultMaxBuffer is the output retained per stream of a background process.
const defaultMaxBuffer = 8 << 20

// maxOutputWait caps the long-poll of GET .../output.
const maxOutputWait = 60

// ProcessStartRequest is the body of POST /v1/processes.
type ProcessStartRequest struct {
	commandFields
	Stdin     *bool  `json:"stdin"`
	MaxBuffer *int64 `json:"max_buffer"`
	TTY       *bool  `json:"tty"`
	Rows      *int64 `json:"rows"`
	Cols      *int64 `json:"cols"`
}

func parseProcessStart(data []byte) (*proc.Command, proc.ProcessOptions, error) {
	var req ProcessStartRequest
	var o proc.ProcessOptions
	if err := decodeJSON(data, &req); err != nil {
		return nil, o, err
	}
	c, err := req.command()
	if err != nil {
		return nil, o, err
	}
	o.Stdin = req.Stdin != nil && *req.Stdin
	if o.MaxBuffer, err = nonNegative("max_buffer", req.MaxBuffer, defaultMaxBuffer); err != nil {
		return nil, o, err
	}
	if o.TTY, o.Size, err = parseTTY(req.TTY, req.Rows, req.Cols); err != nil {
		return nil, o, err
	}
	return c, o, nil
}

type processInfo struct {
	ID        string   `json:"id"`
	Pid       int      `json:"pid"`
	Argv      []string `json:"argv"`
	Cmd       *string  `json:"cmd"`
	Running   bool     `json:"running"`
	ExitCode  *int     `json:"exit_code"`
	Signal    *string  `json:"signal"`
	StartedAt float64  `json:"started_at"`
	EndedAt   *float64 `json:"ended_at"`
	StdinOpen bool     `json:"stdin_open"`
	TTY       bool     `json:"tty"`
	UID       uint32   `json:"uid"`
	GID       uint32   `json:"gid"`
	User      *string  `json:"user"`
}

// userName is a passwd name for JSON: null when passwd lists none.
func userName(w proc.Who) *string {
	if w.Name == "" {
		return nil
	}
	return &w.Name
}

func infoOf(p *proc.Process) processInfo {
	i := p.Info()
	out := processInfo{ID: i.ID, Pid: i.Pid, Argv: i.Argv, Cmd: i.Cmd, Running: i.Running,
		StartedAt: unixSeconds(i.StartedAt), StdinOpen: i.StdinOpen, TTY: i.TTY,
		UID: i.Who.UID, GID: i.Who.GID, User: userName(i.Who)}
	if i.Exit != nil {
		code := i.Exit.Code
		out.ExitCode, out.Signal = &code, signalPtr(*i.Exit)
		end := unixSeconds(*i.EndedAt)
		out.EndedAt = &end
	}
	return out
}

func (s *Server) processStart(w http.ResponseWriter, r *http.Request, _ string) error {
	body, err := readBody(w, r)
	if err != nil {
		return err
	}
	c, o, err := parseProcessStart(body)
	if err != nil {
		return err
	}
	p, err := s.procs.Start(c, o)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, infoOf(p))
	return nil
}

type processList struct {
	Processes []processInfo `json:"processes"`
}

func (s *Server) processList(w http.ResponseWriter, r *http.Request, _ string) error {
	out := processList{Processes: []processInfo{}}
	for _, p := range s.procs.List() {
		out.Processes = append(out.Processes, infoOf(p))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) processGet(w http.ResponseWriter, r *http.Request, id string) error {
	p, err := s.procs.Get(id)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, infoOf(p))
	return nil
}

func (s *Server) processDelete(w http.ResponseWriter, r *http.Request, id string) error {
	if err := s.procs.Delete(id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

type processOutput struct {
	Stdout           string  `json:"stdout"`
	Stderr           string  `json:"stderr"`
	StdoutOffset     int64   `json:"stdout_offset"`
	StderrOffset     int64   `json:"stderr_offset"`
	StdoutNextOffset int64   `json:"stdout_next_offset"`
	StderrNextOffset int64   `json:"stderr_next_offset"`
	Running          bool    `json:"running"`
	ExitCode         *int    `json:"exit_code"`
	Signal           *string `json:"signal"`
	Encoding         string  `json:"encoding"`
}

func (s *Server) processOutput(w http.ResponseWriter, r *http.Request, id string) error {
	p, err := s.procs.Get(id)
	if err != nil {
		return err
	}
	outOff, err := queryOffset(r, "stdout_offset")
	if err != nil {
		return err
	}
	errOff, err := queryOffset(r, "stderr_offset")
	if err != nil {
		return err
	}
	enc, err := queryEncoding(r)
	if err != nil {
		return err
	}
	wait, err := querySeconds(r, "wait", maxOutputWait)
	if err != nil {
		return err
	}
	o := p.Output(r.Context(), outOff, errOff, time.Duration(wait*float64(time.Second)))
	if enc == encUTF8 && o.Running {
		// Hold back a rune cut in half; the next read starts at its first byte.
		n := utf8Tail(o.Stdout)
		o.Stdout, o.StdoutNext = o.Stdout[:len(o.Stdout)-n], o.StdoutNext-int64(n)
		n = utf8Tail(o.Stderr)
		o.Stderr, o.StderrNext = o.Stderr[:len(o.Stderr)-n], o.StderrNext-int64(n)
	}
	out := processOutput{
		Stdout: encodeOutput(o.Stdout, enc), Stderr: encodeOutput(o.Stderr, enc),
		StdoutOffset: o.StdoutOffset, StderrOffset: o.StderrOffset,
		StdoutNextOffset: o.StdoutNext, StderrNextOffset: o.StderrNext,
		Running: o.Running, Encoding: enc,
	}
	if o.Exit != nil {
		code := o.Exit.Code
		out.ExitCode, out.Signal = &code, signalPtr(*o.Exit)
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) processStdin(w http.ResponseWriter, r *http.Request, id string) error {
	p, err := s.procs.Get(id)
	if err != nil {
		return err
	}
	closeAfter, err := queryBool(r, "close", false)
	if err != nil {
		return err
	}
	if err := p.WriteStdin(r.Context(), r.Body, closeAfter); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// SignalRequest is the body of POST /v1/processes/{id}/signal.
type SignalRequest struct {
	Signal json.RawMessage `json:"signal"`
	Group  *bool           `json:"group"`
}

func parseSignal(data []byte) (syscall.Signal, bool, error) {
	var req SignalRequest
	if err := decodeJSON(data, &req); err != nil {
		return 0, false, err
	}
	if len(req.Signal) == 0 || string(req.Signal) == "null" {
		return 0, false, apierr.InvalidRequest("signal is required")
	}
	var name string
	if err := json.Unmarshal(req.Signal, &name); err != nil {
		var n json.Number
		if json.Unmarshal(req.Signal, &n) != nil {
			return 0, false, apierr.InvalidRequest("signal must be a name or a number")
		}
		name = n.String()
	}
	sig, ok := proc.ParseSignal(name)
	if !ok {
		return 0, false, apierr.InvalidRequest("unknown signal %q", name)
	}
	return sig, req.Group == nil || *req.Group, nil
}

func (s *Server) processSignal(w http.ResponseWriter, r *http.Request, id string) error {
	p, err := s.procs.Get(id)
	if err != nil {
		return err
	}
	body, err := readBody(w, r)
	if err != nil {
		return err
	}
	sig, group, err := parseSignal(body)
	if err != nil {
		return err
	}
	if err := p.Signal(sig, group); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, infoOf(p))
	return nil
}

// WaitRequest is the body of POST /v1/processes/{id}/wait.
type WaitRequest struct {
	Timeout *float64 `json:"timeout"`
}

func parseWait(data []byte) (time.Duration, error) {
	var req WaitRequest
	if err := decodeJSON(data, &req); err != nil {
		return 0, err
	}
	if req.Timeout != nil && *req.Timeout == 0 {
		return -1, nil // poll: do not block at all
	}
	return duration("timeout", req.Timeout, false)
}

func (s *Server) processWait(w http.ResponseWriter, r *http.Request, id string) error {
	p, err := s.procs.Get(id)
	if err != nil {
		return err
	}
	timeout, err := readParsed(w, r, parseWait)
	if err != nil {
		return err
	}
	if timeout >= 0 {
		p.Wait(r.Context(), timeout)
	}
	writeJSON(w, http.StatusOK, infoOf(p))
	return nil
}
