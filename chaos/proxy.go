package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Proxy tuning.
const (
	// maxInspectBody bounds the request body read to find a request's
	// phase, and the prefill response body read to corrupt its descriptor;
	// larger bodies pass through unfaulted.
	maxInspectBody = 16 << 20
	// spendTimeout bounds the revision-checked decrement of a counted
	// fault; when the bus does not answer in time the fault does not
	// strike.
	spendTimeout = 2 * time.Second
	// copyBufferSize is the size of the buffers the proxy copies response
	// bodies with.
	copyBufferSize = 32 << 10
	// pooledBuffers bounds the copy buffers kept for reuse.
	pooledBuffers = 256
)

// ProxyOptions configures a Proxy.
type ProxyOptions struct {
	// Target is the engine's base URL, e.g. "http://10.0.0.21:8000";
	// request paths are appended to its path. Required.
	Target string
	// EngineID is the engine's id in the fleet: the proxy applies the
	// faults armed under <EngineID>.* and names it in its events.
	// Required; letters, digits, '-' and '_'.
	EngineID string
	// Store is where faults are armed; the proxy publishes its inject
	// events through the Store's publisher. Nil: the proxy never faults
	// (a plain transparent proxy).
	Store *Store
	// Transport carries the requests to the engine. Nil: a transport owned
	// by the proxy (keep-alives, no compression, no overall timeout).
	Transport http.RoundTripper
	// Log receives the proxy's notices; nil discards them.
	Log *slog.Logger
}

// Proxy is a transparent streaming reverse proxy in front of one engine
// that injects the faults armed for that engine (behaviour.md R-CHAOS-1). It is an
// http.Handler built on httputil.ReverseProxy: every chunk is flushed as it
// arrives, and methods, paths, headers (X-Forwarded-* included) and bodies
// pass through untouched, full duplex; the outbound Host is the target's.
// When the engine cannot be reached the client's connection is reset, as a
// refused connection to the engine would look.
//
// For each request the proxy decides the phase — "prefill" when the JSON
// body's kv_transfer_params.do_remote_decode is true, else "decode" for
// POST /v1/chat/completions and /v1/completions, none for every other
// request, which is never faulted — and applies the armed faults of that
// phase (or "any") that are not expired and win their probability roll.
// At most one fault of a kind strikes a request (the first by fault id),
// and of the faults that answer in the engine's place (connect-refused,
// http-status), the faults that end a stream (mid-stream-silence,
// close-before-done, done-before-token, error-object) and the descriptor
// faults, only the first in catalogue order that strikes; delays add up. A
// counted fault strikes only once its revision-checked decrement in the
// bucket succeeds (else the next fault of its group may). Each strike is
// published as an inject event.
//
// A request the proxy cancels or faults leaves no goroutine behind, and
// when the client goes away the upstream request is cancelled (R-OWN-5).
// Create it with NewProxy, call Start to load and watch its faults, and
// Close it when done. Safe for concurrent use.
type Proxy struct {
	engineID  string
	target    *url.URL
	rp        *httputil.ReverseProxy
	store     *Store
	transport *http.Transport // owned, closed by Close; nil when given
	log       *slog.Logger

	mu     sync.RWMutex
	faults []armedFault // sorted by key
	armed  atomic.Int32 // len(faults), read without the lock

	startMu sync.Mutex
	started bool
	closed  bool
	cancel  context.CancelFunc // ends the watch
	watcher jetstream.KeyWatcher
	done    chan struct{} // closed when the watch goroutine ends
	service micro.Service // the proxy's ProxyService instance; nil without a Store
}

// armedFault is one fault of the proxy's engine, parsed.
type armedFault struct {
	key   string
	fault Fault
	set   setting
}

