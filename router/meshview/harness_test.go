package meshview

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

const testModel = "sim-model"

// stack is a view over simulated engines, all in this process on
// loopback, as a router holds it: its model refresh and engine watch
// started (View.Start), every goroutine it starts stopped and waited for
// when the test ends.
type stack struct {
	t    testing.TB
	v    *View
	reg  *prometheus.Registry
	cfg  *config.Config
	sims map[string]*sim.Server
	// log holds the view's log lines (text handler).
	log testkit.LockedBuffer
}

type engineDef struct {
	id, role string
}

// newStack starts the engines and a view configured by mutate.
func newStack(t testing.TB, defs []engineDef, mutate func(*config.Config)) *stack {
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
	v, err := New(Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(&s.log, nil)), Registry: s.reg,
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

// meshBus is a bus the test can stop and start again at the same
// address, with the stack's connection (B) and a peer's (bustest.Mesh).
type meshBus = bustest.Mesh

func newMeshBus(t testing.TB) *meshBus { return bustest.NewMesh(t, "router") }
