package proc

import (
	"bytes"
	"math/rand"
	"testing"
)

func TestRingMatchesTail(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for _, max := range []int{1, 3, 7, 64} {
		r := ring{max: max}
		var all []byte
		for i := 0; i < 200; i++ {
			p := make([]byte, rng.Intn(20))
			rng.Read(p)
			r.write(p)
			all = append(all, p...)
			from := int64(rng.Intn(len(all) + 5))
			got, start := r.read(from)
			first := int64(len(all)) - int64(min(len(all), max))
			wantStart := min(max64(from, first), int64(len(all)))
			if start != wantStart || !bytes.Equal(got, all[wantStart:]) {
				t.Fatalf("max=%d from=%d: got start %d %q want %d %q", max, from, start, got, wantStart, all[wantStart:])
			}
		}
	}
}

func max64(a, b int64) int64 {
	if a > b {
		return a
	}
	return b
}
