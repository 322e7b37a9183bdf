package router

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/router/meshview"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestRetryPolicy checks the retry decision alone (R-RETRY-1, R-RETRY-2):
// only transient faults, only with attempts left, only with room before
// the deadline and while the request lives, and only within the
// router-wide budget, which is asked last.
func TestRetryPolicy(t *testing.T) {
	transient := engines.NewFault(engines.KindConnectError, schemas.PhasePrefill, "p1", 0, "refused")
	final := engines.NewFault(engines.KindClientFault, schemas.PhaseDecode, "d1", 422, "bad")
	roomy, cancelRoomy := context.WithTimeout(context.Background(), time.Minute)
	defer cancelRoomy()
	tight, cancelTight := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancelTight()
	ended, cancelEnded := context.WithCancel(context.Background())
	cancelEnded()
	open := func() *retryBudget { return newRetryBudget(1, 10*time.Second, 100) }

	cases := []struct {
		name     string
		policy   retryPolicy
		ctx      context.Context
		fault    *engines.Fault
		attempts int
		retry    bool
		denial   retryDenial
	}{
		{"default: one attempt (R-RETRY-1)", retryPolicy{retries: 0, minLeft: 10 * time.Millisecond, budget: open()}, roomy, transient, 1, false, denyAttempts},
		{"transient with attempts left", retryPolicy{retries: 2, minLeft: 10 * time.Millisecond, budget: open()}, roomy, transient, 2, true, ""},
		{"attempts spent", retryPolicy{retries: 2, minLeft: 10 * time.Millisecond, budget: open()}, roomy, transient, 3, false, denyAttempts},
		{"not transient", retryPolicy{retries: 2, minLeft: 10 * time.Millisecond, budget: open()}, roomy, final, 1, false, denyNotTransient},
		{"deadline leaves no room", retryPolicy{retries: 2, minLeft: 10 * time.Millisecond, budget: open()}, tight, transient, 1, false, denyDeadline},
		{"request ended", retryPolicy{retries: 2, minLeft: 10 * time.Millisecond, budget: open()}, ended, transient, 1, false, denyEnded},
		{"budget spent", retryPolicy{retries: 2, minLeft: 10 * time.Millisecond, budget: newRetryBudget(0, 10*time.Second, 3)}, roomy, transient, 1, false, denyBudget},
		{"no budget", retryPolicy{retries: 2, minLeft: 10 * time.Millisecond}, roomy, transient, 1, false, denyBudget},
	}
	for _, tc := range cases {
		retry, denial := tc.policy.tryAgain(tc.ctx, tc.fault, tc.attempts)
		if retry != tc.retry || denial != tc.denial {
			t.Errorf("%s: tryAgain = %v, %q; want %v, %q", tc.name, retry, denial, tc.retry, tc.denial)
		}
	}

	// Only a granted retry takes from the budget.
	b := newRetryBudget(1, 10*time.Second, 1)
	p := retryPolicy{retries: 5, minLeft: 10 * time.Millisecond, budget: b}
	if retry, _ := p.tryAgain(roomy, final, 1); retry {
		t.Fatal("a final fault was retried")
	}
	if retry, _ := p.tryAgain(roomy, transient, 1); !retry {
		t.Fatal("the budget's one retry was spent by a denied one")
	}
	if retry, denial := p.tryAgain(roomy, transient, 2); retry || denial != denyBudget {
		t.Fatalf("a second retry from a budget of one: %v %q", retry, denial)
	}
	if !denyBudget.counted() || !denyDeadline.counted() || denyAttempts.counted() || denyNotTransient.counted() || denyEnded.counted() {
		t.Fatal("narwhal_retries_denied_total counts only deadline and budget denials")
	}
}

// TestPlaceAvoidsEveryFailedEngine is R-RETRY-3 at the placement: no
// engine of avoid is chosen while another can take the phase, and the
// least loaded of them when none can.
func TestPlaceAvoidsEveryFailedEngine(t *testing.T) {
	d1, d2, d3 := testMember("d1", connector.RoleDecode), testMember("d2", connector.RoleDecode), testMember("d3", connector.RoleDecode)
	f := meshview.NewFleet(d1, d2, d3)
	for i := 0; i < 100; i++ {
		m, err := placeLeast(f, "m", decodePhase, []*member{d1, d2})
		if err != nil || m != d3 {
			t.Fatalf("placed on %v (%v) while d3 was free", m, err)
		}
		m.Release(decodePhase)
	}
	d3.SetEligible(false)
	setLoad(t, d1, decodePhase, 5)
	m, err := placeLeast(f, "m", decodePhase, []*member{d1, d2})
	if err != nil || m != d2 {
		t.Fatalf("every engine avoided: placed on %v (%v), want the least loaded d2", m, err)
	}
}

