package router

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/pause"
)

// The front door (behaviour.md R-API-7, R-API-8): deadlines on every connection, a
// cap on connections and header bytes, admission of completion requests
// and a memory bound on the request bodies held at once. Everything here
// answers before any engine is touched. docs/security.md is the threat
// model behind each setting.

// Reasons a request is refused at the door, the reason label of
// narwhal_front_door_refused_total.
const (
	refusedHeaderTooLarge = "header_too_large"
	refusedHeaderTimeout  = "header_timeout"
	refusedBodyTooLarge   = "body_too_large"
	refusedMalformed      = "malformed"
	refusedInflight       = "max_inflight"
	refusedBodyMemory     = "body_memory"
)

// retryAfterS is the Retry-After, in seconds, of the door's 503s: the
// condition (requests or bodies in flight) usually clears within a second.
const retryAfterS = "1"

// frontDoor holds the front door's limits and counters. Its methods are
// safe for concurrent use; none takes a lock on the request path.
type frontDoor struct {
	cfg         config.Server
	maxBody     int64 // request.max_body_bytes
	maxInflight int64 // 0 = no limit
	log         *slog.Logger

	tickets doorTickets // the header hook's decisions, handed to the handler
	bodies  bodyBudget
	// unauthenticated reports from its headers that a request will get
	// 401 (R-API-9); nil: never. Its body is then not read.
	unauthenticated func(h *fasthttp.RequestHeader) bool

	acceptErrors  prometheus.Counter
	stalls        prometheus.Counter
	refused       *prometheus.CounterVec // reason
	lastAcceptLog atomic.Int64           // unix nanoseconds of the last accept-error log line
	acceptQuiet   atomic.Int64           // accept errors not logged since then
}

func newFrontDoor(cfg *config.Config, log *slog.Logger, reg prometheus.Registerer, srv *fasthttp.Server) *frontDoor {
	fd := &frontDoor{
		cfg:         cfg.Server,
		maxBody:     int64(cfg.Request.MaxBodyBytes),
		maxInflight: int64(cfg.Server.MaxInflight),
		log:         log,
		tickets:     doorTickets{hold: cfg.Server.HeaderTimeout() + ticketMargin},
		acceptErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_accept_errors_total",
			Help: "Errors accepting client connections (such as running out of file descriptors); the router backs off and keeps serving.",
		}),
		stalls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_client_stalls_total",
			Help: "Streams ended because their client accepted no bytes for server.stall_timeout_s (counted against no engine).",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_front_door_refused_total",
			Help: "Requests refused before reaching an engine, by reason: header_too_large (431), header_timeout (408), body_too_large (413), malformed (400), max_inflight and body_memory (503).",
		}, []string{"reason"}),
	}
	fd.bodies.limit, fd.bodies.tickets = int64(cfg.Server.MaxBodyBytesInflight), &fd.tickets
	for _, r := range []string{refusedHeaderTooLarge, refusedHeaderTimeout, refusedBodyTooLarge, refusedMalformed, refusedInflight, refusedBodyMemory} {
		fd.refused.WithLabelValues(r)
	}
	reg.MustRegister(fd.acceptErrors, fd.stalls, fd.refused,
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "narwhal_connections_refused_total",
			Help: "Client connections answered 503 and closed at once because server.max_connections were open.",
		}, func() float64 { return float64(srv.GetRejectedConnectionsCount()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "narwhal_body_bytes_inflight",
			Help: "Bytes of request bodies held now, counted against server.max_body_bytes_inflight.",
		}, func() float64 { return float64(fd.bodies.used.Load()) }))

	// R-API-7: deadlines and caps are fasthttp's own settings.
	srv.ReadTimeout = cfg.Server.HeaderTimeout()
	srv.IdleTimeout = cfg.Server.IdleTimeout()
	srv.WriteTimeout = cfg.Server.StallTimeout()
	srv.ReadBufferSize = cfg.Server.MaxHeaderBytes
	srv.Concurrency = cfg.Server.MaxConnections
	// A connection holds a read buffer of max_header_bytes only while it
	// reads a request, not while it waits or streams.
	srv.ReduceMemoryUsage = true
	// fasthttp's messages never quote request bytes.
	srv.SecureErrorLogMessage = true
	srv.HeaderReceived = fd.headerReceived
	return fd
}

