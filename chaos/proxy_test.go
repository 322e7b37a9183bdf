package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
	"golang.org/x/sync/errgroup"
)

// TestTransparentWithNothingArmed proves that a chaos proxy with nothing
// armed for its engine (R-CHAOS-1), or with faults armed that do not apply
// to a request, is invisible: streamed and non-streamed chat completions
// and a streamed completion through the proxy are byte for byte the bodies
// the simulator sends directly, once the "created" timestamps (whole
// seconds, the only bytes that may differ between two identical requests)
// are set to 0 — the completion ids are equal because both requests carry
// the same X-Request-Id, from which the simulator derives them. Status,
// Content-Type and X-Request-Id agree too. Chunks are flushed one by one:
// the client holds the first token while the engine is still streaming,
// and the tokens arrive spread over the engine's inter-token latency.
func TestTransparentWithNothingArmed(t *testing.T) {
	tb := startBus(t)
	const itl = 50 * time.Millisecond
	s := startSim(t, "d1", itl)
	p, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	c := newClient(t)

	cases := []struct{ name, path, body string }{
		{"chat stream", "/v1/chat/completions", chatStream},
		{"chat", "/v1/chat/completions", chatPlain},
		{"completions stream", "/v1/completions", complStream},
	}
	compare := func(t *testing.T) {
		for i, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				id := "transparent-" + strconv.Itoa(i)
				direct := do(t, c, s.URL(), tc.path, id, tc.body)
				proxied := do(t, c, proxyURL, tc.path, id, tc.body)
				if direct.status != http.StatusOK || direct.err != nil {
					t.Fatalf("direct: HTTP %d %v: %s", direct.status, direct.err, direct.body)
				}
				if proxied.status != direct.status || proxied.err != nil {
					t.Fatalf("proxied: HTTP %d %v, want %d", proxied.status, proxied.err, direct.status)
				}
				for _, h := range []string{"Content-Type", "X-Request-Id"} {
					if proxied.header.Get(h) != direct.header.Get(h) {
						t.Errorf("%s %q, direct %q", h, proxied.header.Get(h), direct.header.Get(h))
					}
				}
				if got, want := normalised(proxied.body), normalised(direct.body); got != want {
					t.Errorf("proxied body differs:\n got %q\nwant %q", got, want)
				}
			})
		}
	}
	t.Run("nothing armed", compare)

	// A fault for another phase and one for another engine engage the
	// request inspection but strike nothing.
	armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultHTTPStatus, Phase: PhasePrefill, Probability: 1}, time.Minute)
	if _, err := tb.store.Arm(testContext(t), Fault{EngineID: "other", Name: FaultHTTPStatus, Probability: 1}, time.Minute); err != nil {
		t.Fatal(err)
	}
	t.Run("other phase armed", compare)
	if n := len(tb.events.of(schemas.ChaosInject)); n != 0 {
		t.Errorf("%d inject events, want none", n)
	}

	t.Run("chunk timing", func(t *testing.T) {
		resp, err := post(t, testContext(t), c, proxyURL, "/v1/chat/completions", "timing", chatStream)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		var outputs []time.Time
		for {
			line, err := br.ReadBytes('\n')
			if payload, ok := schemas.SSEData(line); ok && schemas.ClassifyChunk(payload) == schemas.ChunkOutput {
				if len(outputs) == 0 {
					if st := s.Stats(); st.ActiveStreams != 1 {
						t.Errorf("the engine's stream had ended when the client got the first token (active streams %d): the proxy buffered it", st.ActiveStreams)
					}
				}
				outputs = append(outputs, time.Now())
			}
			if err != nil {
				break
			}
		}
		if len(outputs) < 3 {
			t.Fatalf("%d output chunks", len(outputs))
		}
		// The engine sends the output chunks at least one ITL apart (the
		// finish chunk may follow the last token at once), so they span at
		// least (n-2)·ITL at the engine; a proxy that buffered them hands
		// them on within a few milliseconds. Half that span leaves room for
		// a loaded machine delaying the first chunk more than the last one.
		if spread, least := outputs[len(outputs)-1].Sub(outputs[0]), time.Duration(len(outputs)-2)*itl/2; spread < least {
			t.Errorf("output chunks arrived within %v, want at least %v: they were not flushed as the engine sent them", spread, least)
		}
	})
}

