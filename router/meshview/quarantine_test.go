package meshview

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestForgedPushDeliveryNotAppliedRBUS11 proves R-BUS-11 for the
// quarantines a router applies, on a server that enforces the
// credentials: router r2 publishes a quarantine event that claims router
// r1 on its own prefix subject (narwhal.prefix.r2, stored in
// NARWHAL_PREFIX) and makes a push consumer there whose deliver subject
// is narwhal.events.quarantine.d1.r1 — nats-server lets it, and the
// admin's core subscription there receives a payload saying r1
// quarantined d1 — yet the router (its own credential,
// joined to the mesh) does not quarantine d1: it reads quarantine events
// from stream NARWHAL_EVENTS, which never stored that delivery. r2's
// real quarantine of d2, published after, applies.
func TestForgedPushDeliveryNotAppliedRBUS11(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	dir := bustest.Credentials(t)
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: dir})
	connect := func(id string) *bus.Bus {
		return bustest.Connect(t, e, bus.ConnectOptions{Name: "router-" + id,
			CredsFile: bustest.Identity(t, dir, bus.RoleRouter, id), Role: bus.RoleRouter, ID: id})
	}
	own := connect(s.cfg.Router.ID)
	r2 := connect("r2")
	admin := bustest.Connect(t, e, bus.ConnectOptions{Name: "admin", CredsFile: bustest.CredsFile(dir, bus.RoleAdmin)})
	if err := s.v.Join(own, 500*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// What a core subscription on the event subject would receive (a push
	// consumer delivers where a literal subscription shows interest).
	forged := "narwhal.events.quarantine.d1.r1"
	delivered := make(chan *nats.Msg, 4)
	sub, err := admin.Conn().Subscribe(forged, func(m *nats.Msg) { delivered <- m })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := admin.Conn().Flush(); err != nil {
		t.Fatal(err)
	}

	quarantine := func(router, engine string) []byte {
		b, _ := json.Marshal(schemas.Quarantine{
			Envelope:        schemas.Envelope{Schema: schemas.SchemaQuarantine, ID: newID(), At: nowUTC(), RouterID: router, EngineID: engine},
			DurationSeconds: 30, Until: time.Now().Add(30 * time.Second).UTC(), Reason: "first_token_timeout"})
		return b
	}
	if _, err := r2.JetStream().Publish(ctx, bus.PrefixSubject("r2"), quarantine("r1", "d1")); err != nil {
		t.Fatalf("r2 publishes on its prefix subject: %v (%v)", err, r2.PermissionError())
	}
	// Under r2's own consumer name, the only one its credential may make
	// (R-BUS-11): the server does not check the deliver subject.
	forger := r2.ConsumerName(bus.PurposePrefix)
	body := `{"stream_name":"` + bus.PrefixStream + `","config":{"name":"` + forger + `","deliver_subject":"` + forged +
		`","deliver_policy":"all","ack_policy":"none","filter_subject":"` + bus.PrefixSubject("r2") + `"}}`
	reply, err := r2.Conn().RequestWithContext(ctx, "$JS.API.CONSUMER.CREATE."+bus.PrefixStream+"."+forger+"."+bus.PrefixSubject("r2"), []byte(body))
	if err != nil || strings.Contains(string(reply.Data), `"error"`) {
		t.Fatalf("r2 makes a push consumer delivering to %s: %v %s (%v)", forged, err, replyData(reply), r2.PermissionError())
	}
	select {
	case m := <-delivered:
		var q schemas.Quarantine
		if err := json.Unmarshal(m.Data, &q); err != nil || q.RouterID != "r1" || q.EngineID != "d1" {
			t.Fatalf("the forged delivery: %s %s %v", m.Subject, m.Data, err)
		}
		// The message keeps the subject it was published on.
		t.Logf("delivered to %s as a message on %s", forged, m.Subject)
	case <-ctx.Done():
		t.Fatal("the push consumer delivered nothing: the attack this test guards against did not happen")
	}

	// A real quarantine, after the forged one in time: applied within a
	// second (R-QUAR-1, as the core subscription did).
	published := time.Now()
	if _, err := r2.JetStream().Publish(ctx, "narwhal.events.quarantine.d2.r2", quarantine("r2", "d2")); err != nil {
		t.Fatalf("r2 publishes its quarantine of d2: %v (%v)", err, r2.PermissionError())
	}
	d1, d2 := s.v.Fleet().Member("d1"), s.v.Fleet().Member("d2")
	testkit.WaitFor(t, 5*time.Second, "r2's own quarantine of d2 applied", func() bool { return d2.QuarantinedUntil() > nowNano() })
	if took := time.Since(published); took > time.Second {
		t.Errorf("r2's quarantine applied %v after its publish, want within a second", took)
	} else {
		t.Logf("r2's quarantine applied within %v of its publish", took)
	}
	if d1.QuarantinedUntil() > nowNano() {
		t.Fatal("the forged push delivery quarantined d1 on the router")
	}
	if err := own.PermissionError(); err != nil {
		t.Errorf("the router's own credential: %v", err)
	}
}

// replyData is a reply's payload, or "" for none.
func replyData(m *nats.Msg) string {
	if m == nil {
		return ""
	}
	return string(m.Data)
}

// TestRouterJoiningLateAppliesRunningQuarantinesRQUAR1 proves the start
// of the routers' quarantine consumer (R-QUAR-1): a quarantine another
// router published before this router joined, still running, applies on
// joining, for what is left of it; one that lapsed already does not.
func TestRouterJoiningLateAppliesRunningQuarantinesRQUAR1(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	publish := func(engine string, d time.Duration, until time.Time) {
		t.Helper()
		b, _ := json.Marshal(schemas.Quarantine{
			Envelope:        schemas.Envelope{Schema: schemas.SchemaQuarantine, ID: newID(), At: nowUTC(), RouterID: "r2", EngineID: engine},
			DurationSeconds: d.Seconds(), Until: until.UTC(), Reason: "first_token_timeout"})
		if _, err := m.Peer.JetStream().Publish(ctx, "narwhal.events.quarantine."+engine+".r2", b); err != nil {
			t.Fatal(err)
		}
	}
	running := time.Now().Add(30 * time.Second)
	publish("d1", 30*time.Second, running)
	publish("d2", 30*time.Second, time.Now().Add(-time.Second)) // lapsed
	if err := s.v.Join(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	d1, d2 := s.v.Fleet().Member("d1"), s.v.Fleet().Member("d2")
	testkit.WaitFor(t, time.Second, "d1's running quarantine applied", func() bool { return d1.QuarantinedUntil() > nowNano() })
	if until := time.Unix(0, d1.QuarantinedUntil()); until.After(running) {
		t.Errorf("d1 quarantined until %v, beyond the event's %v", until, running)
	}
	if d2.QuarantinedUntil() > nowNano() {
		t.Error("a lapsed quarantine applied on joining")
	}
}
