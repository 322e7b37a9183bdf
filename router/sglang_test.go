package router

import (
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Tests of the sglang connector's attempt (R-DESC-7): one body with fresh
// bootstrap fields to both engines at once, the prefill watched.

// sglangKVTimeout is how long the decode sims wait for a room: far above
// every bound the tests assert, so that a result that arrives in time
// cannot come from the decode's own timeout.
const sglangKVTimeout = 10 * time.Second

// sglangFleet is prefills producers and decodes consumers, all sglang.
func sglangFleet(prefills, decodes int) []engineDef {
	var defs []engineDef
	for i := 1; i <= prefills; i++ {
		defs = append(defs, engineDef{id: "p" + strconv.Itoa(i), role: "prefill", cfg: sim.Config{Connector: sim.ConnectorSGLang, KVTimeout: sglangKVTimeout}})
	}
	for i := 1; i <= decodes; i++ {
		defs = append(defs, engineDef{id: "d" + strconv.Itoa(i), role: "decode", cfg: sim.Config{Connector: sim.ConnectorSGLang, KVTimeout: sglangKVTimeout}})
	}
	return defs
}

func sglangStack(t *testing.T, prefills, decodes int, mutate func(*config.Config)) *stack {
	return sglangStackOf(t, sglangFleet(prefills, decodes), mutate)
}

func sglangStackOf(t *testing.T, defs []engineDef, mutate func(*config.Config)) *stack {
	s := newStack(t, defs, func(c *config.Config) {
		c.Engine.FirstTokenTimeoutS = 5
		c.Engine.PrefillTimeoutS = 0.5
		if mutate != nil {
			mutate(c)
		}
	})
	s.waitModels()
	return s
}

// bootstrapOf decodes the bootstrap fields of a recorded body.
type bootstrapFields struct {
	Host json.RawMessage `json:"bootstrap_host"`
	Port json.RawMessage `json:"bootstrap_port"`
	Room json.RawMessage `json:"bootstrap_room"`
}

func bootstrapOf(t *testing.T, body json.RawMessage) bootstrapFields {
	t.Helper()
	var b bootstrapFields
	if err := json.Unmarshal(body, &b); err != nil {
		t.Fatal(err)
	}
	return b
}

// legBodies returns the one recorded body of client request id on engine
// srv (failing unless there is exactly one).
func legBody(t *testing.T, srv *sim.Server, clientID string) json.RawMessage {
	t.Helper()
	var out []json.RawMessage
	for _, r := range srv.Requests() {
		if strings.HasPrefix(r.RequestID, clientID+"-") {
			out = append(out, r.Body)
		}
	}
	if len(out) != 1 {
		t.Fatalf("%d legs of %s on the engine, want 1", len(out), clientID)
	}
	return out[0]
}

// TestSGLangAttemptRDESC7 runs streaming and non-streaming chat and
// completions, n = 1 and 2, through an sglang pair: the tokens are the
// decode's (sim.Generate), both engines got the same body with the
// attempt's bootstrap fields (host and port of the producer, a fresh
// room; arrays of n rooms for n = 2), the client's own bootstrap fields
// reach no engine, ttft_s is recorded, and nothing stays reserved
// (R-DESC-7, R-LEG-5, R-TIME-1, R-OWN-3).
func TestSGLangAttemptRDESC7(t *testing.T) {
	s := sglangStack(t, 1, 2, nil)
	_, port, _ := net.SplitHostPort(s.sims["p1"].KVAddr())
	rooms := map[string]bool{}
	for i, c := range []struct {
		endpoint string
		stream   bool
		n        int
	}{{schemas.EndpointChat, true, 1}, {schemas.EndpointChat, false, 1}, {schemas.EndpointCompletions, true, 1}, {schemas.EndpointCompletions, false, 1}, {schemas.EndpointChat, true, 2}, {schemas.EndpointCompletions, false, 2}} {
		t.Run(fmt.Sprintf("%s stream=%v n=%d", c.endpoint, c.stream, c.n), func(t *testing.T) {
			id := "sg-" + strconv.Itoa(i)
			content := "tell me about narwhals " + strconv.Itoa(i)
			extra := fmt.Sprintf(`"max_tokens":6,"stream":%v,"n":%d,"bootstrap_host":"evil.example","bootstrap_port":1,"bootstrap_room":5,"bootstrap_pair_key":"x"`, c.stream, c.n)
			var body, prompt string
			if c.endpoint == schemas.EndpointChat {
				body = chatBody(content, extra)
				msgs, _ := json.Marshal([]map[string]string{{"role": "user", "content": content}})
				prompt, _ = sim.RenderChat(msgs)
			} else {
				body = fmt.Sprintf(`{"model":%q,"prompt":%q,%s}`, testModel, content, extra)
				prompt = content
			}
			resp, got := s.post(c.endpoint, body, "X-Request-Id", id)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			// Every choice j is what the decode generates with seed j.
			want := make([]string, c.n)
			for j := range want {
				toks, _ := sim.Generate(prompt, int64(j), 6, nil, false)
				want[j] = strings.Join(toks, "")
			}
			texts := choiceTexts(t, got, c.stream, c.n)
			for j := range want {
				if texts[j] != want[j] {
					t.Fatalf("choice %d = %q, want %q", j, texts[j], want[j])
				}
			}
			dec := resp.Header.Get("X-Narwhal-Decode-Engine")
			pb, db := legBody(t, s.sims["p1"], id), legBody(t, s.sims[dec], id)
			if string(pb) != string(db) {
				t.Fatalf("the engines got different bodies:\nprefill %s\ndecode  %s", pb, db)
			}
			if strings.Contains(string(pb), "evil.example") || strings.Contains(string(pb), "bootstrap_pair_key") {
				t.Fatalf("a client bootstrap field reached an engine: %s", pb)
			}
			b := bootstrapOf(t, pb)
			wantHost, wantPort := `"127.0.0.1"`, port
			var roomList []uint64
			if c.n == 1 {
				var r uint64
				if string(b.Host) != wantHost || string(b.Port) != wantPort || json.Unmarshal(b.Room, &r) != nil {
					t.Fatalf("bootstrap fields %s %s %s, want host %s port %s and one room", b.Host, b.Port, b.Room, wantHost, wantPort)
				}
				roomList = []uint64{r}
			} else {
				if string(b.Host) != "["+wantHost+","+wantHost+"]" || string(b.Port) != "["+wantPort+","+wantPort+"]" || json.Unmarshal(b.Room, &roomList) != nil || len(roomList) != 2 {
					t.Fatalf("bootstrap fields %s %s %s, want arrays of 2", b.Host, b.Port, b.Room)
				}
			}
			for _, r := range roomList {
				key := strconv.FormatUint(r, 10)
				if r == 5 || r >= 1<<63 || rooms[key] {
					t.Fatalf("room %d: not a fresh 63-bit room", r)
				}
				rooms[key] = true
			}
			s.idle()
			if ev := s.requestEvent(id); ev.TTFTSeconds == nil || ev.FirstByteSeconds == nil || ev.ProducerID != "p1" {
				t.Fatalf("request event %+v: want ttft_s, first_byte_s and producer p1", ev)
			}
		})
	}
	if st := s.sims["p1"].Stats(); st.KVHeld != 0 || st.KVServed == 0 {
		t.Fatalf("prefill stats %+v: every room served and taken", st)
	}
	s.validEvents()
}

// choiceTexts returns the text of each of n choices of a client answer.
func choiceTexts(t *testing.T, body []byte, stream bool, n int) []string {
	t.Helper()
	out := make([]string, n)
	if stream {
		for _, p := range sseEvents(body) {
			if p == "[DONE]" {
				continue
			}
			var ch struct {
				Choices []struct {
					Index int    `json:"index"`
					Text  string `json:"text"`
					Delta struct {
						Content string `json:"content"`
					} `json:"delta"`
				} `json:"choices"`
			}
			if err := json.Unmarshal([]byte(p), &ch); err != nil {
				t.Fatalf("bad event %s", p)
			}
			for _, c := range ch.Choices {
				out[c.Index] += c.Text + c.Delta.Content
			}
		}
		return out
	}
	var cc struct {
		Choices []struct {
			Index   int    `json:"index"`
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &cc); err != nil || len(cc.Choices) != n {
		t.Fatalf("completion %s: want %d choices", body, n)
	}
	for _, c := range cc.Choices {
		out[c.Index] = c.Text + c.Message.Content
	}
	return out
}

// TestSGLangPrefillFailureCancelsDecodeRDESC7 fails the prefill after it
// accepted the request (an error object, a broken connection, an HTTP
// error) while the decode waits for its room: the client gets 502 at once
// — far below the decode's 10 s wait for KV —, the decode leg is
// cancelled (the decode engine sees its request aborted), every
// reservation is released, and the failure is the producer's prefill
// fault (R-DESC-7, R-FAIL-1, R-OWN-3, R-OWN-5).
func TestSGLangPrefillFailureCancelsDecodeRDESC7(t *testing.T) {
	delay := sim.Fault{Kind: sim.FaultHeaderDelay, DelayMS: 200}
	for _, c := range []struct {
		name   string
		faults []sim.Fault
		kind   string
		waited bool // the decode surely waited for its room
	}{
		{"error object", []sim.Fault{{Kind: sim.FaultErrorObject, Message: "prefill forward failed"}}, "error_object", false},
		{"abort", []sim.Fault{{Kind: sim.FaultAbort}}, "prefill_response", false},
		{"status", []sim.Fault{{Kind: sim.FaultStatus, Status: 500}}, "prefill_status", false},
		{"status after a while", []sim.Fault{delay, {Kind: sim.FaultStatus, Status: 500}}, "prefill_status", true},
		{"error object after a while", []sim.Fault{delay, {Kind: sim.FaultErrorObject}}, "error_object", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := sglangStack(t, 1, 1, nil)
			for _, f := range c.faults {
				f.Phase = sim.PhasePrefill
				s.sims["p1"].Arm(f)
			}
			start := time.Now()
			resp, body := s.post(schemas.EndpointChat, chatBody("the KV never comes", `"stream":true`))
			took := time.Since(start)
			if resp.StatusCode != 502 {
				t.Fatalf("status %d, want 502: %s", resp.StatusCode, body)
			}
			if took > time.Second {
				t.Fatalf("502 after %v: the decode was not cancelled at the prefill's failure", took)
			}
			errorBody(t, 502, body)
			s.idle()
			// Every decode request that reached the engine was aborted
			// by the router while it waited for KV.
			testkit.WaitFor(t, 2*time.Second, "decode request aborted", func() bool {
				st := s.sims["d1"].Stats()
				return st.ActiveStreams == 0 && st.Aborted == st.Decodes && st.KVPulled == 0 && st.Completed == 0 &&
					(!c.waited || st.Aborted == 1)
			})
			s.oneFailure("p1", "prefill", c.kind, true)
			s.validEvents()
		})
	}
}

// TestSGLangHangingPrefillIs504RDESC7: a prefill that never answers ends
// the attempt at engine.prefill_timeout_s with 504, the decode cancelled
// (R-DESC-7, R-FAIL-1).
func TestSGLangHangingPrefillIs504RDESC7(t *testing.T) {
	s := sglangStack(t, 1, 1, nil)
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultSilence, Phase: sim.PhasePrefill})
	start := time.Now()
	resp, body := s.post(schemas.EndpointChat, chatBody("hang", ""))
	took := time.Since(start)
	if resp.StatusCode != 504 || took < 450*time.Millisecond || took > 2*time.Second {
		t.Fatalf("status %d after %v, want 504 at the 0.5 s prefill timeout: %s", resp.StatusCode, took, body)
	}
	if e := errorBody(t, 504, body); e.Message != "engine prefill timeout" {
		t.Fatalf("message %q", e.Message)
	}
	s.idle()
	s.oneFailure("p1", "prefill", "prefill_timeout", true)
}