// TestUnknownTrafficPassesUntouched proves the proxy forwards what it does
// not fault as it came (R-CHAOS-1): any method, path, query, header
// (forwarding headers included) and body, and any status, header and body
// back — also while faults are armed for the engine, and for an inference
// path whose body is not JSON.
func TestUnknownTrafficPassesUntouched(t *testing.T) {
	tb := startBus(t)
	type seen struct {
		method, uri string
		header      http.Header
		body        []byte
		length      int64
	}
	var mu sync.Mutex
	var got []seen
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, seen{r.Method, r.RequestURI, r.Header.Clone(), body, r.ContentLength})
		mu.Unlock()
		w.Header().Set("X-Upstream", "yes")
		w.Header()["X-Multi"] = []string{"a", "b"}
		w.WriteHeader(207)
		_, _ = w.Write([]byte("raw\x00bytes"))
	}))
	defer up.Close()
	p, proxyURL := startProxy(t, "e1", up.URL, tb.store)
	armAndWait(t, tb.store, p, Fault{EngineID: "e1", Name: FaultHTTPStatus, Phase: PhasePrefill, Probability: 1}, time.Minute)
	c := newClient(t)

	cases := []struct {
		method, uri string
		body        []byte
	}{
		{"PATCH", "/some/odd/path?q=1&r=%2F", []byte("binary\x01\x02")},
		{"GET", "/health", nil},
		{"POST", "/v1/chat/completions", []byte("not json {")},
		{"DELETE", "/v1/completions", []byte(`{"stream":true}`)},
	}
	for i, tc := range cases {
		req, err := http.NewRequestWithContext(testContext(t), tc.method, proxyURL+tc.uri, bytes.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		if tc.body == nil {
			req.Body = nil
		}
		req.Header.Set("X-Custom", "v"+strconv.Itoa(i))
		req.Header.Set("X-Forwarded-For", "10.1.2.3")
		req.Header.Set("User-Agent", "agent/1")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 207 || string(body) != "raw\x00bytes" || resp.Header.Get("X-Upstream") != "yes" ||
			strings.Join(resp.Header["X-Multi"], ",") != "a,b" {
			t.Errorf("%s %s: client got HTTP %d %q %v", tc.method, tc.uri, resp.StatusCode, body, resp.Header)
		}
		mu.Lock()
		s := got[len(got)-1]
		mu.Unlock()
		if s.method != tc.method || s.uri != tc.uri || !bytes.Equal(s.body, tc.body) || (tc.body != nil && s.length != int64(len(tc.body))) {
			t.Errorf("%s %s: engine got %s %s %q (length %d)", tc.method, tc.uri, s.method, s.uri, s.body, s.length)
		}
		for _, h := range []string{"X-Custom", "X-Forwarded-For", "User-Agent"} {
			if s.header.Get(h) != req.Header.Get(h) || len(s.header[h]) != 1 {
				t.Errorf("%s %s: engine got %s %q, want %q", tc.method, tc.uri, h, s.header[h], req.Header.Get(h))
			}
		}
	}
	if n := len(tb.events.of(schemas.ChaosInject)); n != 0 {
		t.Errorf("%d inject events, want none", n)
	}
}

// TestUnreachableEngineLooksRefused proves that when the engine cannot be
// reached the proxy resets the client's connection — a connect error to
// the router, as without the proxy — rather than answering a status.
func TestUnreachableEngineLooksRefused(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	_, proxyURL := startProxy(t, "gone", deadURL, nil)
	resp, err := post(t, testContext(t), newClient(t), proxyURL, "/v1/chat/completions", "", chatPlain)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("got HTTP %d, want a broken connection", resp.StatusCode)
	}
}

