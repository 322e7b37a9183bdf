package breaker

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// thiefEndpoint is an HTTP server of an attacker's that counts every TCP
// connection made to it and records the Authorization header of every
// request it reads.
type thiefEndpoint struct {
	srv   *httptest.Server
	conns atomic.Int64
	mu    sync.Mutex
	auths []string
}

// startThief starts a thiefEndpoint on a real socket, closed when the
// test ends.
func startThief(t *testing.T) *thiefEndpoint {
	t.Helper()
	te := &thiefEndpoint{}
	te.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		te.mu.Lock()
		te.auths = append(te.auths, r.Header.Get("Authorization"))
		te.mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	te.srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			te.conns.Add(1)
		}
	}
	te.srv.Start()
	t.Cleanup(te.srv.Close)
	return te
}

// seen returns the connections made and the Authorization headers read.
func (te *thiefEndpoint) seen() (int64, []string) {
	te.mu.Lock()
	defer te.mu.Unlock()
	return te.conns.Load(), append([]string(nil), te.auths...)
}

// TestRegistrationKeyEnvOfItsIDOnlyRFLEET5 proves R-FLEET-5 for the API
// key: a registration whose api_key_env names a variable other than its
// id's (another engine's key, the bus credential's path) is refused and
// counted under reason api_key_env, is never written to the fleet, and
// its URL gets no connection at all; a registration naming its id's
// variable, NARWHAL_ENGINE_KEY_<ID>, of an engine that requires that key
// is probed with it and becomes active.
func TestRegistrationKeyEnvOfItsIDOnlyRFLEET5(t *testing.T) {
	const secret, ownKey = "d1-secret-key", "x8-own-key"
	t.Setenv("D1_API_KEY", secret)
	t.Setenv("NARWHAL_TEST_BUS_SECRET", secret)
	t.Setenv(schemas.EngineKeyEnv("x8"), ownKey)
	h := newHarness(t, setup{})
	r := h.startLeader("breaker-1")
	thief := startThief(t)

	h.register(schemas.Registration{EngineID: "x9", URL: thief.srv.URL, Role: "decode", APIKeyEnv: "D1_API_KEY"}, "")
	h.register(schemas.Registration{EngineID: "x9-b", URL: thief.srv.URL, Role: "decode", APIKeyEnv: "NARWHAL_TEST_BUS_SECRET"}, "")
	// Its own id's variable, but of another id: refused too.
	h.register(schemas.Registration{EngineID: "x7", URL: thief.srv.URL, Role: "decode", APIKeyEnv: schemas.EngineKeyEnv("x8")}, "")

	// The derived name works end to end: a simulated engine that requires
	// its key is checked with it and made active.
	x8 := simtest.Start(t, sim.Config{Role: "both", EngineID: "x8", Model: testModel, APIKey: ownKey})
	h.register(schemas.Registration{EngineID: "x8", URL: x8.URL(), Role: "both", APIKeyEnv: schemas.EngineKeyEnv("x8")}, "")
	testkit.WaitFor(t, waitBound, "x8 active after probes with its own key", func() bool {
		e, _ := h.fleetEntry("x8")
		return e.State == schemas.FleetActive
	})
	if e, _ := h.fleetEntry("x8"); e.APIKeyEnv != "NARWHAL_ENGINE_KEY_X8" {
		t.Fatalf("x8's entry names api_key_env %q", e.APIKeyEnv)
	}

	// The stream is read in order: x8's registration came after the
	// refused ones, so they were judged by now.
	if got := refused(r.Service, RefusedKeyEnv); got != 3 {
		t.Errorf("registrations refused for api_key_env: %v, want 3", got)
	}
	for _, id := range []string{"x9", "x9-b", "x7"} {
		if e, rev := h.fleetEntry(id); rev != 0 {
			t.Errorf("refused %s is in the fleet: %+v", id, e)
		}
	}
	if conns, auths := thief.seen(); conns != 0 || len(auths) != 0 {
		t.Fatalf("the thief's URL got %d connections, Authorization headers %q; want none", conns, auths)
	}
}

