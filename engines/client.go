// Package engines is Narwhal's engine client: it runs the prefill and
// decode legs of an attempt against OpenAI-compatible engines (vLLM,
// SGLang, the simulator) on its own bounded keep-alive connections per
// engine (fasthttp's header and body codecs), reads decode streams under the
// first-token and between-token timers, and classifies every failure as a
// typed *Fault (behaviour.md §2, §3, §5, §6, §12).
//
// Client.Prefill returns a *connector.PrefillResult; passing it unchanged
// to Client.Decode runs the decode leg.
package engines

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	// The connectors Narwhal ships, registered for NewEngine.
	_ "github.com/narwhalmesh/narwhal/engines/connector/all"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Engine is one engine of the fleet as the client needs it.
type Engine struct {
	// ID is the fleet-unique engine id.
	ID string
	// URL is the base URL without a trailing slash, e.g.
	// "http://10.0.0.11:8000".
	URL string
	// Role is the engine's role.
	Role connector.Role
	// Connector is the engine's KV connector.
	Connector connector.Connector
	// Credential is the engine's API key, sent on every request to it;
	// zero for an engine without one.
	Credential Credential
	// BootstrapPort is the port of a prefill SGLang engine's bootstrap
	// server (fleet entry bootstrap_port, R-DESC-7); 0 for other engines.
	BootstrapPort int
}

// NewEngine returns the Engine with id, the base URL baseURL (trailing
// slashes removed, e.g. "http://10.0.0.11:8000/" becomes
// "http://10.0.0.11:8000"), role, and the connector registered as
// connectorName. It returns the registry's error, naming the known
// connectors, when connectorName is not registered.
func NewEngine(id, baseURL string, role connector.Role, connectorName string) (Engine, error) {
	conn, err := connector.Lookup(connectorName)
	if err != nil {
		return Engine{}, err
	}
	return Engine{ID: id, URL: strings.TrimRight(baseURL, "/"), Role: role, Connector: conn}, nil
}

// Request is one attempt's view of a client request: what to send and
// where (behaviour.md §0 "attempt").
type Request struct {
	// Body is the parsed client request (kv_transfer_params removed).
	Body *schemas.Request
	// BackendRequestID is the attempt's fresh backend request id, sent as
	// X-Request-Id on both legs (R-OWN-4).
	BackendRequestID string
	// Producer runs the prefill leg, Consumer the decode leg; the same
	// engine for a same-worker attempt.
	Producer, Consumer *Engine
	// Traceparent is the W3C trace context header sent on the next leg
	// ("00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>"), so
	// that an engine that traces (vLLM) joins the request's trace; empty
	// sends none. The caller sets it per leg: each leg's span is the
	// parent of that leg's engine spans.
	Traceparent string
	// Tracestate is the W3C tracestate header sent with Traceparent;
	// empty sends none. SetTrace sets both from a span (trace.go).
	Tracestate string
}

// SameWorker reports whether producer and consumer are one engine, in
// which case no transfer parameters are sent on either leg (R-LEG-4).
func (r *Request) SameWorker() bool {
	return r.Producer == r.Consumer || r.Producer.ID == r.Consumer.ID
}

// ErrClientGone is the cancellation cause the router gives a request's
// context when the client disconnects; legs cancelled with it end with a
// KindClientGone fault (R-OWN-5).
var ErrClientGone = errors.New("client disconnected")

// ErrRouterShutdown is the cancellation cause the router gives requests
// still running when its shutdown grace period ends; legs cancelled with
// it end with a KindShutdown fault (503).
var ErrRouterShutdown = errors.New("router shutting down")

var (
	errPrefillTimeout    = errors.New("prefill timeout")
	errFirstTokenTimeout = errors.New("first token timeout")
	errSilence           = errors.New("silence between tokens")
	errStreamClosed      = errors.New("stream closed by its owner")
)

