package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestBreakerNeedsNATSURL checks that a standalone breaker refuses to run
// without NARWHAL_NATS_URL, saying so.
func TestBreakerNeedsNATSURL(t *testing.T) {
	t.Setenv("NARWHAL_NATS_URL", "")
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}})
	if err := runBreakerCmd(context.Background(), []string{"--config", path}); err != errNoNATSURL {
		t.Fatalf("breaker without NARWHAL_NATS_URL: %v", err)
	}
}

// TestBreakerCommandLeads proves `narwhal breaker` (behaviour.md §8, §14): pointed
// at a NATS server by NARWHAL_NATS_URL it takes the leader lease, writes
// every engine's placement entry (R-BRK-8), and returns cleanly when its
// context ends (SIGINT/SIGTERM), releasing the lease.
func TestBreakerCommandLeads(t *testing.T) {
	testkit.CheckLeaks(t)
	emb := bustest.Start(t)
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	t.Setenv("NARWHAL_ROUTER_LOG_LEVEL", "warn")
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runBreakerCmd(ctx, []string{"--config", path}) }()

	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	b := bustest.Connect(t, emb, bus.ConnectOptions{})
	leaseHolder := func() string {
		kv, err := b.JetStream().KeyValue(cctx, breaker.LeaseBucket)
		if err != nil {
			return ""
		}
		e, err := kv.Get(cctx, breaker.LeaseKey)
		if err != nil {
			return ""
		}
		var l breaker.Lease
		_ = json.Unmarshal(e.Value(), &l)
		return l.BreakerID
	}
	for _, engine := range []string{"p1", "d1"} {
		testkit.WaitFor(t, 10*time.Second, "a placement entry for "+engine, func() bool {
			e, err := b.Placement().Get(cctx, engine)
			if err != nil {
				return false
			}
			var el schemas.Eligibility
			if err := json.Unmarshal(e.Value(), &el); err != nil || !el.Eligible || !strings.HasPrefix(el.BreakerID, "breaker-") {
				t.Fatalf("placement entry of %s: %s", engine, e.Value())
			}
			return true
		})
	}
	if h := leaseHolder(); h != breakerID() {
		t.Fatalf("lease held by %q, want %q", h, breakerID())
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("breaker command: %v", err)
	}
	if h := leaseHolder(); h != "" {
		t.Fatalf("lease still held by %q after the breaker stopped", h)
	}
}

// TestBreakerCommandNamesMissingBucket proves R-BUS-8 for the breaker: it
// creates no bucket; on a bus whose lease bucket is missing it waits for
// the set-up, and with bus.connect_timeout_s gives up after it with an
// error naming the bucket and the command that creates it.
func TestBreakerCommandNamesMissingBucket(t *testing.T) {
	testkit.CheckLeaks(t)
	emb := bustest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()
	admin := bustest.Connect(t, emb, bus.ConnectOptions{})
	if err := admin.JetStream().DeleteKeyValue(ctx, bus.LeaseBucket); err != nil {
		t.Fatal(err)
	}
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	t.Setenv("NARWHAL_NATS_CONNECT_TIMEOUT_S", "1")
	t.Setenv("NARWHAL_ROUTER_LOG_LEVEL", "error")
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	err := runBreakerCmd(ctx, []string{"--config", path})
	if err == nil || !strings.Contains(err.Error(), "bucket narwhal_breaker does not exist") || !strings.Contains(err.Error(), "narwhal bus setup") {
		t.Errorf("breaker on a bus without its lease bucket: %v", err)
	}
	if _, err := admin.JetStream().KeyValue(ctx, bus.LeaseBucket); err == nil {
		t.Error("the breaker created its lease bucket")
	}
	admin.Close()
}
