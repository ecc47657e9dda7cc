package proc

import (
	"strings"
	"testing"
)

func TestMarkScannerSplitsAnywhere(t *testing.T) {
	const mark = "MARK123"
	for _, body := range []string{"", "x", "hello\n", "no newline", "\n\n", "a\nMARK12 fake\n"} {
		stream := body + "\n" + mark + " 7\n" + "late"
		for cut := 0; cut <= len(stream); cut++ {
			s := markScanner{pat: []byte("\n" + mark + " "), wantRC: true, max: 1 << 20}
			s.feed([]byte(stream[:cut]))
			s.feed([]byte(stream[cut:]))
			if !s.complete || string(s.kept) != body || s.rc != 7 {
				t.Fatalf("body %q cut %d: complete=%v kept=%q rc=%d", body, cut, s.complete, s.kept, s.rc)
			}
		}
	}
}

func TestMarkScannerTruncates(t *testing.T) {
	s := markScanner{pat: []byte("\nM\n"), max: 4}
	s.feed([]byte(strings.Repeat("a", 10) + "\nM\n"))
	if string(s.kept) != "aaaa" || !s.truncated || !s.complete {
		t.Fatalf("kept=%q truncated=%v complete=%v", s.kept, s.truncated, s.complete)
	}
}
