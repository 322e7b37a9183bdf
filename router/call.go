package router

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/router/meshview"
	"github.com/narwhalmesh/narwhal/schemas"
)

// A request's path through the router, top to bottom:
//
//	serveCompletion        this file: arrive, prepare, run, answer
//	  call.run             attempt.go: attempts under the retry policy (retry.go)
//	    call.attempt       attempt.go: placement, the connector's legs (engines.Client.StartAttempt), the decode up to its first output
//	  call.answer          this file, then relay.go: the stream relayed, or aggregated
//	  call.finish          this file: every reservation, leg and watch released
//	    call.record        outcome.go: metrics, the request event, the log line
//
// Engine faults are recorded where they happen (call.recordFault,
// outcome.go); the fault that ends a request before commit is answered by
// call.fail.

// call is one client request from arrival to its last byte. It owns every
// leg, reservation, timer and watch of the request (behaviour.md R-OWN-1): all of
// them are released by finish, whatever the outcome.
type call struct {
	rt       *Router
	id       string
	arrival  time.Time
	req      *schemas.Request
	ctx      context.Context
	cancel   context.CancelCauseFunc
	watch    *watch
	attempts int
	scratch  *placeScratch // placement's pooled buffers (placement.go)
	// unpublished is set for a request refused on its body (it does not
	// parse or breaks a request limit, R-API-4): counted and logged, but
	// no request event, like the front door's other refusals
	// (docs/security.md).
	unpublished bool

	producer, consumer *member
	prefillTokens      int64                 // the producer attempt's estimated uncached tokens, reserved with its prefill slot (R-PLACE-3)
	inflight           prefix.InflightTicket // the producer attempt's prompt in its exact engine's Inflight (R-PLACE-4), settled with the prefill slot
	inflightOn         *member               // the engine of inflight, nil when none; both set before the attempt runs
	sharedCount        int                   // inflight's prompt as the other routers were told of it (bus.PlacedChain): its keys…
	sharedLast         uint64                // … and the last of them
	sharedOpen         atomic.Bool           // the other routers have not been told that inflight's attempt ended; the first of releasePrefill and dropInflight to clear it tells them
	prediction         meshview.Prediction   // what the placement predicted of the producer attempt (R-PLACE-3)
	holdPrefill        atomic.Bool           // producer's prefill slot is reserved (released from the prefill's goroutine too)
	prefillAnswered    atomic.Bool           // the attempt's prefill answered with its usage (set on the prefill's goroutine)
	holdDecode         bool                  // consumer's decode slot is reserved
	live               *engines.Attempt      // the committed attempt, until finish ends its legs
	backendID          string
	stream             *engines.Stream
	pending            []heldChunk // metadata read before the first output
	first              []byte      // the first generated output, copied

	series           *modelSeries // the model label's series (metrics.series): "other" until prepare knows the model
	lastOutput       time.Time    // when the last generated chunk was read, for narwhal_inter_token_seconds
	ttft, firstByte  time.Duration
	status           int
	outcome          string
	promptTokens     int
	completionTokens int
	usage            bool // the decode engine reported usage: the token counts are known
	cachedTokens     int  // its usage.prompt_tokens_details.cached_tokens, when cachedKnown
	cachedKnown      bool // it reported them (R-FAIL-8)
	recomputed       bool // it recomputed the prompt instead of loading the KV (R-FAIL-8)
	committed        bool
	decodeStart      time.Time
	chunks           int
	finished         bool
	cancelDeadline   context.CancelFunc
	bodyBytes        int64      // held against server.max_body_bytes_inflight until finish
	key              *clientKey // the caller's API key; nil on an open router (R-API-9)
	holdKey          bool       // key's in-flight slot is taken

	trace                   *callTrace // the request's spans; nil when tracing is off (trace.go)
	traceparent, tracestate string     // with tracing off: the client's trace context, passed to the legs
}

// heldChunk is a metadata chunk read before the first generated output,
// copied, with what the stream's one scan found in it; it is relayed
// before that output.
type heldChunk struct {
	payload []byte
	chunk   schemas.Chunk
}

