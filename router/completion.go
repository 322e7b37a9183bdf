package router

import (
	"context"
	"errors"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// call is one client request from arrival to its last byte. It owns every
// leg, reservation, timer and watch of the request (SPEC R-OWN-1): all of
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

	producer, consumer *member
	holdPrefill        bool // producer's prefill slot is reserved
	holdDecode         bool // consumer's decode slot is reserved
	result             *connector.PrefillResult
	backendID          string
	stream             *engines.Stream
	pending            [][]byte // metadata read before the first output (all ChunkMetadata)
	first              []byte   // the first generated output, copied

	ttft, firstByte  time.Duration
	status           int
	outcome          string
	promptTokens     int
	completionTokens int
	committed        bool
	decodeStart      time.Time
	chunks           int
	finished         bool
	cancelDeadline   context.CancelFunc
	bodyBytes        int64 // held against server.max_body_bytes_inflight until finish
}

// serveCompletion handles POST /v1/chat/completions and /v1/completions.
func (rt *Router) serveCompletion(fctx *fasthttp.RequestCtx, endpoint string) {
	arrival := time.Now()
	id := requestID(fctx)
	// R-API-8: admission and the body bound answer before anything else.
	body, ok := rt.front.holdBody(fctx)
	if !ok {
		rt.front.refuseBodyMemory(fctx)
		return
	}
	if !rt.front.admit(&rt.inflight) {
		rt.front.releaseBody(body)
		rt.front.refuseInflight(fctx)
		return
	}
	c := &call{rt: rt, arrival: arrival, id: id, bodyBytes: body}
	rt.metrics.inflight.Inc()

	req, err := schemas.ParseLimited(endpoint, fctx.PostBody(), rt.limits)
	// The parsed request keeps its own copy: drop fasthttp's now.
	fctx.Request.ResetBody()
	if err != nil {
		var re *schemas.RequestError
		if errors.As(err, &re) {
			c.req = &schemas.Request{Endpoint: endpoint}
			c.reject(fctx, re.Status, re.Message, "client_error")
			return
		}
		c.req = &schemas.Request{Endpoint: endpoint}
		c.reject(fctx, 400, err.Error(), "client_error")
		return
	}
	c.req = req
	if !rt.fleet.servesModel(req.Model) {
		c.reject(fctx, 404, "The model `"+schemas.BoundField(req.Model)+"` does not exist.", "client_error")
		return
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

	fault := c.run()
	if fault != nil {
		c.fail(fctx, fault)
		return
	}
	// Which engines served the request, for operators and demos.
	fctx.Response.Header.Set("X-Narwhal-Prefill-Engine", c.producer.ID)
	fctx.Response.Header.Set("X-Narwhal-Decode-Engine", c.consumer.ID)
	if req.Stream {
		c.committed = true
		c.status = 200
		fctx.SetStatusCode(200)
		fctx.SetContentType("text/event-stream; charset=utf-8")
		fctx.Response.Header.Set("Cache-Control", "no-cache")
		fctx.Response.Header.Set("X-Accel-Buffering", "no")
		bp := relayBufPool.Get().(*[]byte)
		fctx.SetBodyStream(&relayBody{c: c, bp: bp, buf: (*bp)[:0]}, -1)
		return
	}
	c.aggregate(fctx)
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

// run makes attempts until one has produced its first generated output
// (c.stream open, c.first set), or returns the fault that ends the request
// (R-RETRY-1…3).
func (c *call) run() *engines.Fault {
	rt := c.rt
	var excludeP, excludeC *member
	for {
		c.attempts++
		f := c.attempt(excludeP, excludeC)
		if f == nil {
			return nil
		}
		if f.Kind == engines.KindClientGone {
			rt.metrics.disconnects.Inc()
			return f
		}
		if !f.Transient() || c.attempts > rt.cfg.Recovery.RetryAttempts {
			return f
		}
		if dl, ok := c.ctx.Deadline(); ok && time.Until(dl) < 10*time.Millisecond {
			// Spent or nearly: also when it ran out while the fault came
			// back (the context is then done for the same reason).
			rt.metrics.retryDenied.WithLabelValues("deadline").Inc()
			return f
		}
		if c.ctx.Err() != nil {
			return f // the client left or the router is shutting down
		}
		if !rt.budget.allow() {
			rt.metrics.retryDenied.WithLabelValues("budget").Inc()
			return f
		}
		rt.metrics.retries.Inc()
		// R-RETRY-3: avoid the failed engine for the phase it failed. An
		// expired handoff blames neither engine.
		switch {
		case f.Kind == engines.KindHandoffExpired:
		case f.Phase == schemas.PhasePrefill:
			excludeP = rt.fleet.byID[f.EngineID]
		default:
			excludeC = rt.fleet.byID[f.EngineID]
		}
	}
}

// attempt runs one prefill and the start of one decode (SPEC §0 attempt).
func (c *call) attempt(excludeP, excludeC *member) *engines.Fault {
	rt := c.rt
	prod, err := rt.fleet.place(c.req.Model, prefillPhase, excludeP)
	if err != nil {
		return noEngine(prefillPhase)
	}
	cons, err := rt.fleet.place(c.req.Model, decodePhase, excludeC)
	if err != nil {
		prod.release(prefillPhase)
		return noEngine(decodePhase)
	}
	c.producer, c.consumer = prod, cons
	c.holdPrefill, c.holdDecode = true, true
	c.backendID = c.id + "-" + strconv.Itoa(c.attempts) + "-" + newID()[:8]
	ereq := &engines.Request{Body: c.req, BackendRequestID: c.backendID, Producer: &prod.Engine, Consumer: &cons.Engine}

	// Prefill leg.
	res, perr := rt.client.Prefill(c.ctx, ereq)
	prefillEnd := time.Now()
	rt.metrics.leg.WithLabelValues(schemas.PhasePrefill).Observe(prefillEnd.Sub(c.arrival).Seconds())
	c.releasePrefill()
	if perr != nil {
		c.releaseDecode()
		f := perr.(*engines.Fault)
		if f.Kind == engines.KindDescriptorRejected && !strings.HasSuffix(f.Message, connector.ReasonMissingDescriptor) {
			// The producer may hold blocks for a descriptor nobody can
			// use: make the stranded KV visible (R-OWN-6).
			c.publishAbandoned(prod.ID, "", "descriptor_rejected", 0, false)
		}
		c.engineFault(f)
		return f
	}
	c.result = res
	c.ttft = res.Completed.Sub(c.arrival)

	// Decode leg, up to the first generated output.
	c.decodeStart = time.Now()
	stream, derr := rt.client.Decode(c.ctx, ereq, res)
	if derr != nil {
		f := derr.(*engines.Fault)
		c.abandon(reasonFor(f))
		c.releaseDecode()
		c.engineFault(f)
		return f
	}
	c.stream = stream
	c.pending = c.pending[:0]
	for {
		payload, kind, err := stream.Next()
		if err != nil {
			f := err.(*engines.Fault)
			c.closeStream()
			c.abandon(reasonFor(f))
			c.releaseDecode()
			c.engineFault(f)
			return f
		}
		if kind == schemas.ChunkOutput {
			c.first = append([]byte(nil), payload...)
			c.firstByte = stream.FirstOutput().Sub(c.arrival)
			c.result = nil // consumed
			return nil
		}
		c.pending = append(c.pending, append([]byte(nil), payload...))
	}
}

func noEngine(p phase) *engines.Fault {
	return engines.NewFault(engines.KindNoEngine, p.String(), "", 0, "no eligible engine for "+p.String())
}

func reasonFor(f *engines.Fault) string {
	switch f.Kind {
	case engines.KindClientGone:
		return "client_disconnected"
	case engines.KindDescriptorRejected:
		return "descriptor_rejected"
	case engines.KindHandoffExpired:
		return "handoff_expired"
	case engines.KindShutdown:
		return "router_shutdown"
	case engines.KindRequestTimeout:
		return "request_timeout"
	}
	return "decode_failed"
}

func (c *call) releasePrefill() {
	if c.holdPrefill {
		c.holdPrefill = false
		c.producer.release(prefillPhase)
	}
}

func (c *call) releaseDecode() {
	if c.holdDecode {
		c.holdDecode = false
		c.consumer.release(decodePhase)
	}
}

func (c *call) closeStream() {
	if c.stream != nil {
		c.stream.Close()
		c.stream = nil
	}
}

// abandon releases an unconsumed handoff at the producer where the
// connector can and publishes a handoff event with outcome abandoned
// either way (R-OWN-6). It runs synchronously, bounded to one second, so
// nothing outlives the request.
func (c *call) abandon(reason string) {
	res := c.result
	c.result = nil
	if res == nil || !res.HasDescriptor() {
		return
	}
	rt := c.rt
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	released, err := rt.client.Release(ctx, &c.producer.Engine, res)
	cancel()
	if err != nil {
		rt.log.Warn("handoff release failed", "request_id", c.id, "engine_id", res.ProducerID, "err", err)
	}
	c.publishAbandoned(res.ProducerID, res.Connector, reason, res.Age(time.Now()), released)
}

// publishAbandoned publishes the handoff event of R-OWN-6.
func (c *call) publishAbandoned(producerID, conn, reason string, age time.Duration, released bool) {
	rt := c.rt
	rt.metrics.abandoned.Inc()
	if conn == "" {
		conn = c.producer.Connector.Name()
	}
	rt.publish(&schemas.Handoff{
		Envelope:         schemas.Envelope{Schema: schemas.SchemaHandoff, RouterID: rt.id, EngineID: producerID, RequestID: c.id},
		Outcome:          schemas.HandoffAbandoned,
		Reason:           reason,
		ConsumerID:       c.consumer.ID,
		BackendRequestID: c.backendID,
		Connector:        conn,
		AgeSeconds:       age.Seconds(),
		Released:         released,
	})
}

// engineFault records an engine fault: metrics, the failure event, and the
// local quarantine with its event (R-QUAR-1).
func (c *call) engineFault(f *engines.Fault) {
	rt := c.rt
	if !f.EngineFault() {
		return
	}
	rt.metrics.faults.WithLabelValues(f.EngineID, f.Phase, string(f.Kind)).Inc()
	rt.log.Warn("engine fault", "request_id", c.id, "engine_id", f.EngineID, "phase", f.Phase, "kind", string(f.Kind), "status", f.Status, "msg", f.Message, "attempt", c.attempts)
	ev := &schemas.Failure{
		Envelope:         schemas.Envelope{Schema: schemas.SchemaFailure, RouterID: rt.id, EngineID: f.EngineID, RequestID: c.id},
		Phase:            f.Phase,
		Kind:             string(f.Kind),
		Status:           f.Status,
		UpstreamStatus:   f.UpstreamStatus,
		Message:          f.Message,
		Timeout:          f.Timeout,
		Counts:           f.CountsTowardEjection(),
		BackendRequestID: c.backendID,
		Attempt:          c.attempts,
	}
	if c.producer != nil {
		ev.ProducerID = c.producer.ID
	}
	if c.consumer != nil {
		ev.ConsumerID = c.consumer.ID
	}
	rt.publish(ev)
	if q := rt.cfg.Recovery.FailureQuarantine(); q > 0 && f.CountsTowardEjection() {
		until := time.Now().Add(q)
		if rt.Quarantine(f.EngineID, until) {
			rt.metrics.quarantines.Inc()
			rt.publish(&schemas.Quarantine{
				Envelope:        schemas.Envelope{Schema: schemas.SchemaQuarantine, RouterID: rt.id, EngineID: f.EngineID, RequestID: c.id},
				DurationSeconds: q.Seconds(),
				Until:           until.UTC(),
				Reason:          string(f.Kind),
			})
		}
	}
}

func (rt *Router) publish(ev schemas.Event) {
	if rt.pub != nil {
		rt.pub.Publish(ev)
	}
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
	fctx.SetStatusCode(status)
	fctx.SetContentType("application/json")
	fctx.SetBody(f.AppendJSON(nil))
	c.status, c.outcome = status, string(f.Kind)
	c.finish()
}

// relayBody is the body of a committed stream (SPEC R-FAIL-5, R-RETRY-4).
// fasthttp calls WriteTo in the connection's own goroutine and sends each
// Write as one chunk, flushed: the relay writes the metadata held before
// the first output, the first output, then every event as the engine sent
// it, one Write per batch of events the engine had ready. It ends with
// data: [DONE], or after a failure with one terminal error event and no
// [DONE]. Close, which fasthttp always calls, finishes the request.
type relayBody struct {
	c       *call
	bp      *[]byte // buf's pool entry
	buf     []byte
	off     int // what Read has handed out of buf
	started bool
	done    bool
}

var relayBufPool = sync.Pool{New: func() any { b := make([]byte, 0, 2<<10); return &b }}

// SupportsBodyWriteTo tells fasthttp to use WriteTo (fasthttp.BodyWriterTo).
func (r *relayBody) SupportsBodyWriteTo() bool { return true }

// WriteTo relays the stream to w until it ends.
func (r *relayBody) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for {
		more := r.fill()
		if len(r.buf) > 0 {
			n, err := w.Write(r.buf)
			total += int64(n)
			r.buf = r.buf[:0]
			if err != nil {
				r.c.clientGone()
				return total, err
			}
		}
		if !more {
			return total, nil
		}
	}
}

// Read is the io.Reader fallback of WriteTo.
func (r *relayBody) Read(p []byte) (int, error) {
	for r.off >= len(r.buf) {
		if r.done {
			return 0, io.EOF
		}
		r.buf, r.off = r.buf[:0], 0
		r.fill()
	}
	n := copy(p, r.buf[r.off:])
	r.off += n
	return n, nil
}

// fill appends the next batch to r.buf: first the held metadata and the
// first output, then events until the engine has nothing more buffered. It
// returns false once the stream has ended (its last bytes, [DONE] or the
// terminal error event, are then in r.buf).
func (r *relayBody) fill() bool {
	c := r.c
	if r.done {
		return false
	}
	if !r.started {
		r.started = true
		for _, p := range c.pending {
			r.buf = c.appendEvent(r.buf, p, schemas.ChunkMetadata)
		}
		r.buf = c.appendEvent(r.buf, c.first, schemas.ChunkOutput)
		return true
	}
	for {
		payload, kind, err := c.stream.Next()
		if err == io.EOF {
			r.buf = append(r.buf, "data: [DONE]\n\n"...)
			c.outcome = "ok"
			r.done = true
			return false
		}
		if err != nil {
			r.done = true
			f := err.(*engines.Fault)
			if f.Kind == engines.KindClientGone {
				c.clientGone()
				return false
			}
			c.engineFault(f)
			c.outcome = string(f.Kind)
			r.buf = append(r.buf, "data: "...)
			r.buf = f.AppendJSON(r.buf)
			r.buf = append(r.buf, "\n\n"...)
			return false
		}
		c.chunks++
		r.buf = c.appendEvent(r.buf, payload, kind)
		if c.stream.Buffered() == 0 {
			return true
		}
	}
}

// Close finishes the request; fasthttp calls it once the body is written
// or the connection failed.
func (r *relayBody) Close() error {
	r.c.finish()
	if r.bp != nil && cap(r.buf) <= 1<<20 {
		*r.bp = r.buf[:0]
		relayBufPool.Put(r.bp)
	}
	r.bp, r.buf = nil, nil
	return nil
}

// appendEvent appends one data event to dst, keeping the usage chunk only
// for clients that asked for it (R-LEG-5, R-LEG-6) while reading usage from
// it either way. Output chunks are passed through without a second look.
func (c *call) appendEvent(dst, payload []byte, kind schemas.ChunkKind) []byte {
	if kind == schemas.ChunkMetadata && schemas.ChunkHasUsage(payload) {
		c.readUsage(payload)
		if !c.req.IncludeUsage && schemas.IsUsageOnly(payload) {
			return dst
		}
	}
	dst = append(dst, "data: "...)
	dst = append(dst, payload...)
	return append(dst, "\n\n"...)
}

func (c *call) readUsage(payload []byte) {
	if p, cmp, ok := schemas.UsageTokens(payload); ok {
		c.promptTokens, c.completionTokens = p, cmp
	}
}

func (c *call) clientGone() {
	c.cancel(engines.ErrClientGone)
	c.outcome = string(engines.KindClientGone)
	c.rt.metrics.disconnects.Inc()
}

// aggregate answers a non-streaming client with one completion built from
// the decode stream (R-LEG-5).
func (c *call) aggregate(fctx *fasthttp.RequestCtx) {
	agg := schemas.NewAggregator(c.req.Chat())
	for _, p := range c.pending {
		_ = agg.Add(p)
	}
	_ = agg.Add(c.first)
	for {
		payload, _, err := c.stream.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			f := err.(*engines.Fault)
			if f.Kind == engines.KindClientGone {
				c.rt.metrics.disconnects.Inc()
			} else {
				c.engineFault(f)
			}
			c.fail(fctx, f)
			return
		}
		if err := agg.Add(payload); err != nil {
			f := engines.NewFault(engines.KindInvalidStream, schemas.PhaseDecode, c.consumer.ID, 0, "decode engine "+c.consumer.ID+" sent a chunk that could not be aggregated")
			c.engineFault(f)
			c.fail(fctx, f)
			return
		}
	}
	if p, cmp, ok := agg.Usage(); ok {
		c.promptTokens, c.completionTokens = p, cmp
	}
	c.watch.stop()
	c.watch = nil
	fctx.SetStatusCode(200)
	fctx.SetContentType("application/json")
	fctx.SetBody(agg.AppendJSON(nil))
	c.status, c.outcome = 200, "ok"
	c.finish()
}

