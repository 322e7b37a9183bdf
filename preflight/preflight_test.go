package preflight

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// simFleet starts simulators (id → role) serving model "m" and returns a
// config for them with an engine contract, and the simulators.
func simFleet(t *testing.T, specs [][2]string) (*config.Config, map[string]*sim.Server) {
	t.Helper()
	sims := map[string]*sim.Server{}
	var yaml strings.Builder
	yaml.WriteString("engine:\n  first_token_timeout_s: 2\nengine_contract:\n  model: m\n  engine: vllm\n  version: \">=0.10\"\n  connector: nixl\nfleet:\n")
	for _, e := range specs {
		srv := simtest.Start(t, sim.Config{EngineID: e[0], Role: e[1], Model: "m"})
		sims[e[0]] = srv
		fmt.Fprintf(&yaml, "  - id: %s\n    url: %s\n    role: %s\n", e[0], srv.URL(), e[1])
	}
	cfg, err := config.Parse([]byte(yaml.String()))
	if err != nil {
		t.Fatal(err)
	}
	return cfg, sims
}

// pairs returns the report's transfers as "producer->consumer ok|FAIL".
func pairs(r *Report) []string {
	var out []string
	for _, tr := range r.Transfers {
		res := "ok"
		if tr.Err != nil {
			res = "FAIL"
		}
		out = append(out, tr.Producer.ID+"->"+tr.Consumer.ID+" "+res)
	}
	return out
}

// TestRunProbesEveryPermittedTransfer proves R-PRE-1 on a healthy fleet:
// every engine passes its contract check, and every role-permitted
// transfer — prefill to decode, prefill to both, both to decode, and both
// same-worker — is probed for real (the simulators count the legs) and
// passes, in fleet order.
func TestRunProbesEveryPermittedTransfer(t *testing.T) {
	testkit.CheckLeaks(t)
	cfg, sims := simFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}, {"b1", "both"}})

	r, err := Run(context.Background(), cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r.CheckKind != "health, engine_contract" || len(r.Checks) != 3 {
		t.Fatalf("checks %q %d", r.CheckKind, len(r.Checks))
	}
	for _, c := range r.Checks {
		if c.Err != nil || c.Model != "m" {
			t.Errorf("check %s: model %q, %v", c.Engine.ID, c.Model, c.Err)
		}
	}
	if got := strings.Join(pairs(r), ", "); got != "p1->d1 ok, p1->b1 ok, b1->d1 ok, b1->b1 ok" {
		t.Errorf("transfers %s", got)
	}
	if f := r.Failed(); f != nil {
		t.Errorf("Failed() = %q", f)
	}
	// Three real prefill legs with a handoff: two on p1, one on b1 (its
	// same-worker prefill is a plain request); d1 pulled two handoffs.
	if p, b := sims["p1"].Stats().Prefills, sims["b1"].Stats().Prefills; p != 2 || b != 1 {
		t.Errorf("prefill legs: p1 %d, b1 %d", p, b)
	}
	if got := sims["d1"].Stats().KVPulled; got != 2 {
		t.Errorf("d1 pulled %d handoffs, want 2", got)
	}
}

// TestRunReportsFailures proves R-PRE-1's failures are in the report, by
// name: a decode engine whose decode leg fails fails every transfer to it
// (the others pass), and an engine that breaks the contract fails its
// check.
func TestRunReportsFailures(t *testing.T) {
	testkit.CheckLeaks(t)
	cfg, sims := simFleet(t, [][2]string{{"p1", "prefill"}, {"p2", "prefill"}, {"d1", "decode"}, {"d2", "decode"}})
	sims["d2"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Message: "decode broken"})

	r, err := Run(context.Background(), cfg, Options{Parallel: 2})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(pairs(r), ", "); got != "p1->d1 ok, p1->d2 FAIL, p2->d1 ok, p2->d2 FAIL" {
		t.Errorf("transfers %s", got)
	}
	if got := strings.Join(r.Failed(), ", "); got != "p1 -> d2, p2 -> d2" {
		t.Errorf("Failed() = %q", got)
	}
	if err := r.Transfers[1].Err; err == nil || !strings.Contains(err.Error(), "decode broken") {
		t.Errorf("p1 -> d2: %v", err)
	}

	sims["d2"].Disarm()
	sims["d1"].Arm(sim.Fault{Kind: sim.FaultWrongModel})
	r, err = Run(context.Background(), cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(r.Failed(), ", "); got != "engine d1" {
		t.Errorf("Failed() = %q", got)
	}
	if err := r.Checks[2].Err; err == nil || !strings.Contains(err.Error(), "breaks engine_contract.model") {
		t.Errorf("d1's check: %v", err)
	}
}

// TestRunRefusesWhatItCannotStart checks Run's own errors: an empty fleet,
// an unregistered connector, a negative parallelism.
func TestRunRefusesWhatItCannotStart(t *testing.T) {
	cfg := config.Default()
	if _, err := Run(context.Background(), &cfg, Options{}); err == nil || !strings.Contains(err.Error(), "at least one engine") {
		t.Errorf("empty fleet: %v", err)
	}
	cfg.Fleet = []config.EngineSpec{{ID: "e1", URL: "http://127.0.0.1:1", Role: connector.RoleBoth, Connector: "no-such"}}
	if _, err := Run(context.Background(), &cfg, Options{}); err == nil || !strings.Contains(err.Error(), "fleet engine e1") {
		t.Errorf("unknown connector: %v", err)
	}
	cfg.Fleet[0].Connector = connector.DefaultName
	if _, err := Run(context.Background(), &cfg, Options{Parallel: -1}); err == nil {
		t.Error("parallel -1 accepted")
	}
}