// NewProxy returns a Proxy for opts. It fails when Target is not an
// absolute http(s) URL or EngineID is not a valid id.
func NewProxy(opts ProxyOptions) (*Proxy, error) {
	target, err := url.Parse(opts.Target)
	if err != nil || (target.Scheme != "http" && target.Scheme != "https") || target.Host == "" {
		return nil, fmt.Errorf("target %q: want an http:// or https:// base URL", opts.Target)
	}
	if !validID(opts.EngineID) {
		return nil, fmt.Errorf("engine id %q: want letters, digits, '-' or '_'", opts.EngineID)
	}
	p := &Proxy{engineID: opts.EngineID, target: target, store: opts.Store, log: opts.Log}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	transport := opts.Transport
	if transport == nil {
		p.transport = &http.Transport{
			DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:          1024,
			MaxIdleConnsPerHost:   256,
			IdleConnTimeout:       90 * time.Second,
			TLSHandshakeTimeout:   10 * time.Second,
			ExpectContinueTimeout: time.Second,
			DisableCompression:    true, // the request goes as the client sent it
		}
		transport = p.transport
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite:        p.rewrite,
		Transport:      transport,
		FlushInterval:  -1,
		BufferPool:     newBufferPool(),
		ModifyResponse: p.modifyResponse,
		ErrorHandler:   p.upstreamError,
		ErrorLog:       log.New(slogWriter{p.log}, "", 0),
	}
	return p, nil
}

// EngineID returns the id of the engine the proxy stands in front of.
func (p *Proxy) EngineID() string { return p.engineID }

// Start loads the faults armed for the proxy's engine from the Store and
// keeps watching them until Close: a change in the bucket applies to the
// next request. Once they are loaded it answers as an instance of
// ProxyService on the Store's connection, so that Store.Proxies finds it.
// It returns then, or an error when the watch or the service cannot start
// or ctx ends first. Without a Store it does nothing. Calling it again, or
// after Close, is an error.
func (p *Proxy) Start(ctx context.Context) error {
	p.startMu.Lock()
	defer p.startMu.Unlock()
	if p.started || p.closed {
		return errors.New("proxy already started or closed")
	}
	p.started = true
	if p.store == nil {
		return nil
	}
	wctx, cancel := context.WithCancel(context.Background())
	w, err := p.store.watch(wctx, p.engineID)
	if err != nil {
		cancel()
		return fmt.Errorf("watch %s.*: %w", p.engineID, err)
	}
	for loaded := false; !loaded; {
		select {
		case <-ctx.Done():
			cancel()
			_ = w.Stop()
			return fmt.Errorf("loading the faults of %s: %w", p.engineID, context.Cause(ctx))
		case e, ok := <-w.Updates():
			if !ok {
				cancel()
				return fmt.Errorf("watch %s.* ended", p.engineID)
			}
			if e == nil {
				loaded = true
			} else {
				p.apply(e)
			}
		}
	}
	svc, err := p.addService()
	if err != nil {
		cancel()
		_ = w.Stop()
		return err
	}
	p.cancel, p.watcher, p.done, p.service = cancel, w, make(chan struct{}), svc
	go p.watch(wctx, w)
	return nil
}

// watch applies the bucket's changes until ctx ends or the watch closes.
func (p *Proxy) watch(ctx context.Context, w jetstream.KeyWatcher) {
	defer close(p.done)
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			if e != nil {
				p.apply(e)
			}
		}
	}
}

