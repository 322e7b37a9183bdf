package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// The shared-storage tests (behaviour.md R-DESC-8, R-FAIL-8): two
// `narwhal sim --connector shared-storage` engines, a prefill p1 and a
// decode d1, that share one KV store directory, under a `narwhal router`
// and a `narwhal breaker` joined to a bus in the test process — the
// harness of the SGLang tests (sglangStack), with another connector.

// sharedStack is the running shared-storage deployment.
type sharedStack struct {
	*sglangStack
	store string // the KV store directory both sims share
}

// startShared starts p1 and d1 on one KV store, the router (with
// routerEnv added) and the breaker, and waits until they are ready.
// recovery.eject_after is ejectAfter.
func startShared(t *testing.T, routerEnv ...string) *sharedStack {
	t.Helper()
	s := &sharedStack{sglangStack: &sglangStack{sims: map[string]*simProc{},
		client: &http.Client{Transport: &http.Transport{}, Timeout: requestBound}}, store: t.TempDir()}
	t.Cleanup(s.client.CloseIdleConnections)
	var natsURL string
	natsURL, s.bus, s.events = eventBus(t, "narwhal-e2e-shared-storage")

	ports := freePorts(t, 3)
	for i, d := range []struct{ id, role string }{{"p1", sim.RolePrefill}, {"d1", sim.RoleDecode}} {
		sp := &simProc{id: d.id, role: d.role, url: "http://" + hostPort(ports[i])}
		sp.p = startProcess(t, "sim "+d.id, nil, "sim", "--connector", "shared-storage", "--kv-store", s.store,
			"--role", d.role, "--listen", hostPort(ports[i]), "--engine-id", d.id, "--model", meshModel)
		s.sims[d.id] = sp
		s.order = append(s.order, sp)
	}
	for _, sp := range s.order {
		waitHTTP(t, sp.p, sp.url+"/health")
		testkit.WaitEvery(t, readyBound, pollInterval, sp.id+"'s listening line", func() bool { return kvLine.MatchString(sp.p.stdout.String()) })
		if out := sp.p.stdout.String(); !strings.Contains(out, " store="+s.store) {
			t.Fatalf("%s does not use the shared store: %s", sp.id, out)
		}
	}
	var fleet strings.Builder
	for _, sp := range s.order {
		fmt.Fprintf(&fleet, "  - id: %s\n    url: %s\n    role: %s\n    connector: shared-storage\n", sp.id, sp.url, sp.role)
	}
	s.cfgPath = writeConfig(t, `engine:
  first_token_timeout_s: 5
  decode_read_timeout_s: 5
  prefill_timeout_s: 5
request:
  timeout_s: 20
recovery:
  eject_after: `+strconv.Itoa(ejectAfter)+`
  readmit_interval_s: 0.3
fleet:
`+fleet.String())
	addr := hostPort(ports[2])
	s.routerURL = "http://" + addr
	env := append([]string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_ROUTER_ID=" + meshRouterID}, routerEnv...)
	s.router = startProcess(t, "router", env, "router", "--config", s.cfgPath, "--listen", addr)
	waitHTTP(t, s.router, s.routerURL+"/readyz")
	startProcess(t, "breaker", []string{"NARWHAL_NATS_URL=" + natsURL}, "breaker", "--config", s.cfgPath)
	return s
}

// recomputed reads narwhal_kv_recomputed_total{producer,consumer} from
// the router's /metrics (0 when the pair has no sample yet).
func (s *sharedStack) recomputed(t *testing.T, producer, consumer string) float64 {
	t.Helper()
	mfs, err := testkit.Scrape(probeClient, s.routerURL+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	v, _ := testkit.Sum(mfs, "narwhal_kv_recomputed_total", "producer", producer, "consumer", consumer)
	return v
}

// waitEvents waits until at least n events match and returns them all.
func (s *sharedStack) waitEvents(t *testing.T, bound time.Duration, n int, what string, match func(event) bool) []event {
	t.Helper()
	var got []event
	testkit.WaitEvery(t, bound, pollInterval, what, func() bool {
		got = s.list(t, match)
		return len(got) >= n
	})
	return got
}

// longPrompt is a prompt of n distinct words (sim tokens) for request
// tag: long enough that its KV fills full blocks of the store, unique so
// that no engine's own prefix cache holds it.
func longPrompt(tag string, n int) string {
	w := make([]string, n)
	for i := range w {
		w[i] = tag + "w" + strconv.Itoa(i)
	}
	return strings.Join(w, " ")
}

// isRecompute matches the kv_recomputed events of request id (any request
// when id is empty).
func isRecompute(id string) func(event) bool {
	return func(e event) bool {
		return e.kind == schemas.KindKVRecomputed && (id == "" || e.RequestID == id)
	}
}

// legMembers decodes a recorded leg body.
func legMembers(t *testing.T, body json.RawMessage) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("leg body %s: %v", body, err)
	}
	return m
}

