package router

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// closedURL returns the URL of a loopback port nothing listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ln.Close()
	return url
}

// readyBody is the JSON of /readyz.
type readyBody struct {
	Status   string   `json:"status"`
	Problems []string `json:"problems"`
	Engines  []struct {
		ID, Role, Problem string
	} `json:"engines"`
}

func (s *stack) ready() (int, readyBody) {
	s.t.Helper()
	resp, b := s.get("/readyz")
	var r readyBody
	if err := json.Unmarshal(b, &r); err != nil {
		s.t.Fatalf("/readyz body %s: %v", b, err)
	}
	return resp.StatusCode, r
}

// TestStartupNamesUnplaceableEngines proves the start-up feedback about
// engines (R-API-2): a router whose fleet has an engine that refuses
// connections (d2) and one whose /v1/models lists nothing (p2) logs a
// warning naming each with its URL and why, and /readyz — 200, since p1
// and d1 serve both phases — names both engines and why, without their
// addresses; the engines that serve are logged as placeable with their
// models.
func TestStartupNamesUnplaceableEngines(t *testing.T) {
	empty := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"object":"list","data":[]}`))
	}))
	t.Cleanup(empty.Close)
	dead := closedURL(t)
	var logs syncBuffer
	s := newStackLogged(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, func(c *config.Config) {
		c.Fleet = append(c.Fleet,
			config.EngineSpec{ID: "p2", URL: empty.URL, Role: connector.RolePrefill, Connector: "nixl"},
			config.EngineSpec{ID: "d2", URL: dead, Role: connector.RoleDecode, Connector: "nixl"})
	}, nil, &logs)
	testkit.WaitFor(t, 3*time.Second, "the first /v1/models of every engine", func() bool {
		return s.rt.fleet().Member("p2").Problem() != "" && s.rt.fleet().Member("d2").Problem() != "" &&
			s.rt.fleet().Member("p1").Models() != nil && s.rt.fleet().Member("d1").Models() != nil
	})
	wants := []string{
		`msg="engine not placeable: unreachable: connection refused" router_id=rt-test engine_id=d2 url=` + dead + ` role=decode err="GET /v1/models: `,
		`msg="engine not placeable: serves no model (its GET /v1/models lists none)" router_id=rt-test engine_id=p2 url=` + empty.URL + ` role=prefill` + "\n",
		`msg="engine placeable" router_id=rt-test engine_id=p1`,
		`msg="engine placeable" router_id=rt-test engine_id=d1`,
	}
	// An engine's state is stored a moment before its line is logged.
	testkit.Poll(3*time.Second, 10*time.Millisecond, func() bool {
		out := logs.String()
		for _, want := range wants {
			if !strings.Contains(out, want) {
				return false
			}
		}
		return true
	})
	out := logs.String()
	for _, want := range wants {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
	if n := strings.Count(out, "engine_id=d2"); n != 1 {
		t.Errorf("d2 logged %d times, want once (a problem is logged when it changes)", n)
	}

	status, r := s.ready()
	if status != 200 || r.Status != "ready" || len(r.Engines) != 2 {
		t.Fatalf("/readyz %d %+v, want 200 naming p2 and d2", status, r)
	}
	got := map[string]string{}
	for _, e := range r.Engines {
		got[e.ID] = e.Role + ": " + e.Problem
	}
	if got["p2"] != "prefill: serves no model (its GET /v1/models lists none)" || got["d2"] != "decode: unreachable: connection refused" {
		t.Errorf("/readyz engines %v", got)
	}
	if _, b := s.get("/readyz"); strings.Contains(string(b), strings.TrimPrefix(dead, "http://")) {
		t.Errorf("/readyz shows an engine's address: %s", b)
	}
	// The router asks d2 again every second: the warning is not repeated.
	time.Sleep(1500 * time.Millisecond)
	if n := strings.Count(logs.String(), "engine_id=d2"); n != 1 {
		t.Errorf("d2 logged %d times after more refreshes, want once", n)
	}
}