// TestCatalogue proves every fault of R-CHAOS-1 against an in-process
// simulator: the bytes the client sees (status, body, chunks, whether
// [DONE] comes) and the inject event on narwhal.events.chaos.<engine_id>
// (schema narwhal.chaos.v1) naming the fault, the request's phase and its
// X-Request-Id.
func TestCatalogue(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 0)
	p, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	c := newClient(t)
	seenByEngine := func() int { return len(s.Requests()) }

	// reference bodies, straight from the engine
	directStream := normalised(do(t, c, s.URL(), "/v1/chat/completions", "ref-stream", chatStream).body)
	directPlain := normalised(do(t, c, s.URL(), "/v1/chat/completions", "ref-plain", chatPlain).body)
	// the same request ids are reused below, so ids match the references
	streamID, plainID := "ref-stream", "ref-plain"

	arm := func(t *testing.T, name, phase string, params map[string]string) {
		t.Helper()
		tb.events.reset()
		armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: name, Phase: phase, Probability: 1, Params: params}, time.Minute)
		t.Cleanup(func() { disarmAndWait(t, tb.store, p) })
	}
	injected := func(t *testing.T, name, phase, requestID string) {
		t.Helper()
		evs := tb.events.wait(t, schemas.ChaosInject, 1)
		ev := evs[0]
		if len(evs) != 1 || ev.Fault != name || ev.FaultID != name || ev.Phase != phase || ev.RequestID != requestID || ev.EngineID != "d1" {
			t.Errorf("inject events %+v, want one of %s on %s for %s", evs, name, phase, requestID)
		}
	}
	wantStream := func(t *testing.T, r *exchangeResult, body string, done bool) {
		t.Helper()
		if r.status != http.StatusOK || r.err != nil {
			t.Fatalf("HTTP %d %v, want 200 and a clean end", r.status, r.err)
		}
		if got := normalised(r.body); got != body {
			t.Errorf("client saw\n %q\nwant\n %q", got, body)
		}
		if r.hasDone() != done {
			t.Errorf("[DONE] seen: %v, want %v", r.hasDone(), done)
		}
	}

	t.Run(FaultConnectRefused, func(t *testing.T) {
		arm(t, FaultConnectRefused, PhaseDecode, nil)
		before := seenByEngine()
		resp, err := post(t, testContext(t), c, proxyURL, "/v1/chat/completions", "refused-1", chatStream)
		if err == nil {
			resp.Body.Close()
			t.Fatalf("got HTTP %d, want the connection reset without a response", resp.StatusCode)
		}
		if seenByEngine() != before {
			t.Error("the engine saw the request")
		}
		injected(t, FaultConnectRefused, PhaseDecode, "refused-1")
	})

	t.Run(FaultConnectDelay, func(t *testing.T) {
		arm(t, FaultConnectDelay, PhaseAny, map[string]string{ParamDelayMS: "300"})
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		wantStream(t, r, directStream, true)
		if d := r.headers.Sub(r.start); d < 300*time.Millisecond {
			t.Errorf("headers after %v, want ≥ 300ms", d)
		}
		injected(t, FaultConnectDelay, PhaseDecode, streamID)
	})

	t.Run(FaultHeaderDelay, func(t *testing.T) {
		arm(t, FaultHeaderDelay, PhaseDecode, map[string]string{ParamDelayMS: "300"})
		before := seenByEngine()
		start := time.Now()
		resp, err := post(t, testContext(t), c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if d := time.Since(start); d < 300*time.Millisecond {
			t.Errorf("headers after %v, want ≥ 300ms", d)
		}
		if seenByEngine() != before+1 {
			t.Error("the engine had not seen the request when the held headers arrived: it was not forwarded first")
		}
		body, _ := io.ReadAll(resp.Body)
		if normalised(body) != directStream {
			t.Errorf("body %q", body)
		}
		injected(t, FaultHeaderDelay, PhaseDecode, streamID)
	})

	t.Run(FaultFirstTokenDelay, func(t *testing.T) {
		arm(t, FaultFirstTokenDelay, PhaseDecode, map[string]string{ParamDelayMS: "400"})
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		wantStream(t, r, directStream, true)
		if len(r.chunks) < 2 || r.chunks[0].kind != schemas.ChunkMetadata || r.chunks[1].kind != schemas.ChunkOutput {
			t.Fatalf("chunks %+v: want the role chunk, then output", r.chunks)
		}
		if d := r.chunks[1].at.Sub(r.start); d < 400*time.Millisecond {
			t.Errorf("first output after %v, want ≥ 400ms", d)
		}
		if gap := r.chunks[1].at.Sub(r.chunks[0].at); gap < 200*time.Millisecond {
			t.Errorf("the role chunk came only %v before the first output: metadata was held too", gap)
		}
		injected(t, FaultFirstTokenDelay, PhaseDecode, streamID)

		// A non-streaming body is all output: it is held whole.
		tb.events.reset()
		r = do(t, c, proxyURL, "/v1/chat/completions", plainID, chatPlain)
		if r.status != http.StatusOK || normalised(r.body) != directPlain {
			t.Errorf("HTTP %d %q, want %q", r.status, r.body, directPlain)
		}
		if d := r.end.Sub(r.start); d < 400*time.Millisecond {
			t.Errorf("body after %v, want ≥ 400ms", d)
		}
		injected(t, FaultFirstTokenDelay, PhaseDecode, plainID)
	})

	t.Run(FaultMidStreamSilence, func(t *testing.T) {
		arm(t, FaultMidStreamSilence, PhaseDecode, map[string]string{ParamAfterTokens: "2", ParamDelayMS: "300"})
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		wantStream(t, r, prefixThroughOutputs(directStream, 2), false)
		if r.outputs() != 2 {
			t.Errorf("%d output chunks, want 2", r.outputs())
		}
		// The client reads the last chunk a little after the proxy sent it
		// and began the silence: allow for that.
		if d := r.end.Sub(r.chunks[len(r.chunks)-1].at); d < 250*time.Millisecond {
			t.Errorf("the stream ended %v after its last chunk, want about 300ms of silence", d)
		}
		injected(t, FaultMidStreamSilence, PhaseDecode, streamID)
	})

	t.Run(FaultCloseBeforeDone, func(t *testing.T) {
		arm(t, FaultCloseBeforeDone, PhaseDecode, map[string]string{ParamAfterTokens: "3"})
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		wantStream(t, r, prefixThroughOutputs(directStream, 3), false)
		if r.outputs() != 3 {
			t.Errorf("%d output chunks, want 3", r.outputs())
		}
		injected(t, FaultCloseBeforeDone, PhaseDecode, streamID)
	})

	t.Run(FaultCloseBeforeDone+" after the last token", func(t *testing.T) {
		arm(t, FaultCloseBeforeDone, PhaseDecode, map[string]string{ParamAfterTokens: "100"})
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		want := strings.TrimSuffix(directStream, "data: [DONE]\n\n")
		wantStream(t, r, want, false)
		injected(t, FaultCloseBeforeDone, PhaseDecode, streamID)
	})

	t.Run(FaultDoneBeforeToken, func(t *testing.T) {
		arm(t, FaultDoneBeforeToken, PhaseDecode, nil)
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		wantStream(t, r, prefixThroughOutputs(directStream, 0)+"data: [DONE]\n\n", true)
		if r.outputs() != 0 || len(r.chunks) < 2 {
			t.Errorf("chunks %+v: want the metadata, then [DONE]", r.chunks)
		}
		injected(t, FaultDoneBeforeToken, PhaseDecode, streamID)
	})

	t.Run(FaultErrorObject, func(t *testing.T) {
		arm(t, FaultErrorObject, PhaseDecode, map[string]string{ParamAfterTokens: "1", ParamCode: "503"})
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		frame := `data: {"error":{"message":"chaos: injected error object","type":"ServiceUnavailableError","param":null,"code":503}}` + "\n\n"
		wantStream(t, r, prefixThroughOutputs(directStream, 1)+frame+"data: [DONE]\n\n", true)
		injected(t, FaultErrorObject, PhaseDecode, streamID)
	})

	t.Run(FaultErrorObject+" with a code that is no status", func(t *testing.T) {
		arm(t, FaultErrorObject, PhaseDecode, map[string]string{ParamCode: "42", ParamMessage: `KV "transfer" failed`, ParamType: "EngineError"})
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		frame := `data: {"error":{"message":"KV \"transfer\" failed","type":"EngineError","param":null,"code":42}}` + "\n\n"
		wantStream(t, r, prefixThroughOutputs(directStream, 0)+frame+"data: [DONE]\n\n", true)
		var kinds []schemas.ChunkKind
		for _, ch := range r.chunks {
			kinds = append(kinds, ch.kind)
		}
		if len(kinds) < 2 || kinds[len(kinds)-2] != schemas.ChunkError {
			t.Errorf("chunk kinds %v: want an error frame before [DONE] (R-FAIL-4)", kinds)
		}
		injected(t, FaultErrorObject, PhaseDecode, streamID)
	})

	for _, tc := range []struct {
		code    int
		message string
		body    string
	}{
		{503, "", `{"error":{"message":"chaos: injected HTTP 503","type":"ServiceUnavailableError","param":null,"code":503}}`},
		{429, "slow down", `{"error":{"message":"slow down","type":"RateLimitError","param":null,"code":429}}`},
		{500, "", `{"error":{"message":"chaos: injected HTTP 500","type":"InternalServerError","param":null,"code":500}}`},
	} {
		t.Run(FaultHTTPStatus+" "+strconv.Itoa(tc.code), func(t *testing.T) {
			params := map[string]string{}
			if tc.code != 500 {
				params[ParamCode] = strconv.Itoa(tc.code)
			}
			if tc.message != "" {
				params[ParamMessage] = tc.message
			}
			arm(t, FaultHTTPStatus, PhaseAny, params)
			before := seenByEngine()
			r := do(t, c, proxyURL, "/v1/chat/completions", "status-1", chatStream)
			if r.status != tc.code || string(r.body) != tc.body || r.header.Get("Content-Type") != "application/json" {
				t.Errorf("HTTP %d %s %q, want %d %q", r.status, r.header.Get("Content-Type"), r.body, tc.code, tc.body)
			}
			if seenByEngine() != before {
				t.Error("the engine saw the request")
			}
			injected(t, FaultHTTPStatus, PhaseDecode, "status-1")
		})
	}

	t.Run(FaultTrickle, func(t *testing.T) {
		const delay = 40 * time.Millisecond
		arm(t, FaultTrickle, PhaseDecode, map[string]string{ParamDelayMS: "40"})
		r := do(t, c, proxyURL, "/v1/chat/completions", streamID, chatStream)
		wantStream(t, r, directStream, true)
		events := len(sseEvents(directStream))
		if d, least := r.end.Sub(r.start), time.Duration(events)*delay; d < least {
			t.Errorf("%d events in %v, want ≥ %v", events, d, least)
		}
		injected(t, FaultTrickle, PhaseDecode, streamID)
	})

	for _, tc := range []struct {
		fault, reason string
	}{
		{FaultDropEngineID, connector.ReasonMissingIdentity},
		{FaultGarbleBlockIDs, connector.ReasonMalformedBlocks},
		{FaultChangeConnectorShape, connector.ReasonConnectorMismatch},
	} {
		t.Run(tc.fault, func(t *testing.T) {
			direct := do(t, c, s.URL(), "/v1/chat/completions", "prefill-"+tc.fault, prefillLeg)
			arm(t, tc.fault, PhasePrefill, nil)
			r := do(t, c, proxyURL, "/v1/chat/completions", "prefill-"+tc.fault, prefillLeg)
			if r.status != http.StatusOK || r.header.Get("Content-Length") != strconv.Itoa(len(r.body)) {
				t.Fatalf("HTTP %d, Content-Length %q for %d bytes", r.status, r.header.Get("Content-Length"), len(r.body))
			}
			// The descriptor is corrupted as the router's check of the rule
			// sees it; every other byte is the engine's.
			ds, de, ok := descriptorSpan(direct.body)
			ps, pe, ok2 := descriptorSpan(r.body)
			if !ok || !ok2 {
				t.Fatalf("no descriptor: direct %s, proxied %s", direct.body, r.body)
			}
			if _, err := (nixl.Nixl{}).Validate(direct.body[ds:de]); err != nil {
				t.Fatalf("the engine's descriptor is rejected already: %v", err)
			}
			_, err := (nixl.Nixl{}).Validate(r.body[ps:pe])
			var rej *connector.RejectError
			if !errors.As(err, &rej) || rej.Reason != tc.reason {
				t.Errorf("descriptor %s: %v, want rejected for %s", r.body[ps:pe], err, tc.reason)
			}
			if normalised(r.body[:ps]) != normalised(direct.body[:ds]) || string(r.body[pe:]) != string(direct.body[de:]) {
				t.Errorf("bytes outside the descriptor changed:\n got %s\nwant %s", r.body, direct.body)
			}
			injected(t, tc.fault, PhasePrefill, "prefill-"+tc.fault)
		})
	}
}