// TestSGLangRetryFreshRoomRRETRY2 retries a failed prefill: the retry
// never uses the failed producer, and gets a new room and backend id
// (R-RETRY-2, R-RETRY-3, R-OWN-4, R-DESC-7).
func TestSGLangRetryFreshRoomRRETRY2(t *testing.T) {
	s := sglangStack(t, 2, 1, func(c *config.Config) {
		c.Recovery.RetryAttempts = 1
		c.Recovery.RetryBudgetRatio = 1
	})
	// p1 fails after the decode of the same attempt has surely arrived.
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhasePrefill, DelayMS: 100})
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultErrorObject, Phase: sim.PhasePrefill})
	retried := 0
	for i := range 8 {
		id := "rt-" + strconv.Itoa(i)
		resp, body := s.post(schemas.EndpointChat, chatBody("retry me", `"max_tokens":3`), "X-Request-Id", id)
		if resp.StatusCode != 200 || resp.Header.Get("X-Narwhal-Prefill-Engine") != "p2" {
			t.Fatalf("status %d on %s: %s", resp.StatusCode, resp.Header.Get("X-Narwhal-Prefill-Engine"), body)
		}
		s.idle()
		if s.requestEvent(id).Attempts == 1 {
			continue
		}
		retried++
		first, second := legBody(t, s.sims["p1"], id), legBody(t, s.sims["p2"], id)
		if string(bootstrapOf(t, first).Room) == string(bootstrapOf(t, second).Room) {
			t.Fatalf("the retry reused room %s", bootstrapOf(t, first).Room)
		}
		// The decode engine got both attempts, each with its own room.
		var decodeRooms []string
		for _, r := range s.sims["d1"].Requests() {
			if strings.HasPrefix(r.RequestID, id+"-") {
				decodeRooms = append(decodeRooms, string(bootstrapOf(t, r.Body).Room))
			}
		}
		if len(decodeRooms) != 2 || decodeRooms[1] != string(bootstrapOf(t, second).Room) {
			t.Fatalf("decode rooms %v, want the two attempts' rooms", decodeRooms)
		}
	}
	if retried == 0 {
		t.Fatal("no request was placed on p1 first in 8 tries")
	}
}

