package meshview

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

const testModel = "sim-model"

// stack is a view over simulated engines, all in this process on
// loopback, as a router holds it: its model refresh and engine watch
// started (View.Start), every goroutine it starts stopped and waited for
// when the test ends.
type stack struct {
	t    *testing.T
	v    *View
	reg  *prometheus.Registry
	cfg  *config.Config
	sims map[string]*sim.Server
}

type engineDef struct {
	id, role string
}

// newStack starts the engines and a view configured by mutate.
func newStack(t *testing.T, defs []engineDef, mutate func(*config.Config)) *stack {
	t.Helper()
	s := &stack{t: t, sims: map[string]*sim.Server{}, reg: prometheus.NewRegistry()}
	cfg := config.Default()
	cfg.Router.ID = "rt-test"
	for _, d := range defs {
		srv := simtest.Start(t, sim.Config{Role: d.role, EngineID: d.id, Model: testModel})
		s.sims[d.id] = srv
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: d.id, URL: srv.URL(), Role: connector.Role(d.role), Connector: "nixl"})
	}
	if mutate != nil {
		mutate(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	s.cfg = &cfg
	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	var wg sync.WaitGroup
	stopping := false
	goFn := func(fn func()) bool {
		mu.Lock()
		defer mu.Unlock()
		if stopping {
			return false
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn()
		}()
		return true
	}
	t.Cleanup(func() {
		mu.Lock()
		stopping = true
		mu.Unlock()
		cancel()
		wg.Wait()
	})
	v, err := New(Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registry: s.reg,
		Context: ctx, Go: goFn, KeepsIndex: cfg.Placement.Policy == config.PolicyPrefix})
	if err != nil {
		t.Fatal(err)
	}
	s.v = v
	v.RefreshModels(ctx)
	if !v.Start() {
		t.Fatal("the view's watches did not start")
	}
	return s
}

// waitModels waits until the view knows every engine's models.
func (s *stack) waitModels() {
	testkit.WaitFor(s.t, 3*time.Second, "models known", func() bool {
		for _, m := range s.v.Fleet().Members() {
			if m.Models() == nil {
				return false
			}
		}
		return true
	})
}

// pd is the usual fleet: two prefill and two decode engines.
func pd() []engineDef {
	return []engineDef{{id: "p1", role: "prefill"}, {id: "p2", role: "prefill"}, {id: "d1", role: "decode"}, {id: "d2", role: "decode"}}
}

// prefixFleet is three prefill engines and one decode engine.
func prefixFleet() []engineDef {
	return []engineDef{{id: "p1", role: "prefill"}, {id: "p2", role: "prefill"}, {id: "p3", role: "prefill"}, {id: "d1", role: "decode"}}
}

func nowUTC() time.Time { return time.Now().UTC() }

func nowNano() int64 { return time.Now().UnixNano() }

// newID returns a random 16-byte hex id.
func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// meshBus starts an embedded NATS server on a fixed free port (so it can be
// restarted at the same address) and connects the stack's view to it.
type meshBus struct {
	t    *testing.T
	dir  string
	port int
	emb  *bus.Embedded
	b    *bus.Bus // the view's connection
	peer *bus.Bus // another process's view, to write the bucket and publish
	term uint64   // the lease term of "test-breaker", which writes placement
}

func freePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func (m *meshBus) start() {
	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: m.dir, Host: "127.0.0.1", Port: m.port})
	if err != nil {
		m.t.Fatal(err)
	}
	m.emb = emb
}

func (m *meshBus) url() string { return "nats://127.0.0.1:" + strconv.Itoa(m.port) }

func newMeshBus(t *testing.T) *meshBus {
	m := &meshBus{t: t, dir: t.TempDir(), port: freePort(t)}
	m.start()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var err error
	if m.b, err = bus.Connect(ctx, bus.ConnectOptions{URL: m.url(), Name: "router"}); err != nil {
		t.Fatal(err)
	}
	if m.peer, err = bus.Connect(ctx, bus.ConnectOptions{URL: m.url(), Name: "peer"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.b.Close()
		m.peer.Close()
		m.emb.Shutdown()
	})
	m.term = m.takeLease("test-breaker")
	return m
}

// takeLease makes breaker id the holder of the leader lease (R-BUS-9) and
// returns its term.
func (m *meshBus) takeLease(id string) uint64 {
	m.t.Helper()
	ctx := context.Background()
	kv, err := m.peer.JetStream().CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bus.LeaseBucket, History: 1})
	if err != nil {
		m.t.Fatal(err)
	}
	_ = kv.Delete(ctx, bus.LeaseKey)
	v, _ := json.Marshal(bus.Lease{BreakerID: id, Since: time.Now().UTC()})
	rev, err := kv.Create(ctx, bus.LeaseKey, v)
	if err != nil {
		m.t.Fatal(err)
	}
	return rev
}

func (m *meshBus) setEligible(engine string, eligible bool) {
	m.t.Helper()
	state := "eligible"
	if !eligible {
		state = "ejected"
	}
	ev := schemas.Eligibility{Envelope: schemas.Envelope{Schema: schemas.SchemaEligibility, ID: newID(), At: nowUTC(), BreakerID: "test-breaker", EngineID: engine},
		Eligible: eligible, State: state, LeaseTerm: m.term}
	b, _ := json.Marshal(ev)
	if _, err := m.peer.Placement().Put(context.Background(), engine, b); err != nil {
		m.t.Fatal(err)
	}
}