// TestFaultsStrikeOnlyWhereTheyApply proves the phase and request-shape
// rules of R-CHAOS-1: a prefill fault leaves decode requests alone and
// strikes prefill legs; descriptor faults do not touch decode streams;
// stream faults do not touch non-streaming requests; requests a fault
// does not apply to spend nothing and publish nothing.
func TestFaultsStrikeOnlyWhereTheyApply(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 0)
	p, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	c := newClient(t)
	directStream := normalised(do(t, c, s.URL(), "/v1/chat/completions", "a1", chatStream).body)
	directPlain := normalised(do(t, c, s.URL(), "/v1/chat/completions", "a2", chatPlain).body)

	armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultHTTPStatus, Phase: PhasePrefill, Probability: 1, Count: 1}, time.Minute)
	armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultDropEngineID, Phase: PhaseAny, Probability: 1}, time.Minute)
	armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultCloseBeforeDone, Phase: PhaseAny, Probability: 1}, time.Minute)

	if r := do(t, c, proxyURL, "/v1/chat/completions", "a2", chatPlain); r.status != 200 || normalised(r.body) != directPlain {
		t.Errorf("non-streaming decode: HTTP %d %q", r.status, r.body)
	}
	if r := do(t, c, proxyURL, "/v1/chat/completions", "a1", chatStream); r.status != 200 || r.hasDone() ||
		normalised(r.body) != prefixThroughOutputs(directStream, 0) {
		t.Errorf("streamed decode: want close-before-done only, got HTTP %d %q", r.status, r.body)
	}
	if r := do(t, c, proxyURL, "/v1/chat/completions", "a3", prefillLeg); r.status != 500 {
		t.Errorf("prefill: HTTP %d, want the prefill fault's 500", r.status)
	}
	// The counted prefill fault is spent: the next prefill gets the
	// descriptor fault.
	r := do(t, c, proxyURL, "/v1/chat/completions", "a4", prefillLeg)
	if i, j, ok := descriptorSpan(r.body); r.status != 200 || !ok || bytes.Contains(r.body[i:j], []byte("remote_engine_id")) {
		t.Errorf("second prefill: HTTP %d %s, want the descriptor without remote_engine_id", r.status, r.body)
	}
	evs := tb.events.wait(t, schemas.ChaosInject, 3)
	want := []string{"a1/" + FaultCloseBeforeDone, "a3/" + FaultHTTPStatus, "a4/" + FaultDropEngineID}
	var got []string
	for _, ev := range evs {
		got = append(got, ev.RequestID+"/"+ev.Fault)
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("injections %v, want %v", got, want)
	}
}

