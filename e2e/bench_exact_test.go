package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bench"
)

// benchBound bounds one small `narwhal bench --workload` run.
const benchBound = 90 * time.Second

// TestBenchExactIndexRPLACE4: `narwhal bench --compare-policies
// exact,approximate` runs the exact variant's prefill sims with KV
// events carried to its bus, so that its routers hold an exact index of
// every prefill engine and tokenize the prompts placed by it, while the
// approximate variant's routers do neither (behaviour.md R-PLACE-4).
func TestBenchExactIndexRPLACE4(t *testing.T) {
	out := filepath.Join(t.TempDir(), "bench.json")
	ctx, cancel := context.WithTimeout(context.Background(), benchBound)
	defer cancel()
	cmd := exec.CommandContext(ctx, narwhalBin, "bench", "--workload", "shared-prefix", "--quiet",
		"--compare-policies", "exact,approximate", "--routers", "2", "--share-index", "true",
		"--tenants", "2", "--users", "2", "--queries", "3", "--context-tokens", "128", "--query-tokens", "16",
		"--prefill-sims", "2", "--decode-sims", "1", "--windows", "2", "--rate", "20", "--json", out)
	cmd.Env = childEnv()
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("narwhal bench: %v\n%s", err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Comparison bench.PolicyComparison `json:"comparison"`
	}
	if err := json.Unmarshal(b, &file); err != nil {
		t.Fatal(err)
	}
	pc := file.Comparison
	if len(pc.Policies) != 2 || pc.Requests != 12 {
		t.Fatalf("comparison of %d policies over %d requests", len(pc.Policies), pc.Requests)
	}
	exact, approx := pc.Policies[0], pc.Policies[1]
	if exact.Name != "prefix ×2 shared exact" || approx.Name != "prefix ×2 shared approximate" {
		t.Fatalf("variants %q and %q", exact.Name, approx.Name)
	}
	for _, p := range pc.Policies {
		if p.Run.OK != 12 {
			t.Fatalf("%s: %d of 12 requests ok, errors %v", p.Name, p.Run.OK, p.Run.Errors)
		}
	}
	// Both routers of the exact variant hold both prefill engines' exact
	// index, and asked an engine for the token ids of every prompt placed
	// once an engine's events had arrived: at least the second window's
	// six (a prompt placed before any event is placed as without the
	// exact index).
	if exact.ExactEngines != 2 {
		t.Fatalf("exact variant: %d engines exact, want 2", exact.ExactEngines)
	}
	if n := exact.Tokenize["ok"] + exact.Tokenize["hit"]; n < 6 || n > 12 {
		t.Fatalf("exact variant: %d prompts tokenized (%v), want 6 to 12", n, exact.Tokenize)
	}
	if approx.ExactEngines > 0 || approx.Tokenize["ok"]+approx.Tokenize["hit"] != 0 {
		t.Fatalf("approximate variant: %d engines exact, tokenized %v", approx.ExactEngines, approx.Tokenize)
	}
}
