package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// startSim starts one simulator serving plain (non-disaggregated)
// requests, as a router's client sees an OpenAI-compatible server.
func startSim(t *testing.T, cfg sim.Config) string {
	t.Helper()
	cfg.Role, cfg.EngineID, cfg.Model = "both", "sim-1", "m"
	return simtest.Start(t, cfg).URL()
}

func testWorkload(model string, tokens int) Workload {
	return Workload{
		Endpoint:    schemas.EndpointChat,
		Model:       model,
		Stream:      true,
		PromptWords: Range{8, 8},
		MaxTokens:   Range{tokens, tokens},
		IgnoreEOS:   true,
		Concurrency: 1,
		Requests:    1,
		Timeout:     5 * time.Second,
		Seed:        7,
	}
}

// oneRequest sends one request of wl to t with a fresh worker and returns
// the worker's recorder.
func oneRequest(t *testing.T, target Target, wl Workload) *recorder {
	t.Helper()
	var live counters
	w := newWorker(wl.shape(), &wl, 1, &live)
	target.do(context.Background(), w, time.Now())
	if got := live.done.Load(); got != 1 {
		t.Fatalf("live done = %d after one request, want 1", got)
	}
	return &w.rec
}

// The SSE client counts a stream's tokens and records one TTFT, one
// end-to-end latency and one ITL per output chunk after the first, as
// timed by the engine (sim TTFT 30 ms, ITL 3 ms).
func TestRouterClientCountsTokensAndTimes(t *testing.T) {
	url := startSim(t, sim.Config{TTFT: 30 * time.Millisecond, ITL: 3 * time.Millisecond})
	target := NewRouterTarget(url, 1)
	defer target.Close()
	rec := oneRequest(t, target, testWorkload("m", 4))
	if rec.ok != 1 || len(rec.errors) != 0 {
		t.Fatalf("ok=%d errors=%v, want one success", rec.ok, rec.errors)
	}
	if rec.tokens != 4 {
		t.Errorf("tokens = %d, want 4 (usage.completion_tokens)", rec.tokens)
	}
	if len(rec.ttft) != 1 || rec.ttft[0] < 30*time.Millisecond {
		t.Errorf("ttft = %v, want one sample ≥ 30ms", rec.ttft)
	}
	if len(rec.e2e) != 1 || rec.e2e[0] < rec.ttft[0]+9*time.Millisecond {
		t.Errorf("e2e = %v, want one sample ≥ TTFT + 3 ITLs", rec.e2e)
	}
	// 4 token chunks and the finish chunk are 5 outputs: 4 gaps, three of
	// them an ITL of the engine.
	if len(rec.itl) != 4 {
		t.Fatalf("itl samples = %d, want 4: %v", len(rec.itl), rec.itl)
	}
	// The engine paces its tokens 3 ms apart; a loaded machine may deliver
	// two together, but not the whole stream at once.
	var sum time.Duration
	for _, d := range rec.itl {
		sum += d
	}
	if sum < 3*time.Millisecond {
		t.Errorf("ITL samples %v add up to %v, want ≥ one 3 ms ITL", rec.itl, sum)
	}
}

// Non-streamed: TTFT is the whole completion, no ITL, tokens from usage.
func TestRouterClientNoStream(t *testing.T) {
	url := startSim(t, sim.Config{})
	target := NewRouterTarget(url, 1)
	defer target.Close()
	wl := testWorkload("m", 5)
	wl.Stream = false
	rec := oneRequest(t, target, wl)
	if rec.ok != 1 || rec.tokens != 5 || len(rec.itl) != 0 || len(rec.ttft) != 1 || rec.ttft[0] != rec.e2e[0] {
		t.Fatalf("ok=%d tokens=%d itl=%d ttft=%v e2e=%v errors=%v; want 1, 5, 0, ttft = e2e", rec.ok, rec.tokens, len(rec.itl), rec.ttft, rec.e2e, rec.errors)
	}
}

