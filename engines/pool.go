package engines

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The engine legs run on connections of the client's own: one small pool
// per engine and leg kind, bounded, kept alive, closed after an idle
// timeout. A leg runs on its caller's goroutine — no connection goroutines,
// no hand-offs — and is cancelled by setting the connection's deadline to
// the past from context.AfterFunc, which unparks a blocked read or write at
// once. A connection whose deadline was set that way is closed, never
// returned to the pool.

const (
	// idleConnTimeout closes a kept-alive connection nobody used for that
	// long (as net/http's IdleConnTimeout in NewTransport).
	idleConnTimeout = 90 * time.Second
	// maxIdlePerEngine bounds the idle connections one decode pool keeps.
	maxIdlePerEngine = 1024
	// dialKeepAlive is the TCP keep-alive period of engine connections.
	dialKeepAlive = 30 * time.Second
)

// aLongTimeAgo is the deadline that aborts a connection's reads and writes.
var aLongTimeAgo = time.Unix(1, 0)

// engineConn is one connection to an engine.
type engineConn struct {
	net.Conn
	pool *connPool
	// raw is the TCP socket under Conn, for the liveness check of a reused
	// connection; nil when the connection is not a TCP socket.
	raw       syscall.RawConn
	peekFn    func(fd uintptr) bool // c.peek, bound once
	peekAlive bool
	abortFn   func() // c.abort, bound once
	idleSince time.Time
	reused    bool
}

// abort sets the connection's deadline to the past: a blocked read or
// write returns at once with os.ErrDeadlineExceeded.
func (c *engineConn) abort() { _ = c.Conn.SetDeadline(aLongTimeAgo) }

// alive reports whether an idle connection can carry a request: its engine
// has neither closed it nor sent anything unasked (a non-blocking peek,
// one syscall).
func (c *engineConn) alive() bool {
	if c.raw == nil {
		return true
	}
	c.peekAlive = false
	if err := c.raw.Read(c.peekFn); err != nil {
		return false
	}
	return c.peekAlive
}

// connPool holds the connections of one engine for one leg kind.
type connPool struct {
	addr        string      // host:port to dial
	tlsConfig   *tls.Config // nil for http://
	maxConns    int         // 0: no bound
	maxIdle     int
	dial        func(ctx context.Context, network, addr string) (net.Conn, error)
	idleTimeout time.Duration

	mu      sync.Mutex
	idle    []*engineConn // most recently used last
	open    int           // connections open (idle and in use) or being dialed
	peak    int           // the most open at once (tests)
	waiters []*poolWaiter // legs waiting at the bound, oldest first
	sweep   *time.Timer
}

// poolWaiter is a leg waiting at the pool's bound. It is handed either a
// connection another leg finished with, or nil: a slot is its to dial.
type poolWaiter struct{ ch chan *engineConn }

// get returns a connection to the pool's engine: the most recently used
// idle one that is still alive, else a new one when the bound allows,
// else it waits, in arrival order, for one until ctx ends. fresh skips
// idle connections.
func (p *connPool) get(ctx context.Context, fresh bool) (*engineConn, error) {
	for {
		p.mu.Lock()
		if !fresh && len(p.idle) > 0 {
			c := p.idle[len(p.idle)-1]
			p.idle[len(p.idle)-1] = nil
			p.idle = p.idle[:len(p.idle)-1]
			p.mu.Unlock()
			if c, ok := p.check(c); ok {
				return c, nil
			}
			continue
		}
		if p.maxConns <= 0 || p.open < p.maxConns {
			p.open++
			p.peak = max(p.peak, p.open)
			p.mu.Unlock()
			return p.connectSlot(ctx)
		}
		w := &poolWaiter{ch: make(chan *engineConn, 1)}
		p.waiters = append(p.waiters, w)
		p.mu.Unlock()
		var c *engineConn
		select {
		case c = <-w.ch:
		case <-ctx.Done():
			p.mu.Lock()
			if i := slices.Index(p.waiters, w); i >= 0 {
				p.waiters = slices.Delete(p.waiters, i, i+1)
				p.mu.Unlock()
				return nil, poolWaitError(ctx)
			}
			p.mu.Unlock()
			// Handed something just now: give it back.
			if c = <-w.ch; c != nil {
				p.put(c)
			} else {
				p.release()
			}
			return nil, poolWaitError(ctx)
		}
		if c == nil {
			return p.connectSlot(ctx)
		}
		if c, ok := p.check(c); ok {
			return c, nil
		}
	}
}

