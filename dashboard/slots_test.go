package dashboard

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// serveOn starts d's own server (Serve's, without the bus feed) on a
// loopback listener and returns its address.
func serveOn(t *testing.T, d *Dashboard) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	srv := d.server(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		cancel()
		_ = srv.Close()
		<-done
	})
	return ln.Addr().String()
}

// dialNonReader connects to addr with a 4 KiB receive buffer (Linux
// reserves 8 KiB), set before the connection is made so the TCP window
// stays small, asks for the event stream and reads its response headers;
// then it reads nothing more. It returns the connection and the status.
func dialNonReader(addr string) (net.Conn, int, error) {
	c, err := testkit.DialSmallWindow(addr)
	if err != nil {
		return nil, 0, err
	}
	fmt.Fprintf(c, "GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(testBound))
	resp, err := http.ReadResponse(bufio.NewReaderSize(c, 512), nil)
	if err != nil {
		c.Close()
		return nil, 0, err
	}
	_ = c.SetReadDeadline(time.Time{})
	return c, resp.StatusCode, nil
}

// viewer follows the event stream at addr as a browser does, counting
// the snapshots it receives until ctx ends.
type viewer struct {
	mu     sync.Mutex
	states int
	err    error
}

func followStream(ctx context.Context, addr string) (*viewer, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/events", nil)
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != 200 {
		resp.Body.Close()
		return nil, fmt.Errorf("viewer: HTTP %d", resp.StatusCode)
	}
	v := &viewer{}
	go func() {
		defer resp.Body.Close()
		r := bufio.NewReader(resp.Body)
		for {
			line, err := r.ReadString('\n')
			v.mu.Lock()
			if err != nil {
				if ctx.Err() == nil {
					v.err = err
				}
				v.mu.Unlock()
				return
			}
			if strings.HasPrefix(line, "event: state") {
				v.states++
			}
			v.mu.Unlock()
		}
	}()
	return v, nil
}

func (v *viewer) seen() (int, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.states, v.err
}

// TestNonReadingBrowsersGiveSlotsBack floods the fleet page with 100
// browsers that never read their event stream, over real sockets: the
// first MaxStreams (less the one a real viewer holds) get a stream, the
// rest 503 at once, and every held slot is given back within the
// documented bound (releaseBound: keep-alive comments fill the small
// buffers, then a write fails after the write bound), after which a new
// viewer is served; the viewer that reads all along keeps getting
// snapshots, the flood notwithstanding. The bounds are short here
// (keep-alive every 200 ms, write bound 1 s); TestDefaultReleaseBound
// checks the defaults.
func TestNonReadingBrowsersGiveSlotsBack(t *testing.T) {
	d := New(Options{})
	d.bounds.writeBound = time.Second
	d.bounds.keepAliveEvery = 200 * time.Millisecond
	addr := serveOn(t, d)
	ctx := testContext(t)
	reader, err := followStream(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}

	const n = 100
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		held    int
		refused int
		last    time.Time
	)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, status, err := dialNonReader(addr)
			if err != nil {
				t.Error(err)
				return
			}
			t.Cleanup(func() { c.Close() })
			mu.Lock()
			defer mu.Unlock()
			switch status {
			case 200:
				held++
				last = time.Now()
			case http.StatusServiceUnavailable:
				refused++
			default:
				t.Errorf("non-reader: HTTP %d", status)
			}
		}()
	}
	wg.Wait()
	if held != MaxStreams-1 || refused != n-held {
		t.Fatalf("%d streams held, %d refused; want %d and %d", held, refused, MaxStreams-1, n-MaxStreams+1)
	}
	// Each non-reader is released within the bound of its connect; the
	// last one connected at last. The slack covers a race-instrumented
	// server on two shared cores.
	bound := d.bounds.releaseBound(heldBytes)
	const slack = 2 * time.Second
	within := time.Until(last.Add(bound + slack))
	testkit.WaitFor(t, within, "every non-reader's slot to be given back", func() bool { return d.streams.Load() == 1 })
	t.Logf("%d non-readers released %v after the last connected (bound %v)", held, time.Since(last), bound)

	// A new viewer is served at once, and the one that read all along
	// still follows.
	before, _ := reader.seen()
	v2, err := followStream(ctx, addr)
	if err != nil {
		t.Fatalf("a viewer after the flood: %v", err)
	}
	testkit.WaitFor(t, 3*time.Second, "both viewers to receive snapshots", func() bool {
		a, _ := reader.seen()
		b, _ := v2.seen()
		return a > before && b > 0
	})
	if got, err := reader.seen(); err != nil || got < 2 {
		t.Errorf("the reading viewer got %d snapshots, error %v", got, err)
	}
}

