package bus_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// recordedLog is a slog.Handler that keeps every message it is given.
type recordedLog struct {
	mu   sync.Mutex
	msgs []string
}

func (r *recordedLog) Enabled(context.Context, slog.Level) bool { return true }
func (r *recordedLog) Handle(_ context.Context, rec slog.Record) error {
	line := rec.Message
	rec.Attrs(func(a slog.Attr) bool {
		line += " " + a.Key + "=" + a.Value.String()
		return true
	})
	r.mu.Lock()
	r.msgs = append(r.msgs, line)
	r.mu.Unlock()
	return nil
}
func (r *recordedLog) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *recordedLog) WithGroup(string) slog.Handler      { return r }

// count returns how many messages start with prefix, and the last one.
func (r *recordedLog) count(prefix string) (int, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n, last := 0, ""
	for _, m := range r.msgs {
		if strings.HasPrefix(m, prefix) {
			n++
			last = m
		}
	}
	return n, last
}

// fakeClock is a clock the test moves; it counts how often it is read.
type fakeClock struct {
	base  time.Time
	ahead atomic.Int64 // nanoseconds past base
	reads atomic.Int64
}

func (c *fakeClock) now() time.Time {
	c.reads.Add(1)
	return c.base.Add(time.Duration(c.ahead.Load()))
}

// waitReads waits until the clock has been read n more times than now:
// Connect went round its retry loop that often.
func (c *fakeClock) waitReads(t *testing.T, n int64) {
	t.Helper()
	want := c.reads.Load() + n
	testkit.WaitFor(t, 10*time.Second, "Connect's retries", func() bool { return c.reads.Load() >= want })
}

// TestConnectWaitsForSetup proves that a process started before
// `narwhal bus setup` keeps waiting instead of failing: Connect with
// WaitSetUp logs what is missing and the command that creates it once,
// not per retry, again only after LogEvery (30 s by default; an injected
// clock here), reports the missing stream to Missing, and returns by
// itself once the set-up has run.
func TestConnectWaitsForSetup(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, NoSetup: true})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	rec := &recordedLog{}
	clock := &fakeClock{base: time.Unix(1_800_000_000, 0)}
	var mu sync.Mutex
	var missing []string
	done := make(chan error, 1)
	var b *bus.Bus
	go func() {
		var err error
		b, err = bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), Name: "router", Log: slog.New(rec),
			Buckets: []string{bus.LeaseBucket, bus.FleetBucket, bus.RoutersBucket},
			WaitSetUp: &bus.SetUpWait{Now: clock.now, Missing: func(m *bus.NotSetUpError) {
				mu.Lock()
				defer mu.Unlock()
				if m == nil {
					missing = append(missing, "")
					return
				}
				missing = append(missing, m.Problem())
			}}})
		done <- err
	}()
	const waiting = "waiting for the bus to be set up"
	testkit.WaitFor(t, 10*time.Second, "the first waiting line", func() bool { n, _ := rec.count(waiting); return n == 1 })
	_, line := rec.count(waiting)
	if !strings.Contains(line, "stream NARWHAL_EVENTS does not exist: run narwhal bus setup") {
		t.Errorf("waiting line %q does not name the stream and the command", line)
	}
	clock.waitReads(t, 4)
	if n, _ := rec.count(waiting); n != 1 {
		t.Fatalf("%d waiting lines after several retries within the interval, want 1", n)
	}
	clock.ahead.Store(int64(bus.NotSetUpLogEvery - time.Second))
	clock.waitReads(t, 3)
	if n, _ := rec.count(waiting); n != 1 {
		t.Fatalf("%d waiting lines %v after the first, want 1", n, bus.NotSetUpLogEvery-time.Second)
	}
	clock.ahead.Store(int64(bus.NotSetUpLogEvery))
	testkit.WaitFor(t, 10*time.Second, "the second waiting line, 30 s after the first", func() bool { n, _ := rec.count(waiting); return n == 2 })
	clock.waitReads(t, 3)
	if n, _ := rec.count(waiting); n != 2 {
		t.Fatalf("%d waiting lines just after the interval, want 2", n)
	}
	select {
	case err := <-done:
		t.Fatalf("Connect returned before the set-up: %v", err)
	default:
	}

	admin, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), Name: "admin", Setup: &bus.SetupOptions{}})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	start := time.Now()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Connect after the set-up: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Connect did not return within 5 s of the set-up")
	}
	t.Logf("Connect returned %v after the set-up", time.Since(start))
	defer b.Close()
	if b.Placement() == nil {
		t.Error("no placement bucket bound")
	}
	if n, _ := rec.count("bus set up"); n != 1 {
		t.Errorf("%d \"bus set up\" lines, want 1", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(missing) < 2 || missing[0] != "stream NARWHAL_EVENTS does not exist: run narwhal bus setup" || missing[len(missing)-1] != "" {
		t.Errorf("Missing was told %q, want the stream's problem first and \"\" last", missing)
	}
	for i := 1; i < len(missing); i++ {
		if missing[i] == missing[i-1] {
			t.Errorf("Missing told %q twice in a row: %q", missing[i], missing)
		}
	}
}

// TestConnectNeedsItsBuckets proves that Connect returns only once every
// bucket of ConnectOptions.Buckets exists, and names the missing one, the
// command that creates it and the give-up when ctx ends first.
func TestConnectNeedsItsBuckets(t *testing.T) {
	e := bustest.Start(t)
	admin, err := bus.Connect(context.Background(), bus.ConnectOptions{Embedded: e, Name: "admin"})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if err := admin.JetStream().DeleteKeyValue(context.Background(), bus.ChaosBucket); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	_, err = bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), Name: "chaos", Buckets: []string{bus.ChaosBucket}, WaitSetUp: &bus.SetUpWait{}})
	if err == nil {
		t.Fatal("Connect without the chaos bucket succeeded")
	}
	if time.Since(start) < 1900*time.Millisecond {
		t.Errorf("Connect gave up after %v, before its context ended", time.Since(start))
	}
	for _, want := range []string{"bucket narwhal_chaos does not exist", "narwhal bus setup", "gave up"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}
