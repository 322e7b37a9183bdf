// Package dashboard is the live fleet page of `narwhal dashboard` and
// `narwhal dev`: a bus viewer (behaviour.md R-BUS-5; a viewer credential
// suffices, R-BUS-8) that follows the event stream and the placement,
// fleet, routers and chaos buckets, and serves one page — HTML, CSS and
// JavaScript embedded in the binary, no build step, nothing fetched from
// elsewhere — that the browser keeps up to date from a Server-Sent Events
// stream.
//
// Nothing on the page can change anything: the handler answers GET and
// HEAD only, every text from the bus is shown as text (the script sets
// textContent, never HTML), and a strict Content-Security-Policy allows
// the page's own script and style alone.
package dashboard

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/pause"
)

//go:embed page
var pageFS embed.FS

// Serving limits.
const (
	// MaxStreams is how many browsers may follow the page at once; one
	// more gets 503.
	MaxStreams = 64
	// minPush is the shortest interval between two snapshots sent to one
	// browser: changes within it are sent together.
	minPush = 200 * time.Millisecond
	// maxQuiet is the longest interval between two snapshots: rates and
	// quarantines move with time alone, and the page shows the stream is
	// alive.
	maxQuiet = time.Second
	// writeBound bounds each write to a browser; a browser that does not
	// read loses its stream once a write blocks this long.
	writeBound = 5 * time.Second
	// keepAliveEvery is the interval of the keep-alive comments of an
	// event stream: the stream writes even when the fleet is silent, so a
	// browser that does not read fills its buffers and its next write
	// blocks.
	keepAliveEvery = 2 * time.Second
	// keepAliveBytes is the size of one keep-alive comment (an SSE line
	// starting with ':', which the browser ignores).
	keepAliveBytes = 8 << 10
	// eventsSendBuffer is the kernel send buffer asked for an event
	// stream's connection (SO_SNDBUF; Linux reserves twice it): what the
	// kernel takes for a browser that does not read stays small, instead
	// of growing to megabytes. A browser then gets at most 16 KiB a round
	// trip: 80 KB/s at 200 ms, a snapshot of 1024 engines well within
	// writeBound.
	eventsSendBuffer = 8 << 10
	// heldBytes is what the stream's writes may still hand the kernel
	// once its browser stops reading, for the bound of a browser whose
	// receive buffer holds at most 8 KiB (SO_RCVBUF 4096 on Linux): Linux's
	// 16 KiB of send buffer for eventsSendBuffer and that receive buffer,
	// rounded up.
	heldBytes = 32 << 10
	// responseBound bounds the whole answer to every request but an event
	// stream (the server's WriteTimeout; an event stream bounds each of
	// its writes by writeBound instead): a client that asks for the page
	// and reads nothing gives its connection back.
	responseBound = 10 * time.Second
	// shutdownBound bounds the graceful stop of the HTTP server.
	shutdownBound = 5 * time.Second
)

// ContentSecurityPolicy is the policy of every response: the page's own
// script, style and icon, its own event stream, nothing else — no inline
// script or style, no frames, no forms.
const ContentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; " +
	"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// Dashboard is the page and the state behind it. Create it with New, feed
// it with Run (or Serve, which does both), serve Handler. It is safe for
// concurrent use.
type Dashboard struct {
	st      *state
	bounds  streamBounds
	b       *bus.Bus
	log     *slog.Logger
	streams atomic.Int64
	static  fs.FS
	// start is when New was called: request events count from then on.
	start time.Time
}

// Options configure a Dashboard.
type Options struct {
	// Bus is the bus it follows (a viewer's credential suffices).
	Bus *bus.Bus
	// Log, when set, receives the bus watches' warnings.
	Log *slog.Logger
	// Fleet lists engines to show before, or without, a key in the live
	// fleet's bucket (a config file's fleet: list, as `narwhal dev`'s
	// routers use it); the bucket's role wins when it has one.
	Fleet []Engine
}

// Engine is an engine of a config file's fleet.
type Engine struct {
	// ID is the engine id; Role is "prefill", "decode" or "both".
	ID, Role string
}

