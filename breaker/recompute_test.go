package breaker

import (
	"strings"
	"testing"

	"github.com/nats-io/nuid"

	"github.com/narwhalmesh/narwhal/schemas"
)

// recomputed publishes what a router with handoff.on_recompute fail_pair
// publishes when consumer recomputed the prompt handed off by producer
// (router/recompute.go): the kv_recomputed event, a counted decode
// failure of kind kv_recomputed naming the pair, and the request's
// completed event (status 200, kv_recomputed true). It returns the last
// sequence.
func (h *harness) recomputed(producer, consumer string) uint64 {
	req := "req-" + nuid.Next()
	h.publish(&schemas.KVRecomputed{
		Envelope:   schemas.Envelope{Schema: schemas.SchemaKVRecomputed, RouterID: "test-router", EngineID: consumer, RequestID: req},
		ProducerID: producer, Connector: "nixl", PromptTokens: 40, CachedTokens: 0, Counts: true,
	})
	h.publish(&schemas.Failure{
		Envelope: schemas.Envelope{Schema: schemas.SchemaFailure, RouterID: "test-router", EngineID: consumer, RequestID: req},
		Phase:    schemas.PhaseDecode, Kind: "kv_recomputed", Status: 200, UpstreamStatus: 200,
		Message: "decode engine recomputed the prompt", Counts: true, ProducerID: producer, ConsumerID: consumer, Attempt: 1,
	})
	ttft, fb := 0.01, 0.02
	prompt, completion := 40, 4
	return h.publish(&schemas.RequestCompleted{
		Envelope: schemas.Envelope{Schema: schemas.SchemaRequest, RouterID: "test-router", RequestID: req},
		Endpoint: schemas.EndpointChat, Model: testModel, Stream: true, Status: 200,
		ProducerID: producer, ConsumerID: consumer, Attempts: 1,
		TTFTSeconds: &ttft, FirstByteSeconds: &fb, DurationSeconds: 0.03,
		PromptTokens: &prompt, CompletionTokens: &completion, KVRecomputed: true,
	})
}

// TestFailPairEjectsAfterEjectAfterRFAIL8 proves R-FAIL-8 with
// handoff.on_recompute fail_pair on the breaker: each silent recompute
// counts towards the consumer's streak although its request answered 200
// (the request event's kv_recomputed keeps the streak from being reset),
// the consumer is ejected after eject_after of them; the producer's own
// streak is untouched.
func TestFailPairEjectsAfterEjectAfterRFAIL8(t *testing.T) {
	h := newHarness(t, setup{fleet: prefillAndDecode, readmitS: 60})
	h.startLeader("breaker-a")
	n := h.cfg.Recovery.EjectAfter
	for i := 1; i < n; i++ {
		h.applied(h.recomputed("p1", "d1"))
		if e := h.mustEntry("d1"); e.State != schemas.StateEligible || e.Streak != i || !strings.Contains(e.Reason, "decode kv_recomputed") {
			t.Fatalf("after %d recomputes: %+v", i, e)
		}
	}
	// A plain success of the pair still resets it: only recomputes keep it.
	h.applied(h.succeed("p1", "d1"))
	if e := h.mustEntry("d1"); e.Streak != 0 {
		t.Fatalf("a success without recompute did not reset the streak: %+v", e)
	}
	for range n {
		h.recomputed("p1", "d1")
	}
	e := h.waitState("d1", schemas.StateEjected)
	if e.Streak != n || !strings.Contains(e.Reason, "kv_recomputed") {
		t.Fatalf("ejected entry %+v", e)
	}
	if p, ok := h.entry("p1"); ok && p.Streak != 0 {
		t.Fatalf("the producer's streak moved: %+v", p)
	}
}
