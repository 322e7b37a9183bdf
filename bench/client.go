package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Error classes a request can end in (Report.Errors keys). HTTP statuses
// and SSE error codes are open-ended: "http_<status>" and
// "sse_error_<code>".
const (
	// ClassTransport: the connection failed (refused, reset, broken)
	// before a complete response was read.
	ClassTransport = "transport"
	// ClassTruncated: the stream ended cleanly but without data: [DONE]
	// (R-FAIL-2).
	ClassTruncated = "truncated"
	// ClassTimeout: the request outlived Workload.Timeout.
	ClassTimeout = "timeout"
	// ClassDoneBeforeOutput: data: [DONE] arrived before any generated
	// output (R-FAIL-3 as a client sees it when nothing caught it).
	ClassDoneBeforeOutput = "done_before_output"
	// ClassInvalidChunk: a data payload that is not JSON.
	ClassInvalidChunk = "invalid_chunk"
	// ClassInflightCap: an open-loop arrival not sent because
	// Workload.MaxInFlight requests were already in flight.
	ClassInflightCap = "inflight_cap"
)

// HTTPClass is the error class of an HTTP response status other than 200:
// "http_<status>".
func HTTPClass(status int) string { return "http_" + strconv.Itoa(status) }

// SSEErrorClass is the error class of a terminal SSE error event
// (R-FAIL-4, R-FAIL-5) with the given code: "sse_error_<code>".
func SSEErrorClass(code int) string { return "sse_error_" + strconv.Itoa(code) }

// Target is where a run sends its requests: a *RouterTarget or a
// *FloorTarget.
type Target interface {
	// Name is "router" or "floor".
	Name() string
	// do sends one request built by w and records its outcome in w; start
	// is when the request was due (its latencies count from there).
	do(ctx context.Context, w *worker, start time.Time)
}

// RouterTarget sends requests to a router's OpenAI-compatible endpoint
// over HTTP/1.1 with keep-alive connections, reading streams with a reused
// bufio.Reader and without allocating per token.
type RouterTarget struct {
	base   string
	client *http.Client
	tr     *http.Transport
}

// NewRouterTarget returns a target for the router at baseURL (e.g.
// "http://127.0.0.1:8080", no trailing path). conns is the number of
// connections to keep open to it: the closed loop's concurrency, or the
// open loop's expected requests in flight (at least 64 are kept).
func NewRouterTarget(baseURL string, conns int) *RouterTarget {
	conns = max(conns, 64)
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        conns * 2,
		MaxIdleConnsPerHost: conns * 2,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
		WriteBufferSize:     8 << 10,
		ReadBufferSize:      16 << 10,
	}
	return &RouterTarget{base: strings.TrimRight(baseURL, "/"), tr: tr, client: &http.Client{Transport: tr}}
}

// Name returns "router".
func (t *RouterTarget) Name() string { return "router" }

// URL returns the router's base URL.
func (t *RouterTarget) URL() string { return t.base }

// Close closes the target's idle connections.
func (t *RouterTarget) Close() { t.tr.CloseIdleConnections() }

// Models returns the model ids the router lists at GET /v1/models
// (R-API-2), in its order. It fails on a transport error, a non-200
// status or a body that is not a model list.
func (t *RouterTarget) Models(ctx context.Context) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	models, err := engines.ListModels(ctx, t.client, t.base, engines.Credential{})
	if err != nil {
		return nil, fmt.Errorf("GET %s/v1/models: %w", t.base, err)
	}
	return engines.ModelIDs(models), nil
}

// recorder holds the outcomes of one worker's requests. Latencies are
// recorded for successful requests only.
type recorder struct {
	ttft, itl, e2e []time.Duration
	tokens         int64
	ok             int
	errors         map[string]int
}

func (r *recorder) reset() {
	r.ttft, r.itl, r.e2e = r.ttft[:0], r.itl[:0], r.e2e[:0]
	r.tokens, r.ok = 0, 0
	clear(r.errors)
}

func (r *recorder) merge(o *recorder) {
	r.ttft = append(r.ttft, o.ttft...)
	r.itl = append(r.itl, o.itl...)
	r.e2e = append(r.e2e, o.e2e...)
	r.tokens += o.tokens
	r.ok += o.ok
	for k, v := range o.errors {
		if r.errors == nil {
			r.errors = map[string]int{}
		}
		r.errors[k] += v
	}
}

func (r *recorder) failed() int {
	n := 0
	for _, v := range r.errors {
		n += v
	}
	return n
}

