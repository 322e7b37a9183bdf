package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// The SGLang tests (R-DESC-7): `narwhal sim --connector sglang` engines —
// prefills with a bootstrap server on a known port, decodes that wait for
// their room at most sglangKVTimeout — under a `narwhal router` and a
// `narwhal breaker` joined to a bus in the test process.

// sglangKVTimeout is the decode sims' --kv-timeout: every failure the
// tests expect must come far sooner.
const sglangKVTimeout = 10 * time.Second

// sglangPrefillTimeout is engine.prefill_timeout_s of the stack.
const sglangPrefillTimeout = time.Second

// sglangStack is the running deployment.
type sglangStack struct {
	sims      map[string]*simProc
	order     []*simProc
	boot      map[string]int // bootstrap port per prefill
	cfgPath   string
	routerURL string
	router    *process
	bus       *bus.Bus
	events    *bustest.Events
	client    *http.Client
}

// startSGLang starts prefills p1… and decodes d1…, the router (with
// routerEnv added) and the breaker, and waits until they are ready.
func startSGLang(t *testing.T, prefills, decodes int, routerEnv ...string) *sglangStack {
	t.Helper()
	s := &sglangStack{sims: map[string]*simProc{}, boot: map[string]int{},
		client: &http.Client{Transport: &http.Transport{}, Timeout: requestBound}}
	t.Cleanup(s.client.CloseIdleConnections)
	var natsURL string
	natsURL, s.bus, s.events = eventBus(t, "narwhal-e2e-sglang")

	ports := freePorts(t, 2*prefills+decodes+1)
	next := 0
	take := func() int { next++; return ports[next-1] }
	for i := 1; i <= prefills+decodes; i++ {
		role, id := sim.RolePrefill, "p"+strconv.Itoa(i)
		if i > prefills {
			role, id = sim.RoleDecode, "d"+strconv.Itoa(i-prefills)
		}
		sp := &simProc{id: id, role: role, url: "http://" + hostPort(take())}
		args := []string{"sim", "--connector", "sglang", "--role", role, "--listen", strings.TrimPrefix(sp.url, "http://"),
			"--engine-id", id, "--model", meshModel, "--kv-timeout", sglangKVTimeout.String()}
		if role == sim.RolePrefill {
			s.boot[id] = take()
			args = append(args, "--bootstrap-port", strconv.Itoa(s.boot[id]))
		}
		sp.p = startProcess(t, "sim "+id, nil, args...)
		s.sims[id] = sp
		s.order = append(s.order, sp)
	}
	for _, sp := range s.order {
		sp.await(t)
		if port, ok := s.boot[sp.id]; ok && sp.kvAddr != hostPort(port) {
			t.Fatalf("%s's bootstrap server is on %s, not port %d", sp.id, sp.kvAddr, port)
		}
	}
	var fleet strings.Builder
	for _, sp := range s.order {
		fmt.Fprintf(&fleet, "  - id: %s\n    url: %s\n    role: %s\n    connector: sglang\n", sp.id, sp.url, sp.role)
		if port, ok := s.boot[sp.id]; ok {
			fmt.Fprintf(&fleet, "    bootstrap_port: %d\n", port)
		}
	}
	s.cfgPath = writeConfig(t, `engine:
  first_token_timeout_s: 15
  decode_read_timeout_s: 5
  prefill_timeout_s: `+strconv.FormatFloat(sglangPrefillTimeout.Seconds(), 'f', -1, 64)+`
request:
  timeout_s: 30
recovery:
  readmit_interval_s: 0.3
fleet:
`+fleet.String())
	addr := hostPort(ports[next])
	s.routerURL = "http://" + addr
	env := append([]string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_ROUTER_ID=" + meshRouterID}, routerEnv...)
	s.router = startProcess(t, "router", env, "router", "--config", s.cfgPath, "--listen", addr)
	waitHTTP(t, s.router, s.routerURL+"/readyz")
	startProcess(t, "breaker", []string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_RECOVERY_READMIT_INTERVAL_S=0.3"},
		"breaker", "--config", s.cfgPath)
	return s
}

// writeConfig writes a YAML config file and returns its path.
func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "narwhal.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// post sends body to the router with X-Request-Id id.
func (s *sglangStack) post(t *testing.T, path, id, body string) (*http.Response, []byte, time.Duration) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, s.routerURL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	start := time.Now()
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b, time.Since(start)
}

