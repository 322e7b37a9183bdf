package breaker

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"go.uber.org/goleak"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// waitBound bounds every wait of the breaker tests.
const waitBound = 20 * time.Second

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testkit.NATSLongLived()...)
}

// simSpec is one simulated engine of a test fleet.
type simSpec struct {
	id, role string
	version  string // sim EngineVersion; "" = the default
}

// setup shapes a test harness.
type setup struct {
	fleet      []simSpec
	contract   *config.Contract
	ejectAfter int     // default 3
	readmitS   float64 // default 0.2
	leaseTTLS  float64 // default 1
}

// harness is an embedded NATS server on a random port, simulated engines
// and a connection of the test's own (playing the routers) that records
// every event on the bus.
type harness struct {
	t      *testing.T
	emb    *bus.Embedded
	bus    *bus.Bus
	cfg    *config.Config
	sims   map[string]*sim.Server
	events *bustest.Events
}

// testModel is the model every simulated engine serves.
const testModel = "m"

func newHarness(t *testing.T, su setup) *harness {
	t.Helper()
	leaseTTLS := 1.0
	if su.leaseTTLS > 0 {
		leaseTTLS = su.leaseTTLS
	}
	// The bus's admin makes the lease bucket with the mesh's lease TTL
	// (R-BUS-8); the breakers bind to it.
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, LeaseTTL: config.Seconds(leaseTTLS)})
	h := &harness{t: t, emb: emb, sims: map[string]*sim.Server{}}
	h.bus = h.connect("test-router")

	cfg := config.Default()
	cfg.Router.ID = "test-router"
	cfg.Engine.FirstTokenTimeoutS = 2
	cfg.Engine.DecodeReadTimeoutS = 2
	cfg.Recovery.EjectAfter = 3
	if su.ejectAfter > 0 {
		cfg.Recovery.EjectAfter = su.ejectAfter
	}
	cfg.Recovery.ReadmitIntervalS = 0.2
	if su.readmitS > 0 {
		cfg.Recovery.ReadmitIntervalS = su.readmitS
	}
	cfg.Breaker.LeaseTTLS = leaseTTLS
	cfg.EngineContract = su.contract
	for _, sp := range su.fleet {
		srv := simtest.Start(t, sim.Config{Role: sp.role, EngineID: sp.id, Model: testModel, EngineVersion: sp.version})
		h.sims[sp.id] = srv
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: sp.id, URL: srv.URL(), Role: connector.Role(sp.role), Connector: connector.DefaultName})
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	h.cfg = &cfg

	t.Cleanup(h.validateEvents) // runs after the subscription stopped: the log is complete
	h.events = bustest.Record(t, h.bus, "", true)
	return h
}

// connect opens a bus connection over TCP, closed when the test ends.
func (h *harness) connect(name string) *bus.Bus {
	h.t.Helper()
	return bustest.Connect(h.t, h.emb, bus.ConnectOptions{Name: name})
}

// running is a Service started by the harness on a connection of its own.
type running struct {
	*Service
	bus    *bus.Bus
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

// stop ends Run and waits for it; Run must return nil.
func (r *running) stop(t *testing.T) {
	t.Helper()
	r.once.Do(func() {
		r.cancel()
		if err := <-r.done; err != nil {
			t.Errorf("breaker %s: Run: %v", r.ID(), err)
		}
	})
}

// start runs a Service with breaker_id id until the test ends (or stop).
func (h *harness) start(id string) *running {
	h.t.Helper()
	return h.startWith(id, nil)
}

// startWith is start with the Service's Options changed by options.
func (h *harness) startWith(id string, options func(*Options)) *running {
	h.t.Helper()
	b := h.connect(id)
	opts := Options{Config: h.cfg, Bus: b, ID: id, Logger: testLogger(h.t)}
	if options != nil {
		options(&opts)
	}
	svc, err := New(opts)
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{Service: svc, bus: b, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- svc.Run(ctx) }()
	h.t.Cleanup(func() { r.stop(h.t) }) // before b closes
	return r
}

// startLeader starts a Service and waits until it leads and has seeded
// every engine.
func (h *harness) startLeader(id string) *running {
	h.t.Helper()
	return h.startLeaderWith(id, nil)
}

// startLeaderWith is startLeader with the Service's Options changed by
// options.
func (h *harness) startLeaderWith(id string, options func(*Options)) *running {
	h.t.Helper()
	r := h.startWith(id, options)
	testkit.WaitFor(h.t, waitBound, id+" to lead", r.Leader)
	// A new leader writes every entry again, in its name and lease term.
	for _, e := range h.cfg.Fleet {
		testkit.WaitFor(h.t, waitBound, id+"'s placement entry of "+e.ID, func() bool {
			entry, ok := h.entry(e.ID)
			return ok && entry.BreakerID == id
		})
	}
	return r
}

// publish publishes ev as a router would (its id as the message id) and
// returns its stream sequence.
func (h *harness) publish(ev schemas.Event) uint64 {
	h.t.Helper()
	head := ev.Head()
	head.ID, head.At = nuid.Next(), time.Now().UTC()
	_, seq := bustest.Publish(h.t, h.bus, ev)
	return seq
}

// fail publishes a failure event of engine on phase; producer and consumer
// are the attempt's engines ("" for none).
func (h *harness) fail(engine, phase string, counts bool, producer, consumer string) uint64 {
	kind, status := "first_token_timeout", 504
	if phase == schemas.PhasePrefill {
		kind, status = "prefill_status", 502
	}
	if !counts {
		kind, status = "overload", 429
	}
	return h.publish(&schemas.Failure{
		Envelope:   schemas.Envelope{Schema: schemas.SchemaFailure, RouterID: "test-router", EngineID: engine, RequestID: "req-" + nuid.Next()},
		Phase:      phase,
		Kind:       kind,
		Status:     status,
		Message:    "test fault",
		Timeout:    status == 504,
		Counts:     counts,
		ProducerID: producer,
		ConsumerID: consumer,
		Attempt:    1,
	})
}

// ejectDecode publishes eject_after counted decode failures of a decode
// engine whose attempts had producer (crossed when producer != "") and
// waits until it is ejected.
func (h *harness) ejectDecode(engine, producer string) {
	h.t.Helper()
	for range h.cfg.Recovery.EjectAfter {
		h.fail(engine, schemas.PhaseDecode, true, producer, engine)
	}
	h.waitState(engine, schemas.StateEjected)
}

// ejectPrefill publishes eject_after counted prefill failures of engine and
// waits until it is ejected.
func (h *harness) ejectPrefill(engine string) {
	h.t.Helper()
	for range h.cfg.Recovery.EjectAfter {
		h.fail(engine, schemas.PhasePrefill, true, engine, "")
	}
	h.waitState(engine, schemas.StateEjected)
}

// succeed publishes a successful request-completed event.
func (h *harness) succeed(producer, consumer string) uint64 {
	ttft, fb := 0.01, 0.02
	prompt, completion := 3, 4
	return h.publish(&schemas.RequestCompleted{
		Envelope:   schemas.Envelope{Schema: schemas.SchemaRequest, RouterID: "test-router", RequestID: "req-" + nuid.Next()},
		Endpoint:   schemas.EndpointChat,
		Model:      testModel,
		Stream:     true,
		Status:     200,
		ProducerID: producer, ConsumerID: consumer,
		Attempts:    1,
		TTFTSeconds: &ttft, FirstByteSeconds: &fb,
		DurationSeconds: 0.03, PromptTokens: &prompt, CompletionTokens: &completion,
	})
}

// applied waits until the durable consumer's ack floor reached seq: every
// event up to it has been applied.
func (h *harness) applied(seq uint64) {
	h.t.Helper()
	testkit.WaitFor(h.t, waitBound, "events applied up to sequence", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		cons, err := h.bus.JetStream().Consumer(ctx, bus.StreamName, ConsumerName)
		if err != nil {
			return false
		}
		info, err := cons.Info(ctx)
		return err == nil && info.AckFloor.Stream >= seq
	})
}

