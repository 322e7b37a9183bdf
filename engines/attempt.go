package engines

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// This file is one attempt as its connector runs it (behaviour.md §0
// "attempt"): the engine client gives the producer's connector the legs it
// may run (connector.Legs), the connector decides which, in what order or
// at once, with which bodies, and what it verifies; the client turns every
// failure into a typed *Fault and tells the caller's Observer each step.

// Observer is what the caller of StartAttempt learns of an attempt's
// steps: the router traces them, releases the producer's prefill slot and
// records a late prefill failure with it. A nil Observer observes nothing.
type Observer interface {
	// Begin is called when step begins; the legs sent until the step
	// ends carry the returned W3C trace context (empty: none).
	Begin(step connector.Step, detail connector.StepDetail) (traceparent, tracestate string)
	// End is called when step ends, with its fault (nil when it
	// succeeded). StepDecode and StepLegs are never ended here: they
	// stay open until the attempt fails or the request ends, and their
	// owner ends them.
	End(step connector.Step, f *Fault)
	// PrefillEnded is called once, from any goroutine, when the prefill
	// leg is over; late is its failure when that came after the attempt
	// committed (the client's stream goes on), else nil.
	PrefillEnded(late *Fault)
	// PrefillAnswered is called once a prefill leg answered (Legs.Prefill,
	// Legs.PrefillToEnd), with its usage (Present false when the answer
	// carried none), from the goroutine that ran the leg, before the
	// connector goes on: the router compares the producer's cached tokens
	// with its prefix index's prediction and learns how long a prefill
	// takes there (behaviour.md R-PLACE-3).
	PrefillAnswered(u connector.PrefillUsage)
}

// Attempt is one attempt of a request, started by StartAttempt: its
// connector's run and the decode stream it opened. Its methods are for the
// goroutine that started it.
type Attempt struct {
	client       *Client
	req          *Request
	parent       context.Context
	obs          Observer
	run          connector.Run
	stream       *Stream
	prefillEnded atomic.Bool
}

// StartAttempt runs one attempt of req through its producer's connector
// until the decode stream is open (behaviour.md §0, §2, §3): which legs,
// in what order or at once, with which bodies, and what is verified, is
// the connector's. It always returns the Attempt; on failure also the
// attempt's *Fault (its EngineID and Phase name whom it blames). After a
// failure call Abandon, then Finish; after success read Stream, call
// Commit at its first generated output (Blame for an error before it),
// and Finish when the request ends. obs may be nil.
func (c *Client) StartAttempt(ctx context.Context, req *Request, obs Observer) (*Attempt, *Fault) {
	a := c.newAttempt(ctx, req, obs)
	run, err := req.Producer.Connector.Start(ctx, a.legs())
	a.run = run
	if err != nil {
		if a.stream != nil {
			a.stream.Close()
			a.stream = nil
		}
		return a, a.fault(err, schemas.PhasePrefill)
	}
	return a, nil
}

func (c *Client) newAttempt(ctx context.Context, req *Request, obs Observer) *Attempt {
	return &Attempt{client: c, req: req, parent: ctx, obs: obs}
}

// Stream returns the attempt's decode stream (nil when it failed to open).
// The caller reads it and closes it.
func (a *Attempt) Stream() *Stream { return a.stream }

// Blame returns the fault that ends the attempt when its decode stream
// failed with err before the first generated output: the decode's own
// (an error object naming a handoff field is handoff_refused, R-FAIL-10),
// or the other leg's that caused it (an SGLang prefill that failed
// first).
func (a *Attempt) Blame(err error) *Fault {
	if a.run != nil {
		err = a.run.Blame(err)
	}
	// An error object naming a handoff field before the first output
	// refuses the handoff (behaviour.md R-FAIL-10).
	return HandoffRefusal(a.req, a.fault(err, schemas.PhaseDecode))
}

// Commit tells the connector that the decode produced its first generated
// output. A non-nil fault means the attempt cannot be committed (the
// prefill had failed first) and is its fault.
func (a *Attempt) Commit() *Fault {
	if a.run == nil {
		return nil
	}
	return a.fault(a.run.Commit(), schemas.PhasePrefill)
}

// Abandon ends an attempt that failed before its first output (reason:
// AbandonReason of its fault), releasing a handoff the producer holds
// where the connector can (behaviour.md R-OWN-6). It returns the handoff
// left unconsumed, to be reported, or false.
func (a *Attempt) Abandon(reason string) (connector.Abandoned, bool) {
	if a.run == nil {
		return connector.Abandoned{}, false
	}
	return a.run.Abandon(reason)
}