// Options configures a Client. Every duration is used as given: a zero
// (or negative) duration means no bound of that kind, as in net/http, so
// that validated config values pass through unchanged — the defaults are
// config.Default's (behaviour.md §11), not the client's.
type Options struct {
	// PrefillTimeout bounds the whole prefill leg (engine.prefill_timeout_s);
	// zero means only ctx bounds it.
	PrefillTimeout time.Duration
	// FirstTokenTimeout bounds the decode leg from before its request is
	// opened until the first generated output (R-TMO-1); zero means only
	// ctx bounds it.
	FirstTokenTimeout time.Duration
	// DecodeReadTimeout bounds the silence between transport chunks after
	// the first output (R-TMO-2); zero means no per-chunk bound, as
	// engine.decode_read_timeout_s = 0 does (R-TMO-4).
	DecodeReadTimeout time.Duration
	// HandoffMaxAge is handoff.max_age_s (R-OWN-2); zero means no age
	// limit.
	HandoffMaxAge time.Duration
	// Transport is the HTTP transport of releases, probes and model
	// listings (HTTPClient, HTTPClientFor); nil means NewTransport(). The
	// prefill and decode legs do not use it: they run on the client's own
	// connections (at most PrefillConnsPerEngine prefill connections per
	// engine, decode connections bounded by the engines' decode slots).
	Transport http.RoundTripper
	// MaxResponseBytes bounds a prefill response or an error body read
	// whole; 0 means 16 MiB.
	MaxResponseBytes int64
	// RootCAs are the certificate authorities of https:// engines for the
	// engine legs and the default Transport (engine.tls_ca_file); nil
	// means the system's roots. A Transport given here keeps its own.
	RootCAs *x509.CertPool
}

// Client runs engine legs. It is safe for concurrent use; create one per
// process and reuse it so that connections to engines are reused.
type Client struct {
	http              *http.Client // releases, probes, model listings
	prefillPools      *enginePools // prefill legs
	decodePools       *enginePools // decode legs
	prefillTimeout    time.Duration
	firstTokenTimeout time.Duration
	readTimeout       time.Duration
	handoffMaxAge     time.Duration
	maxResponse       int64
}

