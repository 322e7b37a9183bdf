package router

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// meshBus is a bus the test can stop and start again at the same
// address, with the stack's connection (B) and a peer's (bustest.Mesh).
type meshBus = bustest.Mesh

func newMeshBus(t *testing.T) *meshBus { return bustest.NewMesh(t, "router") }

// decodeEngineOf sends one request and returns the decode engine that
// served it (0 if it failed).
func (s *stack) decodeEngineOf(content string) (string, int) {
	resp, _ := s.post(schemas.EndpointChat, chatBody(content, `"max_tokens":2`))
	return resp.Header.Get("X-Narwhal-Decode-Engine"), resp.StatusCode
}

func TestPlacementFromTheBucketRBRK8(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	m.SetEligible("d1", false) // known before the router starts: read cold (R-BUS-2)
	if err := s.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if !s.rt.PlacementLoaded() {
		t.Fatal("placement not loaded")
	}
	for i := 0; i < 10; i++ {
		if e, code := s.decodeEngineOf("cold"); e != "d2" || code != 200 {
			t.Fatalf("request %d went to %q (%d) while d1 is ejected", i, e, code)
		}
	}
	// A change applies within a second (R-BRK-8).
	m.SetEligible("d1", true)
	m.SetEligible("d2", false)
	start := time.Now()
	testkit.WaitFor(t, time.Second, "d2 ejected on the router", func() bool {
		return !s.rt.fleet().Member("d2").Eligible() && s.rt.fleet().Member("d1").Eligible()
	})
	t.Logf("eligibility applied in %v", time.Since(start))
	for i := 0; i < 10; i++ {
		if e, _ := s.decodeEngineOf("warm"); e != "d1" {
			t.Fatalf("request went to %q while d2 is ejected", e)
		}
	}
	// Every decode engine ejected: 503 with Retry-After (R-BRK-7).
	m.SetEligible("d1", false)
	testkit.WaitFor(t, time.Second, "d1 ejected", func() bool { return !s.rt.fleet().Member("d1").Eligible() })
	resp, body := s.post(schemas.EndpointChat, chatBody("nobody", ""))
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("status %d retry-after %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if e := errorBody(t, 503, body); e.Message != "no eligible engine for decode" {
		t.Fatalf("message %q", e.Message)
	}
	r, ready := s.get("/readyz")
	if r.StatusCode != 503 {
		t.Fatalf("readyz %d with no decode engine", r.StatusCode)
	}
	// The keys in the order of the stand-in's answer (checkUnready) and
	// of docs/mesh.md: status, then problems.
	if want := `{"status":"not ready","problems":["no eligible engine for decode"]`; !strings.HasPrefix(string(ready), want) {
		t.Errorf("readyz %s, want it to begin %s", ready, want)
	}
}

func TestQuarantineFromAnotherRouterRQUAR1(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	if err := s.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	pub := bus.NewPublisher(m.Peer, 16, nil)
	defer pub.Close()
	pub.Publish(&schemas.Quarantine{Envelope: schemas.Envelope{Schema: schemas.SchemaQuarantine, RouterID: "other-router", EngineID: "d1"},
		DurationSeconds: 30, Until: time.Now().Add(30 * time.Second).UTC(), Reason: "first_token_timeout"})
	testkit.WaitFor(t, time.Second, "quarantine applied", func() bool { return s.rt.fleet().Member("d1").QuarantinedUntil() > nowNano() })
	for i := 0; i < 10; i++ {
		if e, _ := s.decodeEngineOf("q"); e != "d2" {
			t.Fatalf("request went to quarantined %q", e)
		}
	}
	// The router's own quarantine events are not applied twice, and a
	// duration is never stretched by a skewed Until.
	pub.Publish(&schemas.Quarantine{Envelope: schemas.Envelope{Schema: schemas.SchemaQuarantine, RouterID: "skewed", EngineID: "d2"},
		DurationSeconds: 1, Until: time.Now().Add(time.Hour).UTC(), Reason: "x"})
	testkit.WaitFor(t, time.Second, "skewed quarantine applied", func() bool { return s.rt.fleet().Member("d2").QuarantinedUntil() > nowNano() })
	if until := time.Unix(0, s.rt.fleet().Member("d2").QuarantinedUntil()); time.Until(until) > 2*time.Second {
		t.Fatalf("quarantine stretched to %v", until)
	}
}