// poolWaitError is the error of a leg whose ctx ended while it waited at
// the pool's bound: the context's cause, marked as errPoolFull (the
// router's own limit, behaviour.md R-FAIL-9). The request's own end (the
// client gone, its deadline) still wins in classifyTransport.
func poolWaitError(ctx context.Context) error {
	return fmt.Errorf("%w: %w", errPoolFull, context.Cause(ctx))
}

// check returns c when it is fit for reuse; otherwise it closes it.
func (p *connPool) check(c *engineConn) (*engineConn, bool) {
	if time.Since(c.idleSince) < p.idleTimeout && c.alive() {
		c.reused = true
		return c, true
	}
	p.discard(c)
	return nil, false
}

// connectSlot dials a connection in a slot already counted in p.open,
// freeing the slot when the dial fails.
func (p *connPool) connectSlot(ctx context.Context) (*engineConn, error) {
	c, err := p.connect(ctx)
	if err != nil {
		p.release()
		return nil, err
	}
	return c, nil
}

// connect dials the engine (and runs the TLS handshake for https://),
// bounded by ctx.
func (p *connPool) connect(ctx context.Context) (*engineConn, error) {
	nc, err := p.dial(ctx, "tcp", p.addr)
	if err != nil {
		return nil, err
	}
	c := &engineConn{Conn: nc, pool: p}
	if sc, ok := nc.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			c.raw = raw
			c.peekFn = c.peek
		}
	}
	if p.tlsConfig != nil {
		tc := tls.Client(nc, p.tlsConfig)
		if err := tc.HandshakeContext(ctx); err != nil {
			nc.Close()
			return nil, err
		}
		c.Conn = tc
	}
	c.abortFn = c.abort
	return c, nil
}

// put returns a connection that finished its leg cleanly: to the oldest
// waiting leg, else to the idle list.
func (p *connPool) put(c *engineConn) {
	c.idleSince = time.Now()
	p.mu.Lock()
	if len(p.waiters) > 0 {
		w := p.waiters[0]
		p.waiters = slices.Delete(p.waiters, 0, 1)
		w.ch <- c
		p.mu.Unlock()
		return
	}
	if len(p.idle) >= p.maxIdle {
		p.mu.Unlock()
		p.discard(c)
		return
	}
	p.idle = append(p.idle, c)
	if p.sweep == nil {
		p.sweep = time.AfterFunc(p.idleTimeout, p.sweepIdle)
	} else if len(p.idle) == 1 {
		p.sweep.Reset(p.idleTimeout)
	}
	p.mu.Unlock()
}

// discard closes a connection and frees its slot.
func (p *connPool) discard(c *engineConn) {
	_ = c.Conn.Close()
	p.release()
}

// release frees one connection slot: the oldest waiting leg gets it.
func (p *connPool) release() {
	p.mu.Lock()
	if len(p.waiters) > 0 {
		w := p.waiters[0]
		p.waiters = slices.Delete(p.waiters, 0, 1)
		w.ch <- nil // the slot stays counted in p.open, now the waiter's
	} else {
		p.open--
	}
	p.mu.Unlock()
}

// sweepIdle closes the connections idle for longer than the idle timeout
// and re-arms for the oldest that remains.
func (p *connPool) sweepIdle() {
	p.mu.Lock()
	now := time.Now()
	var expired []*engineConn
	keep := p.idle[:0]
	for _, c := range p.idle {
		if now.Sub(c.idleSince) >= p.idleTimeout {
			expired = append(expired, c)
		} else {
			keep = append(keep, c)
		}
	}
	clear(p.idle[len(keep):])
	p.idle = keep
	if len(p.idle) > 0 {
		p.sweep.Reset(p.idleTimeout - now.Sub(p.idle[0].idleSince))
	}
	p.mu.Unlock()
	for _, c := range expired {
		p.discard(c)
	}
}

// closeIdle closes every idle connection.
func (p *connPool) closeIdle() {
	p.mu.Lock()
	idle := p.idle
	p.idle = nil
	if p.sweep != nil {
		p.sweep.Stop()
	}
	p.mu.Unlock()
	for _, c := range idle {
		p.discard(c)
	}
}

// stats returns the connections open now and the most open at once.
func (p *connPool) stats() (open, peak, idle int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.open, p.peak, len(p.idle)
}

// engineTarget is an engine base URL split for the client's own legs.
type engineTarget struct {
	addr   string // host:port
	host   string // the Host header
	prefix string // the base URL's path, without a trailing slash
	tls    bool
}

// parseTarget splits an engine base URL ("http://10.0.0.11:8000",
// "https://e1:8443/v") for dialing.
func parseTarget(base string) (engineTarget, error) {
	u, err := url.Parse(base)
	if err != nil {
		return engineTarget{}, err
	}
	var t engineTarget
	switch u.Scheme {
	case "http":
	case "https":
		t.tls = true
	default:
		return engineTarget{}, errors.New("unsupported protocol scheme " + `"` + u.Scheme + `"`)
	}
	if u.Host == "" {
		return engineTarget{}, errors.New("no host in engine URL")
	}
	t.host = u.Host
	t.addr = u.Host
	if u.Port() == "" {
		port := "80"
		if t.tls {
			port = "443"
		}
		t.addr = net.JoinHostPort(u.Hostname(), port)
	}
	t.prefix = strings.TrimRight(u.EscapedPath(), "/")
	return t, nil
}

// enginePools are the client's connection pools, one per engine base URL
// and leg kind.
type enginePools struct {
	maxConns int // per engine; 0 means no bound
	maxIdle  int
	tls      *tls.Config
	dial     func(ctx context.Context, network, addr string) (net.Conn, error)

	mu    sync.RWMutex
	pools map[string]*poolEntry
}

// poolEntry is one engine's pool and its parsed base URL.
type poolEntry struct {
	target engineTarget
	pool   *connPool
	err    error // the base URL could not be parsed
}

// lookup returns the pool of the engine at base, creating it on first use.
func (ps *enginePools) lookup(base string) *poolEntry {
	ps.mu.RLock()
	e := ps.pools[base]
	ps.mu.RUnlock()
	if e != nil {
		return e
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if e = ps.pools[base]; e != nil {
		return e
	}
	e = &poolEntry{}
	e.target, e.err = parseTarget(base)
	if e.err == nil {
		p := &connPool{addr: e.target.addr, maxConns: ps.maxConns, maxIdle: ps.maxIdle, dial: ps.dial, idleTimeout: idleConnTimeout}
		if e.target.tls {
			cfg := ps.tls.Clone()
			cfg.ServerName = hostOnly(e.target.host)
			p.tlsConfig = cfg
		}
		e.pool = p
	}
	if ps.pools == nil {
		ps.pools = map[string]*poolEntry{}
	}
	ps.pools[base] = e
	return e
}

// closeIdle closes the idle connections of every pool.
func (ps *enginePools) closeIdle() {
	ps.mu.RLock()
	defer ps.mu.RUnlock()
	for _, e := range ps.pools {
		if e.pool != nil {
			e.pool.closeIdle()
		}
	}
}

// hostOnly is host without its port.
func hostOnly(host string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		return strings.Trim(h, "[]")
	}
	return strings.Trim(host, "[]")
}

// Pooled read buffers: prefill responses are read whole, in one read when
// they fit; decode streams hold theirs while open.
var (
	prefillReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 16<<10) }}
	decodeReaders  = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}
	requestBufs    = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}
)