// Each way a response can fail ends in its error class: an HTTP status
// (R-FAIL-6 as the client sees it), a terminal SSE error event with its
// code (R-FAIL-4/5), a stream closed before [DONE] (R-FAIL-2), [DONE]
// before any output (R-FAIL-3), a broken connection, a refused one and a
// request timeout. Failed requests record no latency.
func TestRouterClientErrorClasses(t *testing.T) {
	cases := []struct {
		fault sim.Fault
		want  string
	}{
		{sim.Fault{Kind: sim.FaultStatus, Status: 503, Message: "overloaded"}, "http_503"},
		{sim.Fault{Kind: sim.FaultStatus, Status: 400}, "http_400"},
		{sim.Fault{Kind: sim.FaultClose, AfterTokens: 2}, ClassTruncated},
		{sim.Fault{Kind: sim.FaultErrorObject, AfterTokens: 1, Status: 504}, "sse_error_504"},
		{sim.Fault{Kind: sim.FaultDoneBeforeToken}, ClassDoneBeforeOutput},
		{sim.Fault{Kind: sim.FaultAbort, AfterTokens: 2}, ClassTransport},
		{sim.Fault{Kind: sim.FaultHeaderDelay, DelayMS: 2000}, ClassTimeout},
	}
	for _, c := range cases {
		t.Run(c.want, func(t *testing.T) {
			url := startSim(t, sim.Config{Faults: []sim.Fault{c.fault}})
			target := NewRouterTarget(url, 1)
			defer target.Close()
			wl := testWorkload("m", 4)
			wl.Timeout = 200 * time.Millisecond
			rec := oneRequest(t, target, wl)
			if rec.ok != 0 || rec.errors[c.want] != 1 || rec.failed() != 1 {
				t.Fatalf("ok=%d errors=%v, want exactly one %q", rec.ok, rec.errors, c.want)
			}
			if len(rec.ttft)+len(rec.itl)+len(rec.e2e) != 0 || rec.tokens != 0 {
				t.Errorf("a failed request recorded latencies or tokens: %+v", rec)
			}
		})
	}
	t.Run("refused", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		target := NewRouterTarget("http://"+addr, 1)
		defer target.Close()
		rec := oneRequest(t, target, testWorkload("m", 4))
		if rec.errors[ClassTransport] != 1 {
			t.Fatalf("errors = %v, want one transport", rec.errors)
		}
	})
}

// A cancelled run does not count the requests it cut short.
func TestRouterClientCancelledRunNotCounted(t *testing.T) {
	url := startSim(t, sim.Config{Faults: []sim.Fault{{Kind: sim.FaultHeaderDelay, DelayMS: 2000}}})
	target := NewRouterTarget(url, 1)
	defer target.Close()
	wl := testWorkload("m", 4)
	var live counters
	w := newWorker(wl.shape(), &wl, 1, &live)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	target.do(ctx, w, time.Now())
	if live.done.Load() != 0 || w.rec.ok != 0 || w.rec.failed() != 0 {
		t.Fatalf("cancelled request counted: done=%d rec=%+v", live.done.Load(), w.rec)
	}
}

// syntheticStream is an SSE response of n token chunks, the finish chunk,
// the usage chunk and [DONE], shaped as vLLM sends them.
func syntheticStream(n int) []byte {
	var b bytes.Buffer
	b.WriteString(`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}` + "\n\n")
	for i := 0; i < n; i++ {
		b.WriteString(`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" narwhal"},"logprobs":null,"finish_reason":null}]}` + "\n\n")
		if i%5 == 0 {
			b.WriteString(": keep-alive\n\n")
		}
	}
	b.WriteString(`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}` + "\n\n")
	fmt.Fprintf(&b, `data: {"id":"c","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}}`+"\n\n", n, n+8)
	b.WriteString("data: [DONE]\n\n")
	return b.Bytes()
}

