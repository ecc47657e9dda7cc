package server

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
	"unicode/utf8"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/proc"
)

// defaultMaxOutput is the bytes kept per stream when max_output is absent.
const defaultMaxOutput = 1 << 20

// commandFields are the fields shared by exec and process start.
type commandFields struct {
	Argv        []string          `json:"argv"`
	Cmd         *string           `json:"cmd"`
	Shell       *string           `json:"shell"`
	Cwd         *string           `json:"cwd"`
	Env         map[string]string `json:"env"`
	User        *string           `json:"user"`
	MergeStderr *bool             `json:"merge_stderr"`
}

func (f *commandFields) command() (*proc.Command, error) {
	c := &proc.Command{Argv: f.Argv, Cmd: f.Cmd, Env: f.Env, MergeStderr: f.MergeStderr != nil && *f.MergeStderr}
	if f.User != nil {
		if err := proc.CheckUserSpec(*f.User); err != nil {
			return nil, err
		}
		c.User = *f.User
	}
	switch {
	case f.Argv != nil && f.Cmd != nil:
		return nil, apierr.InvalidRequest("give argv or cmd, not both")
	case f.Argv == nil && f.Cmd == nil:
		return nil, apierr.InvalidRequest("argv or cmd is required")
	case f.Argv != nil && len(f.Argv) == 0:
		return nil, apierr.InvalidRequest("argv is empty")
	case f.Shell != nil && f.Cmd == nil:
		return nil, apierr.InvalidRequest("shell goes with cmd only")
	}
	for _, a := range f.Argv {
		if hasNUL(a) {
			return nil, apierr.InvalidRequest("argv contains NUL")
		}
	}
	if f.Cmd != nil && hasNUL(*f.Cmd) {
		return nil, apierr.InvalidRequest("cmd contains NUL")
	}
	if f.Shell != nil {
		if err := checkPath("shell", *f.Shell); err != nil {
			return nil, err
		}
		c.Shell = *f.Shell
	}
	if f.Cwd != nil {
		if err := checkPath("cwd", *f.Cwd); err != nil {
			return nil, err
		}
		c.Dir = *f.Cwd
	}
	if err := checkEnv(f.Env); err != nil {
		return nil, err
	}
	return c, nil
}

func checkEnv(env map[string]string) error {
	for k, v := range env {
		if k == "" || hasNUL(k) || hasNUL(v) || containsByte(k, '=') {
			return apierr.InvalidRequest("bad env entry %q", k)
		}
	}
	return nil
}

func containsByte(s string, b byte) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == b {
			return true
		}
	}
	return false
}

// ExecRequest is the body of POST /v1/exec and /v1/exec/stream.
type ExecRequest struct {
	commandFields
	Stdin         *string  `json:"stdin"`
	StdinEncoding *string  `json:"stdin_encoding"`
	Timeout       *float64 `json:"timeout"`
	KillGrace     *float64 `json:"kill_grace"`
	MaxOutput     *int64   `json:"max_output"`
	Encoding      *string  `json:"encoding"`
}

// parseExec validates an exec request; shared with the fuzz target.
func (s *Server) parseExec(data []byte) (*proc.Command, proc.ExecOptions, string, error) {
	var req ExecRequest
	var o proc.ExecOptions
	if err := decodeJSON(data, &req); err != nil {
		return nil, o, "", err
	}
	c, err := req.command()
	if err != nil {
		return nil, o, "", err
	}
	enc, err := encoding(req.Encoding)
	if err != nil {
		return nil, o, "", err
	}
	if o.Stdin, err = stdinOf(req.Stdin, req.StdinEncoding); err != nil {
		return nil, o, "", err
	}
	if o.Timeout, err = duration("timeout", req.Timeout, true); err != nil {
		return nil, o, "", err
	}
	o.KillGrace = s.killGrace
	if req.KillGrace != nil {
		if o.KillGrace, err = duration("kill_grace", req.KillGrace, false); err != nil {
			return nil, o, "", err
		}
	}
	if o.MaxOutput, err = nonNegative("max_output", req.MaxOutput, defaultMaxOutput); err != nil {
		return nil, o, "", err
	}
	return c, o, enc, nil
}

