package server

import (
	"errors"
	"strings"
	"testing"
	"time"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/proc"
)

var seeds = []string{
	`{"argv":["echo","hi"],"cwd":"/tmp","env":{"A":"B"},"timeout":1.5,"kill_grace":0,"max_output":10,"encoding":"base64","stdin":"x"}`,
	`{"cmd":"ls | wc -l","shell":"/bin/sh","stdin":true,"max_buffer":5}`,
	`{"cmd":"x","timeout":1e308}`, `{"signal":"TERM","group":false}`, `{"signal":9}`, `{"timeout":null}`,
	`{"path":"/x","parents":true,"mode":"755"}`, `{"src":"a","dst":"b","overwrite":true}`,
	`{"shell":"/bin/sh","cwd":"/","env":{}}`, `[]`, `{`, ``, `null`, `{"argv":null,"cmd":null}`,
	`{"argv":["sh"],"tty":true,"rows":30,"cols":100}`, `{"rows":65535,"cols":1}`,
	`{"argv":["cat"],"stdin":"AP8=","stdin_encoding":"base64","user":"agent:staff","merge_stderr":true}`,
	`{"cmd":"x","stdin":"x","stdin_encoding":"utf-8","user":"1000:1000"}`, `{"argv":["x"],"user":""}`,
	`{"cmd":"sleep 9","timeout":1,"on_timeout":"interrupt","kill_grace":0.5,"merge_stderr":true}`,
	`{"cmd":"x","on_timeout":"kill"}`, `{"shell":"/bin/sh","user":"root"}`,
}

// checkDecodeErr: a decoder may refuse input, but only with a 4xx protocol
// error (never a panic, never a 5xx).
func checkDecodeErr(t *testing.T, data []byte, err error) {
	if err == nil {
		return
	}
	var ae *apierr.Error
	if !errors.As(err, &ae) || ae.Status < 400 || ae.Status > 499 {
		t.Fatalf("%q: error %v is not a 4xx protocol error", data, err)
	}
}

func fuzzDecoder(f *testing.F, decode func([]byte) error) {
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		checkDecodeErr(t, data, decode(data))
	})
}

func FuzzDecodeExec(f *testing.F) {
	s := &Server{killGrace: 2 * time.Second}
	fuzzDecoder(f, func(b []byte) error {
		c, o, enc, err := s.parseExec(b)
		if err == nil && (c == nil || (c.Argv == nil) == (c.Cmd == nil) || enc == "" || o.MaxOutput < 0 || o.Timeout < 0 || o.KillGrace < 0 ||
			(c.User != "" && proc.CheckUserSpec(c.User) != nil)) {
			panic("accepted an inconsistent exec request")
		}
		return err
	})
}

func FuzzDecodeProcessStart(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error {
		c, o, err := parseProcessStart(b)
		if err == nil && (c == nil || o.MaxBuffer < 0 || (o.TTY && (o.Size.Rows == 0 || o.Size.Cols == 0))) {
			panic("accepted an inconsistent process request")
		}
		return err
	})
}

func FuzzDecodeSignal(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error {
		sig, _, err := parseSignal(b)
		if err == nil && (sig < 1 || sig > 64) {
			panic("accepted a bad signal")
		}
		return err
	})
}

func FuzzDecodeResize(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error {
		size, err := parseResize(b)
		if err == nil && (size.Rows == 0 || size.Cols == 0) {
			panic("accepted an empty terminal")
		}
		return err
	})
}

func FuzzDecodeWait(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error { _, err := parseWait(b); return err })
}

func FuzzDecodeShellCreate(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error {
		a, err := parseShellCreate(b)
		if err == nil && a.user != "" && proc.CheckUserSpec(a.user) != nil {
			panic("accepted a bad user")
		}
		return err
	})
}

func FuzzDecodeShellRun(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error {
		a, err := parseShellRun(b)
		if err == nil && (a.maxOutput < 0 || a.enc == "" || a.timeout < 0 || (a.killGrace != nil && *a.killGrace < 0)) {
			panic("accepted an inconsistent run request")
		}
		return err
	})
}

func FuzzDecodeMkdir(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error {
		a, err := parseMkdir(b)
		if err == nil && (a.path == "" || a.mode > 0o7777) {
			panic("accepted a bad mkdir")
		}
		return err
	})
}

func FuzzDecodeMove(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error {
		src, dst, _, err := parseMove(b)
		if err == nil && (src == "" || dst == "") {
			panic("accepted an empty path")
		}
		return err
	})
}

func FuzzDecodeToken(f *testing.F) {
	fuzzDecoder(f, func(b []byte) error {
		tok, err := parseToken(b)
		if err == nil && (len(tok) < minToken || strings.ContainsAny(tok, " \t\r\n\x00")) {
			panic("accepted a bad token")
		}
		return err
	})
}