// Finish ends the attempt's legs when the request ends, waiting at most
// wait for a prefill leg still running (wait < 0: until it ends by
// itself). It returns when the prefill completed (zero if it did not) and
// the prefill's fault when it failed.
func (a *Attempt) Finish(wait time.Duration) (time.Time, *Fault) {
	if a.run == nil {
		return time.Time{}, nil
	}
	t, err := a.run.Finish(wait)
	return t, a.fault(err, schemas.PhasePrefill)
}

// AbandonReason is the reason of the handoff event for a handoff that f
// left unconsumed (behaviour.md R-OWN-6).
func AbandonReason(f *Fault) string {
	switch f.Kind {
	case KindClientGone:
		return "client_disconnected"
	case KindDescriptorRejected:
		return "descriptor_rejected"
	case KindHandoffExpired:
		return "handoff_expired"
	case KindShutdown:
		return "router_shutdown"
	case KindRequestTimeout:
		return "request_timeout"
	}
	return "decode_failed"
}

// Transfer runs one whole attempt of req (StartAttempt): its decode stream
// read to its end, each chunk passed to each (when not nil), committed at
// its first generated output, abandoned on a failure (a handoff released
// at the producer, R-OWN-6), and its prefill leg waited for. It returns
// nil when the decode ended with [DONE] and every leg succeeded, else the
// *Fault of the leg that failed. The breaker's probe, preflight and the
// benchmark's floor run their attempts with it.
func (c *Client) Transfer(ctx context.Context, req *Request, each func(payload []byte, kind schemas.ChunkKind)) error {
	a, f := c.StartAttempt(ctx, req, nil)
	if f != nil {
		a.Abandon(AbandonReason(f))
		a.Finish(0)
		return f
	}
	s := a.stream
	defer s.Close()
	committed := false
	for {
		payload, kind, err := s.Next()
		if err == io.EOF {
			if _, f := a.Finish(-1); f != nil {
				return f
			}
			return nil
		}
		if err == nil && kind == schemas.ChunkOutput && !committed {
			if f = a.Commit(); f == nil {
				committed = true
			}
		} else if err != nil {
			f = a.Blame(err)
		}
		if f != nil {
			s.Close()
			if !committed {
				a.Abandon(AbandonReason(f))
			}
			a.Finish(0)
			return f
		}
		if each != nil {
			each(payload, kind)
		}
	}
}

// fault turns an error of a connector or a leg into the attempt's *Fault:
// a *Fault as it is, a *connector.RejectError as the producer's
// descriptor_rejected (R-DESC-6), anything else as a fault of the engine
// of phase.
func (a *Attempt) fault(err error, phase string) *Fault {
	if err == nil {
		return nil
	}
	var f *Fault
	if errors.As(err, &f) {
		return f
	}
	var rej *connector.RejectError
	if errors.As(err, &rej) {
		return rejectFault(a.req.Producer.ID, rej)
	}
	id := a.req.Consumer.ID
	if phase == schemas.PhasePrefill {
		id = a.req.Producer.ID
	}
	return AsFault(err, phase, id)
}

// legs returns the connector's side of the attempt.
func (a *Attempt) legs() attemptLegs { return attemptLegs{a} }

// attemptLegs implements connector.Legs over an Attempt.
type attemptLegs struct{ a *Attempt }

func (l attemptLegs) Request() *schemas.Request { return l.a.req.Body }
func (l attemptLegs) BackendRequestID() string  { return l.a.req.BackendRequestID }
func (l attemptLegs) Producer() connector.Engine {
	return l.a.req.Producer.connectorView()
}
func (l attemptLegs) Consumer() connector.Engine {
	return l.a.req.Consumer.connectorView()
}
func (l attemptLegs) HTTPClient() *http.Client {
	return l.a.client.HTTPClientFor(l.a.req.Producer)
}
func (l attemptLegs) HandoffMaxAge() time.Duration { return l.a.client.handoffMaxAge }

func (l attemptLegs) Begin(step connector.Step, detail connector.StepDetail) {
	if l.a.obs != nil {
		l.a.req.Traceparent, l.a.req.Tracestate = l.a.obs.Begin(step, detail)
	}
}

func (l attemptLegs) End(step connector.Step, err error) {
	if l.a.obs == nil || step == connector.StepDecode || step == connector.StepLegs {
		return
	}
	// Both steps fail as the producer's: its leg, its descriptor, or its
	// handoff's age (a *Fault already).
	l.a.obs.End(step, l.a.fault(err, schemas.PhasePrefill))
}

func (l attemptLegs) PrefillEnded(late error) {
	a := l.a
	if !a.prefillEnded.CompareAndSwap(false, true) || a.obs == nil {
		return
	}
	a.obs.PrefillEnded(a.fault(late, schemas.PhasePrefill))
}

