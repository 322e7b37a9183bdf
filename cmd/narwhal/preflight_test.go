package main

import (
	"bytes"
	"context"
	"errors"
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

// TestPreflightHealthyFleet checks the tables `narwhal preflight` prints
// for a healthy fleet (R-PRE-1; package preflight proves the probes): a
// row per engine check and per role-permitted transfer, and success.
func TestPreflightHealthyFleet(t *testing.T) {
	testkit.CheckLeaks(t)
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}, {"b1", "both"}})

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
}

// TestPreflightCountsInWords checks the last line of a passing preflight
// for one transfer: "1 transfer", not "1 transfers".
func TestPreflightCountsInWords(t *testing.T) {
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	var out bytes.Buffer
	if err := runPreflight(context.Background(), []string{"--config", path}, &out); err != nil {
		t.Fatalf("preflight: %v\n%s", err, out.String())
	}
	if !strings.HasSuffix(out.String(), "\npreflight ok: 2 engines, 1 transfer\n") {
		t.Errorf("last line, want \"preflight ok: 2 engines, 1 transfer\":\n%s", out.String())
	}
}

// TestPreflightBrokenTransfer checks what `narwhal preflight` prints and
// returns when transfers fail (R-PRE-1): the table names the failing pairs
// with their errors, its last line names them once, and the error exits 1
// without being printed again.
func TestPreflightBrokenTransfer(t *testing.T) {
	testkit.CheckLeaks(t)
	path, sims := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"p2", "prefill"}, {"d1", "decode"}, {"d2", "decode"}})
	sims["d2"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Message: "decode broken"})

	var out bytes.Buffer
	err := runPreflight(context.Background(), []string{"--config", path}, &out)
	var said *reportedError
	if err == nil || err.Error() != "preflight failed: p1 -> d2, p2 -> d2" || !errors.As(err, &said) || said.code != 1 {
		t.Fatalf("preflight error %v, want one main does not print again (the table's last line said it), exit 1\n%s", err, out.String())
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

// TestPreflightSaysWhatWasWrongRFAIL10: a transfer whose descriptor is
// rejected says the field, the shape expected and what was found, and
// one whose consumer refuses the handoff names handoff_refused and what
// the consumer said — each on its row, on one line.
func TestPreflightSaysWhatWasWrongRFAIL10(t *testing.T) {
	testkit.CheckLeaks(t)
	path, sims := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	sims["p1"].Arm(sim.Fault{Kind: sim.FaultGarbleBlockIDs})
	var out bytes.Buffer
	if err := runPreflight(context.Background(), []string{"--config", path}, &out); err == nil {
		t.Fatalf("preflight passed a garbled descriptor\n%s", out.String())
	}
	row := `p1\s+d1\s+FAIL\s+\S+\s+prefill descriptor_rejected on p1: handoff descriptor rejected: malformed block ids \(kv_transfer_params.remote_block_ids\) ` +
		`\[kv_transfer_params.remote_block_ids: expected .*, found an array holding a string: "\[\\"`
	if !regexp.MustCompile(`(?m)^` + row).MatchString(out.String()) {
		t.Fatalf("no row %q in\n%s", row, out.String())
	}

	sims["p1"].Disarm()
	sims["d1"].Arm(sim.Fault{Kind: sim.FaultDecodeRefusesHandoff})
	out.Reset()
	if err := runPreflight(context.Background(), []string{"--config", path}, &out); err == nil {
		t.Fatalf("preflight passed a consumer that refuses the handoff\n%s", out.String())
	}
	row = `p1\s+d1\s+FAIL\s+\S+\s+decode handoff_refused on d1 \(upstream 400\): decode engine d1 refused the handoff from prefill engine p1 \(HTTP 400\): ` +
		`its error names kv_transfer_params.remote_block_ids, .* \[decode engine d1 answered HTTP 400: "json: cannot unmarshal number`
	if !regexp.MustCompile(`(?m)^` + row).MatchString(out.String()) {
		t.Fatalf("no row %q in\n%s", row, out.String())
	}
}
