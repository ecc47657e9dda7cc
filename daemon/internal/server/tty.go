package server

import (
	"net/http"

	"sandman/daemon/internal/apierr"
	"sandman/daemon/internal/proc"
)

// maxCells bounds rows and cols: struct winsize holds 16-bit counts.
const maxCells = 65535

// parseTTY validates the terminal fields of a process start: rows and cols
// only make sense with tty, and each is 1..65535 (default 24x80).
func parseTTY(tty *bool, rows, cols *int64) (bool, proc.WinSize, error) {
	on := tty != nil && *tty
	size := proc.WinSize{Rows: proc.DefaultRows, Cols: proc.DefaultCols}
	if !on {
		if rows != nil || cols != nil {
			return false, size, apierr.InvalidRequest("rows and cols need tty: true")
		}
		return false, size, nil
	}
	var err error
	if rows != nil {
		if size.Rows, err = cells("rows", *rows); err != nil {
			return false, size, err
		}
	}
	if cols != nil {
		if size.Cols, err = cells("cols", *cols); err != nil {
			return false, size, err
		}
	}
	return true, size, nil
}

func cells(name string, v int64) (uint16, error) {
	if v < 1 || v > maxCells {
		return 0, apierr.InvalidRequest("%s must be 1..%d", name, maxCells)
	}
	return uint16(v), nil
}

// ResizeRequest is the body of POST /v1/processes/{id}/resize.
type ResizeRequest struct {
	Rows *int64 `json:"rows"`
	Cols *int64 `json:"cols"`
}

func parseResize(data []byte) (proc.WinSize, error) {
	var req ResizeRequest
	var size proc.WinSize
	if err := decodeJSON(data, &req); err != nil {
		return size, err
	}
	if req.Rows == nil || req.Cols == nil {
		return size, apierr.InvalidRequest("rows and cols are required")
	}
	var err error
	if size.Rows, err = cells("rows", *req.Rows); err != nil {
		return size, err
	}
	size.Cols, err = cells("cols", *req.Cols)
	return size, err
}

func (s *Server) processResize(w http.ResponseWriter, r *http.Request, id string) error {
	p, err := s.procs.Get(id)
	if err != nil {
		return err
	}
	size, err := readParsed(w, r, parseResize)
	if err != nil {
		return err
	}
	if err := p.Resize(size); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}
