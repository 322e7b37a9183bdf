package sim

import (
	"encoding/json"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"
)

// sglangPair starts an sglang prefill and decode; the decode waits at
// most kvTimeout for a room.
func sglangPair(t *testing.T, kvTimeout time.Duration) (prefill *Server, prefillURL string, decode *Server, decodeURL string, port int) {
	t.Helper()
	prefill, prefillURL = startEngine(t, Config{Role: RolePrefill, EngineID: "p1", Model: "m", Connector: ConnectorSGLang, KVTimeout: kvTimeout})
	decode, decodeURL = startEngine(t, Config{Role: RoleDecode, EngineID: "d1", Model: "m", Connector: ConnectorSGLang, KVTimeout: kvTimeout})
	_, p, _ := net.SplitHostPort(prefill.KVAddr())
	port, _ = strconv.Atoi(p)
	return
}

// sglangBody is one body both engines of a pair receive (R-DESC-7).
func sglangBody(port int, room any, extra map[string]any) map[string]any {
	b := map[string]any{"model": "m", "prompt": "the bootstrap room", "max_tokens": 5, "stream": true,
		"stream_options": map[string]any{"include_usage": true},
		"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
	for k, v := range extra {
		b[k] = v
	}
	return b
}

// TestSGLangBootstrapRDESC7: the decode waits on the prefill's bootstrap
// server for its room and generates what Generate says only after the
// prefill served the KV; the prefill answers one token; n = 2 takes one
// room per choice; the phase of each request is the engine's role.
func TestSGLangBootstrapRDESC7(t *testing.T) {
	prefill, pURL, decode, dURL, port := sglangPair(t, 5*time.Second)
	c := newClient(t)
	for _, n := range []int{1, 2} {
		var room any = uint64(1<<62 + n)
		if n == 2 {
			room = []uint64{11, 12}
		}
		body := sglangBody(port, room, map[string]any{"n": n})
		type answer struct {
			raw    []byte
			status int
		}
		dec := make(chan answer, 1)
		go func() {
			resp, err := postCtx(t.Context(), c, dURL+"/v1/completions", body)
			if err != nil {
				dec <- answer{}
				return
			}
			raw := readBody(t, resp)
			dec <- answer{raw, resp.StatusCode}
		}()
		// The decode waits for the room: nothing yet after a while.
		select {
		case a := <-dec:
			t.Fatalf("decode answered before its KV was served: %d %s", a.status, a.raw)
		case <-time.After(100 * time.Millisecond):
		}
		resp := post(t, c, pURL+"/v1/completions", body)
		praw := readBody(t, resp)
		if resp.StatusCode != 200 || !strings.Contains(string(praw), "data: [DONE]") {
			t.Fatalf("prefill: %d %s", resp.StatusCode, praw)
		}
		a := <-dec
		if a.status != 200 {
			t.Fatalf("decode: %d %s", a.status, a.raw)
		}
		for j := range n {
			toks, _ := Generate("the bootstrap room", int64(j), 5, nil, false)
			if got := streamedText(t, a.raw, j); got != strings.Join(toks, "") {
				t.Fatalf("choice %d = %q, want %q", j, got, strings.Join(toks, ""))
			}
		}
	}
	if st := prefill.Stats(); st.Prefills != 2 || st.KVServed != 3 || st.KVHeld != 0 {
		t.Fatalf("prefill stats %+v", st)
	}
	if st := decode.Stats(); st.Decodes != 2 || st.KVPulled != 2 {
		t.Fatalf("decode stats %+v", st)
	}
	for _, r := range prefill.Requests() {
		if r.Phase != PhasePrefill {
			t.Fatalf("prefill request recorded as %q", r.Phase)
		}
	}
}

// streamedText concatenates choice j's text in an SSE body.
func streamedText(t *testing.T, raw []byte, j int) string {
	t.Helper()
	var sb strings.Builder
	for _, line := range strings.Split(string(raw), "\n") {
		p, ok := strings.CutPrefix(line, "data: ")
		if !ok || p == "[DONE]" {
			continue
		}
		var ch struct {
			Choices []struct {
				Index int    `json:"index"`
				Text  string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(p), &ch); err != nil {
			t.Fatalf("bad event %s", p)
		}
		for _, c := range ch.Choices {
			if c.Index == j {
				sb.WriteString(c.Text)
			}
		}
	}
	return sb.String()
}

// TestSGLangFaultsRDESC7: a room never served fails the decode after its
// own KV timeout; a prefill that fails before its forward pass ends
// (after_tokens 0) serves no room; a request without bootstrap_room is
// refused (an engine in disaggregation mode serves only paired requests).
func TestSGLangFaultsRDESC7(t *testing.T) {
	t.Run("room never served", func(t *testing.T) {
		prefill, pURL, _, dURL, port := sglangPair(t, 300*time.Millisecond)
		prefill.Arm(Fault{Kind: FaultRoomUnserved})
		c := newClient(t)
		body := sglangBody(port, 77, nil)
		resp := post(t, c, pURL+"/v1/completions", body)
		if raw := readBody(t, resp); resp.StatusCode != 200 {
			t.Fatalf("prefill: %d %s", resp.StatusCode, raw)
		}
		start := time.Now()
		resp = post(t, c, dURL+"/v1/completions", body)
		raw := readBody(t, resp)
		took := time.Since(start)
		if !strings.Contains(string(raw), "KV transfer failed: no KV arrived in bootstrap room 77") || took < 250*time.Millisecond {
			t.Fatalf("decode after %v: %s", took, raw)
		}
	})
	t.Run("prefill fails before serving", func(t *testing.T) {
		prefill, pURL, _, _, port := sglangPair(t, time.Second)
		prefill.Arm(Fault{Kind: FaultErrorObject, Phase: PhasePrefill})
		c := newClient(t)
		resp := post(t, c, pURL+"/v1/completions", sglangBody(port, 78, nil))
		raw := readBody(t, resp)
		if resp.StatusCode != 200 || !strings.Contains(string(raw), `"error"`) {
			t.Fatalf("prefill: %d %s", resp.StatusCode, raw)
		}
		if st := prefill.Stats(); st.KVHeld != 0 {
			t.Fatalf("a failed prefill served its room: %+v", st)
		}
	})
	t.Run("unpaired request", func(t *testing.T) {
		_, _, _, dURL, _ := sglangPair(t, time.Second)
		resp := post(t, newClient(t), dURL+"/v1/completions", map[string]any{"model": "m", "prompt": "x"})
		if raw := readBody(t, resp); resp.StatusCode != 400 || !strings.Contains(string(raw), "bootstrap_room is required") {
			t.Fatalf("%d %s", resp.StatusCode, raw)
		}
	})
	if _, err := New(Config{Role: RoleBoth, EngineID: "x", Model: "m", Connector: ConnectorSGLang}); err == nil {
		t.Fatal("an sglang engine of role both was accepted")
	}
}
