package router

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestEngineAPIKeys proves engines behind --api-key (issue 10 item 6): the
// router sends each engine's own key on both legs and on /v1/models; an
// engine that refuses its key (here d2, configured with a wrong one) is
// never placed on, is counted and published as nothing that ejects, and
// does not make the router unready while another engine serves the phase.
func TestEngineAPIKeys(t *testing.T) {
	const key = "engine-key-7d1f"
	keyed := sim.Config{APIKey: key}
	s := newStack(t, []engineDef{{id: "p1", role: "prefill", cfg: keyed}, {id: "d1", role: "decode", cfg: keyed}, {id: "d2", role: "decode", cfg: keyed}},
		func(c *config.Config) {
			for i := range c.Fleet {
				c.Fleet[i].APIKey = key
			}
			c.Fleet[2].APIKey = "not-the-key"
		})
	testkit.WaitFor(t, 3*time.Second, "d2 refused", func() bool { return s.rt.fleet().Member("d2").Refused() })
	testkit.WaitFor(t, 3*time.Second, "p1 and d1 models", func() bool {
		return s.rt.fleet().Member("p1").Models() != nil && s.rt.fleet().Member("d1").Models() != nil
	})
	for i := 0; i < 6; i++ {
		resp, body := s.post("/v1/chat/completions", `{"model":"`+testModel+`","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}`)
		if resp.StatusCode != 200 || !strings.Contains(string(body), "[DONE]") {
			t.Fatalf("request %d: HTTP %d %s", i, resp.StatusCode, body)
		}
	}
	if st := s.sims["d2"].Stats(); st.Decodes != 0 || st.Unauthorized == 0 {
		t.Errorf("d2 (wrong key): %+v, want no decode and refused /v1/models", st)
	}
	if st := s.sims["d1"].Stats(); st.Decodes != 6 || st.KVPulled != 6 || st.Unauthorized != 0 {
		t.Errorf("d1: %+v, want 6 decodes that pulled their KV, nothing refused", st)
	}
	if st := s.sims["p1"].Stats(); st.Prefills != 6 || st.Unauthorized != 0 {
		t.Errorf("p1: %+v", st)
	}
	if got := s.metricSum("narwhal_engine_credentials_refused_total", "engine", "d2"); got != 1 {
		t.Errorf("narwhal_engine_credentials_refused_total{engine=d2} = %v, want 1 (one episode)", got)
	}
	if got := s.metricSum("narwhal_engine_available", "engine", "d2"); got != 0 {
		t.Errorf("d2 available = %v, want 0", got)
	}
	if resp, _ := s.get("/readyz"); resp.StatusCode != 200 {
		t.Errorf("/readyz %d with d1 serving decode", resp.StatusCode)
	}
}

// TestEngineUnauthorizedFault proves the classification of an engine's 401
// on a leg (docs/failures.md, engine_unauthorized): the client gets a 502
// naming the engine, the failure event has the distinct kind and counts
// false (never towards ejection, R-BRK-2), the engine is out of this
// router's placement at once — the next request is a 503, not another 401
// — and placeable again once its /v1/models accepts the credentials.
func TestEngineUnauthorizedFault(t *testing.T) {
	var refuse, modelsRefused atomic.Bool
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" && !modelsRefused.Load() {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"` + testModel + `","object":"model"}]}`))
			return
		}
		if refuse.Load() || r.URL.Path == "/v1/models" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = w.Write([]byte(`{"error":"Unauthorized"}`))
			return
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(fake.Close)
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}}, func(c *config.Config) {
		c.Fleet = append(c.Fleet, config.EngineSpec{ID: "d1", URL: fake.URL, Role: connector.RoleDecode, Connector: "nixl"})
	})
	s.waitModels()
	// The engine's key rotates: from now on it refuses everything.
	refuse.Store(true)
	modelsRefused.Store(true)
	resp, body := s.post("/v1/chat/completions", `{"model":"`+testModel+`","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`)
	if resp.StatusCode != 502 || !strings.Contains(string(body), "decode engine d1 refused the router's credentials (HTTP 401)") {
		t.Fatalf("HTTP %d %s, want 502 naming d1", resp.StatusCode, body)
	}
	if strings.Contains(string(body), "Unauthorized") {
		t.Errorf("the engine's body was passed through: %s", body)
	}
	fs := s.events.failures()
	if len(fs) != 1 || fs[0].Kind != string(engines.KindEngineUnauthorized) || fs[0].Counts || fs[0].EngineID != "d1" || fs[0].UpstreamStatus != 401 {
		t.Fatalf("failure events %+v, want one engine_unauthorized of d1 with counts false", fs)
	}
	resp, body = s.post("/v1/chat/completions", `{"model":"`+testModel+`","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`)
	if resp.StatusCode != 503 || !strings.Contains(string(body), "no eligible engine for decode") {
		t.Errorf("while d1 refuses: HTTP %d %s, want 503 no eligible engine for decode", resp.StatusCode, body)
	}
	if n := len(s.events.failures()); n != 1 {
		t.Errorf("%d failure events, want still 1: a refusing engine is not tried again", n)
	}
	modelsRefused.Store(false)
	testkit.WaitFor(t, 3*time.Second, "d1 placeable again", func() bool { return s.rt.fleet().Member("d1").Available(nowNano()) })
	s.idle()
}