// worker is one client of a run: its random source, reused buffers and
// recorder. It is used by one goroutine at a time.
type worker struct {
	shape   *bodyShape
	rng     *rand.Rand
	stream  bool
	timeout time.Duration
	live    *counters

	bodyCap int
	br      *bufio.Reader
	long    []byte       // a line longer than br's buffer
	body    bytes.Buffer // a non-streamed response body, reused
	header  http.Header
	rec     recorder
	// fixed, when set, is the next request's body (a trace's), used once
	// instead of one drawn from shape.
	fixed []byte

	// onPayload, when set, sees every data payload but [DONE] (tests).
	onPayload func(payload []byte)
}

func newWorker(shape *bodyShape, wl *Workload, seed uint64, live *counters) *worker {
	return &worker{
		shape:   shape,
		rng:     rand.New(rand.NewPCG(wl.Seed, seed)),
		stream:  wl.Stream,
		timeout: wl.timeout(),
		live:    live,
		bodyCap: 512,
		br:      bufio.NewReaderSize(nil, 8<<10),
		header: http.Header{
			"Content-Type": {"application/json"},
			"Accept":       {"text/event-stream, application/json"},
		},
		rec: recorder{errors: map[string]int{}},
	}
}

// newBody returns a fresh request body. It is not reused: the transport
// may still hold a body after the response (net/http's RoundTrip
// contract), so one small allocation per request is the price of safety.
func (w *worker) newBody() []byte {
	if b := w.fixed; b != nil {
		w.fixed = nil
		return b
	}
	b := w.shape.appendBody(make([]byte, 0, w.bodyCap), w.rng)
	w.bodyCap = max(w.bodyCap, cap(b))
	return b
}

// succeed records a successful request.
func (w *worker) succeed(start, first, end time.Time, tokens int) {
	w.rec.ok++
	w.rec.tokens += int64(tokens)
	w.rec.ttft = append(w.rec.ttft, first.Sub(start))
	w.rec.e2e = append(w.rec.e2e, end.Sub(start))
	w.live.done.Add(1)
}

// fail records a failed request of class, or nothing when the run itself
// was cancelled (run is the run's context, req the request's).
func (w *worker) fail(run, req context.Context, class string) {
	if run.Err() != nil {
		return
	}
	if req.Err() != nil {
		class = ClassTimeout
	}
	w.rec.errors[class]++
	w.live.done.Add(1)
	w.live.errors.Add(1)
}

// do implements Target for the router: one POST, then the SSE stream (or
// the JSON completion) read to its end.
func (t *RouterTarget) do(ctx context.Context, w *worker, start time.Time) {
	body := w.newBody()
	rctx, cancel := context.WithTimeout(ctx, w.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, t.base+w.shape.endpoint, bytes.NewReader(body))
	if err != nil {
		w.fail(ctx, rctx, ClassTransport)
		return
	}
	req.Header = w.header
	resp, err := t.client.Do(req)
	if err != nil {
		w.fail(ctx, rctx, ClassTransport)
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		w.discard(resp.Body)
		w.fail(ctx, rctx, HTTPClass(resp.StatusCode))
		return
	}
	if !w.stream {
		w.body.Reset()
		_, err = w.body.ReadFrom(resp.Body)
		end := time.Now()
		if err != nil {
			w.fail(ctx, rctx, ClassTransport)
			return
		}
		if w.onPayload != nil {
			w.onPayload(w.body.Bytes())
		}
		tokens, _ := completionTokens(w.body.Bytes())
		w.succeed(start, end, end, tokens)
		return
	}
	w.br.Reset(resp.Body)
	first, end, tokens, class, err := w.readStream()
	if class != "" {
		if err != nil && !errors.Is(err, io.EOF) && class == ClassTruncated {
			class = ClassTransport
		}
		w.fail(ctx, rctx, class)
		w.br.Reset(nil)
		return
	}
	w.succeed(start, first, end, tokens)
	// Read the end of the chunked body so the connection is reused.
	for {
		if _, err := w.br.ReadSlice('\n'); err != nil && err != bufio.ErrBufferFull {
			break
		}
	}
	w.br.Reset(nil)
}