// TestAnsweringFaultsWin proves the precedence rule: when connect-refused
// and http-status both strike, only connect-refused acts, and the counted
// http-status is not spent by a request it did not act on.
func TestAnsweringFaultsWin(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 0)
	p, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	c := newClient(t)
	armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultHTTPStatus, Probability: 1, Count: 1}, time.Minute)
	refused := armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultConnectRefused, Probability: 1, Count: 1}, time.Minute)
	if resp, err := post(t, testContext(t), c, proxyURL, "/v1/chat/completions", "w1", chatPlain); err == nil {
		resp.Body.Close()
		t.Fatalf("HTTP %d, want the connection refused", resp.StatusCode)
	}
	testkit.WaitFor(t, testBound, "connect-refused to be spent", func() bool {
		for _, f := range p.Faults() {
			if f.Key() == refused.Key() {
				return false
			}
		}
		return true
	})
	if r := do(t, c, proxyURL, "/v1/chat/completions", "w2", chatPlain); r.status != 500 {
		t.Errorf("second request HTTP %d, want the unspent http-status 500", r.status)
	}
	evs := tb.events.wait(t, schemas.ChaosInject, 2)
	if len(evs) != 2 || evs[0].Fault != FaultConnectRefused || evs[1].Fault != FaultHTTPStatus {
		t.Errorf("inject events %+v", evs)
	}
}

