package engines

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// rawEngine is an HTTP/1.1 engine written on raw TCP, so that a test
// decides exactly what each connection does after each request: answer
// and keep it, answer and close it silently, or close it without an
// answer. It counts the requests it received in full.
type rawEngine struct {
	ln       net.Listener
	received atomic.Int64
	conns    atomic.Int64
	closed   atomic.Int64 // connections the engine closed
	// act decides for the n-th request received (from 1) what to do.
	act func(n int64) rawAction
	// hold is closed at cleanup; a request told rawHold waits for it.
	hold chan struct{}
	wg   sync.WaitGroup
	mu   sync.Mutex
	open []net.Conn
}

type rawAction int

const (
	rawAnswer          rawAction = iota // answer, keep the connection
	rawAnswerAndClose                   // answer, then close without saying so
	rawCloseUnanswered                  // close without answering
	rawHold                             // answer nothing until cleanup
)

const prefillCompletion = `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}]}`

func startRawEngine(t *testing.T, act func(n int64) rawAction) *rawEngine {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &rawEngine{ln: ln, act: act, hold: make(chan struct{})}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e.conns.Add(1)
			e.mu.Lock()
			e.open = append(e.open, c)
			e.mu.Unlock()
			e.wg.Add(1)
			go e.serve(c)
		}
	}()
	t.Cleanup(func() {
		close(e.hold)
		ln.Close()
		e.mu.Lock()
		for _, c := range e.open {
			c.Close()
		}
		e.mu.Unlock()
		e.wg.Wait()
	})
	return e
}

func (e *rawEngine) serve(c net.Conn) {
	defer e.wg.Done()
	defer func() {
		c.Close()
		e.closed.Add(1)
	}()
	br := bufio.NewReader(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			return
		}
		n := e.received.Add(1)
		switch e.act(n) {
		case rawCloseUnanswered:
			return
		case rawHold:
			<-e.hold
			return
		}
		resp := "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(prefillCompletion)) + "\r\n\r\n" + prefillCompletion
		if _, err := io.WriteString(c, resp); err != nil {
			return
		}
		if e.act(n) == rawAnswerAndClose {
			return
		}
	}
}

func (e *rawEngine) url() string { return "http://" + e.ln.Addr().String() }

// countingDial wraps the client's dialer: it counts dials and the
// connections open at once, and can make writes fail.
type countingDial struct {
	dials, open, peak atomic.Int64
	// failWrite, when set, decides whether the w-th write (from 1) on
	// the d-th connection dialed (from 1) fails without sending anything.
	failWrite func(d, w int64) bool
}

func (cd *countingDial) install(ps *enginePools) {
	base := ps.dial
	ps.dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := base(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		d := cd.dials.Add(1)
		n := cd.open.Add(1)
		for {
			p := cd.peak.Load()
			if n <= p || cd.peak.CompareAndSwap(p, n) {
				break
			}
		}
		return &countedConn{TCPConn: c.(*net.TCPConn), cd: cd, d: d}, nil
	}
}

type countedConn struct {
	*net.TCPConn
	cd     *countingDial
	d      int64
	writes atomic.Int64
	once   sync.Once
}

var errInjectedWrite = errors.New("injected write failure")

func (c *countedConn) Write(p []byte) (int, error) {
	w := c.writes.Add(1)
	if c.cd.failWrite != nil && c.cd.failWrite(c.d, w) {
		return 0, errInjectedWrite
	}
	return c.TCPConn.Write(p)
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.cd.open.Add(-1) })
	return c.TCPConn.Close()
}

func poolOf(t *testing.T, ps *enginePools, url string) *connPool {
	t.Helper()
	e := ps.lookup(url)
	if e.err != nil {
		t.Fatal(e.err)
	}
	return e.pool
}

func prefillOnce(c *Client, url string) error {
	req, _ := testRequest(url)
	_, err := c.Prefill(context.Background(), req)
	return err
}

// TestKeptAliveConnectionClosedByEngine: a kept-alive connection the engine
// closed while it was idle is noticed before anything is written, and the
// request goes on a fresh connection (R-OWN-4: one request received per
// prefill, never a duplicate).
func TestKeptAliveConnectionClosedByEngine(t *testing.T) {
	eng := startRawEngine(t, func(int64) rawAction { return rawAnswerAndClose })
	c := testClient(time.Second, time.Second)
	defer c.CloseIdleConnections()
	for i := range 3 {
		if err := prefillOnce(c, eng.url()); err != nil {
			t.Fatalf("prefill %d: %v", i, err)
		}
		// The engine closed its side (its FIN is then on the client's
		// socket, loopback): the next prefill finds the connection dead.
		waitFor(t, func() bool { return eng.closed.Load() == int64(i+1) })
	}
	if eng.conns.Load() != 3 {
		t.Fatalf("%d connections for 3 prefills", eng.conns.Load())
	}
	if got := eng.received.Load(); got != 3 {
		t.Fatalf("engine received %d requests for 3 prefills", got)
	}
}

// TestWriteFailureOnReusedConnectionRetriedOnce: a request whose write
// fails on a reused connection reached the engine incompletely at most,
// so it is sent once more on a fresh connection; the engine receives each
// prefill once.
func TestWriteFailureOnReusedConnectionRetriedOnce(t *testing.T) {
	eng := startRawEngine(t, func(int64) rawAction { return rawAnswer })
	c := testClient(time.Second, time.Second)
	defer c.CloseIdleConnections()
	cd := &countingDial{failWrite: func(d, w int64) bool { return d == 1 && w == 2 }}
	cd.install(c.prefillPools)
	for i := range 2 {
		if err := prefillOnce(c, eng.url()); err != nil {
			t.Fatalf("prefill %d: %v", i, err)
		}
	}
	if got, dials := eng.received.Load(), cd.dials.Load(); got != 2 || dials != 2 {
		t.Fatalf("engine received %d requests over %d dials for 2 prefills, want 2 over 2", got, dials)
	}
	// A write that fails on a fresh connection is not retried.
	cd.failWrite = func(d, w int64) bool { return d == 3 }
	c.CloseIdleConnections()
	err := prefillOnce(c, eng.url())
	wantFault(t, err, KindConnectError, 502, "prefill engine d1 unreachable")
	if got, dials := eng.received.Load(), cd.dials.Load(); got != 2 || dials != 3 {
		t.Fatalf("after a failed fresh write: received %d, dials %d, want 2 and 3", got, dials)
	}
}

// TestNoDuplicatePrefill: an engine that received a request and closed the
// reused connection without answering may have run it, so the prefill is
// not sent again: it fails, and the engine received it once.
func TestNoDuplicatePrefill(t *testing.T) {
	eng := startRawEngine(t, func(n int64) rawAction {
		if n == 2 {
			return rawCloseUnanswered
		}
		return rawAnswer
	})
	c := testClient(time.Second, time.Second)
	defer c.CloseIdleConnections()
	cd := &countingDial{}
	cd.install(c.prefillPools)
	if err := prefillOnce(c, eng.url()); err != nil {
		t.Fatal(err)
	}
	err := prefillOnce(c, eng.url())
	wantFault(t, err, KindConnectError, 502, "prefill engine d1 unreachable")
	if got, dials := eng.received.Load(), cd.dials.Load(); got != 2 || dials != 1 {
		t.Fatalf("engine received %d requests over %d dials, want 2 over 1 (no resend)", got, dials)
	}
	open, _, idle := poolOf(t, c.prefillPools, eng.url()).stats()
	if open != 0 || idle != 0 {
		t.Fatalf("pool holds %d connections (%d idle) after a failed leg", open, idle)
	}
}

// TestPoolBound: under concurrent load a prefill pool never has more
// connections open than its bound, and every leg completes.
func TestPoolBound(t *testing.T) {
	eng := startRawEngine(t, func(int64) rawAction { return rawAnswer })
	c := testClient(time.Second, time.Second)
	defer c.CloseIdleConnections()
	const bound = 4
	c.prefillPools.maxConns, c.prefillPools.maxIdle = bound, bound
	cd := &countingDial{}
	cd.install(c.prefillPools)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range 32 {
		wg.Go(func() {
			for range 20 {
				if err := prefillOnce(c, eng.url()); err != nil {
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	_, peak, _ := poolOf(t, c.prefillPools, eng.url()).stats()
	if failed.Load() != 0 || eng.received.Load() != 640 {
		t.Fatalf("%d of 640 prefills failed; engine received %d", failed.Load(), eng.received.Load())
	}
	if cd.peak.Load() > bound || peak > bound {
		t.Fatalf("%d connections open at once (pool counted %d), bound %d", cd.peak.Load(), peak, bound)
	}
	t.Logf("640 prefills from 32 goroutines over %d dials, at most %d open", cd.dials.Load(), cd.peak.Load())
}

// TestCancelUnparksBlockedRead: a leg blocked reading its engine returns
// as soon as its context ends (R-OWN-5: a departed client ends the leg at
// once), for a decode stream parked between tokens and a prefill waiting
// for its answer; the cancelled connection is closed, never pooled.
func TestCancelUnparksBlockedRead(t *testing.T) {
	srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{wait: time.Hour})
	c := testClient(time.Hour, time.Hour)
	defer c.CloseIdleConnections()
	var worst time.Duration
	var all []time.Duration
	for range 10 {
		ctx, cancel := context.WithCancelCause(context.Background())
		req, res := testRequest(srv.URL)
		s, err := c.Decode(ctx, req, res)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := s.Next(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { _, _, err := s.Next(); done <- err }()
		waitParked(t, "(*Stream).Next")
		start := time.Now()
		cancel(ErrClientGone)
		err = <-done
		el := time.Since(start)
		wantFault(t, err, KindClientGone, 499, "client disconnected")
		s.Close()
		all = append(all, el)
		worst = max(worst, el)
	}
	if open, _, idle := poolOf(t, c.decodePools, srv.URL).stats(); open != 0 || idle != 0 {
		t.Fatalf("decode pool holds %d connections (%d idle) after cancelled legs", open, idle)
	}
	slices.Sort(all)
	t.Logf("decode: a parked read returned %v after cancel (median), %v at worst", all[len(all)/2], worst)
	if worst > 50*time.Millisecond {
		t.Fatalf("a parked read returned %v after cancel", worst)
	}

	eng := startRawEngine(t, func(int64) rawAction { return rawHold })
	ctx, cancel := context.WithCancelCause(context.Background())
	done := make(chan error, 1)
	go func() {
		req, _ := testRequest(eng.url())
		_, err := c.Prefill(ctx, req)
		done <- err
	}()
	waitParked(t, "(*Client).Prefill")
	start := time.Now()
	cancel(ErrClientGone)
	err := <-done
	el := time.Since(start)
	wantFault(t, err, KindClientGone, 499, "client disconnected")
	t.Logf("prefill: a parked read returned %v after cancel", el)
	if el > 50*time.Millisecond {
		t.Fatalf("a parked prefill read returned %v after cancel", el)
	}
	if open, _, idle := poolOf(t, c.prefillPools, eng.url()).stats(); open != 0 || idle != 0 {
		t.Fatalf("prefill pool holds %d connections (%d idle) after a cancelled leg", open, idle)
	}
}

// TestCancelledConnectionNeverPooled: connections whose leg ended by the
// first-token budget (R-TMO-1), by the between-chunk bound (R-TMO-3) or
// before [DONE] are closed; only a stream read to its end returns its
// connection to the pool, and the next stream reuses it.
func TestCancelledConnectionNeverPooled(t *testing.T) {
	c := testClient(300*time.Millisecond, 300*time.Millisecond)
	defer c.CloseIdleConnections()
	for _, tc := range []struct {
		name  string
		steps []step
		kind  FaultKind
	}{
		{"first-token budget", []step{{send: data(roleChunk)}, {wait: time.Hour}}, KindFirstTokenTimeout},
		{"between-chunk bound", []step{{send: data(tokenChunk)}, {wait: time.Hour}}, KindMidStreamSilence},
	} {
		srv := scripted(t, 0, 200, tc.steps...)
		r := runStream(context.Background(), c, srv.URL)
		var f *Fault
		if !errors.As(r.err, &f) || f.Kind != tc.kind {
			t.Fatalf("%s: %v", tc.name, r.err)
		}
		if open, _, idle := poolOf(t, c.decodePools, srv.URL).stats(); open != 0 || idle != 0 {
			t.Fatalf("%s: pool holds %d connections (%d idle)", tc.name, open, idle)
		}
	}
	srv := scripted(t, 0, 200, step{send: data(tokenChunk)}, step{send: data("[DONE]")})
	for i := range 2 {
		if r := runStream(context.Background(), c, srv.URL); r.err != nil {
			t.Fatal(r.err)
		}
		if open, _, idle := poolOf(t, c.decodePools, srv.URL).stats(); open != 1 || idle != 1 {
			t.Fatalf("stream %d read to its end: pool holds %d connections (%d idle), want 1 idle", i, open, idle)
		}
	}
}

// waitParked waits until a goroutine running fn is parked in the network
// poller (a blocked read), by reading every goroutine's stack.
func waitParked(t *testing.T, fn string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		n := runtime.Stack(buf, true)
		for g := range strings.SplitSeq(string(buf[:n]), "\n\n") {
			if strings.Contains(g, fn) && strings.Contains(g, "runtime_pollWait") {
				return
			}
		}
		runtime.Gosched()
	}
	t.Fatalf("no goroutine in %s parked on the network", fn)
}

// waitFor polls cond for up to 10 s (a socket state change, not a timer).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, 10*time.Second, "the socket's state", cond)
}

// TestPoolWaiterGivesUp: a leg waiting at the pool's bound ends with its
// context (R-TMO-5: the request deadline bounds the wait too) and leaves
// the pool's count of connections right.
func TestPoolWaiterGivesUp(t *testing.T) {
	eng := startRawEngine(t, func(n int64) rawAction {
		if n == 1 {
			return rawHold
		}
		return rawAnswer
	})
	c := testClient(time.Second, time.Second)
	defer c.CloseIdleConnections()
	c.prefillPools.maxConns = 1
	holder, release := context.WithCancelCause(context.Background())
	done := make(chan error, 1)
	go func() {
		req, _ := testRequest(eng.url())
		_, err := c.Prefill(holder, req)
		done <- err
	}()
	waitParked(t, "(*Client).Prefill")
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	req, _ := testRequest(eng.url())
	_, err := c.Prefill(ctx, req)
	wantFault(t, err, KindRequestTimeout, 504, MsgRequestTimeout)
	release(ErrClientGone)
	<-done
	p := poolOf(t, c.prefillPools, eng.url())
	p.mu.Lock()
	open, waiters := p.open, len(p.waiters)
	p.mu.Unlock()
	if open != 0 || waiters != 0 {
		t.Fatalf("pool counts %d connections and %d waiters after both legs ended", open, waiters)
	}
	if err := prefillOnce(c, eng.url()); err != nil {
		t.Fatalf("the slot was not freed: %v", err)
	}
}

// TestIdleConnectionsClosedAfterTimeout: a kept-alive connection unused
// for the idle timeout is closed.
func TestIdleConnectionsClosedAfterTimeout(t *testing.T) {
	eng := startRawEngine(t, func(int64) rawAction { return rawAnswer })
	c := testClient(time.Second, time.Second)
	defer c.CloseIdleConnections()
	p := poolOf(t, c.prefillPools, eng.url())
	p.idleTimeout = 50 * time.Millisecond
	if err := prefillOnce(c, eng.url()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { open, _, idle := p.stats(); return open == 0 && idle == 0 })
	waitFor(t, func() bool { return eng.closed.Load() == 1 })
}