// TestSGLangLatePrefillFailureRDESC7: a prefill that fails after the
// decode's output started (the KV had arrived) does not end the stream;
// it is recorded as the producer's failure (R-DESC-7).
func TestSGLangLatePrefillFailureRDESC7(t *testing.T) {
	defs := sglangFleet(1, 1)
	defs[1].cfg.ITL = 150 * time.Millisecond // the stream outlives the prefill's answer
	s := sglangStackOf(t, defs, func(c *config.Config) { c.Engine.PrefillTimeoutS = 5 })
	// The prefill serves the room, waits, then fails its own answer.
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultFirstTokenDelay, Phase: sim.PhasePrefill, DelayMS: 300})
	s.sims["p1"].Arm(sim.Fault{Kind: sim.FaultErrorObject, Phase: sim.PhasePrefill, AfterTokens: 1})
	resp, body := s.post(schemas.EndpointChat, chatBody("late failure", `"stream":true,"max_tokens":4`))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	text, done, errObj := streamText(t, body)
	if !done || errObj != nil || text != expectedChat(t, "late failure", 0, 4) {
		t.Fatalf("stream %q done=%v err=%v", text, done, errObj)
	}
	s.idle()
	testkit.WaitFor(t, 2*time.Second, "the late failure recorded", func() bool { return len(s.events.failures()) == 1 })
	s.oneFailure("p1", "prefill", "error_object", true)
}