// finish releases everything the request still holds and records it:
// metrics, the request-completed event (R-BUS-1, R-TIME-1) and a log line.
func (c *call) finish() {
	if c.finished {
		return
	}
	c.finished = true
	rt := c.rt
	c.watch.stop()
	c.watch = nil
	c.closeStream()
	if c.result != nil {
		c.abandon("client_disconnected")
	}
	c.releasePrefill()
	c.releaseDecode()
	rt.front.releaseBody(c.bodyBytes)
	c.bodyBytes = 0
	if c.cancel != nil {
		c.cancel(context.Canceled)
		c.cancelDeadline()
	}
	if c.chunks > 0 {
		rt.metrics.relayedChunks.Add(float64(c.chunks))
	}
	now := time.Now()
	dur := now.Sub(c.arrival)
	rt.inflight.Add(-1)
	rt.metrics.inflight.Dec()
	rt.metrics.requests.WithLabelValues(c.req.Endpoint, strconv.Itoa(c.status), c.outcome).Inc()
	rt.metrics.duration.WithLabelValues(c.req.Endpoint).Observe(dur.Seconds())
	ev := &schemas.RequestCompleted{
		Envelope:         schemas.Envelope{Schema: schemas.SchemaRequest, RouterID: rt.id, RequestID: c.id},
		Endpoint:         c.req.Endpoint,
		Model:            schemas.BoundField(c.req.Model), // a bounded client string
		Stream:           c.req.Stream,
		Status:           c.status,
		Attempts:         c.attempts,
		DurationSeconds:  dur.Seconds(),
		PromptTokens:     c.promptTokens,
		CompletionTokens: c.completionTokens,
	}
	if c.outcome != "ok" {
		ev.ErrorKind = c.outcome
	}
	if c.producer != nil {
		ev.ProducerID = c.producer.ID
		ev.EngineID = c.consumer.ID
		ev.ConsumerID = c.consumer.ID
	}
	if c.ttft > 0 {
		s := c.ttft.Seconds()
		ev.TTFTSeconds = &s
		rt.metrics.ttft.Observe(s)
	}
	if c.firstByte > 0 {
		s := c.firstByte.Seconds()
		ev.FirstByteSeconds = &s
		rt.metrics.firstByte.Observe(s)
	}
	if c.decodeStart != (time.Time{}) {
		rt.metrics.leg.WithLabelValues(schemas.PhaseDecode).Observe(now.Sub(c.decodeStart).Seconds())
	}
	rt.publish(ev)
	if c.outcome != "ok" {
		rt.log.Info("request ended", "request_id", c.id, "status", c.status, "outcome", c.outcome, "attempts", c.attempts, "duration_s", dur.Seconds())
	} else {
		rt.log.Debug("request done", "request_id", c.id, "status", c.status, "attempts", c.attempts, "duration_s", dur.Seconds())
	}
}
