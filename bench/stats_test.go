package bench

import (
	"math"
	"testing"
	"time"
)

func ms(n int) time.Duration { return time.Duration(n) * time.Millisecond }

// Nearest-rank percentiles on samples whose answers are known by hand.
func TestPercentileKnownSamples(t *testing.T) {
	hundred := make([]time.Duration, 100)
	for i := range hundred {
		hundred[i] = ms(i + 1)
	}
	ten := hundred[:10]
	cases := []struct {
		name    string
		samples []time.Duration
		q       float64
		want    time.Duration
	}{
		{"1..100 p50", hundred, 0.50, ms(50)},
		{"1..100 p90", hundred, 0.90, ms(90)},
		{"1..100 p99", hundred, 0.99, ms(99)},
		{"1..100 max", hundred, 1, ms(100)},
		{"1..10 p50", ten, 0.50, ms(5)},
		{"1..10 p90", ten, 0.90, ms(9)},
		{"1..10 p99", ten, 0.99, ms(10)},
		{"1..10 p0", ten, 0, ms(1)},
		{"single", []time.Duration{ms(7)}, 0.99, ms(7)},
		{"empty", nil, 0.5, 0},
	}
	for _, c := range cases {
		if got := Percentile(c.samples, c.q); got != c.want {
			t.Errorf("%s: Percentile(q=%g) = %v, want %v", c.name, c.q, got, c.want)
		}
	}
}

func TestSummarizeSortsAndSummarises(t *testing.T) {
	// 1..10 ms in reverse order, and an outlier.
	var s []time.Duration
	for i := 10; i >= 1; i-- {
		s = append(s, ms(i))
	}
	s = append(s, ms(1000))
	d := Summarize(s)
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-12 }
	if d.Count != 11 || !near(d.MinS, 0.001) || !near(d.MaxS, 1) {
		t.Fatalf("count/min/max = %d/%g/%g, want 11/0.001/1", d.Count, d.MinS, d.MaxS)
	}
	if !near(d.MeanS, (0.055+1)/11) {
		t.Errorf("mean = %g, want %g", d.MeanS, (0.055+1)/11)
	}
	// n=11: p50 is rank 6 (6 ms), p90 rank 10 (10 ms), p99 rank 11.
	if !near(d.P50S, 0.006) || !near(d.P90S, 0.010) || !near(d.P99S, 1) {
		t.Errorf("p50/p90/p99 = %g/%g/%g, want 0.006/0.010/1", d.P50S, d.P90S, d.P99S)
	}
	for i := 1; i < len(s); i++ {
		if s[i] < s[i-1] {
			t.Fatal("Summarize did not sort its samples")
		}
	}
	if (Summarize(nil) != Distribution{}) {
		t.Error("an empty sample must give the zero Distribution")
	}
}

func TestParseRange(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Range
	}{{"16", Range{16, 16}}, {"8:64", Range{8, 64}}, {" 3:3 ", Range{3, 3}}} {
		got, err := ParseRange(c.in)
		if err != nil || got != c.want {
			t.Errorf("ParseRange(%q) = %v, %v; want %v", c.in, got, err, c.want)
		}
		if back, _ := ParseRange(got.String()); back != got {
			t.Errorf("String() of %v does not parse back", got)
		}
	}
	for _, bad := range []string{"", "0", "-1", "5:4", "a", "1:b", "1:2:3"} {
		if _, err := ParseRange(bad); err == nil {
			t.Errorf("ParseRange(%q) accepted", bad)
		}
	}
}

func TestParseStatusRSS(t *testing.T) {
	rss, err := parseStatusRSS([]byte("Name:\tnarwhal\nVmPeak:\t  9000 kB\nVmRSS:\t   1536 kB\nThreads:\t7\n"))
	if err != nil || rss != 1536<<10 {
		t.Fatal(rss, err)
	}
	if _, err := parseStatusRSS([]byte("Name:\tx\n")); err == nil {
		t.Fatal("no VmRSS accepted")
	}
}