// NewTransport returns the tuned transport the client uses by default:
// keep-alives, a large idle pool per engine, no compression (SSE must not
// be buffered by a gzip reader), no overall timeout (the legs' contexts
// bound everything, so cancelling one aborts connect, headers and body
// reads at once).
func NewTransport() *http.Transport {
	return &http.Transport{
		Proxy:                 nil,
		DialContext:           (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          4096,
		MaxIdleConnsPerHost:   1024,
		IdleConnTimeout:       90 * time.Second,
		DisableCompression:    true,
		ForceAttemptHTTP2:     false,
		WriteBufferSize:       4 << 10,
		ReadBufferSize:        4 << 10,
		ExpectContinueTimeout: 0,
	}
}

// PrefillConnsPerEngine caps the prefill connections the client opens to
// one engine. Prefill legs are short: a burst of new requests
// waits briefly for a connection (within engine.prefill_timeout_s) instead
// of opening one socket each, which would exhaust the router's file
// descriptors (each open stream already holds two) and the engine's accept
// queue. Decode streams are long and each needs its own connection, so the
// decode connections are not capped: decode_slots bounds them.
const PrefillConnsPerEngine = 256

// NewClient returns a Client configured by opts.
func NewClient(opts Options) *Client {
	c := &Client{
		prefillTimeout:    max(opts.PrefillTimeout, 0),
		firstTokenTimeout: max(opts.FirstTokenTimeout, 0),
		readTimeout:       max(opts.DecodeReadTimeout, 0),
		handoffMaxAge:     max(opts.HandoffMaxAge, 0),
		maxResponse:       opts.MaxResponseBytes,
	}
	if c.maxResponse <= 0 {
		c.maxResponse = 16 << 20
	}
	transport := opts.Transport
	if transport == nil {
		t := NewTransport()
		withRoots(t, opts.RootCAs)
		transport = t
	}
	c.http = &http.Client{Transport: transport}
	legTLS := &tls.Config{RootCAs: opts.RootCAs, MinVersion: tls.VersionTLS12}
	dial := (&net.Dialer{KeepAlive: dialKeepAlive}).DialContext
	c.prefillPools = &enginePools{maxConns: PrefillConnsPerEngine, maxIdle: PrefillConnsPerEngine, tls: legTLS, dial: dial}
	c.decodePools = &enginePools{maxIdle: maxIdlePerEngine, tls: legTLS, dial: dial}
	return c
}

// DecodeReadTimeout returns the between-chunk bound decode streams get
// (R-TMO-2); 0 means none, the request deadline bounds the stream
// (R-TMO-4).
func (c *Client) DecodeReadTimeout() time.Duration { return c.readTimeout }

// CloseIdleConnections closes the idle connections of the engine legs and
// of the HTTP transport.
func (c *Client) CloseIdleConnections() {
	c.http.CloseIdleConnections()
	if c.prefillPools != nil {
		c.prefillPools.closeIdle()
		c.decodePools.closeIdle()
	}
}

// withRoots makes t trust roots (nil: the system's) for https:// engines,
// TLS 1.2 or newer.
func withRoots(t *http.Transport, roots *x509.CertPool) {
	t.TLSClientConfig = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
}

// withTimeoutCause is context.WithTimeoutCause, with no timeout when d is
// zero (Options: zero means no bound).
func withTimeoutCause(ctx context.Context, d time.Duration, cause error) (context.Context, context.CancelFunc) {
	if d <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeoutCause(ctx, d, cause)
}

// HTTPClient returns the client's *http.Client (for probes and releases).
func (c *Client) HTTPClient() *http.Client { return c.http }

// Prefill runs the prefill leg of req on req.Producer (behaviour.md
// R-LEG-1, R-LEG-1a, R-LEG-4), bounded by the prefill timeout and ctx, and
// captures the handoff descriptor into a PrefillResult (R-LEG-2), through
// the producer's connector (connector.Descriptors: nixl). For a crossed
// attempt the descriptor is validated against R-DESC-0…2 and the
// connector's shape. Errors are *Fault: connect_error, prefill_timeout,
// prefill_status, prefill_response, descriptor_rejected (also for a
// connector that passes no descriptor), client_fault, overload,
// request_timeout or client_disconnected. StartAttempt runs a whole
// attempt of any connector.
func (c *Client) Prefill(ctx context.Context, req *Request) (*connector.PrefillResult, error) {
	d, a, f := c.descriptors(ctx, req)
	if f != nil {
		return nil, f
	}
	res, err := d.Prefill(ctx, a.legs())
	if err != nil {
		return nil, a.fault(err, schemas.PhasePrefill)
	}
	return res, nil
}

// descriptors returns the producer's connector as a descriptor-passing
// one and a bare attempt of req, or the descriptor_rejected fault of a
// connector that passes no descriptor.
func (c *Client) descriptors(ctx context.Context, req *Request) (connector.Descriptors, *Attempt, *Fault) {
	a := c.newAttempt(ctx, req, nil)
	d, ok := req.Producer.Connector.(connector.Descriptors)
	if !ok {
		return nil, nil, rejectFault(req.Producer.ID, &connector.RejectError{Reason: connector.ReasonConnectorMismatch,
			Detail: "the " + req.Producer.Connector.Name() + " connector passes no descriptor"})
	}
	return d, a, nil
}

// Release frees result's KV blocks at the producer when the handoff will
// not be consumed (R-OWN-6), through the producer's connector. It returns
// false with a nil error when the connector or engine cannot release early.
// ctx should be short-lived and independent of a cancelled request.
func (c *Client) Release(ctx context.Context, producer *Engine, result *connector.PrefillResult) (bool, error) {
	d, ok := producer.Connector.(connector.Descriptors)
	if result == nil || !result.HasDescriptor() || !ok {
		return false, nil
	}
	return d.Release(ctx, c.HTTPClientFor(producer), producer.URL, result.AppendDescriptor(nil))
}

// CheckHandoff applies the checks Decode makes before any decode HTTP
// request (R-DESC-0, R-DESC-3, R-DESC-4, R-OWN-2), at now, through the
// producer's connector, and returns the fault, or nil when the handoff
// may be consumed.
func (c *Client) CheckHandoff(req *Request, result *connector.PrefillResult, now time.Time) *Fault {
	d, a, f := c.descriptors(context.Background(), req)
	if f != nil {
		return f
	}
	return a.fault(d.CheckHandoff(a.legs(), result, now), schemas.PhasePrefill)
}

// rejectFault is the R-DESC-6 fault of a rejected descriptor, an engine
// fault of the producer; its Rejection is the reason.
func rejectFault(producerID string, err *connector.RejectError) *Fault {
	f := NewFault(KindDescriptorRejected, schemas.PhasePrefill, producerID, 0, err.Error())
	f.Rejection = err.Reason
	f.Cause = err
	f.Detail = err.Report()
	return f
}

// Decode runs the decode leg of req on req.Consumer with result's
// descriptor (behaviour.md R-LEG-3, R-LEG-4, R-LEG-5), through the
// producer's connector: it first checks the handoff (R-DESC-0, R-DESC-3,
// R-DESC-4, R-OWN-2), then opens the stream with the first-token budget
// already running (R-TMO-1) and returns it once response headers arrived
// with a 2xx status. Read it with Stream.Next and always Close it. Errors
// are *Fault (descriptor_rejected, handoff_expired, connect_error,
// first_token_timeout, upstream_status, client_fault, overload,
// request_timeout, client_disconnected).
func (c *Client) Decode(ctx context.Context, req *Request, result *connector.PrefillResult) (*Stream, error) {
	d, a, f := c.descriptors(ctx, req)
	if f != nil {
		return nil, f
	}
	if err := d.Decode(ctx, a.legs(), result); err != nil {
		return nil, a.fault(err, schemas.PhaseDecode)
	}
	return a.stream, nil
}

// statusFault classifies a non-2xx engine response (R-FAIL-6, R-FAIL-7).
func (c *Client) statusFault(resp *http.Response, phase, engineID string) *Fault {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	obj, ok := schemas.ParseError(body)
	msg := ""
	if ok {
		msg = obj.Message
	}
	var f *Fault
	switch resp.StatusCode {
	case 400, 404, 413, 422:
		if msg == "" {
			msg = http.StatusText(resp.StatusCode)
		}
		f = NewFault(KindClientFault, phase, engineID, resp.StatusCode, msg)
		f.Body = body
		if ok && obj.Type != "" {
			f.Type = obj.Type
		}
		return f
	case 401, 403:
		return NewFault(KindEngineUnauthorized, phase, engineID, resp.StatusCode,
			phase+" engine "+engineID+" refused the router's credentials (HTTP "+strconv.Itoa(resp.StatusCode)+")")
	case 429, 503:
		// 429 is overload; 503 only with a Retry-After (backpressure,
		// R-FAIL-7) — without one it is an engine fault below.
		ra, hasRA := ParseRetryAfter(resp.Header.Get("Retry-After"), time.Now())
		if resp.StatusCode == 503 && !hasRA {
			break
		}
		if msg == "" {
			msg = "engine overloaded"
		}
		f = NewFault(KindOverload, phase, engineID, resp.StatusCode, msg)
		f.Body = body
		f.RetryAfter = ra
		return f
	}
	kind := KindUpstreamStatus
	if phase == schemas.PhasePrefill {
		kind = KindPrefillStatus
	}
	text := phase + " engine " + engineID + " answered HTTP " + strconv.Itoa(resp.StatusCode)
	if msg != "" {
		text += ": " + msg
	}
	return NewFault(kind, phase, engineID, resp.StatusCode, text)
}

// classifyTransport turns a transport or context error into a Fault. parent
// is the request's context, leg the leg's own. Before the response headers,
// an error that says the router ran out of something of its own is
// KindRouterResources (RouterResource, behaviour.md R-FAIL-9), never the
// engine's connect_error.
func classifyTransport(parent, leg context.Context, err error, phase, engineID string, beforeHeaders bool) *Fault {
	var f *Fault
	if pe := parent.Err(); pe != nil {
		switch cause := context.Cause(parent); {
		case errors.Is(cause, ErrClientGone):
			f = NewFault(KindClientGone, phase, engineID, 0, "client disconnected")
		case errors.Is(cause, ErrRouterShutdown):
			f = NewFault(KindShutdown, phase, engineID, 0, "router shutting down")
		default:
			f = NewFault(KindRequestTimeout, phase, engineID, 0, MsgRequestTimeout)
		}
		f.Cause = err
		return f
	}
	if r := RouterResource(err); r != "" && beforeHeaders {
		// The router's own fault, whatever timer ran (R-FAIL-9).
		return resourceFault(phase, engineID, r, err)
	}
	switch context.Cause(leg) {
	case errPrefillTimeout:
		f = NewFault(KindPrefillTimeout, phase, engineID, 0, MsgPrefillTimeout)
	case errFirstTokenTimeout:
		f = NewFault(KindFirstTokenTimeout, phase, engineID, 0, MsgFirstTokenTimeout)
	case errSilence:
		f = NewFault(KindMidStreamSilence, phase, engineID, 0, MsgSilence)
	default:
		if beforeHeaders {
			f = NewFault(KindConnectError, phase, engineID, 0, phase+" engine "+engineID+" unreachable: "+err.Error())
		} else if phase == schemas.PhaseDecode {
			f = NewFault(KindClosedBeforeDone, phase, engineID, 0, MsgClosedBeforeDone)
		} else {
			f = NewFault(KindPrefillResponse, phase, engineID, 0, "prefill engine "+engineID+" connection failed: "+err.Error())
		}
	}
	f.Cause = err
	return f
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }
