package e2e

import (
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestClusterRecomputeFailPair runs R-FAIL-8 with handoff.on_recompute
// fail_pair through a router and a breaker, all processes: d1 answers
// every decode but ignores the handed-off KV (kv-recompute, cached_tokens
// 0). Every request the router places on d1 still answers 200, is a
// schema-valid kv_recomputed event of the pair and a counted decode
// failure naming its producer; after eject_after of them the breaker
// ejects d1 — although no request failed for its client.
func TestClusterRecomputeFailPair(t *testing.T) {
	c := startCluster(t, clusterOptions{routers: 1, breakers: 1, routerEnv: []string{"NARWHAL_HANDOFF_ON_RECOMPUTE=fail_pair"}})
	d1 := c.sims["d1"]
	c.arm(t, d1, `{"kind":"kv-recompute","phase":"decode"}`)
	onD1 := 0
	c.drive(t, []int{200}, func(r reply) bool {
		if r.decode == "d1" {
			onD1++
		}
		return onD1 == ejectAfter
	})
	c.waitEvents(t, decisionBound, 1, "d1's ejection", isEjection("d1"))
	recs := c.waitEvents(t, decisionBound, ejectAfter, "kv_recomputed events of d1", func(e event) bool {
		return e.kind == schemas.KindKVRecomputed && e.EngineID == "d1"
	})
	for _, e := range recs {
		if err := bus.ValidateEvent(e.raw); err != nil {
			t.Fatalf("kv_recomputed event invalid: %v: %s", err, e.raw)
		}
		if e.ProducerID == "" || !e.Counts {
			t.Fatalf("kv_recomputed event %s", e.raw)
		}
	}
	fails := c.list(t, func(e event) bool {
		return e.kind == schemas.KindFailure && e.EngineID == "d1" && e.Kind == "kv_recomputed" && e.Counts && e.ProducerID != ""
	})
	if len(fails) < ejectAfter {
		t.Fatalf("%d counted kv_recomputed failures of d1, want at least %d", len(fails), ejectAfter)
	}
}