func (l attemptLegs) Expired(age time.Duration) error {
	c := l.a.client
	return NewFault(KindHandoffExpired, schemas.PhaseDecode, l.a.req.Producer.ID, 0,
		MsgHandoffExpired+": age "+formatSeconds(age, 3)+"s exceeds handoff.max_age_s "+formatSeconds(c.handoffMaxAge, -1))
}

func (l attemptLegs) Failure(message string) error {
	return NewFault(KindPrefillResponse, schemas.PhasePrefill, l.a.req.Producer.ID, 0, message)
}

func (l attemptLegs) Prefill(ctx context.Context, body []byte) (connector.PrefillAnswer, error) {
	ans, err := l.a.client.prefillLeg(ctx, l.a.req, body)
	if err == nil && l.a.obs != nil {
		l.a.obs.PrefillAnswered(ans.Usage)
	}
	return ans, err
}

func (l attemptLegs) PrefillToEnd(ctx context.Context, body []byte) (connector.PrefillAnswer, error) {
	started := time.Now()
	var u connector.PrefillUsage
	if f := l.a.client.watchPrefill(l.a.parent, ctx, l.a.req, body, &u); f != nil {
		return connector.PrefillAnswer{}, f
	}
	if l.a.obs != nil {
		l.a.obs.PrefillAnswered(u)
	}
	return connector.PrefillAnswer{Usage: u, Started: started, Completed: time.Now()}, nil
}

// noteUsage keeps in u the usage of a prefill answer's chunk ch, when it
// has one (the last one counts).
func noteUsage(u *connector.PrefillUsage, ch schemas.Chunk) {
	if u != nil && ch.Usage {
		*u = connector.PrefillUsage{Present: true, PromptTokens: ch.PromptTokens, Cached: ch.Cached, CachedTokens: ch.CachedTokens}
	}
}

func (l attemptLegs) Decode(ctx context.Context, body []byte) error {
	s, err := l.a.client.openStream(ctx, l.a.req, body)
	if err != nil {
		return err
	}
	l.a.stream = s
	return nil
}

// formatSeconds writes d in seconds with prec decimals (-1: as few as
// needed).
func formatSeconds(d time.Duration, prec int) string {
	return strconv.FormatFloat(d.Seconds(), 'f', prec, 64)
}

// connectorView is what e's connector knows of it.
func (e *Engine) connectorView() connector.Engine {
	name := ""
	if e.Connector != nil {
		name = e.Connector.Name()
	}
	return connector.Engine{ID: e.ID, URL: e.URL, Role: e.Role, Connector: name, BootstrapPort: e.BootstrapPort}
}

// prefillLeg sends body to req's producer as a one-token, non-streaming
// prefill leg bounded by the prefill timeout and ctx, and reads its JSON
// answer: a completion with choices, whose kv_transfer_params member it
// returns raw (trimmed).
func (c *Client) prefillLeg(ctx context.Context, req *Request, body []byte) (connector.PrefillAnswer, error) {
	p := req.Producer
	legCtx, cancel := withTimeoutCause(ctx, c.prefillTimeout, errPrefillTimeout)
	defer cancel()
	started := time.Now()
	l, err := send(legCtx, c.prefillPools, &prefillReaders, p, req, body)
	if err != nil {
		return connector.PrefillAnswer{}, classifyTransport(ctx, legCtx, err, schemas.PhasePrefill, p.ID, true)
	}
	status := l.status()
	if status/100 != 2 {
		resp := l.httpResponse()
		f := c.statusFault(resp, schemas.PhasePrefill, p.ID)
		l.finish(false)
		return connector.PrefillAnswer{}, f
	}
	// One read takes the whole response when it fits the leg's buffer.
	raw, err := l.readBody(int(min(c.maxResponse, 1<<31-1)))
	if err != nil {
		l.finish(false)
		return connector.PrefillAnswer{}, classifyTransport(ctx, legCtx, err, schemas.PhasePrefill, p.ID, false)
	}
	defer l.finish(true)
	completed := time.Now()
	// One allocation-free pass over the completion for the two members
	// that matter; the generated token is discarded (R-LEG-1).
	var desc []byte
	var hasChoices bool
	valid := schemas.Members(raw, func(name, v []byte) bool {
		switch string(name) {
		case "kv_transfer_params":
			desc = v
		case "choices":
			hasChoices = len(v) > 0 && v[0] == '['
		}
		return true
	})
	if !valid || !hasChoices {
		return connector.PrefillAnswer{}, NewFault(KindPrefillResponse, schemas.PhasePrefill, p.ID, status, "prefill engine returned an invalid completion")
	}
	if desc != nil {
		// raw is the leg's buffer, reused once the leg finishes.
		desc = append([]byte(nil), bytes.TrimSpace(desc)...)
	}
	ans := connector.PrefillAnswer{KVTransferParams: desc, Started: started, Completed: completed}
	if ch := schemas.ScanChunk(raw); ch.Usage {
		ans.Usage = connector.PrefillUsage{Present: true, PromptTokens: ch.PromptTokens, Cached: ch.Cached, CachedTokens: ch.CachedTokens}
	}
	return ans, nil
}

