package engines

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestAsFault: callers reach the typed fault with errors.As, wrapped or
// not, and an error outside the client's contract becomes a protocol fault
// instead of a panic.
func TestAsFault(t *testing.T) {
	f := NewFault(KindConnectError, schemas.PhasePrefill, "p1", 0, "refused")
	if AsFault(f, schemas.PhasePrefill, "p1") != f {
		t.Fatal("a *Fault is not returned as itself")
	}
	if AsFault(fmt.Errorf("leg: %w", f), schemas.PhaseDecode, "d1") != f {
		t.Fatal("a wrapped *Fault is not found")
	}
	if AsFault(nil, schemas.PhaseDecode, "d1") != nil {
		t.Fatal("nil is not nil")
	}
	other := errors.New("surprise")
	for phase, kind := range map[string]FaultKind{schemas.PhasePrefill: KindPrefillResponse, schemas.PhaseDecode: KindInvalidStream} {
		g := AsFault(other, phase, "e1")
		if g.Kind != kind || g.Phase != phase || g.EngineID != "e1" || g.Status != 502 || !errors.Is(g, other) || !g.EngineFault() {
			t.Fatalf("%s: %+v", phase, g)
		}
	}
}

// prefillAnswering is a producer whose every prefill response carries
// kv_transfer_params = descriptor (raw JSON; empty: no such field).
func prefillAnswering(t *testing.T, descriptor string) *Engine {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		kv := ""
		if descriptor != "" {
			kv = `,"kv_transfer_params":` + descriptor
		}
		fmt.Fprint(w, `{"id":"c1","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}]`+kv+`}`)
	}))
	t.Cleanup(srv.Close)
	return &Engine{ID: "p1", URL: srv.URL, Role: connector.RolePrefill, Connector: nixl.Nixl{}}
}