// TestRegisteredEntryReadsOnlyItsKeyVariableRFLEET5 proves the second
// wall of R-FLEET-5: an entry of source registration in narwhal_fleet
// naming another variable (written past the breaker, as an older forged
// value would be) is no engine a process builds — the breaker's fleet
// watch ignores it and sends its URL no request, so no router or breaker
// ever reads that variable for it — while an operator's entry (source
// command) naming any variable is built and probed with its value.
func TestRegisteredEntryReadsOnlyItsKeyVariableRFLEET5(t *testing.T) {
	const secret = "d1-secret-key"
	t.Setenv("D1_API_KEY", secret)
	h := newHarness(t, setup{})
	h.startLeader("breaker-1")
	thief := startThief(t)
	ctx := context.Background()
	fleetKV, err := h.bus.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	put := func(e schemas.FleetEntry) {
		t.Helper()
		v, _ := json.Marshal(e)
		if _, err := fleetKV.Put(ctx, e.EngineID, v); err != nil {
			t.Fatal(err)
		}
	}
	put(schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "x9", URL: thief.srv.URL, Role: "decode", Connector: "nixl",
		APIKeyEnv: "D1_API_KEY", State: schemas.FleetJoining, Since: now, At: now, Source: schemas.SourceRegistration, By: "forger", TTLS: 30})
	// The operator's entry, written after: once the breaker probes it, it
	// has read x9's too.
	op := simtest.Start(t, sim.Config{Role: "both", EngineID: "op1", Model: testModel, APIKey: secret})
	put(schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "op1", URL: op.URL(), Role: "both", Connector: "nixl",
		APIKeyEnv: "D1_API_KEY", State: schemas.FleetJoining, Since: now, At: now, Source: schemas.SourceCommand, By: "narwhal-fleet"})
	testkit.WaitFor(t, waitBound, "op1 active, probed with D1_API_KEY", func() bool {
		e, _ := h.fleetEntry("op1")
		return e.State == schemas.FleetActive
	})
	// A built entry would have been probed with op1 (every
	// recovery.readmit_interval_s): a few intervals more, and none came.
	time.Sleep(3 * time.Duration(h.cfg.Recovery.ReadmitIntervalS*float64(time.Second)))
	if conns, auths := thief.seen(); conns != 0 || len(auths) != 0 {
		t.Fatalf("the forged entry's URL got %d connections, Authorization headers %q; want none", conns, auths)
	}
	if e, _ := h.fleetEntry("x9"); e.State != schemas.FleetJoining {
		t.Fatalf("the forged entry became %s", e.State)
	}
}

// TestRegistrationTTLCappedRFLEET5 proves the bound of R-FLEET-5 on a
// registration's TTL: one asking ttl_s 86400 gets a fleet key whose TTL
// is membership.max_registration_ttl_s, and once its heartbeats stop (as
// after its credential is revoked) the engine leaves the fleet within
// that cap, not a day later.
func TestRegistrationTTLCappedRFLEET5(t *testing.T) {
	h := newHarness(t, setup{})
	h.cfg.Membership.MaxRegistrationTTLS = 2
	h.startLeader("breaker-1")
	d := simtest.Start(t, sim.Config{Role: "decode", EngineID: "x9", Model: testModel})
	h.register(schemas.Registration{EngineID: "x9", URL: d.URL(), Role: "decode", TTLS: 86400}, "")
	testkit.WaitFor(t, waitBound, "x9 in the fleet", func() bool { _, rev := h.fleetEntry("x9"); return rev != 0 })
	written := time.Now()
	e, _ := h.fleetEntry("x9")
	if e.TTLS != 2 {
		t.Errorf("x9's entry carries ttl_s %v, want the cap 2", e.TTLS)
	}
	msg, err := h.bus.JetStream().Stream(context.Background(), "KV_"+bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := msg.GetLastMsgForSubject(context.Background(), "$KV."+bus.FleetBucket+".x9")
	if err != nil {
		t.Fatal(err)
	}
	if ttl := raw.Header.Get("Nats-TTL"); ttl != "2s" {
		t.Errorf("x9's fleet key has Nats-TTL %q, want 2s (membership.max_registration_ttl_s)", ttl)
	}
	// No heartbeat follows: the key lapses within the cap (NATS removes
	// expired messages within about a second).
	testkit.WaitFor(t, waitBound, "x9 gone from the fleet", func() bool { _, rev := h.fleetEntry("x9"); return rev == 0 })
	if took := time.Since(written); took > 2*time.Second+2*time.Second {
		t.Errorf("x9 left the fleet %v after its last write, want within the 2 s cap (+2 s slack)", took)
	}
	if strings.Contains(strings.Join(h.fleetIDs(), ","), "x9") {
		t.Errorf("x9 still listed: %v", h.fleetIDs())
	}
}
