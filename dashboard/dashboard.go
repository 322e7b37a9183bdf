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
	// read loses its stream.
	writeBound = 10 * time.Second
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
	d := &Dashboard{st: newState(time.Now), b: b, log: log, static: static, start: time.Now()}
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
	srv := &http.Server{
		Handler:           d.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       10 * time.Second,
		IdleTimeout:       90 * time.Second,
		MaxHeaderBytes:    16 << 10,
		BaseContext:       func(net.Listener) context.Context { return ctx },
		ErrorLog:          slog.NewLogLogger(d.log.Handler(), slog.LevelDebug),
	}
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

// Handler returns the page's HTTP handler (GET and HEAD only; anything
// else gets 405):
//
//	/            the page (index.html)
//	/app.js      its script; /app.css its style; /icon.svg its icon
//	/events      Server-Sent Events: "state" events, each a Snapshot as JSON
//	/state       the Snapshot now, as JSON
//	/healthz     200 "ok"
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
// until the browser leaves or the server stops.
func (d *Dashboard) serveEvents(w http.ResponseWriter, r *http.Request) {
	if d.streams.Add(1) > MaxStreams {
		d.streams.Add(-1)
		w.Header().Set("Retry-After", "5")
		http.Error(w, "too many open fleet pages", http.StatusServiceUnavailable)
		return
	}
	defer d.streams.Add(-1)
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
		_ = rc.SetWriteDeadline(time.Now().Add(writeBound))
		if _, err := fmt.Fprintf(w, "event: state\ndata: %s\n\n", b); err != nil {
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
	for {
		changed := d.st.wait()
		b, _ := d.st.snapshotJSON()
		if !send(b) {
			return
		}
		sent := time.Now()
		quiet.Reset(maxQuiet)
		select {
		case <-ctx.Done():
			return
		case <-quiet.C:
			continue
		case <-changed:
		}
		// Gather the changes of the next moments into one snapshot.
		if !pause.For(ctx, time.Until(sent.Add(minPush))) {
			return
		}
	}
}