// TestProbability proves R-CHAOS-1's probability: 0 never strikes (and
// publishes nothing), 0.5 strikes some requests and spares others, and
// every strike is an inject event.
func TestProbability(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 0)
	p, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	c := newClient(t)

	armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultHTTPStatus, Probability: 0}, time.Minute)
	for i := range 25 {
		if r := do(t, c, proxyURL, "/v1/chat/completions", "p0-"+strconv.Itoa(i), chatPlain); r.status != 200 {
			t.Fatalf("probability 0 struck: HTTP %d", r.status)
		}
	}
	// The store's publisher is the proxy's: once the arm event of a later
	// fault arrived, every earlier inject event would have too.
	tb.events.reset()
	armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultHTTPStatus, Probability: 0.5}, time.Minute)
	tb.events.wait(t, schemas.ChaosArm, 1)
	if n := len(tb.events.of(schemas.ChaosInject)); n != 0 {
		t.Fatalf("%d inject events at probability 0", n)
	}

	struck := 0
	const n = 100
	for i := range n {
		switch r := do(t, c, proxyURL, "/v1/chat/completions", "p5-"+strconv.Itoa(i), chatPlain); r.status {
		case 500:
			struck++
		case 200:
		default:
			t.Fatalf("HTTP %d", r.status)
		}
	}
	if struck == 0 || struck == n {
		t.Errorf("probability 0.5 struck %d of %d requests", struck, n)
	}
	if evs := tb.events.wait(t, schemas.ChaosInject, struck); len(evs) != struck {
		t.Errorf("%d inject events for %d strikes", len(evs), struck)
	}
}

// TestCountStrikesExactlyN proves R-CHAOS-1's count: a fault armed for N
// strikes hits exactly N requests — one after the other, and when many
// race for it — then its key is deleted from the bucket; each inject event
// says how many strikes are left.
func TestCountStrikesExactlyN(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 0)
	p, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	c := newClient(t)

	f := armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultHTTPStatus, Probability: 1, Count: 3}, time.Minute)
	var statuses []int
	for i := range 5 {
		statuses = append(statuses, do(t, c, proxyURL, "/v1/chat/completions", "n"+strconv.Itoa(i), chatPlain).status)
	}
	if got := strconv.Itoa(statuses[0]) + " " + strconv.Itoa(statuses[1]) + " " + strconv.Itoa(statuses[2]) + " " +
		strconv.Itoa(statuses[3]) + " " + strconv.Itoa(statuses[4]); got != "500 500 500 200 200" {
		t.Errorf("statuses %s, want 500 500 500 200 200", got)
	}
	evs := tb.events.wait(t, schemas.ChaosInject, 3)
	for i, ev := range evs {
		if ev.Count != 3 || ev.Left != 2-i {
			t.Errorf("inject event %d: count %d left %d, want 3 and %d", i, ev.Count, ev.Left, 2-i)
		}
	}
	if _, err := tb.store.kv.Get(testContext(t), f.Key()); err == nil {
		t.Error("the spent fault's key is still in the bucket")
	}

	// Many requests race for 5 strikes.
	tb.events.reset()
	armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultHTTPStatus, Probability: 1, Count: 5}, time.Minute)
	var g errgroup.Group
	var struck atomic.Int64
	for i := range 24 {
		g.Go(func() error {
			resp, err := post(t, testContext(t), c, proxyURL, "/v1/chat/completions", "race"+strconv.Itoa(i), chatPlain)
			if err != nil {
				return err
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 500 {
				struck.Add(1)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	if struck := struck.Load(); struck != 5 {
		t.Errorf("%d of 24 racing requests struck, want exactly 5", struck)
	}
	if evs := tb.events.wait(t, schemas.ChaosInject, 5); len(evs) != 5 {
		t.Errorf("%d inject events, want 5", len(evs))
	}
}

// TestExpiryEndsAFault proves R-CHAOS-1's expiry: the proxy stops
// injecting a fault at its stored expiry, and the bucket drops the key by
// its TTL, so a forgotten fault ends by itself everywhere.
func TestExpiryEndsAFault(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 0)
	p, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	c := newClient(t)
	f := armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultHTTPStatus, Probability: 1}, 800*time.Millisecond)
	if r := do(t, c, proxyURL, "/v1/chat/completions", "x0", chatPlain); r.status != 500 && time.Now().Before(f.Expires) {
		t.Fatalf("before expiry: HTTP %d", r.status)
	}
	testkit.WaitFor(t, testBound, "the fault to end", func() bool {
		r := do(t, c, proxyURL, "/v1/chat/completions", "x1", chatPlain)
		if r.status == 200 && r.end.Before(f.Expires) {
			t.Fatalf("the fault ended %v before its expiry", f.Expires.Sub(r.end))
		}
		return r.status == 200
	})
	testkit.WaitFor(t, testBound, "the bucket to drop the expired key", func() bool {
		_, err := tb.store.kv.Get(testContext(t), f.Key())
		return err != nil
	})
	testkit.WaitFor(t, testBound, "the proxy to forget it", func() bool { return p.armed.Load() == 0 })
	if faults, err := tb.store.List(testContext(t), ""); err != nil || len(faults) != 0 {
		t.Errorf("list after expiry: %v %v", faults, err)
	}
}

// TestArmReachesRunningProxy proves that a fault armed through the bucket
// from another connection (as `narwhal chaos arm` on another machine
// does) reaches a running proxy within a second, and a disarm likewise.
func TestArmReachesRunningProxy(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 0)
	_, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	_, other := tb.connect(t, "other-cli")
	c := newClient(t)

	start := time.Now()
	if _, err := other.Arm(testContext(t), Fault{EngineID: "d1", Name: FaultHTTPStatus, Probability: 1, Params: map[string]string{ParamCode: "503"}}, time.Minute); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, testBound, "the fault to strike", func() bool {
		return do(t, c, proxyURL, "/v1/chat/completions", "", chatPlain).status == 503
	})
	if d := time.Since(start); d > time.Second {
		t.Errorf("the armed fault took %v to reach the proxy, want under 1s", d)
	}
	start = time.Now()
	if _, err := other.Disarm(testContext(t), "d1", ""); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, testBound, "the fault to stop", func() bool {
		return do(t, c, proxyURL, "/v1/chat/completions", "", chatPlain).status == 200
	})
	if d := time.Since(start); d > time.Second {
		t.Errorf("the disarm took %v to reach the proxy, want under 1s", d)
	}
}