// readStream reads one SSE response from w.br up to data: [DONE]. It
// records the inter-token latencies (between output chunks) into w.rec and
// returns the times of the first output and of [DONE], and the number of
// output tokens: usage.completion_tokens when the stream carried usage,
// else the number of output chunks. On failure it returns the error class
// (and the read error, if any) and records nothing. It allocates nothing
// per chunk.
func (w *worker) readStream() (first, end time.Time, tokens int, class string, err error) {
	mark := len(w.rec.itl)
	out := newOutputTally()
	for {
		line, err := w.readLine()
		if err != nil {
			w.rec.itl = w.rec.itl[:mark]
			if len(line) == 0 || err != io.EOF {
				return out.first, end, 0, ClassTruncated, err
			}
			// A last line without its newline is still a line.
		}
		payload, ok := schemas.SSEData(line)
		if ok && len(payload) > 0 {
			kind := schemas.ClassifyChunk(payload)
			if w.onPayload != nil && kind != schemas.ChunkDone {
				w.onPayload(payload)
			}
			switch kind {
			case schemas.ChunkOutput, schemas.ChunkMetadata:
				if gap, ok := out.see(kind, payload); ok {
					w.rec.itl = append(w.rec.itl, gap)
				}
			case schemas.ChunkDone:
				if out.chunks == 0 {
					w.rec.itl = w.rec.itl[:mark]
					return out.first, end, 0, ClassDoneBeforeOutput, nil
				}
				return out.first, time.Now(), out.tokens(), "", nil
			case schemas.ChunkError:
				w.rec.itl = w.rec.itl[:mark]
				code := 0
				if obj, ok := schemas.ParseError(payload); ok {
					code = obj.Code
				}
				return out.first, end, 0, SSEErrorClass(code), nil
			default:
				w.rec.itl = w.rec.itl[:mark]
				return out.first, end, 0, ClassInvalidChunk, nil
			}
		}
		if err != nil {
			w.rec.itl = w.rec.itl[:mark]
			return out.first, end, 0, ClassTruncated, err
		}
	}
}

// readLine returns the next line of w.br with its newline; lines longer
// than the buffer are assembled in w.long (bounded to 64 MiB).
func (w *worker) readLine() ([]byte, error) {
	line, err := w.br.ReadSlice('\n')
	if err != bufio.ErrBufferFull {
		return line, err
	}
	w.long = append(w.long[:0], line...)
	for {
		line, err = w.br.ReadSlice('\n')
		w.long = append(w.long, line...)
		if err != bufio.ErrBufferFull {
			return w.long, err
		}
		if len(w.long) > 64<<20 {
			return nil, bufio.ErrBufferFull
		}
	}
}

// discard reads (a bounded part of) an error body so the connection can
// be reused.
func (w *worker) discard(r io.Reader) {
	_, _ = io.Copy(io.Discard, io.LimitReader(r, 64<<10))
}

// completionTokens finds "completion_tokens": <int> in a usage-bearing
// payload without decoding it (R-LEG-6: the decode engine's count). ok is
// false when the member is absent.
func completionTokens(payload []byte) (int, bool) {
	const key = `"completion_tokens"`
	i := bytes.LastIndex(payload, []byte(key))
	if i < 0 {
		return 0, false
	}
	i += len(key)
	for i < len(payload) && (payload[i] == ' ' || payload[i] == ':' || payload[i] == '\t') {
		i++
	}
	n, digits := 0, 0
	for ; i < len(payload) && payload[i] >= '0' && payload[i] <= '9'; i++ {
		n = n*10 + int(payload[i]-'0')
		digits++
	}
	return n, digits > 0
}

// outputTally follows the output of one stream: the times of its first and
// last output chunks, and its tokens.
type outputTally struct {
	first, last time.Time
	chunks      int // output chunks so far
	usage       int // usage.completion_tokens, -1 until a usage chunk
}

func newOutputTally() outputTally { return outputTally{usage: -1} }

// see accounts for one output or metadata chunk (others are ignored). For
// an output chunk after the first it returns the gap since the previous
// one (an inter-token latency) and true.
func (o *outputTally) see(kind schemas.ChunkKind, payload []byte) (gap time.Duration, ok bool) {
	switch kind {
	case schemas.ChunkOutput:
		now := time.Now()
		if o.chunks > 0 {
			gap, ok = now.Sub(o.last), true
		} else {
			o.first = now
		}
		o.last = now
		o.chunks++
	case schemas.ChunkMetadata:
		if n, has := completionTokens(payload); has {
			o.usage = n
		}
	}
	return gap, ok
}

// tokens is usage.completion_tokens when the stream carried usage, else
// the number of output chunks.
func (o *outputTally) tokens() int {
	if o.usage >= 0 {
		return o.usage
	}
	return o.chunks
}