// New returns a Dashboard that shows what opts.Bus carries.
func New(opts Options) *Dashboard {
	b, log := opts.Bus, opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	static, err := fs.Sub(pageFS, "page")
	if err != nil {
		panic(err) // the embedded folder exists: not reached
	}
	d := &Dashboard{st: newState(time.Now), b: b, log: log, static: static, start: time.Now(), bounds: defaultBounds()}
	d.st.configure(opts.Fleet)
	return d
}

// Run follows the bus until ctx ends: a watch of each bucket and a
// consumer of each event kind, each set up again when it ends. Failures,
// ejections, readmissions, probes, quarantines and fleet changes of the
// hour before New are replayed at start; request events count from New
// on.
func (d *Dashboard) Run(ctx context.Context) {
	feed(ctx, d.b, d.st, d.start, d.log)
}

// Serve runs the dashboard on ln until ctx ends: the bus feed (Run) and
// an HTTP server with Handler, whose open event streams end with ctx. It
// returns nil after a clean stop, or the server's error.
func (d *Dashboard) Serve(ctx context.Context, ln net.Listener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		d.Run(ctx)
	}()
	srv := d.server(ctx)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	var err error
	select {
	case err = <-errc:
	case <-ctx.Done():
		sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownBound)
		_ = srv.Shutdown(sctx)
		scancel()
		err = <-errc
	}
	cancel()
	wg.Wait()
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// server returns the HTTP server of Serve, whose requests' contexts
// derive from ctx and carry their connection (connKey), so that an event
// stream can make its send buffer small.
func (d *Dashboard) server(ctx context.Context) *http.Server {
	return &http.Server{
		Handler:           d.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      d.bounds.response,
		IdleTimeout:       90 * time.Second,
		MaxHeaderBytes:    16 << 10,
		BaseContext:       func(net.Listener) context.Context { return ctx },
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, c)
		},
		ErrorLog: slog.NewLogLogger(d.log.Handler(), slog.LevelDebug),
	}
}

// connKey is the context key of a request's connection (a net.Conn).
type connKey struct{}

// streamBounds are the parts of the bound on how long a browser that does
// not read holds one of the MaxStreams slots (releaseBound).
type streamBounds struct {
	writeBound     time.Duration // each write of the stream
	keepAliveEvery time.Duration // between two keep-alive comments
	keepAlive      []byte        // one keep-alive comment
	sendBuffer     int           // SO_SNDBUF of the stream's connection; 0 leaves it
	response       time.Duration // the whole answer to any other request (WriteTimeout)
}

// defaultBounds are the bounds of New.
func defaultBounds() streamBounds {
	return streamBounds{writeBound: writeBound, keepAliveEvery: keepAliveEvery,
		keepAlive: keepAliveComment(keepAliveBytes), sendBuffer: eventsSendBuffer, response: responseBound}
}

// keepAliveComment returns an SSE comment of n bytes (at least 3): a
// colon, spaces, and the blank line that ends it.
func keepAliveComment(n int) []byte {
	b := make([]byte, max(n, 3))
	for i := range b {
		b[i] = ' '
	}
	b[0], b[len(b)-2], b[len(b)-1] = ':', '\n', '\n'
	return b
}

// releaseBound is how long after it connected a browser that reads
// nothing keeps its slot, when held bytes of the stream fit in the
// kernel's buffers before a write blocks: the keep-alive comments (the
// snapshots only add to them) fill those buffers within
// ceil(held/len(keepAlive)) intervals, the next write (a comment, or a
// snapshot, which comes at least every maxQuiet) starts at most an
// interval later, and it fails after writeBound.
func (b streamBounds) releaseBound(held int) time.Duration {
	fills := time.Duration((held + len(b.keepAlive) - 1) / len(b.keepAlive))
	return fills*b.keepAliveEvery + min(b.keepAliveEvery, maxQuiet) + b.writeBound
}