// TestRestartedProxyPicksUpFaults proves that armed faults live in the
// bucket, not in the proxy: a proxy started after the arm applies it at
// once, with the count the previous proxy left.
func TestRestartedProxyPicksUpFaults(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 0)
	if _, err := tb.store.Arm(testContext(t), Fault{EngineID: "d1", Name: FaultHTTPStatus, Probability: 1, Count: 2}, time.Minute); err != nil {
		t.Fatal(err)
	}
	c := newClient(t)
	first, err := NewProxy(ProxyOptions{Target: s.URL(), EngineID: "d1", Store: tb.store})
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Start(testContext(t)); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(first)
	if r := do(t, c, srv.URL, "/v1/chat/completions", "r1", chatPlain); r.status != 500 {
		t.Errorf("first proxy: HTTP %d, want 500", r.status)
	}
	srv.Close()
	first.Close()

	_, proxyURL := startProxy(t, "d1", s.URL(), tb.store) // Start returns once the faults are loaded
	if r := do(t, c, proxyURL, "/v1/chat/completions", "r2", chatPlain); r.status != 500 {
		t.Errorf("restarted proxy, first request: HTTP %d, want 500", r.status)
	}
	if r := do(t, c, proxyURL, "/v1/chat/completions", "r3", chatPlain); r.status != 200 {
		t.Errorf("restarted proxy, after the count: HTTP %d, want 200", r.status)
	}
}

// TestClientGoneCancelsUpstream proves that a request the proxy holds or
// faults ends with its client (R-OWN-5): the engine sees its request
// aborted, the held request never reaches the engine, and no goroutine is
// left behind (TestMain's leak check).
func TestClientGoneCancelsUpstream(t *testing.T) {
	tb := startBus(t)
	s := startSim(t, "d1", 100*time.Millisecond)
	p, proxyURL := startProxy(t, "d1", s.URL(), tb.store)
	c := newClient(t)
	long := `{"model":"m","messages":[{"role":"user","content":"a long story"}],"stream":true,"max_tokens":100}`

	// readUntil opens a stream and reads until it has seen n output
	// chunks (0: the first chunk of any kind), then hangs up.
	readUntil := func(t *testing.T, n int) {
		t.Helper()
		ctx, cancel := context.WithCancel(testContext(t))
		defer cancel()
		resp, err := post(t, ctx, c, proxyURL, "/v1/chat/completions", "", long)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		for seen := 0; ; {
			line, err := br.ReadBytes('\n')
			if err != nil {
				t.Fatalf("stream ended: %v", err)
			}
			payload, ok := schemas.SSEData(line)
			if !ok {
				continue
			}
			if n == 0 {
				return
			}
			if schemas.ClassifyChunk(payload) == schemas.ChunkOutput {
				if seen++; seen == n {
					return
				}
			}
		}
	}
	abortedAfter := func(t *testing.T, before int64) {
		t.Helper()
		testkit.WaitFor(t, testBound, "the engine to see the request aborted", func() bool {
			st := s.Stats()
			return st.Aborted > before && st.ActiveStreams == 0
		})
	}

	t.Run(FaultFirstTokenDelay, func(t *testing.T) {
		armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultFirstTokenDelay, Probability: 1, Params: map[string]string{ParamDelayMS: "60000"}}, time.Minute)
		defer disarmAndWait(t, tb.store, p)
		before := s.Stats().Aborted
		readUntil(t, 0)
		abortedAfter(t, before)
	})
	t.Run(FaultMidStreamSilence+" until the client leaves", func(t *testing.T) {
		armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultMidStreamSilence, Probability: 1, Params: map[string]string{ParamAfterTokens: "1"}}, time.Minute)
		defer disarmAndWait(t, tb.store, p)
		before := s.Stats().Aborted
		readUntil(t, 1)
		abortedAfter(t, before)
	})
	t.Run(FaultTrickle, func(t *testing.T) {
		armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultTrickle, Probability: 1, Params: map[string]string{ParamDelayMS: "60000"}}, time.Minute)
		defer disarmAndWait(t, tb.store, p)
		before := s.Stats().Aborted
		ctx, cancel := context.WithCancel(testContext(t))
		resp, err := post(t, ctx, c, proxyURL, "/v1/chat/completions", "", long)
		if err != nil {
			t.Fatal(err)
		}
		cancel() // the first chunk is held for a minute
		resp.Body.Close()
		abortedAfter(t, before)
	})
	t.Run(FaultConnectDelay, func(t *testing.T) {
		armAndWait(t, tb.store, p, Fault{EngineID: "d1", Name: FaultConnectDelay, Probability: 1, Params: map[string]string{ParamDelayMS: "60000"}}, time.Minute)
		defer disarmAndWait(t, tb.store, p)
		seen := len(s.Requests())
		tb.events.reset()
		ctx, cancel := context.WithCancel(testContext(t))
		done := make(chan error, 1)
		go func() {
			resp, err := post(t, ctx, c, proxyURL, "/v1/chat/completions", "", long)
			if err == nil {
				resp.Body.Close()
			}
			done <- err
		}()
		tb.events.wait(t, schemas.ChaosInject, 1) // the request is in the delay
		cancel()
		if err := <-done; err == nil {
			t.Error("the request succeeded")
		}
		if len(s.Requests()) != seen {
			t.Error("a request whose client left during the connect delay reached the engine")
		}
	})
}