// TestSGLangNeverPairsMixedConnectorsRDESC3: in a fleet of nixl and
// sglang engines, every attempt pairs engines of one connector.
func TestSGLangNeverPairsMixedConnectorsRDESC3(t *testing.T) {
	defs := append(sglangFleet(1, 1), engineDef{id: "p2", role: "prefill"}, engineDef{id: "d2", role: "decode"})
	s := newStack(t, defs, nil)
	s.waitModels()
	for i := range 12 {
		resp, body := s.post(schemas.EndpointChat, chatBody("pair me "+strconv.Itoa(i), `"max_tokens":2`))
		p, d := resp.Header.Get("X-Narwhal-Prefill-Engine"), resp.Header.Get("X-Narwhal-Decode-Engine")
		if resp.StatusCode != 200 || p[1:] != d[1:] {
			t.Fatalf("status %d, pair %s/%s: %s", resp.StatusCode, p, d, body)
		}
	}
	s.idle()
}

// TestSGLangDecodeFailureAbandonsRoomROWN6: a decode that fails before
// its output after the prefill served the room is the consumer's fault,
// and the room's stranded KV is published as an abandoned handoff
// (R-OWN-6, R-DESC-7).
func TestSGLangDecodeFailureAbandonsRoomROWN6(t *testing.T) {
	s := sglangStack(t, 1, 1, nil)
	s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhaseDecode, DelayMS: 200})
	s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500})
	resp, body := s.post(schemas.EndpointChat, chatBody("the decode fails", ""))
	if resp.StatusCode != 502 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	s.idle()
	s.oneFailure("d1", "decode", "upstream_status", true)
	hs := s.events.handoffs()
	if len(hs) != 1 || hs[0].EngineID != "p1" || hs[0].Connector != "sglang" || hs[0].Reason != "decode_failed" || hs[0].Released {
		t.Fatalf("handoff events %+v", hs)
	}
	s.validEvents()
}