// Handler returns the page's HTTP handler (GET and HEAD only; anything
// else gets 405):
//
//	/            the page (index.html)
//	/app.js      its script; /app.css its style; /icon.svg its icon
//	/events      Server-Sent Events: "state" events, each a Snapshot as JSON
//	/state       the Snapshot now, as JSON
//	/healthz     200 "ok"
//
// Under another server than Serve's an event stream cannot reach its
// connection and keeps the kernel's send buffer: a browser that does not
// read then holds its place longer than the documented 14 s.
func (d *Dashboard) Handler() http.Handler {
	files := http.FileServerFS(d.static)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", ContentSecurityPolicy)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		h.Set("Cross-Origin-Resource-Policy", "same-origin")
		h.Set("Cache-Control", "no-store")
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			h.Set("Allow", "GET, HEAD")
			http.Error(w, "the fleet page is read-only", http.StatusMethodNotAllowed)
			return
		}
		switch r.URL.Path {
		case "/", "/app.js", "/app.css", "/icon.svg":
			files.ServeHTTP(w, r)
		case "/events":
			d.serveEvents(w, r)
		case "/state":
			b, _ := d.st.snapshotJSON()
			h.Set("Content-Type", "application/json")
			_, _ = w.Write(b)
		case "/healthz":
			h.Set("Content-Type", "text/plain; charset=utf-8")
			_, _ = w.Write([]byte("ok\n"))
		default:
			http.NotFound(w, r)
		}
	})
}

// serveEvents streams snapshots to one browser: one at once, then one
// after each change (at most every minPush) and at least every maxQuiet,
// with a keep-alive comment every keepAliveEvery, until the browser
// leaves, a write is not accepted within writeBound, or the server stops.
// With the connection's small send buffer, a browser that reads nothing
// gives its slot back within releaseBound (docs/observability.md, the
// fleet page).
func (d *Dashboard) serveEvents(w http.ResponseWriter, r *http.Request) {
	if d.streams.Add(1) > MaxStreams {
		d.streams.Add(-1)
		w.Header().Set("Retry-After", "5")
		http.Error(w, "too many open fleet pages", http.StatusServiceUnavailable)
		return
	}
	defer d.streams.Add(-1)
	bounds := d.bounds
	if c, ok := r.Context().Value(connKey{}).(interface{ SetWriteBuffer(int) error }); ok && bounds.sendBuffer > 0 {
		_ = c.SetWriteBuffer(bounds.sendBuffer)
	}
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Time{}) // a stream outlives the server's ReadTimeout
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return
	}
	send := func(b []byte) bool {
		_ = rc.SetWriteDeadline(time.Now().Add(bounds.writeBound))
		if _, err := fmt.Fprintf(w, "event: state\ndata: %s\n\n", b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	keepAlive := func() bool {
		_ = rc.SetWriteDeadline(time.Now().Add(bounds.writeBound))
		if _, err := w.Write(bounds.keepAlive); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	if _, err := fmt.Fprint(w, "retry: 1000\n\n"); err != nil {
		return
	}
	ctx := r.Context()
	quiet := time.NewTimer(maxQuiet)
	defer quiet.Stop()
	keep := time.NewTicker(bounds.keepAliveEvery)
	defer keep.Stop()
	for {
		changed := d.st.wait()
		b, _ := d.st.snapshotJSON()
		if !send(b) {
			return
		}
		sent := time.Now()
		quiet.Reset(maxQuiet)
		if !awaitNext(ctx, changed, quiet.C, keep.C, keepAlive) {
			return
		}
		// Gather the changes of the next moments into one snapshot.
		if !pause.For(ctx, time.Until(sent.Add(minPush))) {
			return
		}
	}
}

// awaitNext waits for the next snapshot's time — a change, or quiet —
// sending a keep-alive comment at each tick of keep. It reports false
// when ctx ended or a comment was not accepted.
func awaitNext(ctx context.Context, changed <-chan struct{}, quiet, keep <-chan time.Time, keepAlive func() bool) bool {
	for {
		select {
		case <-ctx.Done():
			return false
		case <-keep:
			if !keepAlive() {
				return false
			}
		case <-quiet:
			return true
		case <-changed:
			return true
		}
	}
}