func TestBusOutageKeepsServingRBUS6(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	m.SetEligible("d1", false)
	if err := s.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	m.Emb.Shutdown()
	testkit.WaitFor(t, 3*time.Second, "bus down", func() bool { return !m.B.Connected() })
	// Serving on the last known placement; still ready.
	for i := 0; i < 5; i++ {
		if e, code := s.decodeEngineOf("outage"); e != "d2" || code != 200 {
			t.Fatalf("during the outage: %q %d", e, code)
		}
	}
	if r, _ := s.get("/readyz"); r.StatusCode != 200 {
		t.Fatalf("readyz %d during an outage with a known placement", r.StatusCode)
	}
	// The bus comes back; a change made meanwhile is picked up (resync).
	m.Start()
	testkit.WaitFor(t, 10*time.Second, "reconnected", func() bool { return m.B.Connected() && m.Peer.Connected() })
	m.SetEligible("d1", true)
	testkit.WaitFor(t, 3*time.Second, "d1 readmitted after resync", func() bool { return s.rt.fleet().Member("d1").Eligible() })
}

// TestWrongRoleCredentialIsUnreadyRBUS8 proves that a router connected to
// a bus that enforces credentials (R-BUS-8, R-BUS-11) with a file other
// than its own — the viewer's, which may read but not write, or another
// router's, which may write only under that router's id — says so on
// /readyz (503, naming the violation and its own router-<id>.creds)
// instead of reporting ready while the bus drops everything it writes:
// its request and failure events, its in-flight report, so that no
// breaker ever ejects on its word. With its own file it is ready.
func TestWrongRoleCredentialIsUnreadyRBUS8(t *testing.T) {
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	viewer := bustest.Connect(t, emb, bus.ConnectOptions{CredsFile: bustest.CredsFile(dir, bus.RoleViewer), Role: bus.RoleViewer})
	for _, c := range []struct {
		what  string
		creds func(id string) string
		ready bool
	}{
		{"its own", func(id string) string { return bustest.Identity(t, dir, bus.RoleRouter, id) }, true},
		{"the viewer's", func(string) string { return bustest.CredsFile(dir, bus.RoleViewer) }, false},
		{"another router's", func(string) string { return bustest.Identity(t, dir, bus.RoleRouter, "someone-else") }, false},
	} {
		s := newStack(t, pd(), nil)
		s.waitModels()
		id := s.rt.ID()
		b := bustest.Connect(t, emb, bus.ConnectOptions{CredsFile: c.creds(id), Role: bus.RoleRouter, ID: id})
		if err := s.rt.JoinMesh(b, 5*time.Second); err != nil {
			t.Fatalf("%s: %v", c.what, err)
		}
		if c.ready {
			// Two of its in-flight reports (one a second) written: the
			// bus took its writes.
			kv, err := viewer.JetStream().KeyValue(t.Context(), bus.RoutersBucket)
			if err != nil {
				t.Fatal(err)
			}
			first := uint64(0)
			testkit.WaitFor(t, 5*time.Second, "two in-flight reports of "+id, func() bool {
				e, err := kv.Get(t.Context(), id)
				if err != nil {
					return false
				}
				if first == 0 {
					first = e.Revision()
				}
				return e.Revision() != first
			})
			if resp, body := s.get("/readyz"); resp.StatusCode != 200 {
				t.Errorf("with %s credential: /readyz %d %s, want 200", c.what, resp.StatusCode, body)
			}
			continue
		}
		var body []byte
		want := bus.IdentityCredsFile(bus.RoleRouter, id)
		testkit.WaitFor(t, 5*time.Second, "/readyz 503 naming the refused writes and "+want, func() bool {
			var resp *http.Response
			resp, body = s.get("/readyz")
			return resp.StatusCode == 503 && strings.Contains(string(body), "Permissions Violation") && strings.Contains(string(body), want)
		})
	}
}