// apply updates the proxy's faults with one entry of the bucket.
func (p *Proxy) apply(e jetstream.KeyValueEntry) {
	var af armedFault
	keep := false
	if e.Operation() == jetstream.KeyValuePut {
		if sf, ok := decodeEntry(e); ok {
			set, _ := sf.fault.compile() // decodeEntry validated it
			af, keep = armedFault{key: sf.key, fault: sf.fault, set: set}, true
		} else {
			p.log.Warn("chaos: ignoring an invalid fault", "key", e.Key())
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	i, found := slices.BinarySearchFunc(p.faults, e.Key(), func(a armedFault, key string) int { return strings.Compare(a.key, key) })
	switch {
	case keep && found:
		p.faults[i] = af
	case keep:
		p.faults = slices.Insert(p.faults, i, af)
	case found:
		p.faults = slices.Delete(p.faults, i, i+1)
	}
	p.armed.Store(int32(len(p.faults)))
}

// Faults returns the faults the proxy currently applies (armed, not
// expired), sorted by fault id.
func (p *Proxy) Faults() []Fault {
	now := time.Now()
	p.mu.RLock()
	defer p.mu.RUnlock()
	out := make([]Fault, 0, len(p.faults))
	for _, a := range p.faults {
		if !a.fault.Expired(now) {
			f := a.fault
			f.Params = maps.Clone(f.Params)
			out = append(out, f)
		}
	}
	return out
}

// Close stops watching the bucket and closes the idle connections of the
// proxy's own transport. Requests in flight are not interrupted (close the
// http.Server that serves the proxy for that). Safe to call more than once.
func (p *Proxy) Close() {
	p.startMu.Lock()
	p.closed = true
	cancel, w, done, svc := p.cancel, p.watcher, p.done, p.service
	p.cancel, p.watcher, p.service = nil, nil, nil
	p.startMu.Unlock()
	if svc != nil {
		_ = svc.Stop()
		// The service drains its subscriptions: until the server has
		// taken the unsubscriptions it still routes pings here, which
		// would be answered. A round trip makes the proxy unfindable
		// when Close returns.
		_ = p.store.nc.Flush()
	}
	if cancel != nil {
		cancel()
		_ = w.Stop()
		<-done
	}
	if p.transport != nil {
		p.transport.CloseIdleConnections()
	}
}

// rewrite points the outbound request at the target and keeps the
// forwarding headers the client sent (ReverseProxy's Rewrite mode strips
// them).
func (p *Proxy) rewrite(pr *httputil.ProxyRequest) {
	pr.SetURL(p.target)
	for _, h := range [...]string{"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto"} {
		if v, ok := pr.In.Header[h]; ok {
			pr.Out.Header[h] = v
		}
	}
}

// exchangeKey is the context key of a faulted request's exchange.
type exchangeKey struct{}

// exchange is one request that faults strike.
type exchange struct {
	phase     string
	stream    bool
	requestID string
	has       uint32 // bit k: a fault of kind k strikes
	set       [numKinds]setting
	clientCtx context.Context    // the inbound request's context
	cancel    context.CancelFunc // cancels the upstream request
}

func (x *exchange) hits(k faultKind) bool { return x.has&(1<<k) != 0 }

// ServeHTTP forwards r to the engine, applying the faults that strike it.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// The engine may answer before it has read the whole request body;
	// without full duplex the HTTP/1 server would then close the body under
	// the transport that is still sending it, and so break the upstream
	// connection mid-stream. (HTTP/2 is always full duplex.)
	_ = http.NewResponseController(w).EnableFullDuplex()
	if p.armed.Load() == 0 || r.Method != http.MethodPost ||
		(r.URL.Path != "/v1/chat/completions" && r.URL.Path != "/v1/completions") {
		p.rp.ServeHTTP(w, r)
		return
	}
	body, whole, err := readRequestBody(r)
	if err != nil { // the client broke off its request: nothing to forward
		panic(http.ErrAbortHandler)
	}
	if !whole {
		p.rp.ServeHTTP(w, r)
		return
	}
	phase, stream := requestPhase(body)
	x := p.strike(r, phase, stream)
	if x == nil {
		p.rp.ServeHTTP(w, r)
		return
	}
	if x.hits(kindConnectDelay) && !pause.For(r.Context(), x.set[kindConnectDelay].delay) {
		return // the client left
	}
	switch {
	case x.hits(kindConnectRefused):
		resetConnection(w)
		return
	case x.hits(kindHTTPStatus):
		writeStatus(w, r, &x.set[kindHTTPStatus])
		return
	}
	if x.has&^(1<<kindConnectDelay) == 0 {
		p.rp.ServeHTTP(w, r)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	x.clientCtx, x.cancel = r.Context(), cancel
	p.rp.ServeHTTP(w, r.WithContext(context.WithValue(ctx, exchangeKey{}, x)))
}

// readRequestBody reads r's body into memory and puts an equal body back
// on r. whole is false when the body is larger than maxInspectBody: r's
// body then still yields every byte, and the request is not inspected.
func readRequestBody(r *http.Request) (body []byte, whole bool, err error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, true, nil
	}
	orig := r.Body
	body, err = io.ReadAll(io.LimitReader(orig, maxInspectBody+1))
	if err != nil {
		return nil, false, err
	}
	if len(body) > maxInspectBody {
		r.Body = readCloser{io.MultiReader(bytes.NewReader(body), orig), orig}
		return nil, false, nil
	}
	r.Body = readCloser{bytes.NewReader(body), orig}
	return body, true, nil
}

// readCloser reads from Reader and closes Closer.
type readCloser struct {
	io.Reader
	io.Closer
}

// requestPhase returns the phase of an inference request with JSON body
// body: "prefill" when kv_transfer_params.do_remote_decode is true, else
// "decode"; stream is the body's "stream". A body that is not JSON is a
// non-streaming decode.
func requestPhase(body []byte) (phase string, stream bool) {
	var req struct {
		Stream bool `json:"stream"`
		KV     *struct {
			DoRemoteDecode bool `json:"do_remote_decode"`
		} `json:"kv_transfer_params"`
	}
	_ = json.Unmarshal(body, &req) // a field of the wrong type keeps its zero value
	if req.KV != nil && req.KV.DoRemoteDecode {
		return PhasePrefill, req.Stream
	}
	return PhaseDecode, req.Stream
}

// appliesTo reports whether a fault of kind k acts on a request of the
// phase and streaming mode.
func (k faultKind) appliesTo(phase string, stream bool) bool {
	switch {
	case k.streamOnly():
		return stream
	case k.descriptorFault():
		return phase == PhasePrefill && !stream
	}
	return true
}

// strike selects the faults that strike a request, spends the counted
// ones and publishes an inject event for each. It returns nil when none
// strikes.
func (p *Proxy) strike(r *http.Request, phase string, stream bool) *exchange {
	var chosen [numKinds]armedFault
	var has uint32
	now := time.Now()
	p.mu.RLock()
	for i := range p.faults {
		a := &p.faults[i]
		k := a.set.kind
		if has&(1<<k) != 0 || (a.fault.Phase != PhaseAny && a.fault.Phase != phase) ||
			!k.appliesTo(phase, stream) || a.fault.Expired(now) || !roll(a.fault.Probability) {
			continue
		}
		has |= 1 << k
		chosen[k] = *a
	}
	p.mu.RUnlock()
	if has == 0 {
		return nil
	}
	x := &exchange{phase: phase, stream: stream, requestID: r.Header.Get("X-Request-Id")}
	var ctx context.Context // bounds the spending of counted faults
	var cancel context.CancelFunc
	defer func() {
		if cancel != nil {
			cancel()
		}
	}()
	fire := func(k faultKind) bool {
		f := chosen[k].fault
		if f.Count > 0 {
			if ctx == nil {
				ctx, cancel = context.WithTimeout(r.Context(), spendTimeout)
			}
			spent, ok, err := p.store.spend(ctx, chosen[k].key)
			if err != nil {
				p.log.Warn("chaos: counted fault not spent", "key", chosen[k].key, "err", err)
			}
			if !ok {
				return false
			}
			f = spent
		}
		x.has |= 1 << k
		x.set[k] = chosen[k].set
		ev := f.event(schemas.ChaosInject)
		ev.Phase = phase
		ev.RequestID = x.requestID
		p.store.publish(ev)
		return true
	}
	// An answering fault excludes all but connect-delay; within a group
	// the first kind that is not spent yet strikes.
	for _, k := range [...]faultKind{kindConnectRefused, kindHTTPStatus} {
		if has&(1<<k) != 0 && fire(k) {
			break
		}
	}
	if x.has&answerKinds != 0 {
		if has&(1<<kindConnectDelay) != 0 {
			fire(kindConnectDelay)
		}
		return x
	}
	var taken uint32 // groups that have their fault
	for k := range numKinds {
		bit := uint32(1) << k
		if has&bit == 0 || answerKinds&bit != 0 {
			continue
		}
		group := bit
		switch {
		case terminatorKinds&bit != 0:
			group = terminatorKinds
		case descriptorKinds&bit != 0:
			group = descriptorKinds
		}
		if taken&group == 0 && fire(k) {
			taken |= group
		}
	}
	if x.has == 0 {
		return nil
	}
	return x
}

// Groups of kinds of which at most one strikes a request.
const (
	answerKinds     = 1<<kindConnectRefused | 1<<kindHTTPStatus
	terminatorKinds = 1<<kindMidStreamSilence | 1<<kindCloseBeforeDone | 1<<kindDoneBeforeToken | 1<<kindErrorObject
	descriptorKinds = 1<<kindDropEngineID | 1<<kindGarbleBlockIDs | 1<<kindChangeConnectorShape
)

// roll reports whether an event of probability prob happens.
func roll(prob float64) bool {
	return prob >= 1 || (prob > 0 && rand.Float64() < prob)
}

// resetConnection ends the client's connection without a response: a TCP
// reset on HTTP/1, a stream reset on HTTP/2.
func resetConnection(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = conn.Close()
}

// writeStatus answers a request in the engine's place with s.code and a
// vLLM error body {"error":{"message","type","param":null,"code"}}.
func writeStatus(w http.ResponseWriter, r *http.Request, s *setting) {
	body := schemas.AppendErrorJSON(make([]byte, 0, 96+len(s.message)), s.code, s.message)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if id := r.Header.Get("X-Request-Id"); id != "" {
		h.Set("X-Request-Id", id)
	}
	w.WriteHeader(s.code)
	_, _ = w.Write(body)
}

// modifyResponse applies the response faults of a faulted request: the
// header hold, the descriptor corruption and the stream rewriting.
func (p *Proxy) modifyResponse(resp *http.Response) error {
	x, _ := resp.Request.Context().Value(exchangeKey{}).(*exchange)
	if x == nil {
		return nil
	}
	if x.hits(kindHeaderDelay) && !pause.For(x.clientCtx, x.set[kindHeaderDelay].delay) {
		return context.Cause(x.clientCtx)
	}
	if resp.StatusCode != http.StatusOK {
		return nil // an error answer passes untouched
	}
	if x.has&descriptorKinds != 0 {
		return corruptResponse(resp, x.set[bitKind(x.has&descriptorKinds)].kind)
	}
	sse := isEventStream(resp.Header.Get("Content-Type"))
	switch {
	case sse && x.has&(terminatorKinds|1<<kindFirstTokenDelay|1<<kindTrickle) != 0:
		resp.Body = newStreamFaults(resp.Body, x)
	case !sse && x.has&(1<<kindFirstTokenDelay|1<<kindTrickle) != 0:
		resp.Body = &heldBody{src: resp.Body, ctx: x.clientCtx,
			delay: x.set[kindFirstTokenDelay].delay + x.set[kindTrickle].delay}
	}
	return nil
}

// bitKind returns the kind of a set with one bit.
func bitKind(bit uint32) faultKind {
	var k faultKind
	for bit > 1 {
		bit >>= 1
		k++
	}
	return k
}

// isEventStream reports whether a Content-Type is text/event-stream.
func isEventStream(ct string) bool {
	ct, _, _ = strings.Cut(ct, ";")
	return strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}

// upstreamError handles a failed upstream exchange: nothing when the
// client is gone or the proxy cancelled the request itself, else a reset
// of the client's connection, as the engine's failure would look without
// the proxy.
func (p *Proxy) upstreamError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		return
	}
	p.log.Debug("chaos: upstream failed", "engine", p.engineID, "err", err)
	resetConnection(w)
}

