package proc

import (
	"bytes"
	"strconv"
)

// markScanner splits one shell stream into the run's output and the end
// marker the shell prints after it. It never holds more than the marker's
// length of unclassified bytes, so huge outputs cost no memory beyond max.
type markScanner struct {
	pat       []byte // "\n" + marker + (" " on stdout, which carries the rc; "\n" on stderr)
	wantRC    bool
	pending   []byte
	kept      []byte
	max       int
	truncated bool
	found     bool
	complete  bool
	rc        int
}

func (s *markScanner) keep(p []byte) {
	room := s.max - len(s.kept)
	if len(p) > room {
		p = p[:max(room, 0)]
		s.truncated = true
	}
	s.kept = append(s.kept, p...)
}

// feed consumes output; it reports whether this call completed the scan.
func (s *markScanner) feed(p []byte) bool {
	if s.complete {
		return false // output of background jobs after the marker
	}
	s.pending = append(s.pending, p...)
	if !s.found {
		i := bytes.Index(s.pending, s.pat)
		if i < 0 {
			// Everything but a possible start of the marker is output.
			if n := len(s.pending) - (len(s.pat) - 1); n > 0 {
				s.keep(s.pending[:n])
				s.pending = append(s.pending[:0], s.pending[n:]...)
			}
			return false
		}
		s.keep(s.pending[:i])
		s.pending = append(s.pending[:0], s.pending[i+len(s.pat):]...)
		s.found = true
	}
	if !s.wantRC {
		s.complete = true
		return true
	}
	j := bytes.IndexByte(s.pending, '\n')
	if j < 0 {
		return false
	}
	s.rc, _ = strconv.Atoi(string(s.pending[:j]))
	s.complete = true
	return true
}

// flush gives up on the marker (the shell died): what is pending is output.
func (s *markScanner) flush() {
	if !s.found {
		s.keep(s.pending)
	}
	s.pending = nil
}
