package router

import (
	"encoding/json"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestRequestEventCountsAndEnginesRBUS3 proves what a request event says
// about counts and engines (R-BUS-3, R-LEG-6): its engines are
// producer_id and consumer_id, with no engine_id repeating one of them;
// token counts are present when the decode engine reported usage and
// absent, not 0, when it did not (a failed request). Each event validates
// against its schema.
func TestRequestEventCountsAndEnginesRBUS3(t *testing.T) {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, nil)
	s.waitModels()
	if resp, body := s.post(schemas.EndpointChat, `{"model":"sim-model","messages":[{"role":"user","content":"a b c"}],"max_tokens":4}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	s.armAll(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500}, "d1")
	if resp, body := s.post(schemas.EndpointChat, `{"model":"sim-model","messages":[{"role":"user","content":"a b c"}],"max_tokens":4}`); resp.StatusCode != 502 {
		t.Fatalf("failed decode: %d %s", resp.StatusCode, body)
	}
	s.idle()
	evs := s.events.requests()
	if len(evs) != 2 {
		t.Fatalf("%d request events, want 2", len(evs))
	}
	for i, ev := range evs {
		ev.ID, ev.At = "ev"+string(rune('a'+i)), nowUTC() // as the publisher fills them
		payload, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		if err := bus.ValidateEvent(payload); err != nil {
			t.Errorf("event %s: %v", payload, err)
		}
		var m map[string]any
		if err := json.Unmarshal(payload, &m); err != nil {
			t.Fatal(err)
		}
		if _, ok := m["engine_id"]; ok || m["producer_id"] != "p1" || m["consumer_id"] != "d1" {
			t.Errorf("event %s: want producer_id p1, consumer_id d1 and no engine_id", payload)
		}
		_, prompt := m["prompt_tokens"]
		_, completion := m["completion_tokens"]
		switch i {
		case 0:
			if ev.PromptTokens == nil || *ev.PromptTokens < 3 || ev.CompletionTokens == nil || *ev.CompletionTokens != 4 {
				t.Errorf("successful request: event %s, want its usage", payload)
			}
		case 1:
			if prompt || completion || ev.ErrorKind == "" {
				t.Errorf("failed request: event %s, want an error_kind and no token counts", payload)
			}
		}
	}
}