// The client's hot loop allocates nothing per token: reading a stream of
// 1000 tokens costs no more allocations than one of 10.
func TestReadStreamNoAllocationPerToken(t *testing.T) {
	wl := testWorkload("m", 1)
	var live counters
	w := newWorker(wl.shape(), &wl, 1, &live)
	w.rec.itl = make([]time.Duration, 0, 4096)
	allocs := func(n int) float64 {
		stream := syntheticStream(n)
		r := bytes.NewReader(stream)
		return testkit.LeastAllocs(20, func() {
			r.Reset(stream)
			w.br.Reset(r)
			w.rec.itl = w.rec.itl[:0]
			_, _, tokens, class, _ := w.readStream()
			if class != "" || tokens != n {
				t.Fatalf("readStream: class %q tokens %d, want success with %d", class, tokens, n)
			}
		})
	}
	small, large := allocs(10), allocs(1000)
	// The 1000-token stream runs a hundred times longer, so on a loaded
	// machine it also counts what other goroutines of the test process
	// allocate meanwhile (1 per stream, under -race in the full suite).
	// One allocation per token, or per hundred tokens, would still show
	// as 10 or more; one per stream shows in the short stream's 0.
	if small > 0 || large > small+2 {
		t.Errorf("allocations per stream: %v for 10 tokens, %v for 1000; want 0 and no growth", small, large)
	}
}

func TestCompletionTokens(t *testing.T) {
	for _, c := range []struct {
		in string
		n  int
		ok bool
	}{
		{`{"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":16,"total_tokens":24}}`, 16, true},
		{`{"usage":{"completion_tokens" : 3}}`, 3, true},
		{`{"choices":[{"delta":{"content":"x"}}]}`, 0, false},
		{`{"usage":{"completion_tokens":null}}`, 0, false},
	} {
		n, ok := completionTokens([]byte(c.in))
		if n != c.n || ok != c.ok {
			t.Errorf("completionTokens(%s) = %d, %v; want %d, %v", c.in, n, ok, c.n, c.ok)
		}
	}
}

// Bodies are valid requests of the workload (R-API-4 would refuse
// anything else) with the drawn lengths.
func TestBodiesParse(t *testing.T) {
	for _, endpoint := range []string{schemas.EndpointChat, schemas.EndpointCompletions} {
		wl := testWorkload(`model "quoted"`, 1)
		wl.Endpoint = endpoint
		wl.PromptWords = Range{3, 9}
		wl.MaxTokens = Range{2, 5}
		var live counters
		w := newWorker(wl.shape(), &wl, 1, &live)
		for i := 0; i < 50; i++ {
			body := w.newBody()
			req, err := schemas.ParseRequest(endpoint, body)
			if err != nil {
				t.Fatalf("%s: %v: %s", endpoint, err, body)
			}
			if req.Model != wl.Model || !req.Stream || !req.IncludeUsage || req.MaxTokens < 2 || req.MaxTokens > 5 {
				t.Fatalf("%s: parsed %+v from %s", endpoint, req, body)
			}
			var prompt string
			if endpoint == schemas.EndpointChat {
				raw, _ := req.Member("messages")
				var msgs []struct{ Role, Content string }
				if err := json.Unmarshal(raw, &msgs); err != nil || len(msgs) != 1 || msgs[0].Role != "user" {
					t.Fatalf("messages %s: %v", raw, err)
				}
				prompt = msgs[0].Content
			} else {
				raw, _ := req.Member("prompt")
				if err := json.Unmarshal(raw, &prompt); err != nil {
					t.Fatalf("prompt %s: %v", raw, err)
				}
			}
			words := len(strings.Fields(prompt))
			if words < 3 || words > 9 {
				t.Fatalf("%s: %d prompt words in %q, want 3..9", endpoint, words, prompt)
			}
		}
	}
}