// TestRejectionIsTyped: a rejected descriptor carries its reason as a
// typed field (R-DESC-0…2, R-DESC-6), so callers never read the message;
// MissingDescriptor holds for a missing, null or empty descriptor only.
func TestRejectionIsTyped(t *testing.T) {
	c := NewClient(Options{PrefillTimeout: 5 * time.Second})
	defer c.CloseIdleConnections()
	d := &Engine{ID: "d1", URL: "http://127.0.0.1:1", Role: connector.RoleDecode, Connector: nixl.Nixl{}}
	cases := []struct {
		descriptor, reason string
		missing            bool
	}{
		{"", connector.ReasonMissingDescriptor, true},
		{"null", connector.ReasonMissingDescriptor, true},
		{"{}", connector.ReasonMissingDescriptor, true},
		{`{"remote_block_ids":[1]}`, connector.ReasonMissingIdentity, false},
		{`{"remote_engine_id":"p1","remote_block_ids":["x"]}`, connector.ReasonMalformedBlocks, false},
		{`{"lmcache_key":"k"}`, connector.ReasonConnectorMismatch, false},
	}
	for _, tc := range cases {
		req := &Request{Body: parse(t, schemas.EndpointCompletions, `{"model":"m","prompt":"p","max_tokens":2}`),
			BackendRequestID: "b1", Producer: prefillAnswering(t, tc.descriptor), Consumer: d}
		_, err := c.Prefill(context.Background(), req)
		var f *Fault
		if !errors.As(err, &f) {
			t.Fatalf("%s: error %v is not a *Fault", tc.descriptor, err)
		}
		if f.Kind != KindDescriptorRejected || f.Rejection != tc.reason || f.MissingDescriptor() != tc.missing || f.EngineID != "p1" {
			t.Errorf("%q: kind %s rejection %q missing %v, want %q %v", tc.descriptor, f.Kind, f.Rejection, f.MissingDescriptor(), tc.reason, tc.missing)
		}
		var rej *connector.RejectError
		if !errors.As(err, &rej) || rej.Reason != tc.reason {
			t.Errorf("%q: cause %v", tc.descriptor, f.Cause)
		}
	}
	// The checks before the decode request are typed the same way.
	body := parse(t, schemas.EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	p := &Engine{ID: "p1", Role: connector.RolePrefill, Connector: nixl.Nixl{}}
	f := c.CheckHandoff(&Request{Body: body, Producer: p, Consumer: d}, nil, time.Now())
	if f == nil || !f.MissingDescriptor() {
		t.Fatalf("no result: %v", f)
	}
	res := connector.NewPrefillResult(connector.PrefillResult{ProducerID: "p1", Endpoint: schemas.EndpointCompletions, Connector: "nixl", Started: time.Now()}, []byte(`{"remote_engine_id":"p1"}`))
	if f := c.CheckHandoff(&Request{Body: body, Producer: p, Consumer: d}, res, time.Now()); f == nil || f.Rejection != connector.ReasonEndpointMismatch || f.MissingDescriptor() {
		t.Fatalf("endpoint mismatch: %+v", f)
	}
	if f := NewFault(KindPrefillStatus, schemas.PhasePrefill, "p1", 500, "x"); f.Rejection != "" || f.MissingDescriptor() {
		t.Fatal("a fault that is no rejection has a rejection")
	}
}

// TestZeroOptionsMeanNoBound: the client uses its options unchanged, and a
// zero duration is no bound (as engine.decode_read_timeout_s = 0 is,
// R-TMO-4), so config values need no translation on their way in.
func TestZeroOptionsMeanNoBound(t *testing.T) {
	c := NewClient(Options{})
	if c.prefillTimeout != 0 || c.firstTokenTimeout != 0 || c.DecodeReadTimeout() != 0 || c.handoffMaxAge != 0 {
		t.Fatalf("zero options became %v %v %v %v", c.prefillTimeout, c.firstTokenTimeout, c.readTimeout, c.handoffMaxAge)
	}
	set := NewClient(Options{PrefillTimeout: 60 * time.Second, FirstTokenTimeout: 30 * time.Second, DecodeReadTimeout: 30 * time.Second, HandoffMaxAge: 120 * time.Second})
	if set.prefillTimeout != 60*time.Second || set.firstTokenTimeout != 30*time.Second || set.DecodeReadTimeout() != 30*time.Second || set.handoffMaxAge != 120*time.Second {
		t.Fatal("set options changed on their way in")
	}
	// No age limit: a day-old handoff may still be consumed.
	body := parse(t, schemas.EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	p := &Engine{ID: "p1", Role: connector.RolePrefill, Connector: nixl.Nixl{}}
	d := &Engine{ID: "d1", Role: connector.RoleDecode, Connector: nixl.Nixl{}}
	res := connector.NewPrefillResult(connector.PrefillResult{ProducerID: "p1", Endpoint: schemas.EndpointChat, Connector: "nixl", Started: time.Now().Add(-24 * time.Hour)}, []byte(`{"remote_engine_id":"p1"}`))
	if f := c.CheckHandoff(&Request{Body: body, Producer: p, Consumer: d}, res, time.Now()); f != nil {
		t.Fatalf("no age limit, yet %v", f)
	}
	// No first-token bound: a stream whose first token comes late is read.
	s := c.NewStream(context.Background(), "d1", &lateBody{after: 50 * time.Millisecond, body: "data: " + tokenChunk + "\n\ndata: [DONE]\n\n"})
	defer s.Close()
	if _, kind, err := s.Next(); err != nil || kind != schemas.ChunkOutput {
		t.Fatalf("late first token: %v %v", kind, err)
	}
}

// lateBody returns body after a delay.
type lateBody struct {
	after time.Duration
	body  string
	off   int
}

func (l *lateBody) Read(p []byte) (int, error) {
	if l.off == 0 {
		time.Sleep(l.after) // the engine is slow to answer
	}
	if l.off >= len(l.body) {
		return 0, errors.New("EOF")
	}
	n := copy(p, l.body[l.off:])
	l.off += n
	return n, nil
}

func (l *lateBody) Close() error { return nil }

// TestParseRetryAfterRFAIL7 proves both Retry-After forms are read, that
// short delays round up to a second and that malformed values are not
// backpressure (R-FAIL-7).
func TestParseRetryAfterRFAIL7(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	cases := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"1", time.Second, true},
		{" 120 ", 120 * time.Second, true},
		{"0", time.Second, true},
		{"99999999999999999999999", 24 * time.Hour, true},
		{now.Add(30 * time.Second).Format(http.TimeFormat), 30 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), time.Second, true},
		{"", 0, false},
		{"-1", 0, false},
		{"1.5", 0, false},
		{"soon", 0, false},
	}
	for _, c := range cases {
		got, ok := ParseRetryAfter(c.in, now)
		if got != c.want || ok != c.ok {
			t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}
