package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestAgentBadInput: every bad flag of `narwhal agent` is a clear error
// before anything touches the bus.
func TestAgentBadInput(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "--engine-url, --id and --role are required"},
		{[]string{"--engine-url", "http://127.0.0.1:1", "--id", "d1"}, "--engine-url, --id and --role are required"},
		{[]string{"--engine-url", "127.0.0.1:1", "--id", "d1", "--role", "decode"}, `--engine-url "127.0.0.1:1": an absolute http or https URL`},
		{[]string{"--engine-url", "http://127.0.0.1:1", "--id", "d 1", "--role", "decode"}, `--id "d 1"`},
		{[]string{"--engine-url", "http://127.0.0.1:1", "--id", "d1", "--role", "both-ways"}, `--role "both-ways": prefill, decode or both`},
		{[]string{"--engine-url", "http://127.0.0.1:1", "--id", "d1", "--role", "decode", "--connector", "NIXL"}, `--connector "NIXL"`},
		{[]string{"--engine-url", "http://127.0.0.1:1", "--id", "d1", "--role", "decode", "--decode-slots", "-1"}, "must be >= 0"},
		{[]string{"--engine-url", "http://127.0.0.1:1", "--id", "d1", "--role", "decode", "--drain-timeout", "0s"}, "--drain-timeout must be > 0"},
		// R-FLEET-5: only the id's own key variable.
		{[]string{"--engine-url", "http://127.0.0.1:1", "--id", "d-1", "--role", "decode", "--api-key-env", "NARWHAL_NATS_CREDS"},
			"--api-key-env NARWHAL_NATS_CREDS: an engine that registers itself names only NARWHAL_ENGINE_KEY_D_1"},
		{[]string{"--engine-url", "http://127.0.0.1:1", "--id", "d-1", "--role", "decode", "--api-key-env", "D1_API_KEY"}, "names only NARWHAL_ENGINE_KEY_D_1"},
	} {
		var out, errOut bytes.Buffer
		err := runAgent(context.Background(), tc.args, &out, &errOut)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("narwhal agent %v: %v, want %q", tc.args, err, tc.want)
		}
	}
}

// TestAgentKeyEnvOfItsIDRFLEET5: `narwhal agent` and `narwhal sim
// --register` accept an empty --api-key-env or the id's own variable,
// NARWHAL_ENGINE_KEY_<ID> (R-FLEET-5); TestAgentBadInput shows the refusal
// of any other.
func TestAgentKeyEnvOfItsIDRFLEET5(t *testing.T) {
	for _, name := range []string{"", "NARWHAL_ENGINE_KEY_D_1"} {
		s := config.EngineSpec{ID: "d-1", URL: "http://127.0.0.1:1", Role: "decode", Connector: "nixl", APIKeyEnv: name}
		if err := checkSpec(s); err != nil {
			t.Errorf("--api-key-env %q: %v", name, err)
		}
	}
}

