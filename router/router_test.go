package router

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sync/errgroup"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/router/meshview"
	"github.com/narwhalmesh/narwhal/schemas"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, leakOptions()...)
}

// leakOptions ignores goroutines that outlive a test by design: fasthttp's
// (see testkit.FasthttpLongLived), and nats-server's setup of
// NARWHAL_HISTORY's source, which waits up to 30 s for an answer that a
// server shut down right after creating the stream never sends.
func leakOptions() []goleak.Option {
	return append(testkit.FasthttpLongLived(),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).trySetupSourceConsumer.func3"))
}

func chatBody(content string, extra string) string {
	b := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}]`, testModel, content)
	if extra != "" {
		b += "," + extra
	}
	return b + "}"
}

func TestStreamingChatEndToEnd(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	resp, body := s.post(schemas.EndpointChat, chatBody("hello narwhal", `"stream":true,"max_tokens":12,"seed":3`), "X-Request-Id", "client-req-1")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	// R-API-6: the client's id comes back.
	if got := resp.Header.Get("X-Request-Id"); got != "client-req-1" {
		t.Fatalf("X-Request-Id %q", got)
	}
	text, done, errObj := streamText(t, body)
	if !done || errObj != nil {
		t.Fatalf("done=%v err=%v body=%s", done, errObj, body)
	}
	if want := expectedChat(t, "hello narwhal", 3, 12); text != want {
		t.Fatalf("text %q, want %q", text, want)
	}
	// Exactly one producer ran a prefill, one consumer pulled its KV.
	var prefills, pulls, served int64
	var prefillID, decodeID string
	for id, srv := range s.sims {
		st := srv.Stats()
		prefills += st.Prefills
		pulls += st.KVPulled
		served += st.KVServed
		for _, r := range srv.Requests() {
			if r.Phase == "prefill" {
				prefillID = r.RequestID
			} else if r.Phase == "decode" {
				decodeID = r.RequestID
			}
		}
		_ = id
	}
	if prefills != 1 || pulls != 1 || served != 1 {
		t.Fatalf("prefills %d pulls %d served %d", prefills, pulls, served)
	}
	// R-OWN-4: one backend id on both legs, derived from but not equal to the client's.
	if prefillID == "" || prefillID != decodeID || prefillID == "client-req-1" || !strings.HasPrefix(prefillID, "client-req-1") {
		t.Fatalf("backend ids prefill %q decode %q", prefillID, decodeID)
	}
	s.idle()
	// R-BUS-1 / R-TIME-1: one request-completed event with both durations.
	reqs := s.events.requests()
	if len(reqs) != 1 {
		t.Fatalf("%d request events", len(reqs))
	}
	ev := reqs[0]
	if ev.Status != 200 || ev.RequestID != "client-req-1" || ev.TTFTSeconds == nil || ev.FirstByteSeconds == nil || *ev.TTFTSeconds > *ev.FirstByteSeconds || ev.Attempts != 1 {
		t.Fatalf("event %+v", ev)
	}
}

func TestConcurrentStreams200(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	const n = 200
	want := make([]string, n) // computed here: t.Fatal must not run in the workers
	for i := range want {
		want[i] = expectedChat(t, fmt.Sprintf("prompt number %d", i), 0, 16)
	}
	var g errgroup.Group
	for i := range n {
		g.Go(func() error {
			content := fmt.Sprintf("prompt number %d", i)
			req, _ := http.NewRequest("POST", s.url+schemas.EndpointChat, strings.NewReader(chatBody(content, `"stream":true,"max_tokens":16`)))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body) // a cut stream shows in the checks below
			if resp.StatusCode != 200 {
				return fmt.Errorf("request %d: status %d %s", i, resp.StatusCode, b)
			}
			text, done, errObj, err := streamTextErr(b)
			if err != nil || !done || errObj != nil || text != want[i] {
				return fmt.Errorf("request %d: done=%v err=%v %v text=%q", i, done, errObj, err, text)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Error(err)
	}
	s.idle()
	if got := len(s.events.requests()); got != n {
		t.Fatalf("%d request events, want %d", got, n)
	}
}

func TestNonStreamingAggregatesRLEG5(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	resp, body := s.post(schemas.EndpointChat, chatBody("aggregate me", `"max_tokens":8,"n":2`))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d %s", resp.StatusCode, body)
	}
	var out struct {
		Object  string `json:"object"`
		Choices []struct {
			Index   int `json:"index"`
			Message struct {
				Role    string `json:"role"`
				Content string `json:"content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			Prompt, Completion int
		} `json:"usage"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatal(err)
	}
	if out.Object != "chat.completion" || len(out.Choices) != 2 {
		t.Fatalf("%s", body)
	}
	for j, c := range out.Choices {
		if want := expectedChat(t, "aggregate me", int64(j), 8); c.Message.Content != want || c.Index != j {
			t.Fatalf("choice %d %q, want %q", j, c.Message.Content, want)
		}
	}
}

func TestSameWorkerSendsNoTransferParamsRLEG4(t *testing.T) {
	s := newStack(t, []engineDef{{id: "b1", role: "both"}}, nil)
	s.waitModels()
	resp, body := s.post(schemas.EndpointChat, chatBody("same worker", `"stream":true,"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"x","remote_block_ids":[1]}`))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d %s", resp.StatusCode, body)
	}
	reqs := s.sims["b1"].Requests()
	if len(reqs) != 2 {
		t.Fatalf("%d requests", len(reqs))
	}
	for _, r := range reqs {
		var m map[string]json.RawMessage
		_ = json.Unmarshal(r.Body, &m)
		if _, ok := m["kv_transfer_params"]; ok {
			t.Fatalf("same-worker leg carries kv_transfer_params: %s", r.Body)
		}
	}
	if text, done, _ := streamText(t, body); !done || text != expectedChat(t, "same worker", 0, 16) {
		t.Fatalf("text %q", text)
	}
}