// arm arms faults (a JSON fault or array) on a sim over POST /sim/faults.
func (s *sglangStack) arm(t *testing.T, id, faults string) {
	t.Helper()
	resp, err := s.client.Post(s.sims[id].url+"/sim/faults", "application/json", strings.NewReader(faults))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("arm %s: %d %s", id, resp.StatusCode, b)
	}
}

func (s *sglangStack) disarm(t *testing.T, id string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodDelete, s.sims[id].url+"/sim/faults", nil)
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
}

// legsOf returns the bodies a sim recorded for the legs of client
// request id (backend ids are derived from it), oldest first.
func (s *sglangStack) legsOf(t *testing.T, engine, id string) []json.RawMessage {
	t.Helper()
	var out []json.RawMessage
	for _, r := range s.sims[engine].requests(t) {
		if strings.HasPrefix(r.RequestID, id+"-") {
			out = append(out, r.Body)
		}
	}
	return out
}

// list returns the events so far that match.
func (s *sglangStack) list(t *testing.T, match func(event) bool) []event {
	t.Helper()
	return matching(t, s.events, match)
}

// idle waits until the router reports no leg in flight on any engine in
// a report written after now (R-OWN-3: every reservation released).
func (s *sglangStack) idle(t *testing.T) {
	t.Helper()
	since := time.Now()
	kv, err := s.bus.JetStream().KeyValue(testContext(t, readyBound), bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitEvery(t, 5*time.Second, pollInterval, "a router report with nothing in flight", func() bool {
		e, err := kv.Get(context.Background(), meshRouterID)
		if err != nil {
			return false
		}
		var r schemas.RouterReport
		return json.Unmarshal(e.Value(), &r) == nil && r.At.After(since) && len(r.InFlight) == 0
	})
}

// bootstrap are the bootstrap fields of a recorded body.
type bootstrap struct {
	Host json.RawMessage `json:"bootstrap_host"`
	Port json.RawMessage `json:"bootstrap_port"`
	Room json.RawMessage `json:"bootstrap_room"`
}

func bootstrapFields(t *testing.T, body json.RawMessage) bootstrap {
	t.Helper()
	var b bootstrap
	if err := json.Unmarshal(body, &b); err != nil {
		t.Fatal(err)
	}
	return b
}

// texts returns each choice's text of a client answer.
func texts(t *testing.T, body []byte, stream bool, n int) []string {
	t.Helper()
	out := make([]string, n)
	type piece struct {
		Index   int    `json:"index"`
		Text    string `json:"text"`
		Delta   struct{ Content string }
		Message struct{ Content string }
	}
	var frames [][]byte
	if stream {
		for _, p := range sseData(body) {
			if p != "[DONE]" {
				frames = append(frames, []byte(p))
			}
		}
	} else {
		frames = [][]byte{body}
	}
	for _, f := range frames {
		var ch struct {
			Choices []piece `json:"choices"`
			Error   any     `json:"error"`
		}
		if err := json.Unmarshal(f, &ch); err != nil || ch.Error != nil {
			t.Fatalf("answer frame %s", f)
		}
		for _, c := range ch.Choices {
			out[c.Index] += c.Text + c.Delta.Content + c.Message.Content
		}
	}
	return out
}

// TestSGLangThroughRouterRDESC7 runs SGLang-mode engines (one prefill, two
// decodes) under a router and the breaker: streaming and non-streaming
// chat and completions, n = 1 and 2, answer what the decode generates; the
// prefill and the decode got the same body with the attempt's bootstrap
// fields (the prefill's host and bootstrap port, one room per choice) and
// no client bootstrap field; a prefill failure while the decode waits is
// a 502 at once (not after the decode's 10 s KV timeout) with the decode
// cancelled and nothing left in flight; a hanging prefill is a 504 at
// engine.prefill_timeout_s; the breaker's probe readmits an ejected SGLang
// prefill through a real transfer; `narwhal preflight` passes (R-DESC-7,
// R-FAIL-1, R-OWN-3, R-OWN-5, R-BRK-3, R-PRE-1).
func TestSGLangThroughRouterRDESC7(t *testing.T) {
	s := startSGLang(t, 1, 2)
	bootPort := strconv.Itoa(s.boot["p1"])
	seen := map[string]bool{}
	n := 0
	success := func(t *testing.T, path string, stream bool, choices int) {
		t.Helper()
		n++
		id := "sg-ok-" + strconv.Itoa(n)
		content := "narwhals and bootstrap rooms " + strconv.Itoa(n)
		extra := fmt.Sprintf(`"max_tokens":5,"stream":%v,"n":%d,"bootstrap_host":"203.0.113.9","bootstrap_port":4,"bootstrap_room":99`, stream, choices)
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
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
		ans := texts(t, got, stream, choices)
		for j := range choices {
			toks, _ := sim.Generate(prompt, int64(j), 5, nil, false)
			if ans[j] != strings.Join(toks, "") {
				t.Fatalf("choice %d = %q, want the decode's %q", j, ans[j], strings.Join(toks, ""))
			}
		}
		dec := resp.Header.Get("X-Narwhal-Decode-Engine")
		pl, dl := s.legsOf(t, "p1", id), s.legsOf(t, dec, id)
		if len(pl) != 1 || len(dl) != 1 || !bytes.Equal(pl[0], dl[0]) {
			t.Fatalf("prefill legs %s, decode legs %s: want one identical body each", pl, dl)
		}
		if bytes.Contains(pl[0], []byte("203.0.113.9")) || bytes.Contains(pl[0], []byte(`"bootstrap_room":99`)) {
			t.Fatalf("a client bootstrap field reached the engines: %s", pl[0])
		}
		b := bootstrapFields(t, pl[0])
		host, port, rooms := `"127.0.0.1"`, bootPort, []uint64{}
		if choices > 1 {
			host, port = "["+host+","+host+"]", "["+port+","+port+"]"
			if json.Unmarshal(b.Room, &rooms) != nil || len(rooms) != choices {
				t.Fatalf("bootstrap_room %s: want %d rooms", b.Room, choices)
			}
		} else {
			var r uint64
			if json.Unmarshal(b.Room, &r) != nil {
				t.Fatalf("bootstrap_room %s", b.Room)
			}
			rooms = append(rooms, r)
		}
		if string(b.Host) != host || string(b.Port) != port {
			t.Fatalf("bootstrap_host %s bootstrap_port %s, want %s %s", b.Host, b.Port, host, port)
		}
		for _, r := range rooms {
			if k := strconv.FormatUint(r, 10); seen[k] || r >= 1<<63 {
				t.Fatalf("room %d is not fresh", r)
			} else {
				seen[k] = true
			}
		}
	}
	t.Run("answers", func(t *testing.T) {
		for _, path := range []string{schemas.EndpointChat, schemas.EndpointCompletions} {
			for _, stream := range []bool{true, false} {
				for _, choices := range []int{1, 2} {
					success(t, path, stream, choices)
				}
			}
		}
		s.idle(t)
	})

	t.Run("prefill fails while the decode waits", func(t *testing.T) {
		// The prefill accepts, works 300 ms, then fails with an error
		// object: the decode is waiting for its room all that while.
		s.arm(t, "p1", `[{"kind":"header-delay","phase":"prefill","delay_ms":300,"count":1},{"kind":"error-object","phase":"prefill","status":500,"message":"prefill forward failed","count":1}]`)
		before := map[string]sim.Stats{"d1": s.sims["d1"].stats(t), "d2": s.sims["d2"].stats(t)}
		resp, body, took := s.post(t, schemas.EndpointChat, "sg-fail-1", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"no KV for you"}],"stream":true}`, meshModel))
		if resp.StatusCode != 502 {
			t.Fatalf("status %d, want 502: %s", resp.StatusCode, body)
		}
		// 300 ms of prefill work, then at once: far below the 10 s wait.
		if took < 300*time.Millisecond || took > time.Second {
			t.Fatalf("502 after %v: want it right after the prefill's failure at 300 ms", took)
		}
		t.Logf("502 after %v (the prefill failed at 300 ms; the decode would have waited %v)", took, sglangKVTimeout)
		var aborted int64
		testkit.WaitEvery(t, 2*time.Second, pollInterval, "the decode's request aborted", func() bool {
			aborted = 0
			for _, id := range []string{"d1", "d2"} {
				st := s.sims[id].stats(t)
				if st.ActiveStreams != 0 {
					return false
				}
				aborted += st.Aborted - before[id].Aborted
			}
			return aborted == 1
		})
		s.idle(t)
		fs := s.list(t, func(e event) bool { return e.kind == schemas.KindFailure && e.RequestID == "sg-fail-1" })
		if len(fs) != 1 || fs[0].EngineID != "p1" || fs[0].Phase != "prefill" || !fs[0].Counts {
			t.Fatalf("failure events %+v: want one counted prefill failure of p1", fs)
		}
		success(t, schemas.EndpointChat, true, 1) // resets p1's streak
	})

	t.Run("hanging prefill", func(t *testing.T) {
		s.arm(t, "p1", `{"kind":"silence","phase":"prefill","count":1}`)
		resp, body, took := s.post(t, schemas.EndpointCompletions, "sg-hang-1", fmt.Sprintf(`{"model":%q,"prompt":"hang on","stream":false}`, meshModel))
		if resp.StatusCode != 504 || !strings.Contains(string(body), "engine prefill timeout") {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		if took < sglangPrefillTimeout-50*time.Millisecond || took > sglangPrefillTimeout+time.Second {
			t.Fatalf("504 after %v, want it at the %v prefill timeout", took, sglangPrefillTimeout)
		}
		t.Logf("504 after %v", took)
		s.idle(t)
		success(t, schemas.EndpointCompletions, true, 1)
	})

	t.Run("breaker probe readmits an SGLang prefill", func(t *testing.T) {
		s.arm(t, "p1", `{"kind":"status","phase":"prefill","status":500}`)
		testkit.WaitEvery(t, 10*time.Second, pollInterval, "p1 ejected", func() bool {
			if len(s.list(t, isEjection("p1"))) > 0 {
				return true
			}
			n++
			s.post(t, schemas.EndpointChat, "sg-eject-"+strconv.Itoa(n), fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"x"}]}`, meshModel))
			return false
		})
		s.disarm(t, "p1")
		testkit.WaitEvery(t, 10*time.Second, pollInterval, "p1 readmitted by a successful probe", func() bool {
			return len(s.list(t, isReadmission("p1"))) > 0 && len(s.list(t, isProbe("p1", schemas.ProbeSuccess))) > 0
		})
		// The probe ran the router's path: the same body, with bootstrap
		// fields, to p1 and a decode.
		var probes []sim.RecordedRequest
		for _, r := range s.sims["p1"].requests(t) {
			if strings.HasPrefix(r.RequestID, kvprobe.RequestIDPrefix) {
				probes = append(probes, r)
			}
		}
		if len(probes) == 0 {
			t.Fatal("p1 recorded no probe")
		}
		last := probes[len(probes)-1]
		room := bootstrapFields(t, last.Body).Room
		found := false
		for _, id := range []string{"d1", "d2"} {
			for _, r := range s.sims[id].requests(t) {
				if r.RequestID == last.RequestID && bytes.Equal(r.Body, last.Body) {
					found = true
				}
			}
		}
		if len(room) == 0 || !found {
			t.Fatalf("probe %s: no decode got the same body (room %s)", last.Body, room)
		}
		testkit.WaitEvery(t, 5*time.Second, pollInterval, "p1 placeable again", func() bool {
			n++
			resp, _, _ := s.post(t, schemas.EndpointChat, "sg-back-"+strconv.Itoa(n), fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"back"}],"max_tokens":2}`, meshModel))
			return resp.StatusCode == 200
		})
	})

	t.Run("preflight", func(t *testing.T) {
		out, code := runNarwhal(t, "preflight", "--config", s.cfgPath)
		if code != 0 || !strings.Contains(out, "p1") || !strings.Contains(out, "d2") {
			t.Fatalf("narwhal preflight: exit %d\n%s", code, out)
		}
		t.Logf("narwhal preflight:\n%s", out)
	})
}

// TestSGLangRetryRRETRY2: a failed SGLang prefill is retried on another
// producer (never the failed one) with a new room and backend request id
// (R-RETRY-2, R-RETRY-3, R-OWN-4, R-DESC-7).
func TestSGLangRetryRRETRY2(t *testing.T) {
	s := startSGLang(t, 2, 1, "NARWHAL_RECOVERY_RETRY_ATTEMPTS=1", "NARWHAL_RECOVERY_RETRY_BUDGET_RATIO=1")
	s.arm(t, "p1", `[{"kind":"header-delay","phase":"prefill","delay_ms":100},{"kind":"error-object","phase":"prefill","status":500}]`)
	retried := 0
	for i := 0; i < 12 && retried < 2; i++ {
		id := "sg-retry-" + strconv.Itoa(i)
		resp, body, _ := s.post(t, schemas.EndpointChat, id, fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"retry %d"}],"max_tokens":3,"stream":true}`, meshModel, i))
		if resp.StatusCode != 200 || resp.Header.Get("X-Narwhal-Prefill-Engine") != "p2" {
			t.Fatalf("status %d from prefill %s: %s", resp.StatusCode, resp.Header.Get("X-Narwhal-Prefill-Engine"), body)
		}
		failed := s.legsOf(t, "p1", id)
		if len(failed) == 0 {
			continue
		}
		retried++
		good := s.legsOf(t, "p2", id)
		decodes := s.legsOf(t, "d1", id)
		if len(failed) != 1 || len(good) != 1 || len(decodes) != 2 {
			t.Fatalf("legs: p1 %d, p2 %d, d1 %d; want 1, 1, 2", len(failed), len(good), len(decodes))
		}
		r1, r2 := bootstrapFields(t, failed[0]).Room, bootstrapFields(t, good[0]).Room
		if bytes.Equal(r1, r2) || !bytes.Equal(bootstrapFields(t, decodes[0]).Room, r1) || !bytes.Equal(bootstrapFields(t, decodes[1]).Room, r2) {
			t.Fatalf("rooms: failed %s, retry %s, decodes %s %s", r1, r2, bootstrapFields(t, decodes[0]).Room, bootstrapFields(t, decodes[1]).Room)
		}
		var p2Port int
		if json.Unmarshal(bootstrapFields(t, good[0]).Port, &p2Port) != nil || p2Port != s.boot["p2"] {
			t.Fatalf("the retry names bootstrap port %s, not p2's %d", bootstrapFields(t, good[0]).Port, s.boot["p2"])
		}
	}
	if retried == 0 {
		t.Fatal("no request was placed on p1 first")
	}
	s.idle(t)
}

// TestSGLangNixlMixRefusedRDESC3: a fleet whose SGLang producer has only a
// nixl consumer is refused before anything starts: the router does not
// start, preflight fails, both naming the key.
func TestSGLangNixlMixRefusedRDESC3(t *testing.T) {
	ports := freePorts(t, 1)
	path := writeConfig(t, `fleet:
  - id: p1
    url: http://127.0.0.1:1
    role: prefill
    connector: sglang
    bootstrap_port: 8998
  - id: d1
    url: http://127.0.0.1:2
    role: decode
    connector: nixl
`)
	for _, args := range [][]string{{"router", "--config", path, "--listen", hostPort(ports[0])}, {"preflight", "--config", path}} {
		out, code := runNarwhal(t, args...)
		if code == 0 || !strings.Contains(out, "fleet[0].connector: prefill engine p1 uses sglang, but no decode engine does") {
			t.Fatalf("narwhal %s: exit %d\n%s", args[0], code, out)
		}
	}
}