// TestDefaultReleaseBound checks that the default parts add up to at most
// 15 s for a browser whose receive buffer holds 8 KiB (docs/observability.md,
// the fleet page), and measures it over real sockets with eight browsers
// that never read.
func TestDefaultReleaseBound(t *testing.T) {
	b := defaultBounds()
	bound := b.releaseBound(heldBytes)
	if bound > 15*time.Second {
		t.Fatalf("default release bound %v, want at most 15 s", bound)
	}
	if len(b.keepAlive) != keepAliveBytes || b.keepAlive[0] != ':' || !strings.HasSuffix(string(b.keepAlive), "\n\n") || strings.Count(string(b.keepAlive), "\n") != 2 {
		t.Fatalf("keep-alive comment %q…", b.keepAlive[:8])
	}
	if testing.Short() {
		t.Skip("the measurement takes the default bound (about 14 s)")
	}
	d := New(Options{})
	addr := serveOn(t, d)
	start := time.Now()
	for i := 0; i < 8; i++ {
		c, status, err := dialNonReader(addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if status != 200 {
			t.Fatalf("HTTP %d", status)
		}
	}
	testkit.WaitFor(t, bound+2*time.Second, "the non-readers' slots to be given back", func() bool { return d.streams.Load() == 0 })
	t.Logf("released %v after the first connected (bound %v)", time.Since(start), bound)
	if took := time.Since(start); took < b.writeBound {
		t.Errorf("released after %v, before the write bound %v: a reader on a slow link would be cut off too", took, b.writeBound)
	}
}

// closeCounter is a listener whose accepted connections count their
// closes.
type closeCounter struct {
	net.Listener
	closed chan struct{}
}

func (l *closeCounter) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &countedConn{Conn: c, closed: l.closed}, nil
}

type countedConn struct {
	net.Conn
	once   sync.Once
	closed chan struct{}
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.closed <- struct{}{} })
	return c.Conn.Close()
}

// TestNonReadingClientOfThePageIsReleased: a client that asks for the
// page's files again and again on one connection (pipelined) and reads
// none of the answers fills its buffers; the server's write then blocks.
// It must give the connection (and its goroutine) back within the
// response bound, as an event stream's does within its write bound —
// otherwise enough such clients hold every descriptor of the dashboard
// and lock the fleet page out.
func TestNonReadingClientOfThePageIsReleased(t *testing.T) {
	d := New(Options{})
	d.bounds.response = time.Second
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cl := &closeCounter{Listener: ln, closed: make(chan struct{}, 8)}
	ctx, cancel := context.WithCancel(context.Background())
	srv := d.server(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(cl)
	}()
	defer func() {
		cancel()
		_ = srv.Close()
		<-done
	}()
	c, err := testkit.DialSmallWindow(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// 300 answers of app.js are about 3 MB: far more than the buffers take.
	if _, err := c.Write([]byte(strings.Repeat("GET /app.js HTTP/1.1\r\nHost: x\r\n\r\n", 300))); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	select {
	case <-cl.closed:
		t.Logf("released %v after the requests were sent", time.Since(start))
	case <-time.After(d.bounds.response + 5*time.Second):
		t.Fatalf("a client that reads none of its answers still holds its connection %v later", time.Since(start))
	}
}