// TestReadyzNamesEveryDecodeEngine: with every decode engine unreachable
// /readyz is 503, says the phase cannot be served and names each decode
// engine and why (R-API-2).
func TestReadyzNamesEveryDecodeEngine(t *testing.T) {
	d1, d2 := closedURL(t), closedURL(t)
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}}, func(c *config.Config) {
		c.Fleet = append(c.Fleet,
			config.EngineSpec{ID: "d1", URL: d1, Role: connector.RoleDecode, Connector: "nixl"},
			config.EngineSpec{ID: "d2", URL: d2, Role: connector.RoleDecode, Connector: "nixl"})
	})
	var r readyBody
	var status int
	testkit.WaitFor(t, 3*time.Second, "/readyz naming d1 and d2", func() bool {
		status, r = s.ready()
		return len(r.Engines) == 2
	})
	if status != 503 || r.Status != "not ready" || strings.Join(r.Problems, ";") != "no eligible engine for decode" {
		t.Fatalf("/readyz %d %+v, want 503 for decode", status, r)
	}
	for _, e := range r.Engines {
		if e.Role != "decode" || e.Problem != "unreachable: connection refused" {
			t.Errorf("/readyz engine %+v", e)
		}
	}
}

// TestModelNoReachableEngine proves the two answers to a model the router
// cannot serve (R-API-3): a model no engine of the fleet has listed is a
// 404 that lists the available models; a model that the fleet's decode
// engine served, once that engine is unreachable, is a 503 with
// Retry-After `no reachable engine serves model "sim-model" for decode`
// naming the engine and why — and the prefill engine is not asked (no KV
// blocks held for a decode that cannot run).
func TestModelNoReachableEngine(t *testing.T) {
	// d1 is a real simulator the router learns sim-model from; it is
	// then closed.
	s2 := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, nil)
	s2.waitModels()
	resp, body := s2.post(schemas.EndpointChat, `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`)
	if e := errorBody(t, 404, body); e.Message != "The model `gpt-9` does not exist. Available models: sim-model." || resp.StatusCode != 404 {
		t.Errorf("unknown model: %d %q", resp.StatusCode, e.Message)
	}

	if err := s2.sims["d1"].Close(); err != nil {
		t.Fatal(err)
	}
	s2.rt.RefreshModels(context.Background())
	resp, body = s2.post(schemas.EndpointChat, chatBody("hello", ""))
	e := errorBody(t, 503, body)
	if want := `no reachable engine serves model "sim-model" for decode: engines that serve it: d1 (unreachable: connection refused)`; e.Message != want {
		t.Errorf("503 message %q, want %q", e.Message, want)
	}
	if resp.Header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	if n := len(s2.sims["p1"].Requests()); n != 0 {
		t.Errorf("p1 got %d requests for a model no reachable decode engine serves", n)
	}
	// A model nobody ever served is still a 404, and lists what the fleet
	// serves (the unreachable engine's model included).
	if _, body = s2.post(schemas.EndpointChat, `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`); errorBody(t, 404, body).Message != "The model `gpt-9` does not exist. Available models: sim-model." {
		t.Errorf("unknown model while d1 is down: %s", body)
	}
	evs := s2.events.requests()
	if len(evs) != 3 || evs[1].Status != 503 || evs[2].Status != 404 {
		t.Errorf("request events %+v", evs)
	}
	s2.idle()
}

// TestUnknownModelMessageBounded: the 404 lists at most ten models, each
// bounded, and says when no engine lists any.
func TestUnknownModelMessageBounded(t *testing.T) {
	var many []string
	for i := range 12 {
		many = append(many, strings.Repeat("m", 5000)+string(rune('a'+i)))
	}
	msg := unknownModelMessage("x", many)
	if !strings.HasPrefix(msg, "The model `x` does not exist. Available models: ") || !strings.HasSuffix(msg, " and 2 more.") || len(msg) > 10*(schemas.MaxFieldBytes+64)+200 {
		t.Errorf("message of %d bytes: %.200q…%q", len(msg), msg, msg[len(msg)-40:])
	}
	if got := unknownModelMessage("x", nil); got != "The model `x` does not exist. No engine lists a model yet (see /readyz)." {
		t.Errorf("no models: %q", got)
	}
}
