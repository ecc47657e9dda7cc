package main

import (
	"bytes"
	"io"
	"net/http"
	"sort"
	"syscall"
	"testing"
	"time"
)

// The exec benchmarks compare a no-op command through the daemon (HTTP over
// its unix socket, keep-alive) with a bare fork/exec/wait from this
// process; the difference is the daemon's overhead. Each reports its median
// as p50-ns: go test -run=^$ -bench=True -count=1 ./cmd/sandmand

func reportMedian(b *testing.B, samples []time.Duration) {
	sort.Slice(samples, func(i, j int) bool { return samples[i] < samples[j] })
	if len(samples) > 0 {
		b.ReportMetric(float64(samples[len(samples)/2].Nanoseconds()), "p50-ns")
	}
}

func BenchmarkForkExecTrue(b *testing.B) {
	attr := &syscall.ProcAttr{Files: []uintptr{0, 1, 2}, Sys: &syscall.SysProcAttr{Setpgid: true}}
	samples := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		pid, err := syscall.ForkExec("/bin/true", []string{"true"}, attr)
		if err != nil {
			b.Fatal(err)
		}
		var ws syscall.WaitStatus
		if _, err := syscall.Wait4(pid, &ws, 0, nil); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, time.Since(t0))
	}
	b.StopTimer()
	reportMedian(b, samples)
}

func BenchmarkDaemonExecTrue(b *testing.B) {
	d := startDaemon(b, []string{"SANDMAND_TOKEN=tok"})
	body := []byte(`{"argv":["/bin/true"]}`)
	do := func() {
		req, _ := http.NewRequest("POST", "http://d/v1/exec", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer tok")
		resp, err := d.client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
	do() // open the keep-alive connection
	samples := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		do()
		samples = append(samples, time.Since(t0))
	}
	b.StopTimer()
	reportMedian(b, samples)
}

// BenchmarkDaemonHealth is the HTTP round trip alone, for reference.
func BenchmarkDaemonHealth(b *testing.B) {
	d := startDaemon(b, []string{"SANDMAND_TOKEN=tok"})
	samples := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		resp, err := d.client.Get("http://d/v1/health")
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		samples = append(samples, time.Since(t0))
	}
	b.StopTimer()
	reportMedian(b, samples)
}
