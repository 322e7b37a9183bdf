package testkit

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// recordingTB is a testing.TB whose Fatalf records the message and ends
// the goroutine, as the real one does.
type recordingTB struct {
	testing.TB
	mu       sync.Mutex
	failed   string
	errors   []string
	cleanups []func()
}

func (r *recordingTB) Helper() {}

func (r *recordingTB) Error(args ...any) { r.errors = append(r.errors, fmt.Sprint(args...)) }

func (r *recordingTB) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

func (r *recordingTB) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }

func (r *recordingTB) runCleanups() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

func (r *recordingTB) Fatalf(format string, args ...any) {
	r.mu.Lock()
	r.failed = fmt.Sprintf(format, args...)
	r.mu.Unlock()
	runtime.Goexit()
}

// run calls f with a recordingTB on a goroutine of its own and returns
// the Fatalf message, empty when f returned normally.
func run(t *testing.T, f func(tb testing.TB)) string {
	r := &recordingTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed
}

func TestWaitForReturnsOnceTheConditionHolds(t *testing.T) {
	n := 0
	msg := run(t, func(tb testing.TB) {
		WaitFor(tb, time.Second, "three checks", func() bool { n++; return n == 3 })
	})
	if msg != "" || n != 3 {
		t.Fatalf("WaitFor failed with %q after %d checks, want success after 3", msg, n)
	}
}

func TestWaitForFailsAfterItsBound(t *testing.T) {
	start := time.Now()
	msg := run(t, func(tb testing.TB) {
		WaitFor(tb, 50*time.Millisecond, "never", func() bool { return false })
	})
	if took := time.Since(start); took < 50*time.Millisecond || took > 5*time.Second {
		t.Errorf("WaitFor gave up after %v, want just past 50ms", took)
	}
	if msg != "timed out after 50ms waiting for never" {
		t.Errorf("WaitFor failed with %q", msg)
	}
}

// TestPollReportsWithoutFailing proves Poll returns true once cond
// holds and false, failing nothing, once its bound has passed.
func TestPollReportsWithoutFailing(t *testing.T) {
	n := 0
	if !Poll(time.Second, time.Millisecond, func() bool { n++; return n == 3 }) || n != 3 {
		t.Fatalf("Poll after %d checks, want true after 3", n)
	}
	start := time.Now()
	if Poll(30*time.Millisecond, time.Millisecond, func() bool { return false }) {
		t.Fatal("Poll of a condition that never holds returned true")
	}
	if took := time.Since(start); took < 30*time.Millisecond || took > 5*time.Second {
		t.Errorf("Poll gave up after %v, want just past 30ms", took)
	}
}

// TestLockedBufferWhileWritten proves LockedBuffer's zero value takes
// writes from several goroutines while read, and that Lines leaves out a
// line not ended yet.
func TestLockedBufferWhileWritten(t *testing.T) {
	var b LockedBuffer
	if b.String() != "" || b.Lines() != nil {
		t.Fatalf("empty buffer: %q, %q", b.String(), b.Lines())
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 100 {
				_, _ = b.Write([]byte("line\n"))
				_ = b.Lines()
			}
		})
	}
	wg.Wait()
	_, _ = b.Write([]byte("partial"))
	lines := b.Lines()
	if len(lines) != 400 || lines[0] != "line" || lines[399] != "line" {
		t.Fatalf("%d lines (first %q), want 400 complete ones", len(lines), lines[0])
	}
	if !strings.HasSuffix(b.String(), "line\npartial") {
		t.Errorf("String() ends %q", b.String()[len(b.String())-12:])
	}
}

// TestCPUTimeGrowsWithWork proves CPUTime counts this process's work
// where it is measured.
func TestCPUTimeGrowsWithWork(t *testing.T) {
	start := CPUTime()
	if start == 0 {
		if runtime.GOOS == "linux" {
			t.Fatal("CPUTime is 0 on Linux, where getrusage measures it")
		}
		t.Skip("CPU time is not measured on this platform")
	}
	x := uint64(1)
	WaitFor(t, 10*time.Second, "10ms of CPU time", func() bool {
		for i := range 100000 {
			x = x*6364136223846793005 + uint64(i)
		}
		return CPUTime()-start >= 10*time.Millisecond
	})
	if x == 0 {
		t.Log("the spin's result, kept so that it is not optimised away")
	}
}

