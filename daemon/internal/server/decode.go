package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"strings"
	"time"

	"sandman/daemon/internal/apierr"
)

// maxJSONBody bounds every JSON request body.
const maxJSONBody = 64 << 20

const (
	encUTF8   = "utf-8"
	encBase64 = "base64"
)

// readBody reads a JSON request body under the size limit.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxJSONBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, apierr.New(http.StatusRequestEntityTooLarge, "payload_too_large", "JSON body over %d bytes", maxJSONBody)
		}
		return nil, apierr.New(http.StatusBadRequest, "invalid_json", "reading body: %v", err)
	}
	return data, nil
}

// readParsed reads a JSON request body under the size limit and checks it
// with parse, one of the pure parseX functions the fuzzers also drive.
func readParsed[T any](w http.ResponseWriter, r *http.Request, parse func([]byte) (T, error)) (T, error) {
	data, err := readBody(w, r)
	if err != nil {
		var zero T
		return zero, err
	}
	return parse(data)
}

// decodeJSON is the one decoder of request bodies: syntax problems are
// invalid_json, anything the schema refuses (unknown field, wrong type) is
// invalid_request. An empty body counts as {}.
func decodeJSON(data []byte, v any) error {
	trimmed := bytes.TrimLeft(data, " \t\r\n")
	if len(trimmed) == 0 {
		data = []byte("{}")
	} else if trimmed[0] != '{' {
		if json.Valid(data) {
			return apierr.New(http.StatusBadRequest, "invalid_json", "body is not a JSON object")
		}
		return apierr.New(http.StatusBadRequest, "invalid_json", "body is not valid JSON")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var se *json.SyntaxError
		var te *json.UnmarshalTypeError
		switch {
		case errors.As(err, &se), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
			return apierr.New(http.StatusBadRequest, "invalid_json", "body is not valid JSON: %v", err)
		case errors.As(err, &te):
			return apierr.InvalidRequest("field %q: expected %s, got %s", te.Field, te.Type, te.Value)
		default:
			return apierr.InvalidRequest("%s", strings.TrimPrefix(err.Error(), "json: "))
		}
	}
	if _, err := dec.Token(); err != io.EOF {
		return apierr.New(http.StatusBadRequest, "invalid_json", "trailing data after the JSON object")
	}
	return nil
}

// maxSeconds keeps float seconds inside time.Duration.
const maxSeconds = float64(math.MaxInt64/int64(time.Second)) - 1

// duration checks an optional number of seconds. positive demands > 0 (a
// timeout), otherwise >= 0 is fine.
func duration(name string, f *float64, positive bool) (time.Duration, error) {
	if f == nil {
		return 0, nil
	}
	v := *f
	if v < 0 || (positive && v == 0) || math.IsNaN(v) {
		return 0, apierr.InvalidRequest("%s must be %s", name, map[bool]string{true: "> 0", false: ">= 0"}[positive])
	}
	return time.Duration(min(v, maxSeconds) * float64(time.Second)), nil
}

func encoding(e *string) (string, error) {
	if e == nil {
		return encUTF8, nil
	}
	switch *e {
	case encUTF8, encBase64:
		return *e, nil
	}
	return "", apierr.InvalidRequest("encoding must be %q or %q", encUTF8, encBase64)
}

func nonNegative(name string, v *int64, def int) (int, error) {
	if v == nil {
		return def, nil
	}
	if *v < 0 {
		return 0, apierr.InvalidRequest("%s must be >= 0", name)
	}
	return int(min(*v, math.MaxInt32*4)), nil
}

func hasNUL(s string) bool { return strings.IndexByte(s, 0) >= 0 }

// checkPath applies the invalid_path rule: non-empty, no NUL.
func checkPath(name, p string) error {
	if p == "" {
		return apierr.InvalidPath("%s is empty", name)
	}
	if hasNUL(p) {
		return apierr.InvalidPath("%s contains NUL", name)
	}
	return nil
}
