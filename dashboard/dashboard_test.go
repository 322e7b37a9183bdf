package dashboard

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// testBound bounds each wait of these tests.
const testBound = 15 * time.Second

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	t.Cleanup(cancel)
	return ctx
}

// TestHandlerIsReadOnly checks what the page's handler answers: its
// files and the snapshot for GET and HEAD, 405 for every other method,
// the security headers on every answer, and a page that holds no inline
// script or style and never parses bus text as HTML (R-BUS-8: the page
// can change nothing).
func TestHandlerIsReadOnly(t *testing.T) {
	d := New(Options{Fleet: []Engine{{ID: "p1", Role: "prefill"}}})
	srv := httptest.NewServer(d.Handler())
	defer srv.Close()
	for _, c := range []struct {
		method, path string
		status       int
		ctype        string
	}{
		{"GET", "/", 200, "text/html"},
		{"HEAD", "/", 200, "text/html"},
		{"GET", "/app.js", 200, "text/javascript"},
		{"GET", "/app.css", 200, "text/css"},
		{"GET", "/icon.svg", 200, "image/svg+xml"},
		{"GET", "/state", 200, "application/json"},
		{"GET", "/healthz", 200, "text/plain"},
		{"GET", "/nothing", 404, ""},
		{"GET", "/page/index.html", 404, ""},
		{"POST", "/", 405, ""},
		{"POST", "/state", 405, ""},
		{"PUT", "/events", 405, ""},
		{"DELETE", "/state", 405, ""},
		{"PATCH", "/", 405, ""},
		{"OPTIONS", "/", 405, ""},
	} {
		req, _ := http.NewRequest(c.method, srv.URL+c.path, strings.NewReader("{}"))
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Errorf("%s %s: %d, want %d", c.method, c.path, resp.StatusCode, c.status)
		}
		if c.ctype != "" && !strings.HasPrefix(resp.Header.Get("Content-Type"), c.ctype) {
			t.Errorf("%s %s: Content-Type %q, want %s", c.method, c.path, resp.Header.Get("Content-Type"), c.ctype)
		}
		if c.status == 405 && resp.Header.Get("Allow") != "GET, HEAD" {
			t.Errorf("%s %s: Allow %q", c.method, c.path, resp.Header.Get("Allow"))
		}
		if got := resp.Header.Get("Content-Security-Policy"); got != ContentSecurityPolicy {
			t.Errorf("%s %s: CSP %q", c.method, c.path, got)
		}
		if resp.Header.Get("X-Content-Type-Options") != "nosniff" || resp.Header.Get("X-Frame-Options") != "DENY" {
			t.Errorf("%s %s: headers %v", c.method, c.path, resp.Header)
		}
	}
	for _, need := range []string{"default-src 'none'", "script-src 'self'", "style-src 'self'", "frame-ancestors 'none'", "form-action 'none'"} {
		if !strings.Contains(ContentSecurityPolicy, need) {
			t.Errorf("CSP lacks %s", need)
		}
	}
	if strings.Contains(ContentSecurityPolicy, "unsafe") {
		t.Errorf("CSP allows unsafe sources: %s", ContentSecurityPolicy)
	}

	// The page's own files: scripts only from /app.js, no inline handlers
	// or style attributes (the CSP would block them), no form, and the
	// script never turns text into HTML.
	html := read(t, srv.URL+"/")
	if m := regexp.MustCompile(`<script(?:\s[^>]*)?>`).FindAllString(html, -1); len(m) != 1 || !strings.Contains(m[0], `src="/app.js"`) {
		t.Errorf("script tags %q, want one, src=/app.js", m)
	}
	for _, bad := range []string{" style=", " onclick=", " onload=", "<form", "<iframe", "http://", "https://"} {
		if strings.Contains(html, bad) {
			t.Errorf("index.html holds %q", bad)
		}
	}
	js := read(t, srv.URL+"/app.js")
	for _, bad := range []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function", "fetch(", "XMLHttpRequest", "method:", "http://", "https://"} {
		if strings.Contains(js, bad) {
			t.Errorf("app.js uses %q", bad)
		}
	}
	if !strings.Contains(js, "textContent") || !strings.Contains(js, `new EventSource("/events")`) {
		t.Error("app.js does not set textContent or follow /events")
	}

	var snap Snapshot
	if err := json.Unmarshal([]byte(read(t, srv.URL+"/state")), &snap); err != nil {
		t.Fatal(err)
	}
	if len(snap.Engines) != 1 || snap.Engines[0].ID != "p1" || snap.Engines[0].Role != "prefill" || snap.Engines[0].State != stateEligible {
		t.Errorf("snapshot engines %+v, want the configured p1", snap.Engines)
	}
}

