package router

import (
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/schemas"
)

// ServeUnready is the stand-in a router's address answers with while the
// process waits for what it needs before a Router can serve, such as the
// bus at start (docs/mesh.md, "Start-up: what a process waits for";
// behaviour.md R-API-2: not ready without the bus). Every request on ln
// gets 503 with Retry-After: 1 and Connection: close: GET /readyz the body
// {"status":"not ready","problems":[why]}, any other the error object of
// behaviour.md R-API-3 with message "not ready: " + why. It serves over
// HTTPS, with front's certificate files, when front configures TLS.
//
// It serves until the returned stop is called. stop closes the connections
// it accepted (a 503 being written is cut: the client asks again), waits
// for its goroutine and leaves ln open, with no deadline, for the Router
// to Serve on. A listener that is not a *net.TCPListener is not served;
// its stop does nothing.
func ServeUnready(ln net.Listener, front config.Server, why string, log *slog.Logger) (stop func()) {
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		return func() {}
	}
	ready, _ := json.Marshal(map[string]any{"status": "not ready", "problems": []string{why}})
	other := schemas.AppendErrorJSON(nil, http.StatusServiceUnavailable, "not ready: "+why)
	srv := &http.Server{
		ReadHeaderTimeout: 5 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Retry-After", "1")
			w.Header().Set("Connection", "close")
			w.WriteHeader(http.StatusServiceUnavailable)
			if r.URL.Path == "/readyz" {
				_, _ = w.Write(ready)
				return
			}
			_, _ = w.Write(other)
		}),
	}
	srv.SetKeepAlivesEnabled(false)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if front.TLS() {
			_ = srv.ServeTLS(heldListener{tl}, front.TLSCertFile, front.TLSKeyFile)
			return
		}
		_ = srv.Serve(heldListener{tl})
	}()
	return func() {
		_ = srv.Close() // cuts a 503 being written: the client asks again
		<-done
		_ = tl.SetDeadline(time.Time{})
	}
}

// heldListener is a TCP listener whose Close only wakes a blocked Accept
// (with a past deadline), so that a server may stop serving on it and
// another take it over.
type heldListener struct{ *net.TCPListener }

// Close makes Accept return at once and keeps the socket open.
func (l heldListener) Close() error { return l.SetDeadline(time.Unix(1, 0)) }
