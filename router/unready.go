package router

import (
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

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
	return ServeUnreadyCounted(ln, front, why, log, nil)
}

// ServeUnreadyCounted is ServeUnready that also counts and logs its
// answers as the Router counts and logs its own, so that a router waiting
// at start is not invisible to its metrics: each request under /v1/ is
// added to answers (nil: none), which the Router given them in
// Options.UnreadyAnswers moves into narwhal_requests_total{code="503",
// outcome="not_ready",key="none",model="other"}, endpoint the path when it
// is a completion endpoint, else "" (docs/observability.md). Every answer
// carries an X-Request-Id (behaviour.md R-API-6, the client's when valid)
// and each one under /v1/ is logged at info level as "request ended", as
// the Router logs a request that did not end ok. /readyz, /healthz and
// other paths are answered but not counted, as the Router does not count
// them.
func ServeUnreadyCounted(ln net.Listener, front config.Server, why string, log *slog.Logger, answers *UnreadyAnswers) (stop func()) {
	return ServeUnreadyWhy(ln, front, NewUnreadyWhy(why), log, answers)
}

// UnreadyWhy is what the stand-in of ServeUnreadyWhy says the process
// waits for, which may change while it waits: "bus unreachable", then
// "stream NARWHAL_EVENTS does not exist: run narwhal bus setup" once the
// bus answers but is not set up (docs/mesh.md, "Start-up: what a process
// waits for"). It is safe for concurrent use; make one with NewUnreadyWhy.
type UnreadyWhy struct{ why atomic.Pointer[string] }

// NewUnreadyWhy returns an UnreadyWhy saying why.
func NewUnreadyWhy(why string) *UnreadyWhy {
	w := &UnreadyWhy{}
	w.Set(why)
	return w
}

// Set makes the stand-in's next answers say why.
func (w *UnreadyWhy) Set(why string) { w.why.Store(&why) }

// String returns what the stand-in says now.
func (w *UnreadyWhy) String() string { return *w.why.Load() }

// ServeUnreadyWhy is ServeUnreadyCounted whose answers say what why says
// at the time of each request: /readyz {"status":"not ready","problems":
// [why]}, any other request "not ready: " + why.
func ServeUnreadyWhy(ln net.Listener, front config.Server, whyNow *UnreadyWhy, log *slog.Logger, answers *UnreadyAnswers) (stop func()) {
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		return func() {}
	}
	srv := &http.Server{
		ReadHeaderTimeout: 5 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			arrival := time.Now()
			id := r.Header.Get("X-Request-Id")
			if !validRequestID([]byte(id)) {
				id = newID()
			}
			w.Header().Set("X-Request-Id", id)
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Retry-After", "1")
			w.Header().Set("Connection", "close")
			w.WriteHeader(http.StatusServiceUnavailable)
			why := whyNow.String()
			if r.URL.Path == "/readyz" {
				ready, _ := json.Marshal(readyAnswer{Status: "not ready", Problems: []string{why}})
				_, _ = w.Write(ready)
				return
			}
			_, _ = w.Write(schemas.AppendErrorJSON(nil, http.StatusServiceUnavailable, "not ready: "+why))
			if !strings.HasPrefix(r.URL.Path, string(apiPrefix)) {
				return
			}
			endpoint := ""
			if isCompletion(r.URL.Path) {
				endpoint = r.URL.Path
			}
			answers.add(endpoint)
			log.Info("request ended", "request_id", id, "key", config.NoKeyName, "status", http.StatusServiceUnavailable,
				"outcome", OutcomeNotReady, "attempts", 0, "duration_s", time.Since(arrival).Seconds(), "why", why)
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

// OutcomeNotReady is the outcome label (narwhal_requests_total) and log
// outcome of the 503s ServeUnreadyCounted answers while the process waits
// for what it needs before a Router can serve (the bus at start). It is a
// mesh fault, not the client's: the error-ratio alert counts it.
const OutcomeNotReady = "not_ready"

// UnreadyAnswers counts the /v1/ answers of ServeUnreadyCounted by
// endpoint label until a Router takes them over (Options.UnreadyAnswers);
// from then on each answer counts in that Router's narwhal_requests_total
// at once (a stand-in's last answers may end after the Router started).
// The zero value is ready to use; a nil *UnreadyAnswers counts nothing. It
// is safe for concurrent use.
type UnreadyAnswers struct {
	mu     sync.Mutex
	counts map[string]float64     // by endpoint label, until sink is set
	sink   *prometheus.CounterVec // the Router's narwhal_requests_total
}

// add counts one answer for endpoint.
func (u *UnreadyAnswers) add(endpoint string) {
	if u == nil {
		return
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.sink != nil {
		u.sink.WithLabelValues(endpoint, "503", OutcomeNotReady, config.NoKeyName, otherModel).Inc()
		return
	}
	if u.counts == nil {
		u.counts = map[string]float64{}
	}
	u.counts[endpoint]++
}

// Count returns the answers counted so far for endpoint that no Router
// has taken over yet.
func (u *UnreadyAnswers) Count(endpoint string) float64 {
	if u == nil {
		return 0
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.counts[endpoint]
}

// moveInto adds the counts to vec (narwhal_requests_total) and sends every
// later answer there.
func (u *UnreadyAnswers) moveInto(vec *prometheus.CounterVec) {
	if u == nil {
		return
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	for endpoint, n := range u.counts {
		vec.WithLabelValues(endpoint, "503", OutcomeNotReady, config.NoKeyName, otherModel).Add(n)
	}
	u.counts, u.sink = nil, vec
}