// TestRetryAvoidsEveryFailedEngineRRETRY3: exclusion is cumulative. With
// d1 and d2 failing every decode and d3 healthy, a request with two
// retries never places a decode twice on the same engine: its third
// attempt avoids both engines that failed, not only the last one.
func TestRetryAvoidsEveryFailedEngineRRETRY3(t *testing.T) {
	defs := []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}, {id: "d2", role: "decode"}, {id: "d3", role: "decode"}}
	s := newStack(t, defs, func(c *config.Config) {
		c.Recovery.RetryAttempts = 2
		c.Recovery.RetryBudgetRatio = 1 // the budget is not what this test is about
	})
	s.waitModels()
	// The router-wide budget allows as many retries as requests in its
	// window: requests that need none first, so that it is not what ends
	// the ones below.
	for i := 0; i < 80; i++ {
		if resp, body := s.post(schemas.EndpointChat, chatBody("budget", `"max_tokens":1`)); resp.StatusCode != 200 {
			t.Fatalf("healthy request: %d %s", resp.StatusCode, body)
		}
	}
	s.armAll(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500}, "d1", "d2")
	third := 0
	for i := 0; i < 40; i++ {
		id := fmt.Sprintf("cumulative-%d", i)
		resp, body := s.post(schemas.EndpointChat, chatBody("avoid d1 and d2", `"stream":true,"max_tokens":3`), "X-Request-Id", id)
		legs := s.legsOf("decode", id)
		for engine, ids := range legs {
			if len(ids) > 1 {
				t.Fatalf("request %d went back to %s, which failed an earlier attempt: %v", i, engine, legs)
			}
		}
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
		if len(legs["d1"]) == 1 && len(legs["d2"]) == 1 {
			third++
		}
		if len(legs["d3"]) != 1 {
			t.Fatalf("request %d did not end on the healthy d3: %v", i, legs)
		}
	}
	if third == 0 {
		t.Fatal("no request failed on both d1 and d2: the test proved nothing")
	}
	t.Logf("%d of 40 requests reached their third attempt", third)
	s.idle()
}

// emptyDescriptorEngine is a producer that answers every prefill with
// "kv_transfer_params": {} — no descriptor, so no KV blocks held.
func emptyDescriptorEngine(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v1/models":
			fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, testModel)
		case schemas.EndpointChat:
			fmt.Fprint(w, `{"id":"chatcmpl-1","object":"chat.completion","model":"`+testModel+`","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1},"kv_transfer_params":{}}`)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestEmptyDescriptorIsNoHandoffRDESC0: a prefill answered with
// "kv_transfer_params": {} is rejected as a missing descriptor (R-DESC-0,
// R-DESC-6), and since no descriptor was handed off, no handoff is
// abandoned: no handoff event, no narwhal_handoffs_abandoned_total
// (R-OWN-6 concerns handoffs that exist).
func TestEmptyDescriptorIsNoHandoffRDESC0(t *testing.T) {
	url := emptyDescriptorEngine(t)
	s := newStack(t, []engineDef{{id: "d1", role: "decode"}}, func(c *config.Config) {
		c.Fleet = append(c.Fleet, config.EngineSpec{ID: "p1", URL: url, Role: "prefill", Connector: "nixl"})
	})
	s.waitModels()
	resp, body := s.post(schemas.EndpointChat, chatBody("no descriptor", `"max_tokens":3`), "X-Request-Id", "empty-descriptor")
	e := errorBody(t, 502, body)
	if resp.StatusCode != 502 || e.Message != "handoff descriptor rejected: missing descriptor (kv_transfer_params)" {
		t.Fatalf("got %d %q", resp.StatusCode, e.Message)
	}
	s.idle()
	f := s.oneFailure("p1", "prefill", string(engines.KindDescriptorRejected), true)
	if f.Message != e.Message {
		t.Fatalf("failure event message %q", f.Message)
	}
	if h := s.events.handoffs(); len(h) != 0 {
		t.Fatalf("a handoff that never existed was published as %s: %+v", h[0].Outcome, h)
	}
	if n := s.metricSum("narwhal_handoffs_abandoned_total"); n != 0 {
		t.Fatalf("narwhal_handoffs_abandoned_total = %v for a handoff that never existed", n)
	}
}