func TestBadInputTouchesNoEngineRAPI4(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) { c.Request.MaxBodyBytes = 4096 })
	s.waitModels()
	cases := []struct {
		name, path, body string
		status           int
	}{
		{"invalid JSON", schemas.EndpointChat, `{"model":`, 400},
		{"missing model", schemas.EndpointChat, `{"messages":[{"role":"user","content":"x"}]}`, 400},
		{"missing messages", schemas.EndpointChat, `{"model":"sim-model"}`, 400},
		{"missing prompt", schemas.EndpointCompletions, `{"model":"sim-model"}`, 400},
		{"max_tokens 0", schemas.EndpointCompletions, `{"model":"sim-model","prompt":"x","max_tokens":0}`, 400},
		{"unknown model", schemas.EndpointChat, `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`, 404},
		{"body over the limit", schemas.EndpointChat, chatBody(strings.Repeat("x", 5000), ""), 413},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp, body := s.post(c.path, c.body)
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, c.status, body)
			}
			var e schemas.ErrorResponse
			if err := json.Unmarshal(body, &e); err != nil || e.Error.Code != c.status || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("error body %s", body)
			}
			if resp.Header.Get("X-Request-Id") == "" {
				t.Fatal("no X-Request-Id")
			}
		})
	}
	for id, srv := range s.sims {
		if n := len(srv.Requests()); n != 0 {
			t.Fatalf("engine %s got %d requests", id, n)
		}
	}
}

func TestRequestIDRAPI6(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	for _, tc := range []struct{ sent, kept string }{
		{"abc-123_x.y:z", "abc-123_x.y:z"},
		{"has space", ""},
		{strings.Repeat("a", 129), ""},
		{"", ""},
	} {
		var resp *http.Response
		if tc.sent == "" {
			resp, _ = s.post(schemas.EndpointChat, chatBody("id", ""))
		} else {
			resp, _ = s.post(schemas.EndpointChat, chatBody("id", ""), "X-Request-Id", tc.sent)
		}
		got := resp.Header.Get("X-Request-Id")
		if tc.kept != "" && got != tc.kept {
			t.Fatalf("sent %q, got %q", tc.sent, got)
		}
		if tc.kept == "" && (got == "" || got == tc.sent) {
			t.Fatalf("sent %q, got %q: want a new id", tc.sent, got)
		}
	}
	// Errors carry it too.
	resp, _ := s.post(schemas.EndpointChat, `{`, "X-Request-Id", "bad-body-1")
	if resp.StatusCode != 400 || resp.Header.Get("X-Request-Id") != "bad-body-1" {
		t.Fatalf("%d %q", resp.StatusCode, resp.Header.Get("X-Request-Id"))
	}
}