// TestAgentLifecycleRFLEET4 runs `narwhal agent` against an embedded bus
// with a breaker: it waits while its engine does not answer, registers it
// once /health and /v1/models answer — the breaker writes it joining
// (R-FLEET-4, R-FLEET-5) and renews it on each heartbeat — and when
// stopped asks for draining, waits for the routers' reports to show no
// leg on the engine (R-FLEET-3), asks to leave (the breaker removes the
// key) and returns nil.
func TestAgentLifecycleRFLEET4(t *testing.T) {
	emb := bustest.Start(t)
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	t.Setenv("NARWHAL_MEMBERSHIP_REGISTRATION_TTL_S", "1")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	b := bustest.Connect(t, emb, bus.ConnectOptions{})
	fleetKV, err := b.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	runFleetBreaker(t, emb)
	state := func() string {
		e, err := fleetKV.Get(ctx, "d7")
		if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
			return "gone"
		}
		if err != nil {
			t.Fatal(err)
		}
		var fe schemas.FleetEntry
		if err := json.Unmarshal(e.Value(), &fe); err != nil {
			t.Fatal(err)
		}
		return fe.State
	}

	// The engine's address is known but nothing answers there yet.
	engine, err := sim.New(sim.Config{Role: sim.RoleDecode, EngineID: "d7", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	ln := simtestListener(t)
	url := "http://" + ln
	agentCtx, stopAgent := context.WithCancel(context.Background())
	defer stopAgent()
	var out, errOut testkit.LockedBuffer
	done := make(chan error, 1)
	drainedFile := filepath.Join(t.TempDir(), "drained")
	go func() {
		done <- runAgent(agentCtx, []string{"--engine-url", url, "--id", "d7", "--role", "decode", "--drain-timeout", "5s", "--drained-file", drainedFile}, &out, &errOut)
	}()
	testkit.WaitFor(t, 5*time.Second, "the agent waiting for the engine", func() bool { return strings.Contains(errOut.String(), "waiting for the engine") })
	if s := state(); s != "gone" {
		t.Fatalf("registered (%s) before the engine answered", s)
	}
	if _, err := engine.Start(ln); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = engine.Close() })
	testkit.WaitFor(t, 5*time.Second, "d7 registered, and said so", func() bool {
		return state() == schemas.FleetJoining && strings.Contains(out.String(), "registered d7 (decode, "+url+") in the live fleet, TTL 1s\n")
	})
	// Several TTLs later it is still there: the heartbeat renews it (each
	// renewal is a new revision of the key; the key never lapses between).
	first, err := fleetKV.Get(ctx, "d7")
	if err != nil {
		t.Fatal(err)
	}
	since := time.Now()
	testkit.WaitFor(t, 10*time.Second, "d7 renewed over 2.5 TTLs", func() bool {
		if s := state(); s != schemas.FleetJoining {
			t.Fatalf("%v after registering: %s, want still joining", time.Since(since), s)
		}
		e, err := fleetKV.Get(ctx, "d7")
		return err == nil && e.Revision() >= first.Revision()+3 && time.Since(since) >= 2500*time.Millisecond
	})

	routers, err := b.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	// A router with a leg on d7: the drain waits for it (the breaker would
	// end a drain at once with no router at all).
	busy, _ := json.Marshal(schemas.RouterReport{Schema: schemas.SchemaRouterReport, RouterID: "r1", At: time.Now().UTC(),
		Draining: map[string]int64{}, InFlight: map[string]int64{"d7": 1}})
	if _, err := routers.Put(ctx, "r1", busy); err != nil {
		t.Fatal(err)
	}
	stopAgent()
	testkit.WaitFor(t, 2*time.Second, "d7 draining", func() bool { return state() == schemas.FleetDraining })
	select {
	case err := <-done:
		t.Fatalf("the agent returned %v while a router had a leg on d7", err)
	case <-time.After(300 * time.Millisecond):
	}
	if _, err := os.Stat(drainedFile); err == nil {
		t.Fatal("--drained-file exists before the drain ended")
	}
	rep, _ := json.Marshal(schemas.RouterReport{Schema: schemas.SchemaRouterReport, RouterID: "r1", At: time.Now().UTC(),
		Draining: map[string]int64{"d7": 0}, InFlight: map[string]int64{}})
	if _, err := routers.Put(ctx, "r1", rep); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the agent did not return once the router reported no leg on d7")
	}
	// The agent asked to leave; the breaker removes the key.
	testkit.WaitFor(t, 2*time.Second, "d7 gone after the agent left", func() bool { return state() == "gone" })
	if b, err := os.ReadFile(drainedFile); err != nil || string(b) != "drained d7\n" {
		t.Errorf("--drained-file: %q %v", b, err)
	}
}

// runFleetBreaker runs a breaker with the default configuration on emb
// until the test ends: the one writer of the fleet (R-FLEET-5).
func runFleetBreaker(t *testing.T, emb *bus.Embedded) *breaker.Service {
	t.Helper()
	cfg := config.Default()
	svc, err := breaker.New(breaker.Options{Config: &cfg, Bus: bustest.Connect(t, emb, bus.ConnectOptions{Name: "breaker-test"}), ID: "breaker-test",
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("breaker: %v", err)
		}
	})
	return svc
}

// TestAgentWaitsForSetUp proves that `narwhal agent` started against a
// bus whose set-up has not run waits for it (R-BUS-8) and registers once
// it has, instead of failing at once.
func TestAgentWaitsForSetUp(t *testing.T) {
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, NoSetup: true})
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	engine := simtest.Start(t, sim.Config{Role: sim.RoleDecode, EngineID: "d8", Model: "m"})
	agentCtx, stopAgent := context.WithCancel(context.Background())
	defer stopAgent()
	var out, errOut testkit.LockedBuffer
	done := make(chan error, 1)
	go func() {
		done <- runAgent(agentCtx, []string{"--engine-url", engine.URL(), "--id", "d8", "--role", "decode", "--drain-timeout", "1s"}, &out, &errOut)
	}()
	testkit.WaitFor(t, 5*time.Second, "the agent waiting for the set-up", func() bool {
		return strings.Contains(errOut.String(), "waiting for the bus to be set up")
	})
	select {
	case err := <-done:
		t.Fatalf("the agent returned %v on a bus not set up", err)
	default:
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := bus.Connect(ctx, bus.ConnectOptions{Embedded: emb, Setup: &bus.SetupOptions{}}); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 10*time.Second, "d8 registered", func() bool { return strings.Contains(out.String(), "registered d8") })
	stopAgent()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// simtestListener returns a free loopback HOST:PORT.
func simtestListener(t *testing.T) string {
	t.Helper()
	s := simtest.Start(t, sim.Config{Role: sim.RoleDecode, EngineID: "tmp", Model: "m"})
	addr := strings.TrimPrefix(s.URL(), "http://")
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}