// serveCompletion handles POST /v1/chat/completions and /v1/completions.
// key is the caller's authenticated API key, nil on an open router.
func (rt *Router) serveCompletion(fctx *fasthttp.RequestCtx, endpoint string, key *clientKey) {
	c := rt.arrive(fctx)
	if c != nil {
		c.key = key
		c.traceArrive(fctx, endpoint)
	}
	if c == nil || !c.prepare(fctx, endpoint) {
		return
	}
	if f := c.run(); f != nil {
		c.fail(fctx, f)
		return
	}
	c.answer(fctx)
}

// arrive takes a request through the front door: admission and the body
// bound answer before anything else (R-API-8). It returns nil for a request
// refused there (already answered), else the call, counted in flight from
// its arrival.
func (rt *Router) arrive(fctx *fasthttp.RequestCtx) *call {
	arrival := time.Now()
	id := requestID(fctx)
	body, ok := rt.front.holdBody(fctx)
	if !ok {
		rt.front.refuseBodyMemory(fctx)
		return nil
	}
	if !rt.front.admit(&rt.inflight) {
		rt.front.releaseBody(body)
		rt.front.refuseInflight(fctx)
		return nil
	}
	c := &call{rt: rt, arrival: arrival, id: id, bodyBytes: body, series: rt.metrics.other}
	rt.metrics.inflight.Inc()
	return c
}

// prepare parses and checks the request (R-API-4, R-API-8), and when it
// may go on gives it its deadline (R-TMO-5) and its disconnect watch
// (R-OWN-5). A refused request is answered and finished; prepare then
// returns false.
func (c *call) prepare(fctx *fasthttp.RequestCtx, endpoint string) bool {
	rt := c.rt
	req, err := schemas.ParseLimited(endpoint, fctx.PostBody(), rt.limits)
	// The parsed request keeps its own copy: drop fasthttp's now.
	fctx.Request.ResetBody()
	if err != nil {
		c.req = &schemas.Request{Endpoint: endpoint}
		c.unpublished = true
		var re *schemas.RequestError
		if errors.As(err, &re) {
			c.reject(fctx, re.Status, re.Message, "client_error")
		} else {
			c.reject(fctx, 400, err.Error(), "client_error")
		}
		return false
	}
	c.req = req
	served := rt.fleet().EverServed(req.Model)
	if served {
		// A model the fleet has served: a bounded label, also on a
		// request its key may not make.
		c.series = rt.metrics.series(req.Model)
	}
	if !c.admitKey(fctx) {
		return false
	}
	if !served {
		c.reject(fctx, 404, unknownModelMessage(req.Model, modelsFor(c.key, rt.fleet().Models())), "client_error")
		return false
	}
	if p, should := rt.fleet().UnreachableFor(req.Model); should != nil {
		c.fail(fctx, engines.NewFault(engines.KindNoEngine, p.String(), "", 0, unreachableModelMessage(req.Model, p, should)))
		return false
	}
	rt.budget.request()

	deadline := rt.cfg.Request.Timeout()
	if d, ok := clientTimeout(fctx); ok && d < deadline {
		deadline = d
	}
	ctx, cancelDeadline := context.WithTimeout(rt.base, deadline)
	c.ctx, c.cancel = context.WithCancelCause(ctx)
	c.cancelDeadline = cancelDeadline
	c.watch = rt.watcher.add(fctx.Conn(), func() { c.cancel(engines.ErrClientGone) })
	return true
}

// maxListedNames bounds how many models or engines an error message
// lists; the rest are counted.
const maxListedNames = 10

// unknownModelMessage is the 404 message of a model no engine of the
// fleet has listed (R-API-3): "The model `m` does not exist. Available
// models: a, b." — at most maxListedNames names, each bounded like the
// model.
func unknownModelMessage(model string, available []string) string {
	var b strings.Builder
	b.WriteString("The model `" + schemas.BoundField(model) + "` does not exist.")
	if len(available) == 0 {
		b.WriteString(" No engine lists a model yet (see /readyz).")
		return b.String()
	}
	b.WriteString(" Available models: ")
	writeListed(&b, len(available), func(i int) { b.WriteString(schemas.BoundField(available[i])) })
	b.WriteString(".")
	return b.String()
}