// TestSharedStorageThroughRouterRDESC8 runs the shared-storage connector
// through a router and the breaker, all processes, with
// handoff.on_recompute fail_pair (behaviour.md R-DESC-8, R-FAIL-8, R-BRK-3,
// R-BRK-4, R-PRE-1):
//   - every request is served by both legs — X-Narwhal-Prefill-Engine p1,
//     X-Narwhal-Decode-Engine d1 — the prefill leg a one-token prefill and
//     the decode leg the client's request streamed with usage, neither
//     with kv_transfer_params (the client's own removed); the client gets
//     what the decode generates;
//   - the decode finds the prompt's KV in the store (it loaded the blocks
//     p1 wrote; no kv_recomputed event, narwhal_kv_recomputed_total 0 for
//     the pair);
//   - a forced store miss on d1 (kv-recompute) is a silent recompute: each
//     request still answers 200 and is a schema-valid kv_recomputed event
//     and metric sample of p1→d1 and a counted kv_recomputed failure of
//     d1; after eject_after of them the breaker ejects d1;
//   - the breaker's probe, a real shared-storage transfer p1→d1 without
//     kv_transfer_params, readmits d1, which then serves again;
//   - `narwhal preflight` passes and reports the transfer p1→d1.
func TestSharedStorageThroughRouterRDESC8(t *testing.T) {
	s := startShared(t, "NARWHAL_HANDOFF_ON_RECOMPUTE=fail_pair")
	n := 0
	// serve sends one request of a unique 40-token prompt, checks the
	// answer and both legs, and returns its id.
	serve := func(t *testing.T, path string, stream bool) string {
		t.Helper()
		n++
		id := "ss-" + strconv.Itoa(n)
		content := longPrompt(id, 40)
		extra := fmt.Sprintf(`"max_tokens":5,"stream":%v,"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"client-forged"}`, stream)
		if stream {
			extra += `,"stream_options":{"include_usage":true}`
		}
		var body, prompt string
		if path == schemas.EndpointChat {
			body = fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],%s}`, meshModel, content, extra)
			msgs, _ := json.Marshal([]map[string]string{{"role": "user", "content": content}})
			prompt, _ = sim.RenderChat(msgs)
		} else {
			body = fmt.Sprintf(`{"model":%q,"prompt":%q,%s}`, meshModel, content, extra)
			prompt = content
		}
		resp, got, _ := s.post(t, path, id, body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d: %s", id, resp.StatusCode, got)
		}
		if p, d := resp.Header.Get("X-Narwhal-Prefill-Engine"), resp.Header.Get("X-Narwhal-Decode-Engine"); p != "p1" || d != "d1" {
			t.Fatalf("%s: prefill engine %q, decode engine %q; want p1 and d1", id, p, d)
		}
		toks, _ := sim.Generate(prompt, 0, 5, nil, false)
		if ans := texts(t, got, stream, 1); ans[0] != strings.Join(toks, "") {
			t.Fatalf("%s: answer %q, want the decode's %q", id, ans[0], strings.Join(toks, ""))
		}
		pl, dl := s.legsOf(t, "p1", id), s.legsOf(t, "d1", id)
		if len(pl) != 1 || len(dl) != 1 {
			t.Fatalf("%s: %d prefill legs, %d decode legs; want one each", id, len(pl), len(dl))
		}
		pm, dm := legMembers(t, pl[0]), legMembers(t, dl[0])
		if _, ok := pm["kv_transfer_params"]; ok || string(pm["max_tokens"]) != "1" || string(pm["stream"]) != "false" {
			t.Fatalf("%s: prefill leg %s: want a one-token prefill without kv_transfer_params", id, pl[0])
		}
		if _, ok := dm["kv_transfer_params"]; ok || string(dm["stream"]) != "true" || !strings.Contains(string(dm["stream_options"]), `"include_usage":true`) {
			t.Fatalf("%s: decode leg %s: want the client's request streamed with usage, without kv_transfer_params", id, dl[0])
		}
		if strings.Contains(string(pl[0])+string(dl[0]), "client-forged") {
			t.Fatalf("%s: the client's kv_transfer_params reached an engine", id)
		}
		return id
	}

	t.Run("both legs, KV found in the store", func(t *testing.T) {
		before := s.sims["d1"].stats(t)
		var ids []string
		for _, path := range []string{schemas.EndpointChat, schemas.EndpointCompletions} {
			for _, stream := range []bool{true, false} {
				ids = append(ids, serve(t, path, stream))
			}
		}
		// Every decode loaded the two full blocks of its prompt that p1
		// wrote (40 prompt tokens; chat's rendering adds some).
		after := s.sims["d1"].stats(t)
		if loaded := after.KVStoreLoaded - before.KVStoreLoaded; loaded < int64(2*len(ids)) || after.KVPulled-before.KVPulled != int64(len(ids)) {
			t.Fatalf("d1 loaded %d blocks in %d requests (stats %+v)", loaded, after.KVPulled-before.KVPulled, after)
		}
		if st := s.sims["p1"].stats(t); st.KVStoreWritten < int64(2*len(ids)) || st.Prefills < int64(len(ids)) {
			t.Fatalf("p1 stats %+v", st)
		}
		s.idle(t)
		// The router judged each handoff (R-FAIL-8) and saw the KV loaded.
		reqs := s.waitEvents(t, readyBound, len(ids), "the request events", func(e event) bool {
			return e.kind == schemas.KindRequest && strings.HasPrefix(e.RequestID, "ss-")
		})
		for _, e := range reqs {
			if strings.Contains(string(e.raw), `"kv_recomputed":true`) {
				t.Fatalf("request event %s says the decode recomputed", e.raw)
			}
		}
		if recs := s.list(t, isRecompute("")); len(recs) != 0 {
			t.Fatalf("kv_recomputed events after handoffs that loaded the KV: %s", recs[0].raw)
		}
		if v := s.recomputed(t, "p1", "d1"); v != 0 {
			t.Fatalf("narwhal_kv_recomputed_total{p1,d1} = %v, want 0", v)
		}
		// No descriptor, so no handoff events (R-DESC-8).
		if hs := s.list(t, func(e event) bool { return e.kind == schemas.KindHandoff }); len(hs) != 0 {
			t.Fatalf("handoff event of a shared-storage attempt: %s", hs[0].raw)
		}
	})

	t.Run("forced store miss is a silent recompute", func(t *testing.T) {
		s.arm(t, "d1", `{"kind":"kv-recompute","phase":"decode"}`)
		var ids []string
		for i := range ejectAfter {
			ids = append(ids, serve(t, schemas.EndpointCompletions, i%2 == 0))
		}
		for _, id := range ids {
			recs := s.waitEvents(t, readyBound, 1, "the kv_recomputed event of "+id, isRecompute(id))
			e := recs[0]
			if err := bus.ValidateEvent(e.raw); err != nil {
				t.Fatalf("kv_recomputed event invalid: %v: %s", err, e.raw)
			}
			var rec schemas.KVRecomputed
			if err := json.Unmarshal(e.raw, &rec); err != nil {
				t.Fatal(err)
			}
			if rec.EngineID != "d1" || rec.ProducerID != "p1" || rec.Connector != "shared-storage" || !rec.Counts ||
				rec.PromptTokens != 40 || rec.CachedTokens != 0 {
				t.Fatalf("kv_recomputed event %s", e.raw)
			}
		}
		if v := s.recomputed(t, "p1", "d1"); v != float64(ejectAfter) {
			t.Fatalf("narwhal_kv_recomputed_total{p1,d1} = %v, want %d", v, ejectAfter)
		}
		fails := s.list(t, func(e event) bool {
			return e.kind == schemas.KindFailure && e.EngineID == "d1" && e.Kind == "kv_recomputed" && e.Counts && e.ProducerID == "p1"
		})
		if len(fails) != ejectAfter {
			t.Fatalf("%d counted kv_recomputed failures of d1, want %d", len(fails), ejectAfter)
		}
		s.waitEvents(t, decisionBound, 1, "d1's ejection", isEjection("d1"))
	})

	t.Run("breaker probe readmits the consumer", func(t *testing.T) {
		ejections := s.list(t, isEjection("d1"))
		if len(ejections) == 0 {
			t.Fatal("d1 was not ejected")
		}
		s.disarm(t, "d1")
		s.waitEvents(t, decisionBound, 1, "d1 readmitted", isReadmission("d1"))
		s.waitEvents(t, readyBound, 1, "a successful probe of d1", isProbe("d1", schemas.ProbeSuccess))
		// The probe ran the router's path: a prefill on p1 and a decode
		// on d1 of one backend request, neither with kv_transfer_params.
		pp, dp := probed(t, s.sims["p1"], sim.PhasePrefill), probed(t, s.sims["d1"], sim.PhaseDecode)
		if len(pp) == 0 || len(dp) == 0 {
			t.Fatalf("probe legs: %d at p1, %d at d1", len(pp), len(dp))
		}
		last := dp[len(dp)-1]
		paired := false
		for _, r := range pp {
			paired = paired || r.RequestID == last.RequestID
			if _, ok := legMembers(t, r.Body)["kv_transfer_params"]; ok {
				t.Fatalf("probe prefill %s carries kv_transfer_params", r.Body)
			}
		}
		if _, ok := legMembers(t, last.Body)["kv_transfer_params"]; ok || !paired || !strings.HasPrefix(last.RequestID, kvprobe.RequestIDPrefix) {
			t.Fatalf("probe decode %s %s: want the decode of a probe prefill on p1, without kv_transfer_params", last.RequestID, last.Body)
		}
		// d1 is placeable again and loads the KV again.
		testkit.WaitEvery(t, 5*time.Second, pollInterval, "d1 placeable again", func() bool {
			n++
			id := "ss-back-" + strconv.Itoa(n)
			resp, _, _ := s.post(t, schemas.EndpointCompletions, id, fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, meshModel, longPrompt(id, 40)))
			return resp.StatusCode == 200
		})
		before := s.recomputed(t, "p1", "d1")
		id := serve(t, schemas.EndpointChat, true)
		s.idle(t)
		if recs := s.list(t, isRecompute(id)); len(recs) != 0 || s.recomputed(t, "p1", "d1") != before {
			t.Fatalf("%s after readmission recomputed: %v", id, recs)
		}
	})

	t.Run("preflight", func(t *testing.T) {
		out, code := runNarwhal(t, "preflight", "--config", s.cfgPath)
		if code != 0 || !regexp.MustCompile(`(?m)^p1\s+d1\s+ok\s`).MatchString(out) || !strings.Contains(out, "preflight ok: 2 engines, 1 transfer\n") {
			t.Fatalf("narwhal preflight: exit %d\n%s", code, out)
		}
		t.Logf("narwhal preflight:\n%s", out)
	})
}

// TestSharedStorageNixlMixRefusedRDESC8: a fleet whose shared-storage
// producer has only a nixl consumer (and whose nixl consumer has no
// producer of its connector) is refused before anything starts: the
// router does not start and preflight fails, both naming the fleet
// entries (behaviour.md R-DESC-8, R-DESC-3).
func TestSharedStorageNixlMixRefusedRDESC8(t *testing.T) {
	ports := freePorts(t, 1)
	path := writeConfig(t, `fleet:
  - id: p1
    url: http://127.0.0.1:1
    role: prefill
    connector: shared-storage
  - id: d1
    url: http://127.0.0.1:2
    role: decode
    connector: nixl
`)
	for _, args := range [][]string{{"router", "--config", path, "--listen", hostPort(ports[0])}, {"preflight", "--config", path}} {
		out, code := runNarwhal(t, args...)
		if code == 0 || !strings.Contains(out, "fleet[0].connector: prefill engine p1 uses shared-storage, but no decode engine does") ||
			!strings.Contains(out, "fleet[1].connector: decode engine d1 uses nixl, but no prefill engine does") {
			t.Fatalf("narwhal %s: exit %d\n%s", args[0], code, out)
		}
	}
}
