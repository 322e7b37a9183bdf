package engines

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// This file is the attempt of a connector whose two legs run at once
// (connector.Concurrent: SGLang's bootstrap protocol, behaviour.md R-DESC-7): one
// body with the attempt's bootstrap fields, sent to the producer and the
// consumer together; the consumer's stream is the client's; the
// producer's answer is watched so that its failure ends the attempt at
// once instead of leaving the consumer to wait for KV that never comes.

// Bootstrap is the bootstrap fields of one SGLang attempt (R-DESC-7): the
// producer's host and bootstrap port, and one fresh room per sequence.
type Bootstrap struct {
	// Host is the producer's host as its URL names it (an IPv6 address in
	// brackets, as SGLang's routers write it).
	Host string
	// Port is the producer's bootstrap port (fleet entry bootstrap_port).
	Port int
	// Rooms are the attempt's rooms: random integers in [0, 2^63), one per
	// sequence. With one room the fields are scalars; with more, each
	// field is an array of len(Rooms) (SGLang's batch form).
	Rooms []uint64
}

// NewBootstrap returns fresh bootstrap fields for one attempt of req
// (R-DESC-7, R-OWN-4: a retry gets new rooms): the producer's host and
// bootstrap port, and one random 63-bit room per sequence — per prompt of
// a batched completions prompt, else n rooms when the request asks for n
// > 1 choices, else one. It returns an error when the producer has no
// bootstrap port or its URL names no host.
func NewBootstrap(req *Request) (Bootstrap, error) {
	p := req.Producer
	if p.BootstrapPort < 1 || p.BootstrapPort > 65535 {
		return Bootstrap{}, errors.New("prefill engine " + p.ID + " has no bootstrap port (fleet entry bootstrap_port)")
	}
	u, err := url.Parse(p.URL)
	if err != nil || u.Hostname() == "" {
		return Bootstrap{}, errors.New("prefill engine " + p.ID + " has no host in its URL")
	}
	host := u.Hostname()
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	n := req.Body.Prompts()
	if n == 1 && req.Body.N > 1 {
		n = req.Body.N
	}
	rooms := make([]uint64, n)
	for i := range rooms {
		rooms[i] = rand.Uint64() >> 1
	}
	return Bootstrap{Host: host, Port: p.BootstrapPort, Rooms: rooms}, nil
}

// AppendMembers appends the fields as JSON object members without braces:
// "bootstrap_host":…,"bootstrap_port":…,"bootstrap_room":… — scalars for
// one room, arrays of len(Rooms) otherwise.
func (b Bootstrap) AppendMembers(dst []byte) []byte {
	batch := len(b.Rooms) > 1
	each := func(dst []byte, key string, item func([]byte, int) []byte) []byte {
		dst = append(dst, '"')
		dst = append(dst, key...)
		dst = append(dst, '"', ':')
		if !batch {
			return item(dst, 0)
		}
		dst = append(dst, '[')
		for i := range b.Rooms {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = item(dst, i)
		}
		return append(dst, ']')
	}
	dst = each(dst, "bootstrap_host", func(d []byte, _ int) []byte { return strconv.AppendQuote(d, b.Host) })
	dst = append(dst, ',')
	dst = each(dst, "bootstrap_port", func(d []byte, _ int) []byte { return strconv.AppendInt(d, int64(b.Port), 10) })
	dst = append(dst, ',')
	return each(dst, "bootstrap_room", func(d []byte, i int) []byte { return strconv.AppendUint(d, b.Rooms[i], 10) })
}

// Addr returns "host:port" of the producer's bootstrap server.
func (b Bootstrap) Addr() string {
	return net.JoinHostPort(strings.Trim(b.Host, "[]"), strconv.Itoa(b.Port))
}

var (
	errPrefillFailed = errors.New("prefill leg failed")
	errLegsClosed    = errors.New("attempt closed by its owner")
)

// States of SGLangLegs.state.
const (
	legsWatching      int32 = iota // neither the first decode output nor a prefill failure yet
	legsCommitted                  // the decode's first output came first
	legsPrefillFailed              // the prefill failed first
)

// SGLangLegs is one running attempt of a concurrent connector (R-DESC-7):
// the prefill leg in its own goroutine, watched, beside the decode leg
// whose Stream StartSGLang returned. A prefill failure before Commit
// cancels the decode leg at once; after Commit it is only reported
// (OnPrefillEnd). Its owner calls Commit at the decode's first generated
// output, Blame for the fault of a decode leg that ended before it, and
// Close when the attempt is over, whatever its outcome (nothing outlives
// Close, R-OWN-1).
type SGLangLegs struct {
	done     chan struct{}
	cancelP  context.CancelCauseFunc
	cancelD  context.CancelCauseFunc
	state    atomic.Int32
	closed   bool
	producer string

	// Written by the prefill goroutine before done is closed (fault also
	// before state becomes legsPrefillFailed).
	fault     *Fault
	completed time.Time
}

// StartSGLang starts both legs of req's attempt at once (R-DESC-7): the
// body is the decode body (R-LEG-5: streamed, with usage) carrying b's
// bootstrap fields, sent unchanged to the producer and to the consumer.
// The prefill leg runs in its own goroutine, bounded by the prefill
// timeout (engine.prefill_timeout_s) and ctx, and is read to its end: a
// non-2xx answer, an error object (in a JSON answer or a stream), a
// stream that ends before [DONE], a connect error or the timeout is its
// failure. The decode leg is opened here under the first-token budget
// (R-TMO-1), exactly as Decode opens it.
//
// onPrefillEnd, when not nil, is called once from the prefill's goroutine
// when that leg ends: with its fault when it failed after Commit (the
// stream goes on; the caller logs and publishes it), else nil.
//
// Before any leg starts it refuses a producer and consumer of different
// connectors (R-DESC-3: 502 "handoff descriptor rejected: connector
// mismatch") and returns a nil *SGLangLegs; onPrefillEnd is then never
// called. Otherwise the legs are returned, always, and must be Closed;
// the error is the attempt's fault when the decode failed to open
// (Blame's choice between the two legs).
func (c *Client) StartSGLang(ctx context.Context, req *Request, b Bootstrap, onPrefillEnd func(late *Fault)) (*SGLangLegs, *Stream, error) {
	p, d := req.Producer, req.Consumer
	if p.Connector.Name() != d.Connector.Name() || !connector.Concurrent(p.Connector) {
		return nil, nil, rejectFault(p.ID, &connector.RejectError{Reason: connector.ReasonConnectorMismatch,
			Detail: "producer " + p.Connector.Name() + ", consumer " + d.Connector.Name()})
	}
	if req.SameWorker() {
		return nil, nil, rejectFault(p.ID, &connector.RejectError{Reason: connector.ReasonConnectorMismatch,
			Detail: "an " + p.Connector.Name() + " engine cannot prefill for itself"})
	}
	body := req.Body.AppendBootstrapBody(make([]byte, 0, req.Body.Size()+160+24*len(b.Rooms)), b.AppendMembers(nil))
	l := &SGLangLegs{done: make(chan struct{}), producer: p.ID}
	pctx, cancelP := context.WithCancelCause(ctx)
	dctx, cancelD := context.WithCancelCause(ctx)
	l.cancelP, l.cancelD = cancelP, cancelD
	go l.runPrefill(c, ctx, pctx, req, body, onPrefillEnd)
	stream, err := c.openStream(dctx, req, body)
	if err != nil {
		return l, nil, l.Blame(err, d.ID)
	}
	return l, stream, nil
}

// runPrefill is the watched prefill leg.
func (l *SGLangLegs) runPrefill(c *Client, parent, pctx context.Context, req *Request, body []byte, onEnd func(*Fault)) {
	defer close(l.done)
	f := c.watchPrefill(parent, pctx, req, body)
	var late *Fault
	switch {
	case f == nil:
		l.completed = time.Now()
	case context.Cause(pctx) == errLegsClosed, parent.Err() != nil:
		// Ended by the owner, or by the request itself (client gone,
		// deadline, shutdown): the decode leg sees the same; nothing to
		// blame the producer for.
	default:
		l.fault = f
		if l.state.CompareAndSwap(legsWatching, legsPrefillFailed) {
			l.cancelD(errPrefillFailed) // the KV will never come: stop waiting for it
		} else {
			late = f
		}
	}
	if onEnd != nil {
		onEnd(late)
	}
}

// watchPrefill sends the prefill leg and reads its answer to the end.
func (c *Client) watchPrefill(parent, pctx context.Context, req *Request, body []byte) *Fault {
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
		switch schemas.ScanChunk(payload).Kind {
		case schemas.ChunkDone:
			return nil
		case schemas.ChunkError:
			obj, _ := schemas.ParseError(payload)
			return prefillErrorObject(obj, p.ID)
		case schemas.ChunkOutput, schemas.ChunkMetadata:
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

// Commit tells the legs that the decode produced its first generated
// output: from now on a prefill failure no longer ends the attempt (the
// KV has arrived). It returns false when the prefill had failed first;
// the attempt is then the prefill's fault (Blame). It allocates nothing.
func (l *SGLangLegs) Commit() bool {
	return l.state.CompareAndSwap(legsWatching, legsCommitted) || l.state.Load() == legsCommitted
}

// Blame returns the fault that ends an attempt whose decode leg ended
// with err before its first output (or whose Commit returned false): the
// prefill's fault when the prefill failed first — the decode only stopped
// because of it —, else err as a decode fault of consumerID.
func (l *SGLangLegs) Blame(err error, consumerID string) *Fault {
	if l.state.Load() == legsPrefillFailed {
		return l.fault
	}
	return AsFault(err, schemas.PhaseDecode, consumerID)
}

// Failed returns the prefill's fault when the prefill failed before the
// decode's first output, else nil.
func (l *SGLangLegs) Failed() *Fault {
	if l.state.Load() == legsPrefillFailed {
		return l.fault
	}
	return nil
}

// Wait waits until the prefill leg ends by itself (it is bounded by the
// prefill timeout and the request) and returns its fault: nil when it
// succeeded or was ended by the request or by Close.
func (l *SGLangLegs) Wait() *Fault {
	<-l.done
	return l.fault
}

// WaitFor waits at most d for the prefill leg to end by itself and
// reports whether it did.
func (l *SGLangLegs) WaitFor(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-l.done:
		return true
	case <-t.C:
		return false
	}
}

// Close ends the attempt's legs: the prefill leg is cancelled if still
// running (its answer no longer matters) and waited for, and the decode
// leg's context is released (close its Stream too). It returns when the
// prefill's goroutine has ended. Idempotent; the owner's goroutine only.
func (l *SGLangLegs) Close() {
	if l.closed {
		return
	}
	l.closed = true
	l.cancelP(errLegsClosed)
	<-l.done
	l.cancelD(errStreamClosed)
}

// Completed returns when the prefill leg completed successfully (its
// answer read to the end): ttft_s ends there (R-TIME-1). Zero when it
// failed or did not complete; valid after Wait or Close.
func (l *SGLangLegs) Completed() time.Time {
	select {
	case <-l.done:
		return l.completed
	default:
		return time.Time{}
	}
}

// ProducerID returns the producer's engine id.
func (l *SGLangLegs) ProducerID() string { return l.producer }
