package server

import (
	"math"
	"net/http"
	"strconv"

	"sandman/daemon/internal/apierr"
)

// Query-parameter helpers: a value that does not parse is invalid_request.

func queryBool(r *http.Request, name string, def bool) (bool, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return def, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, apierr.InvalidRequest("query parameter %s: %q is not a boolean", name, v)
	}
	return b, nil
}

func queryOffset(r *http.Request, name string) (int64, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, apierr.InvalidRequest("query parameter %s: %q is not an offset >= 0", name, v)
	}
	return n, nil
}

func querySeconds(r *http.Request, name string, max float64) (float64, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return 0, nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, apierr.InvalidRequest("query parameter %s: %q is not a number of seconds >= 0", name, v)
	}
	return min(f, max), nil
}

func queryEncoding(r *http.Request) (string, error) {
	v := r.URL.Query().Get("encoding")
	if v == "" {
		return encUTF8, nil
	}
	return encoding(&v)
}

// queryPath is the required ?path= of the file and archive endpoints.
func queryPath(r *http.Request) (string, error) {
	p := r.URL.Query().Get("path")
	return p, checkPath("path", p)
}

// queryMode parses an octal permission like "644"; ok is false if absent.
func queryMode(r *http.Request) (mode uint32, ok bool, err error) {
	v := r.URL.Query().Get("mode")
	if v == "" {
		return 0, false, nil
	}
	m, err := parseMode(v)
	return m, err == nil, err
}

func parseMode(v string) (uint32, error) {
	m, err := strconv.ParseUint(v, 8, 32)
	if err != nil || m > 0o7777 {
		return 0, apierr.InvalidRequest("mode %q is not an octal permission (e.g. 644)", v)
	}
	return uint32(m), nil
}