// TestCheckLeaksFindsALeftGoroutine proves the leak check can fail: a
// goroutine started after CheckLeaks and still running at cleanup is
// reported, and none is once it has ended.
func TestCheckLeaksFindsALeftGoroutine(t *testing.T) {
	leaky := &recordingTB{TB: t}
	CheckLeaks(leaky)
	stop := make(chan struct{})
	ended := make(chan struct{})
	go func() { defer close(ended); <-stop }()
	leaky.runCleanups()
	close(stop)
	<-ended
	if len(leaky.errors) == 0 {
		t.Fatal("CheckLeaks did not report a goroutine left running")
	}
	if !strings.Contains(strings.Join(leaky.errors, "\n"), "TestCheckLeaksFindsALeftGoroutine") {
		t.Errorf("the report does not name the leaked goroutine: %v", leaky.errors)
	}

	clean := &recordingTB{TB: t}
	CheckLeaks(clean)
	go func() {}()
	clean.runCleanups()
	if len(clean.errors) != 0 {
		t.Errorf("CheckLeaks reported a goroutine that had ended: %v", clean.errors)
	}
}

func testRegistry(t *testing.T) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "t_requests_total", Help: "h"}, []string{"engine", "phase"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "t_inflight", Help: "h"})
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "t_seconds", Help: "h"})
	reg.MustRegister(c, g, h)
	c.WithLabelValues("d1", "decode").Add(2)
	c.WithLabelValues("d1", "prefill").Add(3)
	c.WithLabelValues("d2", "decode").Add(5)
	g.Set(7)
	h.Observe(0.1)
	h.Observe(0.2)
	return reg
}

func TestGatheredSum(t *testing.T) {
	reg := testRegistry(t)
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"t_requests_total", nil, 10},
		{"t_requests_total", []string{"engine", "d1"}, 5},
		{"t_requests_total", []string{"engine", "d1", "phase", "decode"}, 2},
		{"t_requests_total", []string{"engine", "d3"}, 0},
		{"t_inflight", nil, 7},
		{"t_seconds", nil, 2},
		{"t_absent", nil, 0},
	} {
		if got := GatheredSum(t, reg, c.name, c.labels...); got != c.want {
			t.Errorf("GatheredSum(%s, %v) = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

func TestScrapeReadsTheTextFormat(t *testing.T) {
	srv := httptest.NewServer(promhttp.HandlerFor(testRegistry(t), promhttp.HandlerOpts{}))
	defer srv.Close()
	if got := ScrapedSum(t, srv.Client(), srv.URL, "t_requests_total", "phase", "decode"); got != 7 {
		t.Errorf("ScrapedSum = %v, want 7", got)
	}
	mfs, err := Scrape(srv.Client(), srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if _, found := Sum(mfs, "t_requests_total", "engine", "d3"); found {
		t.Error("Sum found a series that is absent")
	}
	if v, found := Sum(mfs, "t_inflight"); !found || v != 7 {
		t.Errorf("Sum(t_inflight) = %v, %v; want 7, true", v, found)
	}
	bad := httptest.NewServer(http.NotFoundHandler())
	defer bad.Close()
	if _, err := Scrape(bad.Client(), bad.URL); err == nil || !strings.Contains(err.Error(), "HTTP 404") {
		t.Errorf("Scrape of a 404 page: %v", err)
	}
}

// TestCAServesTLS proves a CA's certificates verify against its pool for
// 127.0.0.1 over a real TLS connection, and not against another CA's.
func TestCAServesTLS(t *testing.T) {
	ca := NewCA(t)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) }))
	srv.TLS = ca.ServerTLS(t, "server")
	srv.StartTLS()
	defer srv.Close()
	get := func(pool *x509.CertPool) error {
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr}).Get(srv.URL)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := get(ca.Pool); err != nil {
		t.Fatalf("a client trusting the CA: %v", err)
	}
	if err := get(NewCA(t).Pool); err == nil {
		t.Fatal("a client trusting another CA accepted the certificate")
	}
	pemBytes, err := os.ReadFile(ca.Path)
	if err != nil || !x509.NewCertPool().AppendCertsFromPEM(pemBytes) {
		t.Fatalf("the CA's PEM file: %v", err)
	}
	dir := t.TempDir()
	s1 := ca.WriteIssued(t, "a", filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem"))
	s2 := ca.WriteIssued(t, "a", filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem"))
	if _, err := tls.LoadX509KeyPair(filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem")); err != nil || s1.Cmp(s2) == 0 {
		t.Fatalf("written pair: %v; serials %v %v", err, s1, s2)
	}
}