func read(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestEventsStream checks the Server-Sent Events the browser follows: a
// first snapshot at once, another within a second of a change, and a
// refusal beyond MaxStreams.
func TestEventsStream(t *testing.T) {
	d := New(Options{})
	srv := httptest.NewServer(d.Handler())
	defer srv.Close()
	req, _ := http.NewRequestWithContext(testContext(t), http.MethodGet, srv.URL+"/events", nil)
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("HTTP %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	r := bufio.NewReader(resp.Body)
	next := func() Snapshot {
		t.Helper()
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				t.Fatal(err)
			}
			if data, ok := strings.CutPrefix(line, "data: "); ok {
				var s Snapshot
				if err := json.Unmarshal([]byte(data), &s); err != nil {
					t.Fatalf("data %q: %v", data, err)
				}
				return s
			}
		}
	}
	if s := next(); len(s.Engines) != 0 {
		t.Fatalf("first snapshot %+v", s)
	}
	start := time.Now()
	d.st.configure([]Engine{{ID: "d1", Role: "decode"}})
	for {
		s := next()
		if len(s.Engines) == 1 {
			break
		}
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("a change reached the stream after %v, want within a second", took)
	}

	d.streams.Store(MaxStreams)
	resp2, err := http.Get(srv.URL + "/events")
	if err != nil {
		t.Fatal(err)
	}
	resp2.Body.Close()
	if resp2.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("stream beyond MaxStreams: HTTP %d, want 503", resp2.StatusCode)
	}
}

// viewerBus starts an embedded bus with role credentials (R-BUS-8) and
// returns an admin connection, which writes what the test shows, and a
// viewer connection, which the dashboard reads with.
func viewerBus(t *testing.T) (admin, viewer *bus.Bus) {
	t.Helper()
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	connect := func(role string) *bus.Bus {
		return bustest.Connect(t, emb, bus.ConnectOptions{Name: "test-" + role, CredsFile: bustest.CredsFile(dir, role)})
	}
	return connect(bus.RoleAdmin), connect(bus.RoleViewer)
}

func put(t *testing.T, b *bus.Bus, bucket, key string, v any) {
	t.Helper()
	kv, err := b.BindBucket(testContext(t), bucket)
	if err != nil {
		t.Fatal(err)
	}
	raw, ok := v.([]byte)
	if !ok {
		if raw, err = json.Marshal(v); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := kv.Put(testContext(t), key, raw); err != nil {
		t.Fatal(err)
	}
}

func env(schema, id, router, breaker, engine string) schemas.Envelope {
	return schemas.Envelope{Schema: schema, ID: id, At: time.Now().UTC(), RouterID: router, BreakerID: breaker, EngineID: engine}
}

func fleetEntry(id, role, state string) schemas.FleetEntry {
	now := time.Now().UTC()
	return schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: id, URL: "http://127.0.0.1:1", Role: role,
		Connector: "nixl", State: state, Since: now, At: now, Source: schemas.SourceCommand, By: "test"}
}

func placement(id string, eligible bool, streak int, reason string) map[string]any {
	state := schemas.StateEligible
	if !eligible {
		state = schemas.StateEjected
	}
	return map[string]any{"schema": schemas.SchemaEligibility, "id": "pl-" + id, "at": time.Now().UTC(), "breaker_id": "b1",
		"engine_id": id, "eligible": eligible, "state": state, "streak": streak, "reason": reason, "lease_term": 1}
}