// heldBody is a non-streaming response body held for delay before its
// first byte.
type heldBody struct {
	src    io.ReadCloser
	ctx    context.Context
	delay  time.Duration
	waited bool
}

func (b *heldBody) Read(p []byte) (int, error) {
	if !b.waited {
		b.waited = true
		if !pause.For(b.ctx, b.delay) {
			return 0, context.Cause(b.ctx)
		}
	}
	return b.src.Read(p)
}

func (b *heldBody) Close() error { return b.src.Close() }

// bufferPool is a bounded pool of copy buffers for httputil.ReverseProxy.
type bufferPool chan []byte

func newBufferPool() bufferPool { return make(bufferPool, pooledBuffers) }

// Get returns a pooled buffer or a new one.
func (bp bufferPool) Get() []byte {
	select {
	case b := <-bp:
		return b
	default:
		return make([]byte, copyBufferSize)
	}
}

// Put keeps b for reuse unless the pool is full.
func (bp bufferPool) Put(b []byte) {
	if cap(b) < copyBufferSize {
		return
	}
	select {
	case bp <- b[:copyBufferSize]:
	default:
	}
}

// slogWriter turns the ReverseProxy's log lines into debug records.
type slogWriter struct{ l *slog.Logger }

func (w slogWriter) Write(p []byte) (int, error) {
	w.l.Debug(strings.TrimSpace(string(p)), "component", "chaos-proxy")
	return len(p), nil
}