func TestTimingsRTIME1(t *testing.T) {
	// The producer spends 40 ms per prompt word; the consumer 150 ms to its
	// first token. ttft_s ends when the prefill leg completed, first_byte_s
	// at the first generated output, both from arrival.
	s := newStack(t, []engineDef{
		{id: "p1", role: "prefill", cfg: sim.Config{PrefillPerToken: 40 * millisecond}},
		{id: "d1", role: "decode", cfg: sim.Config{TTFT: 150 * millisecond}},
	}, nil)
	s.waitModels()
	resp, body := s.post(schemas.EndpointCompletions, `{"model":"sim-model","prompt":"one two three four five","max_tokens":3,"stream":true}`)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	s.idle()
	ev := s.events.requests()[0]
	ttft, fb := *ev.TTFTSeconds, *ev.FirstByteSeconds
	// prompt = 5 words → 200 ms of prefill.
	if ttft < 0.2 || ttft > 0.2+0.3 {
		t.Fatalf("ttft_s %.3f, want ≈ 0.2", ttft)
	}
	if d := fb - ttft; d < 0.15 || d > 0.15+0.3 {
		t.Fatalf("first_byte_s - ttft_s = %.3f, want ≈ 0.15", d)
	}
	if ev.DurationSeconds < fb {
		t.Fatalf("duration %.3f < first byte %.3f", ev.DurationSeconds, fb)
	}
	_, metrics := s.get("/metrics")
	for _, want := range []string{`narwhal_ttft_seconds_count{model="sim-model"} 1`, `narwhal_first_byte_seconds_count{model="sim-model"} 1`} {
		if !strings.Contains(string(metrics), want) {
			t.Fatalf("metrics lack %q", want)
		}
	}
}

func TestIdleEnginesShareTheLoadROWN3(t *testing.T) {
	// Least outstanding with random ties: sequential requests (every engine
	// idle each time) spread evenly, whatever the order of the fleet.
	var ms []*member
	for _, id := range []string{"p1", "p2", "d1", "d2", "d3"} {
		role := connector.RoleDecode
		if id[0] == 'p' {
			role = connector.RolePrefill
		}
		ms = append(ms, testMember(id, role))
	}
	f := meshview.NewFleet(ms...)
	counts := map[string]int{}
	const n = 3000
	for i := 0; i < n; i++ {
		for _, p := range []phase{prefillPhase, decodePhase} {
			m, err := placeLeast(f, "m", p, nil)
			if err != nil {
				t.Fatal(err)
			}
			counts[m.ID]++
			m.Release(p)
		}
	}
	for id, want := range map[string]float64{"p1": n / 2, "p2": n / 2, "d1": n / 3, "d2": n / 3, "d3": n / 3} {
		if got := float64(counts[id]); got < want*0.85 || got > want*1.15 {
			t.Fatalf("%s placed %v times, want ≈ %v (%v)", id, got, want, counts)
		}
	}
	// A busier engine is not chosen while an idle one exists.
	setLoad(t, f.Member("d1"), decodePhase, 1)
	setLoad(t, f.Member("d2"), decodePhase, 1)
	for i := 0; i < 50; i++ {
		m, _ := placeLeast(f, "m", decodePhase, nil)
		if m.ID != "d3" {
			t.Fatalf("placed on %s with load %d", m.ID, m.Reserved(decodePhase))
		}
		m.Release(decodePhase)
	}
	// A slot limit is respected (R-OWN-3): every decode engine has one
	// slot, taken.
	var full []*member
	for _, id := range []string{"d1", "d2", "d3"} {
		m := meshview.NewMember(engines.Engine{ID: id, Role: connector.RoleDecode}, schemas.FleetEntry{State: schemas.FleetActive, DecodeSlots: 1}, true)
		m.SetModels([]string{"m"})
		setLoad(t, m, decodePhase, 1)
		full = append(full, m)
	}
	if _, err := placeLeast(meshview.NewFleet(full...), "m", decodePhase, nil); err == nil {
		t.Fatal("placed beyond every slot limit")
	}
}