// TestFleetFromTheBus feeds a dashboard from a bus through the viewer's
// credential (read-only, R-BUS-8, R-BUS-5): the live fleet's roles and
// states, placement (ejection and streak, R-BRK-1, R-BUS-2), the routers'
// in-flight reports (R-FLEET-3), armed chaos faults (R-CHAOS-1), and the
// events (failures, request latencies and rates, quarantine, probes,
// R-BUS-1) become one snapshot; invalid values are counted, not shown.
func TestFleetFromTheBus(t *testing.T) {
	admin, viewer := viewerBus(t)
	put(t, admin, bus.FleetBucket, "p1", fleetEntry("p1", "prefill", schemas.FleetActive))
	put(t, admin, bus.FleetBucket, "d1", fleetEntry("d1", "decode", schemas.FleetActive))
	put(t, admin, bus.FleetBucket, "d2", fleetEntry("d2", "decode", schemas.FleetDraining))
	put(t, admin, bus.FleetBucket, "j1", fleetEntry("j1", "both", schemas.FleetJoining))
	put(t, admin, bus.PlacementBucket, "p1", placement("p1", true, 1, "1 consecutive failures"))
	put(t, admin, bus.PlacementBucket, "d1", placement("d1", false, 3, "ejected after 3 consecutive failures"))
	put(t, admin, bus.PlacementBucket, "bad", []byte(`{"not":"a placement value"}`))
	put(t, admin, bus.RoutersBucket, "rt-1", schemas.RouterReport{Schema: schemas.SchemaRouterReport, RouterID: "rt-1",
		At: time.Now().UTC(), Draining: map[string]int64{"d2": 0}, InFlight: map[string]int64{"p1": 2, "d2": 1}})
	put(t, admin, bus.ChaosBucket, "d1.http-status", map[string]any{"engine_id": "d1", "id": "http-status", "fault": "http-status",
		"phase": "decode", "probability": 1, "count": 3, "left": 2, "params": map[string]string{"code": "503"},
		"armed_at": time.Now().UTC(), "expires": time.Now().Add(time.Minute).UTC()})

	d := New(Options{Bus: viewer})
	// The page's clock stands still a second ahead: every event of the test
	// falls within the rates' 10 s window however slow the machine is
	// (one from after it is shown at it).
	fixed := time.Now().Add(time.Second)
	d.st.now = func() time.Time { return fixed }
	runUntilDone(t, d)

	ttft, firstByte := 0.05, 0.25
	prompt, completion := 10, 11
	for i, status := range []int{200, 200, 502} {
		e := &schemas.RequestCompleted{Envelope: env(schemas.SchemaRequest, "r"+string(rune('0'+i)), "rt-1", "", ""),
			Endpoint: schemas.EndpointChat, Model: "m", Stream: true, Status: status, ProducerID: "p1", ConsumerID: "d2",
			Attempts: 1, TTFTSeconds: &ttft, FirstByteSeconds: &firstByte, DurationSeconds: 1.25, PromptTokens: &prompt, CompletionTokens: &completion}
		e.RequestID = "req-" + e.ID
		if status != 200 {
			e.ErrorKind, e.FirstByteSeconds = "upstream_status", nil
		}
		bustest.Publish(t, admin, e)
	}
	hostile := `<script>alert(1)</script>`
	bustest.Publish(t, admin, &schemas.Failure{Envelope: env(schemas.SchemaFailure, "f1", "rt-1", "", "d1"),
		Phase: schemas.PhaseDecode, Kind: "upstream_status", Status: 502, Message: hostile, Counts: true, Attempt: 1})
	bustest.Publish(t, admin, &schemas.Eligibility{Envelope: env(schemas.SchemaEligibility, "e1", "", "b1", "d1"),
		State: schemas.StateEjected, Streak: 3, Reason: "ejected after 3 consecutive failures"})
	bustest.Publish(t, admin, &schemas.Quarantine{Envelope: env(schemas.SchemaQuarantine, "q1", "rt-1", "", "p1"),
		DurationSeconds: 60, Until: time.Now().Add(time.Minute).UTC(), Reason: "first_token_timeout"})
	bustest.Publish(t, admin, &schemas.Probe{Envelope: env(schemas.SchemaProbe, "pr1", "", "b1", "d1"),
		Outcome: schemas.ProbeFailure, Phase: schemas.PhaseDecode, ProducerID: "p1", ConsumerID: "d1", Message: "health check: 503"})
	if _, err := admin.JetStream().Publish(testContext(t), "narwhal.events.failure.d1", []byte(`{"schema":"narwhal.failure.v1"}`)); err != nil {
		t.Fatal(err)
	}

	var snap Snapshot
	ready := func() bool {
		b, _ := d.st.snapshotJSON()
		snap = Snapshot{}
		_ = json.Unmarshal(b, &snap)
		if len(snap.Engines) != 4 || len(snap.Routers) != 1 || len(snap.Failures) != 1 || len(snap.Faults) != 1 || len(snap.Timeline) != 2 {
			return false
		}
		return snap.Routers[0].Requests == 3 && snap.Engines[0].Probe != nil && snap.Ignored >= 2
	}
	if !testkit.Poll(testBound, 10*time.Millisecond, ready) {
		b, _ := json.MarshalIndent(snap, "", " ")
		t.Fatalf("not everything published reached the snapshot:\n%s", b)
	}

	byID := map[string]engineView{}
	for _, e := range snap.Engines {
		byID[e.ID] = e
	}
	for id, want := range map[string][2]string{
		"p1": {"prefill", stateQuarantined}, "d1": {"decode", stateEjected},
		"d2": {"decode", stateDraining}, "j1": {"both", stateProbing},
	} {
		if e := byID[id]; e.Role != want[0] || e.State != want[1] {
			t.Errorf("engine %s: role %q state %q, want %s %s", id, e.Role, e.State, want[0], want[1])
		}
	}
	if e := byID["d1"]; e.Streak != 3 || e.Probe.Outcome != schemas.ProbeFailure || e.Failures != 1 {
		t.Errorf("d1: %+v, want streak 3, its failed probe and one failure", e)
	}
	if e := byID["p1"]; e.InFlight != 2 || e.TTFT == nil || *e.TTFT != ttft || e.QuarantinedUntil == nil {
		t.Errorf("p1: %+v, want 2 in flight, TTFT %v, quarantined", e, ttft)
	}
	// The consumer's first byte, and its mean inter-token latency: the
	// second after the first byte over the 10 tokens after the first.
	if e := byID["d2"]; e.InFlight != 1 || e.FirstByte == nil || *e.FirstByte != firstByte || e.ITL == nil || *e.ITL != 0.1 {
		t.Errorf("d2: %+v, want 1 in flight, first byte %v, ITL 0.1", e, firstByte)
	}
	if r := snap.Routers[0]; r.ID != "rt-1" || r.Errors != 1 || r.RequestRate != 0.3 || r.ErrorRate < 0.33 || r.ErrorRate > 0.34 || r.InFlight != 3 {
		t.Errorf("router %+v, want 3 requests in the last 10 s, 1 error, 3 in flight", r)
	}
	if f := snap.Failures[0]; f.Message != hostile || f.EngineID != "d1" || f.Kind != "upstream_status" {
		t.Errorf("failure %+v, want the message kept as it came", f)
	}
	if f := snap.Faults[0]; f.EngineID != "d1" || f.Fault != "http-status" || f.Left != 2 || f.Params != "code=503" {
		t.Errorf("fault %+v", f)
	}
	whats := []string{snap.Timeline[0].What, snap.Timeline[1].What}
	if !strings.Contains(strings.Join(whats, " "), whatEjected) || !strings.Contains(strings.Join(whats, " "), whatQuarantined) {
		t.Errorf("timeline %+v, want the ejection and the quarantine", snap.Timeline)
	}

	// Readmission and removal reach the snapshot too.
	bustest.Publish(t, admin, &schemas.Eligibility{Envelope: env(schemas.SchemaEligibility, "e2", "", "b1", "d1"),
		Eligible: true, State: schemas.StateEligible, Reason: "readmitted after a successful inference probe"})
	put(t, admin, bus.PlacementBucket, "d1", placement("d1", true, 0, "readmitted after a successful inference probe"))
	kv, err := admin.BindBucket(testContext(t), bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(testContext(t), "j1"); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, testBound, "d1 readmitted and j1 gone", func() bool {
		b, _ := d.st.snapshotJSON()
		snap = Snapshot{}
		_ = json.Unmarshal(b, &snap)
		return len(snap.Engines) == 3 && snap.Engines[0].ID == "d1" && snap.Engines[0].State == stateEligible &&
			len(snap.Timeline) == 3 && snap.Timeline[0].What == whatReadmitted
	})
}