// listener wraps ln so that accept errors never end Serve (R-API-7).
func (fd *frontDoor) listener(ln net.Listener) *doorListener {
	return &doorListener{Listener: ln, fd: fd, done: make(chan struct{})}
}

// doorListener is the client listener. Accept retries every error but
// the listener's own closing: out of file descriptors (EMFILE, ENFILE),
// out of buffers, aborted handshakes. It backs off from 5 ms, doubling up
// to 1 s, counts each error in narwhal_accept_errors_total and logs at
// most one line a second, so fasthttp's Serve, which returns on any
// accept error, keeps serving.
type doorListener struct {
	net.Listener
	fd        *frontDoor
	done      chan struct{}
	closeOnce sync.Once
}

// Accept waits for the next connection; it returns an error only once the
// listener is closed.
func (l *doorListener) Accept() (net.Conn, error) {
	var delay time.Duration
	for {
		c, err := l.Listener.Accept()
		if err == nil {
			return &doorConn{Conn: c}, nil
		}
		select {
		case <-l.done:
			return nil, net.ErrClosed
		default:
		}
		if errors.Is(err, net.ErrClosed) {
			return nil, err
		}
		l.fd.acceptError(err)
		if delay == 0 {
			delay = 5 * time.Millisecond
		} else if delay *= 2; delay > time.Second {
			delay = time.Second
		}
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-l.done:
			t.Stop()
			return nil, net.ErrClosed
		}
	}
}

// Lingering after a body refused unread (doorConn): the client gets the
// router's answer if it sends what is left of its body within
// lingerWait, up to lingerBytes of it.
const (
	lingerWait  = 2 * time.Second
	lingerBytes = 64 << 20
)

// doorConn is a client connection. When the router answered without
// reading the request's body (a 413, a 503 for body memory, a 401: the
// body is still on the wire), closing it with those bytes unread would
// make the kernel reset the connection, and a client that writes its
// whole body before reading (most HTTP libraries do) would get
// ECONNRESET instead of the answer. Such a connection lingers on Close,
// as web servers do: it shuts its write side (the answer is sent), then
// reads and discards what the client still sends, for at most
// lingerWait and lingerBytes, and only then closes.
type doorConn struct {
	net.Conn
	linger atomic.Bool
}

// NetConn returns the connection under it (for the send-buffer and
// disconnect code that needs the TCP socket).
func (c *doorConn) NetConn() net.Conn { return c.Conn }

// SyscallConn returns the raw socket of the connection under it.
func (c *doorConn) SyscallConn() (syscall.RawConn, error) {
	sc, ok := c.Conn.(syscall.Conn)
	if !ok {
		return nil, errors.ErrUnsupported
	}
	return sc.SyscallConn()
}

// Close closes the connection, lingering first when lingerOnClose marked
// it.
func (c *doorConn) Close() error {
	if c.linger.Load() {
		if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
			_ = c.Conn.SetReadDeadline(time.Now().Add(lingerWait))
			_, _ = io.CopyN(io.Discard, c.Conn, lingerBytes)
		}
	}
	return c.Conn.Close()
}

// lingerOnClose marks ctx's connection (under TLS, the socket's) to
// linger when it closes: the request's body was refused unread.
func lingerOnClose(ctx *fasthttp.RequestCtx) {
	conn := ctx.Conn()
	if tc, ok := conn.(*tls.Conn); ok {
		conn = tc.NetConn()
	}
	if dc, ok := conn.(*doorConn); ok {
		dc.linger.Store(true)
	}
}