func TestShutdownEndsStreamsWithAnErrorEvent(t *testing.T) {
	// Ctrl-C: in-flight streams finish within the grace period, or end with
	// a terminal error event (R-FAIL-5), never silently.
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode", cfg: sim.Config{ITL: 100 * millisecond}}}, nil)
	s.waitModels()
	resp, err := http.Post(s.url+schemas.EndpointChat, "application/json", strings.NewReader(chatBody("long", `"stream":true,"max_tokens":200`)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first := make([]byte, 1)
	if _, err := resp.Body.Read(first); err != nil { // committed and streaming
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	if err := s.rt.Shutdown(ctx); err != nil { // grace is 1 s in the harness
		t.Fatal(err)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Fatalf("shutdown took %v", el)
	}
	rest, _ := io.ReadAll(resp.Body)
	_, done, errObj := streamText(t, append(first, rest...))
	if done || errObj == nil || errObj.Code != 503 || errObj.Message != "router shutting down" {
		t.Fatalf("done=%v err=%+v", done, errObj)
	}
	if s.rt.InFlight() != 0 {
		t.Fatal("requests left")
	}
}

func TestEveryResponseHasARequestIDRAPI6(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	for _, path := range []string{"/healthz", "/readyz", "/v1/models", "/metrics", "/nope"} {
		resp, _ := s.get(path)
		if resp.Header.Get("X-Request-Id") == "" {
			t.Errorf("GET %s: no X-Request-Id", path)
		}
	}
	resp, _ := s.get(schemas.EndpointChat) // wrong method
	if resp.StatusCode != 405 || resp.Header.Get("X-Request-Id") == "" {
		t.Errorf("GET %s: %d %q", schemas.EndpointChat, resp.StatusCode, resp.Header.Get("X-Request-Id"))
	}
}

func TestClientTimeoutHeaderRTMO5(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	// Absurd values are ignored, not turned into an instant deadline.
	for _, v := range []string{"inf", "1e300", "NaN", "-3", "abc"} {
		if resp, body := s.post(schemas.EndpointChat, chatBody("t", `"max_tokens":2`), "X-Request-Timeout", v); resp.StatusCode != 200 {
			t.Errorf("X-Request-Timeout %s: %d %s", v, resp.StatusCode, body)
		}
	}
}

func TestZeroReadTimeoutMeansNoChunkBoundRTMO4(t *testing.T) {
	for _, tc := range []struct {
		cfg  float64
		want time.Duration
	}{{0, 0}, {2.5, 2500 * time.Millisecond}} {
		s := newStack(t, pd(), func(c *config.Config) { c.Engine.DecodeReadTimeoutS = tc.cfg })
		if got := s.rt.client.DecodeReadTimeout(); got != tc.want {
			t.Errorf("decode_read_timeout_s %v: the engine client bounds chunks at %v, want %v", tc.cfg, got, tc.want)
		}
	}
}

func TestReservationsEndWithTheirPhaseROWN3(t *testing.T) {
	// The prefill slot is released when the prefill leg ends, the decode
	// slot when the stream ends.
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode", cfg: sim.Config{ITL: 100 * millisecond}}}, nil)
	s.waitModels()
	resp, err := http.Post(s.url+schemas.EndpointChat, "application/json", strings.NewReader(chatBody("slots", `"stream":true,"max_tokens":20`)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first := make([]byte, 1)
	if _, err := resp.Body.Read(first); err != nil { // decoding now
		t.Fatal(err)
	}
	p, d := s.rt.fleet().Member("p1").Reserved(prefillPhase), s.rt.fleet().Member("d1").Reserved(decodePhase)
	if p != 0 || d != 1 {
		t.Fatalf("while decoding: prefill slots %d (want 0), decode slots %d (want 1)", p, d)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	s.idle()
}