// TestBounds checks that hostile input cannot grow the page without
// limit: engines, failures and the timeline are capped, long text is cut
// at a rune boundary, and an event from the future is shown at now.
func TestBounds(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	s := newState(func() time.Time { return now })
	for i := range maxEngines + 10 {
		s.applyFleet("e"+strings.Repeat("x", i%7)+string(rune('a'+i%26))+strconv.Itoa(i), &schemas.FleetEntry{Role: "decode", State: schemas.FleetActive})
	}
	long := strings.Repeat("é", maxText)
	for i := range maxFailures + 5 {
		s.applyFailure(&schemas.Failure{Envelope: schemas.Envelope{EngineID: "d1", At: now.Add(time.Hour)}, Message: long, Kind: strconv.Itoa(i)})
	}
	for range maxTimeline + 5 {
		s.applyEligibilityEvent(&schemas.Eligibility{Envelope: schemas.Envelope{EngineID: "d1", At: now}})
	}
	snap := s.snapshot()
	if len(snap.Engines) != maxEngines || s.ignored != 10 {
		t.Errorf("%d engines, %d ignored; want %d and 10", len(snap.Engines), s.ignored, maxEngines)
	}
	if len(snap.Failures) != maxFailures || snap.Failures[0].Kind != strconv.Itoa(maxFailures+4) {
		t.Errorf("%d failures, newest %q", len(snap.Failures), snap.Failures[0].Kind)
	}
	if m := snap.Failures[0].Message; len(m) > maxText+len("…") || !strings.HasSuffix(m, "é…") {
		t.Errorf("message cut to %d bytes: ...%q", len(m), m[len(m)-8:])
	}
	if !snap.Failures[0].At.Equal(now) {
		t.Errorf("an event from the future shown at %v, want now", snap.Failures[0].At)
	}
	if len(snap.Timeline) != maxTimeline {
		t.Errorf("%d timeline entries, want %d", len(snap.Timeline), maxTimeline)
	}
	if got := clip("a\xffb", 10); got != "a\uFFFDb" {
		t.Errorf("clip of invalid UTF-8 = %q", got)
	}
}

