package meshview

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestRoutersTrustNothingTheyReadRBUS9 proves R-BUS-9 on one router:
// malformed JSON, `{}`, a value for another key, a value written by a
// breaker that does not hold the lease, a value of an old lease term and
// a deleted key are all ignored — the engine keeps its state — and counted
// in narwhal_placement_ignored_total; a new lease holder's values apply
// (the router reads the new lease when a value names a newer term); a
// quarantine event with a huge duration is cut to
// recovery.max_quarantine_s.
func TestRoutersTrustNothingTheyReadRBUS9(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) { c.Recovery.MaxQuarantineS = 2 })
	s.waitModels()
	m := newMeshBus(t)
	m.SetEligible("d1", false)
	if err := s.v.Join(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	d1 := s.v.Fleet().Member("d1")
	if d1.Eligible() {
		t.Fatal("d1 eligible after a valid ejection")
	}
	ignored := func() float64 { return testkit.GatheredSum(t, s.reg, "narwhal_placement_ignored_total") }
	put := func(key, value string) {
		t.Helper()
		if _, err := m.Peer.Placement().Put(context.Background(), key, []byte(value)); err != nil {
			t.Fatal(err)
		}
	}
	value := func(breaker string, term uint64, engine string, eligible bool) string {
		state := "eligible"
		if !eligible {
			state = "ejected"
		}
		b, _ := json.Marshal(schemas.Eligibility{Envelope: schemas.Envelope{Schema: schemas.SchemaEligibility, ID: newID(), At: nowUTC(), BreakerID: breaker, EngineID: engine},
			Eligible: eligible, State: state, LeaseTerm: term})
		return string(b)
	}
	forged := []string{
		`not json`,
		`{}`,
		`{"eligible":true}`,
		value("test-breaker", m.Term, "d2", true),                                                                // for another key
		value("standby-breaker", m.Term, "d1", true),                                                             // not the lease holder
		value("test-breaker", m.Term+1000, "d1", true),                                                           // a term nobody holds
		strings.Replace(value("test-breaker", m.Term, "d1", true), `"state":"eligible"`, `"state":"ejected"`, 1), // eligible but ejected
	}
	for i, v := range forged {
		before := ignored()
		put("d1", v)
		testkit.WaitFor(t, time.Second, fmt.Sprintf("forged value %d counted", i), func() bool { return ignored() > before })
		if d1.Eligible() {
			t.Fatalf("forged value %d made d1 eligible: %s", i, v)
		}
	}
	before := ignored()
	if err := m.Peer.Placement().Delete(context.Background(), "d1"); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, time.Second, "the deletion counted", func() bool { return ignored() > before })
	if d1.Eligible() {
		t.Fatal("deleting d1's key made it eligible")
	}
	if v := testkit.GatheredSum(t, s.reg, "narwhal_placement_ignored_total"); v < float64(len(forged)+1) {
		t.Fatalf("narwhal_placement_ignored_total = %v, want >= %d", v, len(forged)+1)
	}

	// A new leader: its values apply, the old one's are stale.
	old := m.Term
	m.Term = m.TakeLease("new-breaker")
	put("d1", value("new-breaker", m.Term, "d1", true))
	testkit.WaitFor(t, time.Second, "the new leader's readmission", d1.eligible.Load)
	before = ignored()
	put("d1", value("test-breaker", old, "d1", false))
	testkit.WaitFor(t, time.Second, "the old leader's value counted", func() bool { return ignored() > before })
	if !d1.Eligible() {
		t.Fatal("a value of an old lease term was applied")
	}

	// A huge quarantine is capped (R-BUS-9).
	pub := bus.NewPublisher(m.Peer, 16, nil)
	defer pub.Close()
	pub.Publish(&schemas.Quarantine{Envelope: schemas.Envelope{Schema: schemas.SchemaQuarantine, RouterID: "hostile", EngineID: "d2"},
		DurationSeconds: 1e9, Until: time.Now().Add(1e6 * time.Hour).UTC(), Reason: "x"})
	d2 := s.v.Fleet().Member("d2")
	testkit.WaitFor(t, time.Second, "the quarantine applied", func() bool { return d2.QuarantinedUntil() > nowNano() })
	if until := time.Unix(0, d2.QuarantinedUntil()); time.Until(until) > 2*time.Second {
		t.Fatalf("a 1e9 s quarantine lasts until %v, beyond recovery.max_quarantine_s = 2", until)
	}
}

