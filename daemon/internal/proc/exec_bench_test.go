package proc

import (
	"context"
	"sort"
	"testing"
	"time"

	"sandman/daemon/internal/reaper"
)

// BenchmarkExecTrue is Runner.Exec of /bin/true without HTTP: the process
// machinery's share of the daemon's exec latency.
func BenchmarkExecTrue(b *testing.B) {
	r, err := NewRunner(reaper.New(), DaemonEnv())
	if err != nil {
		b.Fatal(err)
	}
	c := &Command{Argv: []string{"/bin/true"}}
	samples := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		res, err := r.Exec(context.Background(), c, ExecOptions{MaxOutput: 1 << 20})
		if err != nil || res.Code != 0 {
			b.Fatal(err, res)
		}
		samples = append(samples, time.Since(t0))
	}
	b.StopTimer()
	sort.Slice(samples, func(i, j int) bool { return samples[i] < samples[j] })
	b.ReportMetric(float64(samples[len(samples)/2].Nanoseconds()), "p50-ns")
}