// TestEventsBeforeTheBuckets checks that events replayed at start, which
// may come before the buckets' first read, are kept for an engine the
// buckets name later (R-BUS-2, R-FLEET-1), and that ids no bucket names
// give their room up to one that does.
func TestEventsBeforeTheBuckets(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	s := newState(func() time.Time { return now })
	s.applyProbe(&schemas.Probe{Envelope: schemas.Envelope{EngineID: "d1", At: now}, Outcome: schemas.ProbeFailure})
	s.applyQuarantine(&schemas.Quarantine{Envelope: schemas.Envelope{EngineID: "d1", At: now}, Until: now.Add(time.Minute)})
	s.applyFailure(&schemas.Failure{Envelope: schemas.Envelope{EngineID: "d1", At: now}})
	if snap := s.snapshot(); len(snap.Engines) != 0 {
		t.Fatalf("an id no bucket names is shown: %+v", snap.Engines)
	}
	s.applyFleet("d1", &schemas.FleetEntry{Role: "decode", State: schemas.FleetActive})
	snap := s.snapshot()
	if len(snap.Engines) != 1 || snap.Engines[0].Probe == nil || snap.Engines[0].Failures != 1 || snap.Engines[0].State != stateQuarantined {
		t.Fatalf("d1 after its events: %+v", snap.Engines)
	}
	// Forged ids fill the records; a real engine's events still land.
	for i := range maxEngines {
		s.applyFailure(&schemas.Failure{Envelope: schemas.Envelope{EngineID: "forged-" + strconv.Itoa(i), At: now}})
	}
	s.applyFleet("d2", &schemas.FleetEntry{Role: "decode", State: schemas.FleetActive})
	s.applyFailure(&schemas.Failure{Envelope: schemas.Envelope{EngineID: "d2", At: now}})
	for _, e := range s.snapshot().Engines {
		if e.Failures != 1 {
			t.Errorf("%s: %d failures, want 1", e.ID, e.Failures)
		}
	}
}

