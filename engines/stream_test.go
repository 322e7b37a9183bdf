package engines

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
	"github.com/narwhalmesh/narwhal/schemas"
)

const (
	roleChunk  = `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`
	tokenChunk = `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" narwhal"},"logprobs":null,"finish_reason":null}]}`
	stopChunk  = `{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}`
	usageChunk = `{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`
)

// step is one action of a scripted decode engine.
type step struct {
	wait time.Duration
	send string // written as is, then flushed
}

func data(p string) string { return "data: " + p + "\n\n" }

// scripted returns a decode engine that plays steps after a header delay.
func scripted(t *testing.T, headerDelay time.Duration, status int, steps ...step) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if !sleepCtx(r.Context(), headerDelay) {
			return
		}
		if status != 0 && status != 200 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			w.Write(schemas.AppendErrorJSON(nil, status, "scripted"))
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		for _, s := range steps {
			if !sleepCtx(r.Context(), s.wait) {
				return
			}
			io.WriteString(w, s.send)
			w.(http.Flusher).Flush()
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// sleepCtx waits d unless ctx ends first (the scripted engine's own fault
// timing, not test synchronisation).
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

type streamResult struct {
	outputs, metadata int
	err               error
}

func testClient(firstToken, read time.Duration) *Client {
	return NewClient(Options{FirstTokenTimeout: firstToken, DecodeReadTimeout: read, PrefillTimeout: time.Second, HandoffMaxAge: time.Minute})
}

func testRequest(url string) (*Request, *connector.PrefillResult) {
	body, err := schemas.ParseRequest(schemas.EndpointChat, []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`))
	if err != nil {
		panic(err)
	}
	e := &Engine{ID: "d1", URL: url, Role: connector.RoleBoth, Connector: nixl.Nixl{}}
	req := &Request{Body: body, BackendRequestID: "b-1", Producer: e, Consumer: e}
	res := connector.NewPrefillResult(connector.PrefillResult{ProducerID: "d1", Endpoint: schemas.EndpointChat, Connector: "nixl", Started: time.Now()}, nil)
	return req, res
}

func runStream(ctx context.Context, c *Client, url string) streamResult {
	req, res := testRequest(url)
	s, err := c.Decode(ctx, req, res)
	if err != nil {
		return streamResult{err: err}
	}
	defer s.Close()
	var r streamResult
	for {
		_, kind, err := s.Next()
		if err == io.EOF {
			return r
		}
		if err != nil {
			r.err = err
			return r
		}
		if kind == schemas.ChunkOutput {
			r.outputs++
		} else {
			r.metadata++
		}
	}
}

func wantFault(t *testing.T, err error, kind FaultKind, status int, msgPrefix string) *Fault {
	t.Helper()
	var f *Fault
	if !errors.As(err, &f) {
		t.Fatalf("error %v (%T), want a %s fault", err, err, kind)
	}
	if f.Kind != kind || f.Status != status || !strings.HasPrefix(f.Message, msgPrefix) {
		t.Fatalf("fault %s %d %q, want %s %d %q…", f.Kind, f.Status, f.Message, kind, status, msgPrefix)
	}
	return f
}

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"), goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
}

func TestValidStream(t *testing.T) {
	// R-FAIL-2: generated output then [DONE] is a valid stream.
	srv := scripted(t, 0, 200, step{send: data(roleChunk)}, step{send: data(tokenChunk)}, step{send: data(stopChunk)}, step{send: data(usageChunk)}, step{send: data("[DONE]")})
	r := runStream(context.Background(), testClient(time.Second, time.Second), srv.URL)
	if r.err != nil || r.outputs != 2 || r.metadata != 2 {
		t.Fatalf("%+v: %v", r, r.err)
	}
}

func TestImmediateStopIsOutput(t *testing.T) {
	// behaviour.md §0: an immediate finish_reason is output (an empty completion), not R-FAIL-3.
	srv := scripted(t, 0, 200, step{send: data(roleChunk)}, step{send: data(stopChunk)}, step{send: data("[DONE]")})
	if r := runStream(context.Background(), testClient(time.Second, time.Second), srv.URL); r.err != nil || r.outputs != 1 {
		t.Fatalf("%+v: %v", r, r.err)
	}
}

// The timer tests put "just inside" at half the bound and "just outside"
// at 1.5× it: a timer enforced at twice its configured value fails them,
// while a loaded machine's scheduling delay (tens of ms) does not.

func TestFirstTokenBudgetRTMO1(t *testing.T) {
	c := testClient(500*time.Millisecond, time.Second)
	t.Run("inside: header delay and metadata together spend half the budget", func(t *testing.T) {
		srv := scripted(t, 125*time.Millisecond, 200, step{send: data(roleChunk)}, step{wait: 125 * time.Millisecond, send: data(tokenChunk)}, step{send: data("[DONE]")})
		if r := runStream(context.Background(), c, srv.URL); r.err != nil {
			t.Fatal(r.err)
		}
	})
	t.Run("outside: response headers at 1.5x the budget", func(t *testing.T) {
		srv := scripted(t, 750*time.Millisecond, 200, step{send: data(tokenChunk)}, step{send: data("[DONE]")})
		r := runStream(context.Background(), c, srv.URL)
		wantFault(t, r.err, KindFirstTokenTimeout, 504, "engine first token timeout")
	})
	t.Run("outside: headers at once, token at 1.5x the budget", func(t *testing.T) {
		srv := scripted(t, 0, 200, step{send: data(roleChunk)}, step{wait: 750 * time.Millisecond, send: data(tokenChunk)}, step{send: data("[DONE]")})
		r := runStream(context.Background(), c, srv.URL)
		wantFault(t, r.err, KindFirstTokenTimeout, 504, MsgFirstTokenTimeout)
	})
	t.Run("connect, headers and metadata spend one budget", func(t *testing.T) {
		// Headers at 375 ms and the token 375 ms later: each inside the
		// budget alone, together 1.5x it. A budget restarted at the
		// headers or at a metadata chunk would let this through.
		srv := scripted(t, 375*time.Millisecond, 200, step{send: data(roleChunk)}, step{wait: 375 * time.Millisecond, send: data(tokenChunk)}, step{send: data("[DONE]")})
		r := runStream(context.Background(), c, srv.URL)
		wantFault(t, r.err, KindFirstTokenTimeout, 504, MsgFirstTokenTimeout)
	})
	t.Run("metadata chunks do not satisfy the first-token budget", func(t *testing.T) {
		var steps []step
		for i := 0; i < 15; i++ { // 15 × 50 ms of keep-alives and empty deltas: 750 ms, 1.5x the budget
			steps = append(steps, step{wait: 50 * time.Millisecond, send: ": keep-alive\n\n"}, step{send: data(roleChunk)})
		}
		steps = append(steps, step{send: data(tokenChunk)}, step{send: data("[DONE]")})
		srv := scripted(t, 0, 200, steps...)
		r := runStream(context.Background(), c, srv.URL)
		wantFault(t, r.err, KindFirstTokenTimeout, 504, MsgFirstTokenTimeout)
	})
}

func TestBetweenChunkTimerRTMO2(t *testing.T) {
	c := testClient(time.Second, 500*time.Millisecond)
	t.Run("inside: gaps of half the bound", func(t *testing.T) {
		steps := []step{{send: data(tokenChunk)}}
		for i := 0; i < 3; i++ {
			steps = append(steps, step{wait: 250 * time.Millisecond, send: data(tokenChunk)})
		}
		srv := scripted(t, 0, 200, append(steps, step{send: data("[DONE]")})...)
		if r := runStream(context.Background(), c, srv.URL); r.err != nil || r.outputs != 4 {
			t.Fatalf("%+v %v", r, r.err)
		}
	})
	t.Run("outside: a gap of 1.5x the bound after the first token (R-TMO-3)", func(t *testing.T) {
		srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{wait: 750 * time.Millisecond, send: data(tokenChunk)}, step{send: data("[DONE]")})
		r := runStream(context.Background(), c, srv.URL)
		if r.outputs != 1 {
			t.Fatalf("outputs %d", r.outputs)
		}
		wantFault(t, r.err, KindMidStreamSilence, 504, "engine went silent between tokens")
	})
	t.Run("outside: the bound counts from the last byte, not the last token", func(t *testing.T) {
		// Keep-alives for 250 ms, then 750 ms of nothing.
		srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{wait: 250 * time.Millisecond, send: ": keep-alive\n\n"},
			step{wait: 750 * time.Millisecond, send: data(tokenChunk)}, step{send: data("[DONE]")})
		wantFault(t, runStream(context.Background(), c, srv.URL).err, KindMidStreamSilence, 504, MsgSilence)
	})
	t.Run("metadata chunks reset the between-chunk timer", func(t *testing.T) {
		steps := []step{{send: data(tokenChunk)}}
		for i := 0; i < 6; i++ { // 6 × 250 ms = 1.5 s without a token, never more than half the bound without bytes
			steps = append(steps, step{wait: 250 * time.Millisecond, send: ": keep-alive\n\n"})
		}
		steps = append(steps, step{send: data(tokenChunk)}, step{send: data(usageChunk)}, step{send: data("[DONE]")})
		srv := scripted(t, 0, 200, steps...)
		if r := runStream(context.Background(), c, srv.URL); r.err != nil || r.outputs != 2 {
			t.Fatalf("%+v: %v", r, r.err)
		}
	})
}

func TestNoChunkBoundUsesRequestDeadlineRTMO4(t *testing.T) {
	c := testClient(time.Second, 0) // decode_read_timeout_s = 0
	srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{wait: 400 * time.Millisecond, send: data(tokenChunk)}, step{send: data("[DONE]")})
	if r := runStream(context.Background(), c, srv.URL); r.err != nil || r.outputs != 2 {
		t.Fatalf("a 400 ms gap with no per-chunk bound: %+v", r)
	}
	// R-TMO-5: the request deadline still bounds it.
	srv = scripted(t, 0, 200, step{send: data(tokenChunk)}, step{wait: 5 * time.Second, send: data(tokenChunk)}, step{send: data("[DONE]")})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	r := runStream(ctx, c, srv.URL)
	wantFault(t, r.err, KindRequestTimeout, 504, MsgRequestTimeout)
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("stream outlived the request deadline: %v", el)
	}
}

func TestStreamFaultsRFAIL(t *testing.T) {
	c := testClient(time.Second, time.Second)
	t.Run("R-FAIL-3 [DONE] before any token", func(t *testing.T) {
		srv := scripted(t, 0, 200, step{send: data(roleChunk)}, step{send: data(usageChunk)}, step{send: data("[DONE]")})
		wantFault(t, runStream(context.Background(), c, srv.URL).err, KindDoneBeforeToken, 502, "stream ended with [DONE] before any token arrived")
	})
	t.Run("R-FAIL-2 closed before [DONE]", func(t *testing.T) {
		srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{send: data(tokenChunk)})
		r := runStream(context.Background(), c, srv.URL)
		wantFault(t, r.err, KindClosedBeforeDone, 502, MsgClosedBeforeDone)
		if r.outputs != 2 {
			t.Fatalf("outputs %d", r.outputs)
		}
	})
	t.Run("R-FAIL-4 error object then [DONE] is an error with its own status", func(t *testing.T) {
		srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{send: data(`{"error":{"message":"engine overheated","type":"ServiceUnavailableError","param":null,"code":503}}`)}, step{send: data("[DONE]")})
		f := wantFault(t, runStream(context.Background(), c, srv.URL).err, KindErrorObject, 503, "engine overheated")
		if f.Type != "ServiceUnavailableError" || !f.CountsTowardEjection() {
			t.Fatalf("fault %+v", f)
		}
	})
	t.Run("R-FAIL-4 error object whose code is no HTTP status gives 502", func(t *testing.T) {
		srv := scripted(t, 0, 200, step{send: data(`{"object":"error","message":"boom","type":"InternalServerError","param":null,"code":"E42"}`)}, step{send: data("[DONE]")})
		wantFault(t, runStream(context.Background(), c, srv.URL).err, KindErrorObject, 502, "boom")
	})
	t.Run("invalid data line", func(t *testing.T) {
		srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{send: data("{not json")})
		wantFault(t, runStream(context.Background(), c, srv.URL).err, KindInvalidStream, 502, "decode engine")
	})
}

func TestUpstreamStatusRFAIL6(t *testing.T) {
	c := testClient(time.Second, time.Second)
	for _, tc := range []struct {
		status  int
		kind    FaultKind
		want    int
		counts  bool
		timeout bool
	}{
		{500, KindUpstreamStatus, 502, true, false},
		{503, KindUpstreamStatus, 502, true, false},
		{504, KindUpstreamStatus, 504, true, true},
		{408, KindUpstreamStatus, 504, true, true},
		{400, KindClientFault, 400, false, false},
		{404, KindClientFault, 404, false, false},
		{413, KindClientFault, 413, false, false},
		{422, KindClientFault, 422, false, false},
		{429, KindOverload, 429, false, false},
	} {
		srv := scripted(t, 0, tc.status)
		err := runStream(context.Background(), c, srv.URL).err
		var f *Fault
		if !errors.As(err, &f) || f.Kind != tc.kind || f.Status != tc.want || f.CountsTowardEjection() != tc.counts || f.Timeout != tc.timeout || f.UpstreamStatus != tc.status {
			t.Fatalf("HTTP %d: %+v", tc.status, f)
		}
		if tc.kind == KindClientFault || tc.kind == KindOverload {
			// Passed through with the engine's own body.
			if got := string(f.AppendJSON(nil)); got != string(schemas.AppendErrorJSON(nil, tc.status, "scripted")) {
				t.Fatalf("HTTP %d body %s", tc.status, got)
			}
		}
	}
}

func TestConnectErrorAndClientGone(t *testing.T) {
	c := testClient(time.Second, time.Second)
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	f := wantFault(t, runStream(context.Background(), c, "http://"+addr).err, KindConnectError, 502, "decode engine d1 unreachable")
	if !f.Transient() || !f.CountsTowardEjection() {
		t.Fatalf("%+v", f)
	}
	// R-OWN-5: a client that leaves ends the leg as client_disconnected.
	srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{wait: 5 * time.Second, send: data("[DONE]")})
	ctx, cancel := context.WithCancelCause(context.Background())
	time.AfterFunc(100*time.Millisecond, func() { cancel(ErrClientGone) })
	f = wantFault(t, runStream(ctx, c, srv.URL).err, KindClientGone, 499, "client disconnected")
	if f.EngineFault() || f.CountsTowardEjection() {
		t.Fatalf("%+v", f)
	}
}

// TestClientWaitIsNotSilenceRTMO6 proves R-TMO-6 at the stream: time its
// owner spends in ClientWait (blocked on a slow client) never counts as
// engine silence, however long; after ClientDone the between-chunk bound
// runs again from then and still catches an engine that is really silent
// (R-TMO-2, R-TMO-3).
func TestClientWaitIsNotSilenceRTMO6(t *testing.T) {
	const read = 60 * time.Millisecond
	// The engine sends one token at once and then a second one only after
	// 8 bounds, then nothing more.
	srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{wait: 8 * read, send: data(tokenChunk)}, step{wait: time.Hour})
	c := testClient(time.Second, read)
	req, res := testRequest(srv.URL)
	s, err := c.Decode(context.Background(), req, res)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, kind, err := s.Next(); err != nil || kind != schemas.ChunkOutput {
		t.Fatalf("first output: %v %v", kind, err)
	}
	// The owner is "writing to its client" for 5 bounds: nothing may fire.
	s.ClientWait()
	deadline := time.Now().Add(5 * read)
	for time.Now().Before(deadline) {
		if err := context.Cause(s.ctx); err != nil {
			t.Fatalf("the between-chunk bound fired while the owner waited on its client: %v", err)
		}
		time.Sleep(read / 6)
	}
	s.ClientDone()
	// The engine's token comes 3 bounds later still: the bound, restarted
	// at ClientDone, catches the silence one bound after it.
	done := time.Now()
	_, _, err = s.Next()
	wantFault(t, err, KindMidStreamSilence, 504, MsgSilence)
	if el := time.Since(done); el < read-10*time.Millisecond || el > 3*read {
		t.Fatalf("silence after %v from ClientDone, want about %v", el, read)
	}
}
