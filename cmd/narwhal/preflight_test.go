package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// preflightFleet starts simulators (id → role) serving model "m" and
// writes a config file for them with an engine contract; it returns the
// file's path and the simulators.
func preflightFleet(t *testing.T, engines [][2]string) (string, map[string]*sim.Server) {
	t.Helper()
	sims := map[string]*sim.Server{}
	var yaml strings.Builder
	yaml.WriteString("engine:\n  first_token_timeout_s: 2\nengine_contract:\n  model: m\n  engine: vllm\n  version: \">=0.10\"\n  connector: nixl\nfleet:\n")
	for _, e := range engines {
		srv := simtest.Start(t, sim.Config{EngineID: e[0], Role: e[1], Model: "m"})
		sims[e[0]] = srv
		fmt.Fprintf(&yaml, "  - id: %s\n    url: %s\n    role: %s\n", e[0], srv.URL(), e[1])
	}
	path := filepath.Join(t.TempDir(), "narwhal.yaml")
	if err := os.WriteFile(path, []byte(yaml.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return path, sims
}

// TestPreflightHealthyFleet proves R-PRE-1 on a healthy fleet: every
// engine passes its contract check and every role-permitted transfer —
// prefill to decode, prefill to both, both to decode, and both
// same-worker — is probed for real and passes; the command succeeds.
func TestPreflightHealthyFleet(t *testing.T) {
	testkit.CheckLeaks(t)
	path, sims := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}, {"b1", "both"}})

	var out bytes.Buffer
	if err := runPreflight(context.Background(), []string{"--config", path}, &out); err != nil {
		t.Fatalf("preflight: %v\n%s", err, out.String())
	}
	table := out.String()
	for _, row := range []string{`p1\s+prefill\s+health, engine_contract\s+ok`, `d1\s+decode\s+health, engine_contract\s+ok`, `b1\s+both\s+health, engine_contract\s+ok`,
		`p1\s+d1\s+ok`, `p1\s+b1\s+ok`, `b1\s+d1\s+ok`, `b1\s+b1\s+ok`} {
		if !regexp.MustCompile(`(?m)^` + row + `\s`).MatchString(table) {
			t.Errorf("no row %q in\n%s", row, table)
		}
	}
	if strings.Contains(table, "FAIL") || !strings.Contains(table, "preflight ok: 3 engines, 4 transfers") {
		t.Fatalf("table:\n%s", table)
	}
	// Four real prefills: two on p1 (to d1 and b1), two on b1.
	if p, b := sims["p1"].Stats().Prefills, sims["b1"].Stats().Prefills; p != 2 || b != 1 {
		t.Fatalf("prefill legs: p1 %d, b1 %d (its same-worker prefill is a plain request)", p, b)
	}
	if got := sims["d1"].Stats().KVPulled; got != 2 {
		t.Fatalf("d1 pulled %d handoffs, want 2 (from p1 and b1)", got)
	}
}

// TestPreflightBrokenTransfer proves R-PRE-1 fails on a broken transfer:
// a decode engine that passes its health and contract checks but fails
// its decode leg makes every transfer to it fail; the table and the error
// name the failing pairs, and the other pairs still pass.
func TestPreflightBrokenTransfer(t *testing.T) {
	testkit.CheckLeaks(t)
	path, sims := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"p2", "prefill"}, {"d1", "decode"}, {"d2", "decode"}})
	sims["d2"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Message: "decode broken"})

	var out bytes.Buffer
	err := runPreflight(context.Background(), []string{"--config", path}, &out)
	if err == nil || err.Error() != "preflight failed: p1 -> d2, p2 -> d2" {
		t.Fatalf("preflight error %v\n%s", err, out.String())
	}
	table := out.String()
	for _, row := range []string{`d2\s+decode\s+health, engine_contract\s+ok`, `p1\s+d1\s+ok`, `p2\s+d1\s+ok`,
		`p1\s+d2\s+FAIL\s+\S+\s+decode upstream_status on d2 \(upstream 500\): .*decode broken`, `p2\s+d2\s+FAIL`} {
		if !regexp.MustCompile(`(?m)^` + row).MatchString(table) {
			t.Errorf("no row %q in\n%s", row, table)
		}
	}
	if !strings.Contains(table, "preflight FAILED: p1 -> d2, p2 -> d2") {
		t.Fatalf("table:\n%s", table)
	}

	// An engine that breaks the contract fails its check, by name.
	sims["d2"].Disarm()
	sims["d1"].Arm(sim.Fault{Kind: sim.FaultWrongModel})
	out.Reset()
	err = runPreflight(context.Background(), []string{"--config", path}, &out)
	if err == nil || err.Error() != "preflight failed: engine d1" {
		t.Fatalf("preflight error %v\n%s", err, out.String())
	}
	if !regexp.MustCompile(`(?m)^d1\s+decode\s+health, engine_contract\s+FAIL\s+\S+\s+engine d1 breaks engine_contract.model`).MatchString(out.String()) {
		t.Fatalf("table:\n%s", out.String())
	}
}

// TestPreflightNeedsConfig checks the command's argument errors.
func TestPreflightNeedsConfig(t *testing.T) {
	if err := runPreflight(context.Background(), nil, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "--config") {
		t.Fatalf("no --config: %v", err)
	}
}