// TestRequestPhase proves the proxy's phase rule (R-CHAOS-1): prefill when
// kv_transfer_params.do_remote_decode is true, else decode.
func TestRequestPhase(t *testing.T) {
	for _, tc := range []struct {
		body   string
		phase  string
		stream bool
	}{
		{prefillLeg, PhasePrefill, false},
		{chatStream, PhaseDecode, true},
		{`{"stream":true,"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"p1"}}`, PhaseDecode, true},
		{`{"kv_transfer_params":{"do_remote_decode":false}}`, PhaseDecode, false},
		{`{"kv_transfer_params":null}`, PhaseDecode, false},
		{`not json`, PhaseDecode, false},
		{`{"stream":"yes","kv_transfer_params":{"do_remote_decode":true}}`, PhasePrefill, false},
	} {
		phase, stream := requestPhase([]byte(tc.body))
		if phase != tc.phase || stream != tc.stream {
			t.Errorf("%s: phase %s stream %v, want %s %v", tc.body, phase, stream, tc.phase, tc.stream)
		}
	}
}

// TestDescriptorCorruption proves each descriptor fault changes only the
// top-level kv_transfer_params (R-DESC-1/2/3 as the router checks them),
// keeping every other byte, and leaves a response without a descriptor
// alone.
func TestDescriptorCorruption(t *testing.T) {
	body := `{"id":"x", "choices":[{"kv_transfer_params":{"remote_engine_id":"inner"}}],` +
		"\n \"kv_transfer_params\" :\t{\"do_remote_prefill\":true,\"remote_engine_id\":\"e-1\",\"remote_block_ids\":[[1,2],[3]],\"tp_size\":1} ,\"usage\":{}}"
	i, j, ok := descriptorSpan([]byte(body))
	if !ok || body[i:j] != `{"do_remote_prefill":true,"remote_engine_id":"e-1","remote_block_ids":[[1,2],[3]],"tp_size":1}` {
		t.Fatalf("span %q %v", body[i:j], ok)
	}
	for _, tc := range []struct {
		kind faultKind
		want string
	}{
		{kindDropEngineID, `{"do_remote_prefill":true,"remote_block_ids":[[1,2],[3]],"tp_size":1}`},
		{kindGarbleBlockIDs, `{"do_remote_prefill":true,"remote_block_ids":["[1,2]","[3]"],"remote_engine_id":"e-1","tp_size":1}`},
		{kindChangeConnectorShape, `{"lmcache_key":"chaos"}`},
	} {
		out, ok := corruptDescriptor([]byte(body), tc.kind)
		if !ok {
			t.Fatalf("%s: not corrupted", catalogue[tc.kind].name)
		}
		if want := body[:i] + tc.want + body[j:]; string(out) != want {
			t.Errorf("%s:\n got %s\nwant %s", catalogue[tc.kind].name, out, want)
		}
	}
	for _, b := range []string{`{"id":"x","kv_transfer_params":null}`, `{"id":"x"}`, `[1]`, `{"kv_transfer_params":{"lmcache_key":"k"}}`} {
		if out, ok := corruptDescriptor([]byte(b), kindDropEngineID); ok {
			t.Errorf("%s: corrupted into %s", b, out)
		}
	}
	var garbled []string
	if err := json.Unmarshal(garbleBlockIDs(json.RawMessage(`[17, 18]`)), &garbled); err != nil || strings.Join(garbled, ",") != "17,18" {
		t.Errorf("garbled %v %v", garbled, err)
	}
}