// unreachableModelMessage is the 503 message of a model that engines of
// the fleet served but none reachable lists now, for phase p:
// `no reachable engine serves model "m" for decode: engines that serve
// it: d1 (unreachable: connection refused), d2 (serves no model …)`.
func unreachableModelMessage(model string, p phase, should []*member) string {
	var b strings.Builder
	fmt.Fprintf(&b, "no reachable engine serves model %q for %s: engines that serve it: ", schemas.BoundField(model), p)
	now := time.Now().UnixNano()
	writeListed(&b, len(should), func(i int) {
		why := should[i].Unplaceable(now)
		if why == "" {
			why = "no longer lists it"
		}
		b.WriteString(should[i].ID + " (" + why + ")")
	})
	return b.String()
}

// writeListed writes n items to b, separated by ", ": the first
// maxListedNames of them, each by item(i), then " and <rest> more".
func writeListed(b *strings.Builder, n int, item func(i int)) {
	for i := range n {
		if i == maxListedNames {
			fmt.Fprintf(b, " and %d more", n-i)
			return
		}
		if i > 0 {
			b.WriteString(", ")
		}
		item(i)
	}
}

// clientTimeout reads a shorter deadline the client asked for, in seconds:
// X-Request-Timeout, or X-Stainless-Timeout as the OpenAI SDKs send it
// (R-TMO-5).
func clientTimeout(fctx *fasthttp.RequestCtx) (time.Duration, bool) {
	for _, h := range []string{"X-Request-Timeout", "X-Stainless-Timeout"} {
		if v := fctx.Request.Header.Peek(h); len(v) > 0 {
			// Finite, positive and below a year: anything else (inf, NaN,
			// 1e300, which would overflow a Duration) is ignored.
			if s, err := strconv.ParseFloat(string(v), 64); err == nil && s > 0 && s < 365*24*3600 {
				return time.Duration(s * float64(time.Second)), true
			}
		}
	}
	return 0, false
}

// answer sends the client the attempt that produced its first output: a
// committed stream relayed chunk by chunk (relayBody), or one aggregated
// completion (R-LEG-5).
func (c *call) answer(fctx *fasthttp.RequestCtx) {
	// Which engines served the request, for operators and demos.
	fctx.Response.Header.Set("X-Narwhal-Prefill-Engine", c.producer.ID)
	fctx.Response.Header.Set("X-Narwhal-Decode-Engine", c.consumer.ID)
	if !c.req.Stream {
		c.aggregate(fctx)
		return
	}
	c.committed = true
	c.status = 200
	fctx.SetStatusCode(200)
	fctx.SetContentType("text/event-stream; charset=utf-8")
	fctx.Response.Header.Set("Cache-Control", "no-cache")
	fctx.Response.Header.Set("X-Accel-Buffering", "no")
	// server.stall_timeout_s bounds each write of the stream, never the
	// stream as a whole (R-TMO-6): keep fasthttp's response deadline off
	// it; the relay sets the connection's own (and fasthttp clears it after
	// the response).
	_ = fctx.SetWriteDeadline(time.Time{})
	fctx.SetBodyStream(newRelayBody(c, fctx.Conn(), c.rt.cfg.Server.StallTimeout()), -1)
}

// reject answers a request refused before any engine was touched.
func (c *call) reject(fctx *fasthttp.RequestCtx, status int, message, outcome string) {
	writeError(fctx, status, message)
	c.status, c.outcome = status, outcome
	c.finish()
}

// fail answers a request whose attempts ended in f before commit.
func (c *call) fail(fctx *fasthttp.RequestCtx, f *engines.Fault) {
	c.watch.stop()
	c.watch = nil
	status := f.Status
	if f.Kind == engines.KindClientGone {
		// Nobody is listening; fasthttp still needs a response.
		fctx.SetConnectionClose()
	}
	if f.Kind == engines.KindNoEngine {
		retry := int(c.rt.cfg.Recovery.ReadmitInterval().Seconds())
		if retry < 1 {
			retry = 1
		}
		fctx.Response.Header.Set("Retry-After", strconv.Itoa(retry))
	}
	if f.Kind == engines.KindRouterResources {
		// The router's own fault: ask again in a second (R-FAIL-9).
		fctx.Response.Header.Set("Retry-After", "1")
	}
	if d := c.rt.backpressure(f); d > 0 {
		// The engine's backpressure, passed through (R-FAIL-7).
		fctx.Response.Header.Set("Retry-After", strconv.Itoa(int(d/time.Second)))
	}
	fctx.SetStatusCode(status)
	fctx.SetContentType("application/json")
	fctx.SetBody(f.AppendJSON(nil))
	c.status, c.outcome = status, string(f.Kind)
	c.finish()
}