// TestForgedRouterEventsNotShownRBUS11 feeds a dashboard events whose
// payload contradicts their subject, published on a plain connection
// (behaviour.md R-BUS-11): a failure of router rt-1 on rt-2's subject, a
// failure on an old four-token subject, a request event of rt-1 on rt-2's
// subject and a quarantine of d1 on p1's subject. None is shown, each is
// counted in the page's ignored count; the genuine failure is shown.
func TestForgedRouterEventsNotShownRBUS11(t *testing.T) {
	admin, viewer := viewerBus(t)
	put(t, admin, bus.FleetBucket, "p1", fleetEntry("p1", "prefill", schemas.FleetActive))
	put(t, admin, bus.FleetBucket, "d1", fleetEntry("d1", "decode", schemas.FleetActive))
	d := New(Options{Bus: viewer})
	runUntilDone(t, d)
	raw := func(subject string, ev schemas.Event) {
		t.Helper()
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		if err := bus.ValidateEvent(b); err != nil {
			t.Fatalf("the forged event is not a valid one: %v", err)
		}
		if _, err := admin.JetStream().Publish(testContext(t), subject, b); err != nil {
			t.Fatal(err)
		}
	}
	failure := func(id string) *schemas.Failure {
		return &schemas.Failure{Envelope: env(schemas.SchemaFailure, id, "rt-1", "", "d1"),
			Phase: schemas.PhaseDecode, Kind: "upstream_status", Status: 502, Message: id, Counts: true, Attempt: 1}
	}
	raw("narwhal.events.failure.d1.rt-2", failure("forged-router"))
	raw("narwhal.events.failure.d1", failure("old-shape"))
	request := &schemas.RequestCompleted{Envelope: env(schemas.SchemaRequest, "rq1", "rt-1", "", ""),
		Endpoint: schemas.EndpointChat, Model: "m", Status: 502, ErrorKind: "upstream_status", ProducerID: "p1", ConsumerID: "d1", Attempts: 1, DurationSeconds: 1}
	request.RequestID = "req-rq1"
	raw("narwhal.events.request.rt-2", request)
	raw("narwhal.events.quarantine.p1.rt-1", &schemas.Quarantine{Envelope: env(schemas.SchemaQuarantine, "q1", "rt-1", "", "d1"),
		DurationSeconds: 60, Until: time.Now().Add(time.Minute).UTC(), Reason: "first_token_timeout"})
	bustest.Publish(t, admin, failure("genuine"))

	var snap Snapshot
	ready := func() bool {
		b, _ := d.st.snapshotJSON()
		snap = Snapshot{}
		_ = json.Unmarshal(b, &snap)
		return len(snap.Failures) == 1 && snap.Ignored == 4
	}
	if !testkit.Poll(testBound, 10*time.Millisecond, ready) {
		b, _ := json.MarshalIndent(snap, "", " ")
		t.Fatalf("want the genuine failure shown and 4 events ignored:\n%s", b)
	}
	if f := snap.Failures[0]; f.Message != "genuine" {
		t.Errorf("failure shown %+v, want the genuine one", f)
	}
	for _, r := range snap.Routers {
		if r.Requests != 0 || r.Errors != 0 {
			t.Errorf("router %+v: a forged request event was counted", r)
		}
	}
	for _, e := range snap.Engines {
		if e.QuarantinedUntil != nil {
			t.Errorf("engine %s shown quarantined by a forged event", e.ID)
		}
	}
}

// runUntilDone runs d until the test ends, and waits for Run to return.
func runUntilDone(t *testing.T, d *Dashboard) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}