// watchPrefill sends body to req's producer and reads its answer to the
// end (a JSON completion, or an event stream to [DONE]), bounded by the
// prefill timeout and pctx; parent is the request's context, which tells
// a cancellation of the request from one of the leg.
func (c *Client) watchPrefill(parent, pctx context.Context, req *Request, body []byte, usage *connector.PrefillUsage) *Fault {
	p := req.Producer
	legCtx, cancel := withTimeoutCause(pctx, c.prefillTimeout, errPrefillTimeout)
	defer cancel()
	l, err := send(legCtx, c.prefillPools, &prefillReaders, p, req, body)
	if err != nil {
		return classifyTransport(parent, legCtx, err, schemas.PhasePrefill, p.ID, true)
	}
	status := l.status()
	if status/100 != 2 {
		f := c.statusFault(l.httpResponse(), schemas.PhasePrefill, p.ID)
		l.finish(false)
		return f
	}
	// The connection is reused only after a JSON answer read to its end;
	// a stream is left at its [DONE].
	clean := false
	defer func() { l.finish(clean) }()
	stream, err := l.bodyStream()
	if err != nil {
		return classifyTransport(parent, legCtx, err, schemas.PhasePrefill, p.ID, false)
	}
	r := io.LimitReader(stream, c.maxResponse)
	if !bytes.HasPrefix(l.resp.Header.ContentType(), []byte("text/event-stream")) {
		raw, err := io.ReadAll(r)
		if err != nil {
			return classifyTransport(parent, legCtx, err, schemas.PhasePrefill, p.ID, false)
		}
		clean = int64(len(raw)) < c.maxResponse
		if obj, ok := schemas.ParseError(raw); ok {
			return prefillErrorObject(obj, p.ID)
		}
		var hasChoices bool
		valid := schemas.Members(raw, func(name, v []byte) bool {
			if string(name) == "choices" {
				hasChoices = len(v) > 0 && v[0] == '['
			}
			return true
		})
		if !valid || !hasChoices {
			return NewFault(KindPrefillResponse, schemas.PhasePrefill, p.ID, status, "prefill engine "+p.ID+" returned an invalid completion")
		}
		noteUsage(usage, schemas.ScanChunk(raw))
		return nil
	}
	br := bufio.NewReaderSize(r, 2<<10)
	var long []byte
	for {
		line, err := schemas.ReadSSELine(br, &long)
		if err != nil {
			if err == io.EOF && legCtx.Err() == nil {
				return NewFault(KindPrefillResponse, schemas.PhasePrefill, p.ID, status, "prefill engine "+p.ID+" ended its stream before [DONE]")
			}
			return classifyTransport(parent, legCtx, err, schemas.PhasePrefill, p.ID, false)
		}
		payload, ok := schemas.SSEData(line)
		if !ok || len(payload) == 0 {
			continue
		}
		switch ch := schemas.ScanChunk(payload); ch.Kind {
		case schemas.ChunkDone:
			return nil
		case schemas.ChunkError:
			obj, _ := schemas.ParseError(payload)
			return prefillErrorObject(obj, p.ID)
		case schemas.ChunkOutput, schemas.ChunkMetadata:
			noteUsage(usage, ch)
		default:
			return NewFault(KindPrefillResponse, schemas.PhasePrefill, p.ID, status, "prefill engine "+p.ID+" sent data that is not JSON")
		}
	}
}

// prefillErrorObject is the fault of an error object in a prefill answer:
// a prefill fault by R-FAIL-1 — 504 for a timeout-shaped code (504, 408),
// else 502 — except that a client-fault or overload code (4xx) keeps its
// status, as R-FAIL-4 and R-FAIL-6 keep it on the decode leg.
func prefillErrorObject(obj schemas.ErrorObject, engineID string) *Fault {
	msg := obj.Message
	if msg == "" {
		msg = "prefill engine " + engineID + " sent an error object"
	}
	f := NewFault(KindErrorObject, schemas.PhasePrefill, engineID, obj.Code, "prefill engine "+engineID+" failed: "+msg)
	switch {
	case f.Status == 504 || f.Status == 408:
		f.Status, f.Timeout = 504, true
	case f.Status >= 400 && f.Status < 500:
		if obj.Type != "" {
			f.Type = obj.Type
		}
		return f
	default:
		f.Status = 502
	}
	f.Type = schemas.ErrorType(f.Status)
	return f
}