// Close closes the listener and ends a backoff in progress.
func (l *doorListener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// acceptError counts err and logs it, at most once a second with the
// number of errors not logged since.
func (fd *frontDoor) acceptError(err error) {
	fd.acceptErrors.Inc()
	now := time.Now().UnixNano()
	last := fd.lastAcceptLog.Load()
	if now-last < int64(time.Second) || !fd.lastAcceptLog.CompareAndSwap(last, now) {
		fd.acceptQuiet.Add(1)
		return
	}
	fd.log.Error("accepting client connections failed; backing off", "err", err, "errors_not_logged", fd.acceptQuiet.Swap(0))
}

// admit takes a place among the completion requests in flight (R-API-8):
// it increments inflight and reports true, or, when server.max_inflight
// are already running, leaves inflight as it was and reports false.
func (fd *frontDoor) admit(inflight *atomic.Int64) bool {
	n := inflight.Add(1)
	if fd.maxInflight > 0 && n > fd.maxInflight {
		inflight.Add(-1)
		return false
	}
	return true
}

// refuse answers a request the door will not serve now with 503 and
// Retry-After (R-API-8), touching no engine, publishing no event.
func (fd *frontDoor) refuse(ctx *fasthttp.RequestCtx, reason, message string) {
	fd.refused.WithLabelValues(reason).Inc()
	ctx.Response.Header.Set("Retry-After", retryAfterS)
	writeError(ctx, fasthttp.StatusServiceUnavailable, message)
}

// refuseInflight is refuse for a request beyond server.max_inflight.
func (fd *frontDoor) refuseInflight(ctx *fasthttp.RequestCtx) {
	fd.refuse(ctx, refusedInflight, "the router is at capacity: "+strconv.FormatInt(fd.maxInflight, 10)+" requests in flight (server.max_inflight); retry shortly")
}

// refuseBodyMemory is refuse for a body that does not fit in
// server.max_body_bytes_inflight.
func (fd *frontDoor) refuseBodyMemory(ctx *fasthttp.RequestCtx) {
	ctx.SetConnectionClose() // the body may be on the wire, unread
	fd.refuse(ctx, refusedBodyMemory, "the router holds too many request bodies at once ("+strconv.FormatInt(fd.bodies.limit, 10)+" bytes, server.max_body_bytes_inflight); retry shortly")
}

// serverError answers the errors fasthttp raises before the handler runs,
// in the OpenAI shape, never quoting the request (R-API-3, R-API-7):
// headers over server.max_header_bytes → 431, a request not read within
// server.header_timeout_s → 408, a body over request.max_body_bytes → 413,
// a body that does not fit the in-flight bound → 503, anything else → 400.
// fasthttp closes the connection after it.
func (rt *Router) serverError(ctx *fasthttp.RequestCtx, err error) {
	fd := rt.front
	requestID(ctx)
	reserved, full := fd.tickets.claim(&ctx.Request.Header)
	fd.bodies.release(reserved)
	var small *fasthttp.ErrSmallBuffer
	var netErr net.Error
	if errors.Is(err, fasthttp.ErrBodyTooLarge) {
		lingerOnClose(ctx)
	}
	if fd.tickets.authRefused(&ctx.Request.Header) && errors.Is(err, fasthttp.ErrBodyTooLarge) {
		ctx.SetConnectionClose() // the body is on the wire, unread
		rt.authenticate(ctx)
		return
	}
	switch {
	case errors.As(err, &small):
		fd.refused.WithLabelValues(refusedHeaderTooLarge).Inc()
		writeError(ctx, fasthttp.StatusRequestHeaderFieldsTooLarge, "request headers exceed the limit of "+strconv.Itoa(fd.cfg.MaxHeaderBytes)+" bytes (server.max_header_bytes)")
	case full && errors.Is(err, fasthttp.ErrBodyTooLarge):
		fd.refuseBodyMemory(ctx)
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		fd.refused.WithLabelValues(refusedBodyTooLarge).Inc()
		writeError(ctx, fasthttp.StatusRequestEntityTooLarge, "request body exceeds the limit of "+strconv.FormatInt(fd.maxBody, 10)+" bytes (request.max_body_bytes)")
		rt.metrics.requests.inc("", "413", "client_error", config.NoKeyName, otherModel)
	case errors.As(err, &netErr) && netErr.Timeout():
		fd.refused.WithLabelValues(refusedHeaderTimeout).Inc()
		writeError(ctx, fasthttp.StatusRequestTimeout, "request not received within "+strconv.FormatFloat(fd.cfg.HeaderTimeoutS, 'g', -1, 64)+" s (server.header_timeout_s)")
	default:
		fd.refused.WithLabelValues(refusedMalformed).Inc()
		writeError(ctx, fasthttp.StatusBadRequest, "malformed HTTP request")
	}
}

// expectContinue answers a request that sent "Expect: 100-continue": one
// the router would refuse (no valid API key, a body over
// request.max_body_bytes, no room under server.max_body_bytes_inflight)
// gets its final error response at once, before the client sends the
// body, instead of "100 Continue" followed by the refusal (R-API-7,
// R-API-8, R-API-9). It returns the status fasthttp sends: 100 to go on
// reading the body, else the error's status (the connection then closes).
func (rt *Router) expectContinue(ctx *fasthttp.RequestCtx) int {
	h := &ctx.Request.Header
	refused := rt.front.tickets.authRefused(h) ||
		rt.front.tickets.full(h) ||
		int64(h.ContentLength()) > rt.front.maxBody
	if !refused {
		return fasthttp.StatusContinue
	}
	rt.serverError(ctx, fasthttp.ErrBodyTooLarge)
	return ctx.Response.StatusCode()
}

// headerReceived runs after a request's headers are read and before its
// body is: it reserves the announced body (Content-Length, or
// request.max_body_bytes for a chunked body) against
// server.max_body_bytes_inflight, so a burst of large bodies cannot grow
// memory without bound (R-API-8). When the bound is full it waits for
// room, up to server.header_timeout_s, with the body left unread in the
// socket (TCP holds the client back); the body then gets a fresh
// server.header_timeout_s to arrive. A body still without room is not
// read: fasthttp refuses it as too large, and serverError answers 503.
// What it decides reaches the handler through fd.tickets.
func (fd *frontDoor) headerReceived(h *fasthttp.RequestHeader) fasthttp.RequestConfig {
	fd.tickets.receive(h)
	if fd.unauthenticated != nil && fd.unauthenticated(h) {
		// R-API-9: a request that will get 401 has its body neither read
		// nor counted; fasthttp refuses the body unread (ErrBodyTooLarge)
		// and serverError answers 401.
		fd.tickets.refuseAuth(h)
		if h.ContentLength() != 0 {
			return fasthttp.RequestConfig{MaxRequestBodySize: 1}
		}
		return fasthttp.RequestConfig{}
	}
	var need int64
	switch cl := h.ContentLength(); {
	case cl > 0:
		need = int64(cl)
	case cl == -1: // chunked: its size is known only once read
		need = fd.maxBody
	}
	if need == 0 || need > fd.maxBody {
		return fasthttp.RequestConfig{} // no body, or one fasthttp refuses with 413 unread
	}
	ok := fd.bodies.reserve(need)
	var rc fasthttp.RequestConfig
	if !ok {
		ok = fd.bodies.reserveWait(need, fd.cfg.HeaderTimeout())
		rc.ReadTimeout = fd.cfg.HeaderTimeout()
	}
	if !ok {
		fd.tickets.issueFull(h)
		return fasthttp.RequestConfig{MaxRequestBodySize: 1}
	}
	fd.tickets.issue(h, need)
	return rc
}

// holdBody makes a handler the owner of its request's body reservation,
// adjusted to the body's real length, by claiming its ticket. It
// returns the bytes now held (release them with releaseBody when the
// request ends) and false when the body does not fit the bound.
func (fd *frontDoor) holdBody(ctx *fasthttp.RequestCtx) (int64, bool) {
	reserved, full := fd.tickets.claim(&ctx.Request.Header)
	if full {
		fd.bodies.release(reserved)
		return 0, false
	}
	n := int64(len(ctx.Request.Body()))
	switch {
	case n == reserved:
	case n < reserved:
		fd.bodies.release(reserved - n)
	default:
		// The ticket expired before the handler ran (a very slow
		// scheduler), or the body was not announced: reserve it now.
		if _, ok := fd.bodies.reserveUntracked(n - reserved); !ok {
			fd.bodies.release(reserved)
			return 0, false
		}
	}
	return n, true
}

// dropBody releases the body reservation of a request whose handler does
// not keep its body.
func (fd *frontDoor) dropBody(ctx *fasthttp.RequestCtx) {
	reserved, _ := fd.tickets.claim(&ctx.Request.Header)
	fd.bodies.release(reserved)
}

// releaseBody gives back n bytes held by holdBody.
func (fd *frontDoor) releaseBody(n int64) { fd.bodies.release(n) }

// bodyBudget counts the bytes of request bodies held, against limit.
// A reservation taken before its body is read waits in tickets for the
// handler that claims it; the bytes of tickets nobody claimed come back
// through sweep.
type bodyBudget struct {
	limit   int64
	used    atomic.Int64
	tickets *doorTickets

	// Waiters for room: release closes room (and makes a new one) when
	// there are any, so the path without waiters takes no lock.
	waiters atomic.Int64
	mu      sync.Mutex
	room    chan struct{}
}

// reserveUntracked adds n to used if it fits under limit.
func (b *bodyBudget) reserveUntracked(n int64) (int64, bool) {
	for {
		used := b.used.Load()
		if used+n > b.limit {
			return used, false
		}
		if b.used.CompareAndSwap(used, used+n) {
			return used + n, true
		}
	}
}

// reserve adds n to used if it fits, sweeping expired tickets first when
// the budget looks full. The caller issues the ticket.
func (b *bodyBudget) reserve(n int64) bool {
	if _, ok := b.reserveUntracked(n); ok {
		return true
	}
	b.sweep(time.Now().UnixNano())
	_, ok := b.reserveUntracked(n)
	return ok
}

// reserveWait is reserve that waits up to wait for room.
func (b *bodyBudget) reserveWait(n int64, wait time.Duration) bool {
	b.waiters.Add(1)
	defer b.waiters.Add(-1)
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		// Take the channel before trying: a release after a failed try
		// then closes this channel or an older one, never a wake-up lost.
		b.mu.Lock()
		if b.room == nil {
			b.room = make(chan struct{})
		}
		room := b.room
		b.mu.Unlock()
		if b.reserve(n) {
			return true
		}
		select {
		case <-room:
		case <-t.C:
			return false
		}
	}
}

// release gives back n bytes and wakes the waiters for room.
func (b *bodyBudget) release(n int64) {
	if n <= 0 {
		return
	}
	b.used.Add(-n)
	if b.waiters.Load() > 0 {
		b.mu.Lock()
		if b.room != nil {
			close(b.room)
			b.room = nil
		}
		b.mu.Unlock()
	}
}

// sweep gives back the bytes of the tickets that expired before now.
func (b *bodyBudget) sweep(now int64) { b.release(b.tickets.sweep(now)) }

// sweepLoop sweeps expired tickets every ticketMargin; it exits with ctx.
func (b *bodyBudget) sweepLoop(ctx context.Context) {
	pause.Every(ctx, ticketMargin, func(now time.Time) { b.sweep(now.UnixNano()) })
}

// outcomeClientStalled ends a request whose client accepted no bytes for
// server.stall_timeout_s: a client fault, counted against no engine
// (R-TMO-6).
const outcomeClientStalled = "client_stalled"