// stdinOf decodes stdin as its encoding says: utf-8 (the JSON string's own
// text, the default) or base64 (any bytes).
func stdinOf(data, enc *string) (*string, error) {
	e, err := encoding(enc)
	if err != nil {
		return nil, apierr.InvalidRequest("stdin_encoding must be %q or %q", encUTF8, encBase64)
	}
	if data == nil || e == encUTF8 {
		return data, nil
	}
	raw, err := base64.StdEncoding.DecodeString(*data)
	if err != nil {
		return nil, apierr.InvalidRequest("stdin is not valid base64: %v", err)
	}
	s := string(raw)
	return &s, nil
}

type execResult struct {
	ExitCode        int     `json:"exit_code"`
	Signal          *string `json:"signal"`
	Stdout          string  `json:"stdout"`
	Stderr          string  `json:"stderr"`
	TimedOut        bool    `json:"timed_out"`
	Truncated       bool    `json:"truncated"`
	DurationSeconds float64 `json:"duration_seconds"`
	Encoding        string  `json:"encoding"`
}

func signalPtr(e proc.Exit) *string {
	if e.Signal == "" {
		return nil
	}
	s := e.Signal
	return &s
}

func (s *Server) exec(w http.ResponseWriter, r *http.Request, _ string) error {
	body, err := readBody(w, r)
	if err != nil {
		return err
	}
	c, o, enc, err := s.parseExec(body)
	if err != nil {
		return err
	}
	res, err := s.runner.Exec(r.Context(), c, o)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, execResult{
		ExitCode: res.Code, Signal: signalPtr(res.Exit),
		Stdout: encodeOutput(res.Stdout, enc), Stderr: encodeOutput(res.Stderr, enc),
		TimedOut: res.TimedOut, Truncated: res.Truncated,
		DurationSeconds: seconds(res.Duration), Encoding: enc,
	})
	return nil
}

type outputEvent struct {
	Event string `json:"event"`
	Data  string `json:"data"`
}

type exitEvent struct {
	Event           string  `json:"event"`
	ExitCode        int     `json:"exit_code"`
	Signal          *string `json:"signal"`
	TimedOut        bool    `json:"timed_out"`
	Truncated       bool    `json:"truncated"`
	DurationSeconds float64 `json:"duration_seconds"`
}

// utf8Tail is how many trailing bytes of b begin a rune that is not complete
// yet; they are held back so a chunk boundary never yields U+FFFD.
func utf8Tail(b []byte) int {
	for i := 1; i <= 3 && i <= len(b); i++ {
		c := b[len(b)-i]
		if c < 0x80 {
			return 0
		}
		if c >= 0xC0 {
			if utf8.FullRune(b[len(b)-i:]) {
				return 0
			}
			return i
		}
	}
	return 0
}

func (s *Server) execStream(w http.ResponseWriter, r *http.Request, _ string) error {
	body, err := readBody(w, r)
	if err != nil {
		return err
	}
	c, o, enc, err := s.parseExec(body)
	if err != nil {
		return err
	}
	flusher, _ := w.(http.Flusher)
	write := func(v any) error {
		line, _ := json.Marshal(v)
		line = append(line, '\n')
		if _, err := w.Write(line); err != nil {
			return err
		}
		if flusher != nil {
			flusher.Flush()
		}
		return nil
	}
	o.Started = func() {
		w.Header().Set("Content-Type", "application/x-ndjson")
		w.WriteHeader(http.StatusOK)
		if flusher != nil {
			flusher.Flush()
		}
	}
	var carry [3][]byte // held-back partial runes, per stream
	names := [3]string{"", "stdout", "stderr"}
	emit := func(stream int, data []byte) error {
		if enc == encUTF8 {
			data = append(carry[stream], data...)
			n := utf8Tail(data)
			carry[stream] = append([]byte(nil), data[len(data)-n:]...)
			data = data[:len(data)-n]
			if len(data) == 0 {
				return nil
			}
		}
		return write(outputEvent{names[stream], encodeOutput(data, enc)})
	}
	res, err := s.runner.ExecStream(r.Context(), c, o, emit)
	if err != nil {
		return err // nothing was written yet: a plain JSON error
	}
	for st := proc.Stdout; st <= proc.Stderr; st++ {
		if len(carry[st]) > 0 {
			_ = write(outputEvent{names[st], encodeOutput(carry[st], enc)})
		}
	}
	_ = write(exitEvent{"exit", res.Code, signalPtr(res.Exit), res.TimedOut, res.Truncated, seconds(res.Duration)})
	return nil
}
