package server

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"sandman/daemon/internal/apierr"
)

type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// writeError reports err; anything that is not an *apierr.Error is mapped
// from its errno, and what is left is internal.
func writeError(w http.ResponseWriter, err error) {
	var ae *apierr.Error
	if !errors.As(err, &ae) {
		ae = apierr.FromOS(err)
	}
	writeJSON(w, ae.Status, errorBody{errorDetail{ae.Code, ae.Message}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		data = []byte(`{"error":{"code":"internal","message":"encoding the response failed"}}`)
	}
	h := w.Header()
	h["Content-Type"] = []string{"application/json"}
	w.WriteHeader(status)
	_, _ = w.Write(data)
}

// encodeOutput renders process output per the request's encoding. For
// utf-8, json.Marshal turns invalid bytes into U+FFFD.
func encodeOutput(b []byte, enc string) string {
	if enc == encBase64 {
		return base64.StdEncoding.EncodeToString(b)
	}
	return string(b)
}

func seconds(d time.Duration) float64 { return d.Seconds() }

func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }
