package engines

import (
	"context"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// dialError is the error net.Dialer returns when the socket call fails
// with errno: a *net.OpError wrapping an *os.SyscallError.
func dialError(call string, errno syscall.Errno) error {
	return &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9}, Err: os.NewSyscallError(call, errno)}
}

// TestRouterResourceClassifiesErrnosRFAIL9 proves the classification of
// behaviour.md R-FAIL-9: each errno that says the router ran out of
// something of its own, anywhere in a dial's error chain, names that
// resource; an engine's refusal or reset names none.
func TestRouterResourceClassifiesErrnosRFAIL9(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{dialError("socket", syscall.EMFILE), ResourceEMFILE},
		{dialError("socket", syscall.ENFILE), ResourceENFILE},
		{dialError("socket", syscall.ENOBUFS), ResourceENOBUFS},
		{dialError("connect", syscall.EADDRNOTAVAIL), ResourceEADDRNOTAVAIL},
		{dialError("socket", syscall.ENOMEM), ResourceENOMEM},
		{fmt.Errorf("leg: %w", dialError("socket", syscall.EMFILE)), ResourceEMFILE},
		{fmt.Errorf("%w: %w", errPoolFull, errPrefillTimeout), ResourcePool},
		{&net.DNSError{Err: "dial udp 10.0.0.53:53: socket: too many open files", Name: "p1.svc", Server: "10.0.0.53:53"}, ResourceEMFILE},
		{fmt.Errorf("dial tcp: %w", &net.DNSError{Err: "dial udp 10.0.0.53:53: socket: no buffer space available", Name: "p1.svc"}), ResourceENOBUFS},
		{&net.DNSError{Err: "no such host", Name: "p1.svc", IsNotFound: true}, ""},
		{dialError("connect", syscall.ECONNREFUSED), ""},
		{dialError("read", syscall.ECONNRESET), ""},
		{errPrefillTimeout, ""},
		{nil, ""},
	} {
		if got := RouterResource(c.err); got != c.want {
			t.Errorf("RouterResource(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}

// failingDial makes every dial of ps fail with err, counting the dials.
func failingDial(ps *enginePools, err error) *int {
	n := new(int)
	ps.dial = func(context.Context, string, string) (net.Conn, error) {
		*n++
		return nil, err
	}
	return n
}

// TestLocalDialFailureIsRouterResourcesRFAIL9 proves that a leg whose dial
// fails because the router is out of descriptors is router_resources on
// both phases (behaviour.md R-FAIL-9): 503, not transient, not an engine
// fault, never towards ejection, its resource named; and that the
// request's own end still wins (a client that went away is
// client_disconnected). An engine that refuses the connection stays a
// connect_error.
func TestLocalDialFailureIsRouterResourcesRFAIL9(t *testing.T) {
	c := testClient(time.Second, time.Second)
	defer c.CloseIdleConnections()
	emfile := dialError("socket", syscall.EMFILE)
	failingDial(c.prefillPools, emfile)
	failingDial(c.decodePools, emfile)
	url := "http://127.0.0.1:9"

	check := func(phase string, err error) {
		t.Helper()
		f := wantFault(t, err, KindRouterResources, 503, "router out of local resources (emfile")
		if f.Resource != ResourceEMFILE || f.Phase != phase || f.Transient() || f.EngineFault() || f.CountsTowardEjection() {
			t.Errorf("%s: resource %q phase %s transient %v engine %v counts %v", phase, f.Resource, f.Phase, f.Transient(), f.EngineFault(), f.CountsTowardEjection())
		}
	}
	req, res := testRequest(url)
	_, err := c.Prefill(context.Background(), req)
	check("prefill", err)
	_, err = c.Decode(context.Background(), req, res)
	check("decode", err)

	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(ErrClientGone)
	_, err = c.Prefill(ctx, req)
	wantFault(t, err, KindClientGone, 499, "client disconnected")

	failingDial(c.prefillPools, dialError("connect", syscall.ECONNREFUSED)) // a new pool, for a new engine
	req, _ = testRequest("http://127.0.0.1:10")
	_, err = c.Prefill(context.Background(), req)
	wantFault(t, err, KindConnectError, 502, "prefill engine d1 unreachable")
}

// TestPoolWaitIsRouterResourcesRFAIL9 proves that a prefill leg whose
// timer runs out while it waits at the router's own pool bound, without
// a connection to the engine ever being tried, is router_resources with
// resource pool (behaviour.md R-FAIL-9).
func TestPoolWaitIsRouterResourcesRFAIL9(t *testing.T) {
	eng := startRawEngine(t, func(int64) rawAction { return rawAnswer })
	c := NewClient(Options{PrefillTimeout: 200 * time.Millisecond, FirstTokenTimeout: time.Second, HandoffMaxAge: time.Minute})
	defer c.CloseIdleConnections()
	c.prefillPools.maxConns, c.prefillPools.maxIdle = 1, 1
	pool := poolOf(t, c.prefillPools, eng.url())
	held, err := pool.get(context.Background(), false) // the pool's one connection, busy
	if err != nil {
		t.Fatal(err)
	}
	err = prefillOnce(c, eng.url())
	f := wantFault(t, err, KindRouterResources, 503, "router out of local resources (pool")
	if f.Resource != ResourcePool || f.CountsTowardEjection() || f.EngineFault() {
		t.Errorf("resource %q counts %v engine %v", f.Resource, f.CountsTowardEjection(), f.EngineFault())
	}
	if got := eng.conns.Load(); got > 1 {
		t.Errorf("engine saw %d connections, want 1: the waiting leg dialed", got)
	}
	pool.discard(held)
	if err := prefillOnce(c, eng.url()); err != nil {
		t.Fatalf("a prefill once the pool has room: %v", err)
	}
}