// finish releases everything the request still holds — its watch, its
// stream, an unconsumed handoff, its reservations, its body's share of the
// in-flight body bound, its contexts — and
// records it. It runs once, whatever the outcome.
func (c *call) finish() {
	if c.finished {
		return
	}
	c.finished = true
	c.watch.stop()
	c.watch = nil
	c.closeStream()
	c.finishAttempt()
	c.releasePrefill(false)
	if c.inflightOn != nil {
		c.endShared(true)
	}
	c.releaseDecode()
	// Kept until every leg ended: a producer's answer read after the
	// first output (SGLang's) still compares its cached tokens with the
	// prediction, whose hashes live in the placement's buffers (R-PLACE-3).
	c.releasePlacement()
	c.rt.front.releaseBody(c.bodyBytes)
	c.bodyBytes = 0
	c.releaseKey()
	c.checkRecompute()
	if c.cancel != nil {
		c.cancel(context.Canceled)
		c.cancelDeadline()
	}
	now := time.Now()
	c.record(now)
	c.traceEnd(now)
}

// releasePrefill gives back the producer's prefill slot and its work in
// flight (R-OWN-3, R-PLACE-3); answered says the prefill completed, so
// its time there counts in the producer's mean (meshview.Member.PrefillEnded).
func (c *call) releasePrefill(answered bool) {
	if c.holdPrefill.CompareAndSwap(true, false) {
		// Ended before the slot is free: a reservation that finds the
		// engine idle in between would otherwise begin the next head
		// first, and this end would measure nothing.
		now := time.Now()
		c.producer.PrefillEnded(now.UnixNano(), answered, c.prefillTokens)
		c.producer.Release(prefillPhase)
		c.producer.AddTokens(-c.prefillTokens)
		if c.inflightOn != nil {
			c.inflightOn.Inflight().Settle(c.inflight, now.Add(inflightGrace).UnixNano())
			if answered {
				// Not answered is not failed: a prefill whose answer
				// came too late, or after the decode committed, was
				// computed all the same. An attempt that failed before
				// its prefill completed calls dropInflight; one that
				// did not ends at finish.
				c.endShared(true)
			}
		}
	}
}

// endShared tells the other routers, once per attempt, that the attempt
// of the placement shared with them ended (R-PLACE-4): the first of a
// prefill answered (completed), dropInflight (failed), the next
// placement of the request (failed: it is retried) and finish
// (completed: the attempt was not judged to have failed before its
// prefill completed).
func (c *call) endShared(completed bool) {
	if c.sharedOpen.CompareAndSwap(true, false) {
		c.rt.mesh.SharePlacedEnd(c.inflightOn, c.sharedCount, c.sharedLast, completed)
	}
}

// dropInflight ends, at once, the credit of the producer attempt's prompt
// at its exact engine (prefix.Inflight, R-PLACE-4): the attempt failed
// before its prefill completed, so the engine may hold none of it. The
// prefill slot itself is released by releasePrefill. It may race with
// releasePrefill's grace on the prefill's goroutine: both only read
// c.inflight and c.inflightOn, set before the attempt runs, and a slot
// freed stays free whichever Settle comes last.
func (c *call) dropInflight() {
	if c.inflightOn != nil {
		c.inflightOn.Inflight().Settle(c.inflight, 0)
		c.endShared(false)
	}
}

func (c *call) releaseDecode() {
	if c.holdDecode {
		c.holdDecode = false
		c.consumer.Release(decodePhase)
	}
}

func (c *call) closeStream() {
	if c.stream != nil {
		c.stream.Close()
		c.stream = nil
	}
}