// entry reads engine's placement entry from narwhal_placement.
func (h *harness) entry(engine string) (schemas.Eligibility, bool) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	kve, err := h.bus.Placement().Get(ctx, engine)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return schemas.Eligibility{}, false
	}
	if err != nil {
		h.t.Fatal(err)
	}
	if err := bus.ValidateEvent(kve.Value()); err != nil {
		h.t.Errorf("placement entry of %s: %v", engine, err)
	}
	var e schemas.Eligibility
	if err := json.Unmarshal(kve.Value(), &e); err != nil {
		h.t.Fatal(err)
	}
	return e, true
}

// mustEntry is entry for an engine that must have one.
func (h *harness) mustEntry(engine string) schemas.Eligibility {
	h.t.Helper()
	e, ok := h.entry(engine)
	if !ok {
		h.t.Fatalf("no placement entry for %s", engine)
	}
	return e
}

// waitState waits until engine's placement entry has state.
func (h *harness) waitState(engine, state string) schemas.Eligibility {
	h.t.Helper()
	var last schemas.Eligibility
	testkit.WaitFor(h.t, waitBound, engine+" "+state, func() bool {
		e, ok := h.entry(engine)
		last = e
		return ok && e.State == state
	})
	return last
}

// probes returns the probe events of engine seen so far.
func (h *harness) probes(engine string) []schemas.Probe {
	var out []schemas.Probe
	for _, raw := range h.events.Of(schemas.KindProbe, engine) {
		var p schemas.Probe
		if err := json.Unmarshal(raw, &p); err != nil {
			h.t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

// waitProbes waits until engine has at least n probe events with outcome
// and returns them.
func (h *harness) waitProbes(engine, outcome string, n int) []schemas.Probe {
	h.t.Helper()
	var got []schemas.Probe
	testkit.WaitFor(h.t, waitBound, "probes of "+engine+" with outcome "+outcome, func() bool {
		got = got[:0]
		for _, p := range h.probes(engine) {
			if p.Outcome == outcome {
				got = append(got, p)
			}
		}
		return len(got) >= n
	})
	return got
}

// eligibilities returns the eligibility events of engine seen so far.
func (h *harness) eligibilities(engine string) []schemas.Eligibility {
	var out []schemas.Eligibility
	for _, raw := range h.events.Of(schemas.KindEligibility, engine) {
		var e schemas.Eligibility
		if err := json.Unmarshal(raw, &e); err != nil {
			h.t.Fatal(err)
		}
		out = append(out, e)
	}
	return out
}

// probeRequests returns the inference requests srv received from probes.
func probeRequests(srv *sim.Server) []sim.RecordedRequest {
	var out []sim.RecordedRequest
	for _, r := range srv.Requests() {
		if strings.HasPrefix(r.RequestID, kvprobe.RequestIDPrefix) {
			out = append(out, r)
		}
	}
	return out
}

// validateEvents checks every event seen on the bus against its JSON
// Schema (R-BUS-3).
func (h *harness) validateEvents() {
	for _, ev := range h.events.All() {
		if err := bus.ValidateEvent(ev.Payload); err != nil {
			h.t.Errorf("published event %s: %v", ev.Payload, err)
		}
	}
}

// backoffOf reads a Service's probe backoff of engine.
func backoffOf(s *Service, engine string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byID[engine].backoff
}

// testLogger logs to the test's log.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