// TestNewLeaderValueKeptUntilTheLeaseConfirmsItRBUS9 proves that a value
// of a new leader that arrives while the router reads an older lease —
// what a lagging replica of the lease bucket serves after a takeover — is
// not lost until its key's next write (R-BUS-9, R-BRK-8): the value names
// a term the lease does not have yet, so it is ignored (counted) and kept
// pending; once the lease holds that writer and term, the router applies
// it within a second, without any new write of the key. A pending value
// that a later write of its key superseded (here a malformed one) is not
// applied.
func TestNewLeaderValueKeptUntilTheLeaseConfirmsItRBUS9(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	m.SetEligible("d1", false)
	if err := s.v.Join(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	d1, d2 := s.v.Fleet().Member("d1"), s.v.Fleet().Member("d2")
	if d1.Eligible() || !d2.Eligible() {
		t.Fatalf("d1 eligible=%v d2 eligible=%v before the takeover, want false and true", d1.Eligible(), d2.Eligible())
	}
	ignored := func() float64 { return testkit.GatheredSum(t, s.reg, "narwhal_placement_ignored_total") }
	put := func(key string, value []byte) {
		t.Helper()
		if _, err := m.Peer.Placement().Put(context.Background(), key, value); err != nil {
			t.Fatal(err)
		}
	}
	value := func(breaker string, term uint64, engine string, eligible bool) []byte {
		state := schemas.StateEligible
		if !eligible {
			state = schemas.StateEjected
		}
		b, _ := json.Marshal(schemas.Eligibility{Envelope: schemas.Envelope{Schema: schemas.SchemaEligibility, ID: newID(), At: nowUTC(), BreakerID: breaker, EngineID: engine},
			Eligible: eligible, State: state, LeaseTerm: term})
		return b
	}

	// takeLease deletes the lease and creates it: two writes of the lease
	// bucket, so the new leader's term is the current one plus two. Its
	// values arrive before the router can read its lease.
	newTerm := m.Term + 2
	before := ignored()
	put("d1", value("new-breaker", newTerm, "d1", true))
	put("d2", value("new-breaker", newTerm, "d2", false))
	// The bucket keeps one value per key: d2's next put could remove this
	// one before the watch delivers it, so it must be judged (kept
	// pending) first.
	testkit.WaitFor(t, 5*time.Second, "the two values counted as ignored", func() bool { return ignored() >= before+2 })
	put("d2", []byte(`{"eligible":false}`)) // supersedes d2's pending value
	testkit.WaitFor(t, 5*time.Second, "the three values counted as ignored", func() bool { return ignored() >= before+3 })
	if d1.Eligible() || !d2.Eligible() {
		t.Fatalf("before the lease names new-breaker: d1 eligible=%v d2 eligible=%v, want the previous state (false, true)", d1.Eligible(), d2.Eligible())
	}

	if got := m.TakeLease("new-breaker"); got != newTerm {
		t.Fatalf("the new lease has term %d, want %d", got, newTerm)
	}
	start := time.Now()
	// The router rechecks the lease at most pendingRecheckMax apart while
	// a value is pending, so it applies the value within a second on an
	// idle machine (logged below); the bound leaves room for a loaded one.
	// A router that kept no pending value would wait for the key's next
	// write, which never comes.
	testkit.WaitFor(t, 5*time.Second, "d1 readmitted by the new leader's pending value", d1.eligible.Load)
	t.Logf("R-BUS-9: the pending value applied %v after the lease named its writer", time.Since(start).Round(time.Millisecond))
	if !d2.Eligible() {
		t.Fatal("d2 ejected by a pending value that a later write of its key had superseded")
	}
}

// TestPlacementReadDirectlyRBRK8 proves the reads that carry placement
// while a router's watch is being set up again (mesh.bridge, R-BRK-8,
// R-BUS-9): each fleet engine's key is read directly and a changed value
// applied with the watch's checks — a valid ejection and readmission
// apply, a malformed value is ignored and counted once however often the
// key is read again. (Its place in the watch loop, across a real node
// loss, is proven by e2e TestClusterR3.)
func TestPlacementReadDirectlyRBRK8(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	mb := newMeshBus(t)
	m := &mesh{bus: mb.B, logged: map[string]bool{}, pending: map[string]schemas.Eligibility{}, bridged: map[string]uint64{}}
	d1, d2 := s.v.Fleet().Member("d1"), s.v.Fleet().Member("d2")
	ignored := func() float64 { return testkit.GatheredSum(t, s.reg, "narwhal_placement_ignored_total") }

	mb.SetEligible("d1", false)
	s.v.bridge(m)
	if d1.Eligible() {
		t.Fatal("d1 eligible after a direct read of its ejection")
	}
	if _, err := mb.Peer.Placement().Put(context.Background(), "d2", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	before := ignored()
	for range 3 {
		s.v.bridge(m)
	}
	if got := ignored() - before; got != 1 {
		t.Fatalf("a malformed value read three times counted %v times, want once", got)
	}
	if !d2.Eligible() {
		t.Fatal("d2 ejected by a malformed value read directly")
	}
	mb.SetEligible("d1", true)
	s.v.bridge(m)
	if !d1.Eligible() {
		t.Fatal("d1 not readmitted by a direct read of its readmission")
	}
}

// TestTamperedWatchIsReplacedRBUS9 proves that a client that may read the
// placement bucket — and so list its consumers and update one by name —
// cannot blind a router (R-BUS-9, R-BRK-8): a watch whose consumer was
// given a filter that matches nothing, or was paused, keeps getting
// heartbeats, yet the router reads it back, sets up a new watch and
// applies the next ejection within a second and a half.
func TestTamperedWatchIsReplacedRBUS9(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	if err := s.v.Join(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	d1 := s.v.Fleet().Member("d1")
	js := m.Peer.JetStream()
	stream := "KV_" + bus.PlacementBucket
	watch := func() jetstream.Consumer {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := js.Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		// A watch being replaced leaves the stream without a consumer, or
		// with the old one beside the new, for a moment: wait for the one
		// watch (two that stay for 5 s still fail).
		var names []string
		testkit.Poll(5*time.Second, 20*time.Millisecond, func() bool {
			names = names[:0]
			for n := range st.ConsumerNames(ctx).Name() {
				names = append(names, n)
			}
			return len(names) == 1
		})
		if len(names) != 1 {
			t.Fatalf("consumers of %s: %v, want the router's watch alone", stream, names)
		}
		c, err := js.Consumer(ctx, stream, names[0])
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	tamperings := []struct {
		what string
		do   func(ctx context.Context, c jetstream.Consumer) error
	}{
		{"a filter that matches nothing", func(ctx context.Context, c jetstream.Consumer) error {
			cfg := c.CachedInfo().Config
			cfg.FilterSubject = "$KV." + bus.PlacementBucket + ".nothing"
			_, err := js.UpdateConsumer(ctx, stream, cfg)
			return err
		}},
		{"a pause", func(ctx context.Context, c jetstream.Consumer) error {
			_, err := js.PauseConsumer(ctx, stream, c.CachedInfo().Name, time.Now().Add(time.Hour))
			return err
		}},
	}
	eligible := true
	for _, tc := range tamperings {
		c := watch()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := tc.do(ctx, c); err != nil {
			t.Fatalf("%s: %v", tc.what, err)
		}
		cancel()
		eligible = !eligible
		m.SetEligible("d1", eligible)
		testkit.WaitFor(t, 1500*time.Millisecond, "d1's placement after "+tc.what+" of the watch", func() bool {
			return d1.Eligible() == eligible
		})
	}
}

// TestQuarantineOfAnotherRoutersIDIgnoredRBUS11 proves R-BUS-11 for the
// quarantine events other routers apply: a quarantine whose payload
// names router r1 on router r2's subject, one on an old four-token
// subject and one whose engine is not its subject's, published on a plain
// connection, quarantine nothing and are counted in
// narwhal_quarantine_events_ignored_total{reason}; r2's own quarantine of
// d2 applies.
func TestQuarantineOfAnotherRoutersIDIgnoredRBUS11(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	if err := s.v.Join(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := m.B.Conn().Flush(); err != nil { // the quarantine subscription is in place
		t.Fatal(err)
	}
	quarantine := func(subject, router, engine string) {
		t.Helper()
		b, _ := json.Marshal(schemas.Quarantine{
			Envelope:        schemas.Envelope{Schema: schemas.SchemaQuarantine, ID: newID(), At: nowUTC(), RouterID: router, EngineID: engine},
			DurationSeconds: 30, Until: time.Now().Add(30 * time.Second).UTC(), Reason: "first_token_timeout"})
		if err := m.Peer.Conn().Publish(subject, b); err != nil {
			t.Fatal(err)
		}
	}
	quarantine("narwhal.events.quarantine.d2.r2", "r1", "d2")
	quarantine("narwhal.events.quarantine.d2", "r1", "d2")
	quarantine("narwhal.events.quarantine.p1.r2", "r2", "d2")
	ignored := func(reason string) float64 {
		return testkit.GatheredSum(t, s.reg, "narwhal_quarantine_events_ignored_total", "reason", reason)
	}
	testkit.WaitFor(t, 5*time.Second, "the forged quarantines counted", func() bool {
		return ignored(schemas.MismatchRouterID) == 2 && ignored(schemas.MismatchEngineID) == 1
	})
	for _, id := range []string{"d2", "p1"} {
		if s.v.Fleet().Member(id).QuarantinedUntil() > nowNano() {
			t.Fatalf("a forged quarantine event quarantined %s", id)
		}
	}
	quarantine("narwhal.events.quarantine.d2.r2", "r2", "d2")
	d2 := s.v.Fleet().Member("d2")
	testkit.WaitFor(t, 5*time.Second, "r2's own quarantine applied", func() bool { return d2.QuarantinedUntil() > nowNano() })
}
