// Package router is Narwhal's router: the fasthttp front end of behaviour.md §1,
// placement over the fleet, the attempts of each client request (prefill
// leg, handoff checks, decode leg, retries, deadlines, reservations), the
// relay of the decode stream to the client, Prometheus metrics and the
// events it publishes on the bus. Its view of the mesh — the fleet and
// what the breakers, the other routers and the engines say of it, the
// shared prefix index — is package router/meshview, which the request
// path reads through meshView (view.go).
package router

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/fasthttpadaptor"
	"go.opentelemetry.io/otel/trace"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/router/meshview"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Publisher takes bus events without blocking (bus.Publisher implements
// it). A nil Publisher in Options discards events.
type Publisher interface {
	Publish(ev schemas.Event)
}

// Options configures a Router.
type Options struct {
	// Config is the validated configuration; its Fleet lists the engines.
	Config *config.Config
	// Publisher receives the router's events (R-BUS-1); nil discards them.
	Publisher Publisher
	// Registry receives the router's metrics; nil means a new registry,
	// served at /metrics either way.
	Registry *prometheus.Registry
	// Logger is the router's logger; nil means slog.Default().
	Logger *slog.Logger
	// Transport is the HTTP transport of releases, health checks and
	// model listings (engines.Options.Transport); nil means
	// engines.NewTransport(). The engine legs run on the engine client's
	// own connections.
	Transport http.RoundTripper
	// ModelRefresh is how often each engine's /v1/models is read again;
	// 0 means 30 s. An engine whose models are unknown is retried every
	// second until they are.
	ModelRefresh time.Duration
	// ShutdownGrace is how long Shutdown lets in-flight requests finish
	// before ending them with an error; 0 means 10 s.
	ShutdownGrace time.Duration
	// Ready, when set, is consulted by /readyz in addition to the fleet
	// (for example: is the bus reachable, R-API-2).
	Ready func() bool
	// TracerProvider, when set, traces every client request: a span per
	// request with child spans per placement, prefill leg, handoff check
	// and decode leg, the legs carrying their span's traceparent
	// (docs/observability.md). Nil turns tracing off: no span is made and
	// the legs carry only a traceparent the client sent.
	TracerProvider trace.TracerProvider
	// UnreadyAnswers, when set, holds the 503s ServeUnreadyCounted
	// answered on this router's address before it existed; New adds them
	// to narwhal_requests_total, where that stand-in's later answers go
	// too.
	UnreadyAnswers *UnreadyAnswers
}

// Router serves the OpenAI-compatible front end over a fleet of engines.
// Create it with New, start it with Serve, stop it with Shutdown.
type Router struct {
	cfg     *config.Config
	id      string
	pub     Publisher
	log     *slog.Logger
	client  *engines.Client
	reg     *prometheus.Registry
	metrics *metrics
	budget  *retryBudget
	retry   retryPolicy
	limits  schemas.Limits
	watcher *disconnectWatcher
	// tokenizer gets prompts' token ids for the exact prefix index
	// (R-PLACE-4); nil when the router keeps none.
	tokenizer *tokenizer
	server    *fasthttp.Server
	front     *frontDoor
	placer    *placer // the placement policy (placement.go)
	ready     func() bool
	tracer    trace.Tracer // nil: tracing off

	// view is the router's view of the mesh (router/meshview): the fleet,
	// its verdicts, models and load, the prefix index, and the watches
	// that keep them true. mesh is the same view as the request path
	// reads it (view.go).
	view *meshview.View
	mesh meshView

	base       context.Context
	baseCancel context.CancelCauseFunc
	grace      time.Duration
	wg         sync.WaitGroup // background loops
	inflight   atomic.Int64
	metricsH   fasthttp.RequestHandler

	// resources are the router's own resource faults (R-FAIL-9): their
	// counter and the /readyz window after the last one.
	resources *resourceFaults
	// joined is the bus of JoinMesh, whose permission violations make the
	// router unready (serveReady); nil before.
	joined atomic.Pointer[bus.Bus]
	// maxConns is the server.max_connections in force, derived from the
	// descriptor limit when unset (R-API-7, R-FAIL-9).
	maxConns int

	auth    auth         // client API keys (R-API-9)
	tlsCert *certificate // the front end's TLS certificate; nil: plain HTTP

	shutdownOnce sync.Once
	shutdownErr  error
	// lifeMu orders starts against Shutdown: it guards ln and stopping,
	// and every wg.Add happens under it while stopping is false, so that
	// none races the wg.Wait in Shutdown.
	lifeMu   sync.Mutex
	ln       net.Listener
	stopping bool
}

// New builds a Router from opts. It returns an error when
// placement.policy names no policy, an engine's connector is unknown or
// the disconnect watcher cannot start.
func New(opts Options) (*Router, error) {
	if opts.Config == nil {
		return nil, errors.New("router: no config")
	}
	cfg := opts.Config
	// The descriptors of engine legs are reserved before anything starts
	// (R-FAIL-9): a max_connections that leaves none is refused.
	maxConns, derivedConns, nofile, err := ConnectionLimit(cfg)
	if err != nil {
		return nil, err
	}
	placer, err := newPlacer(cfg.Placement)
	if err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	w, err := newDisconnectWatcher()
	if err != nil {
		return nil, fmt.Errorf("router: disconnect watcher: %w", err)
	}
	rt := &Router{
		cfg: cfg,
		id:  cfg.Router.ID,
		pub: opts.Publisher,
		log: log.With("router_id", cfg.Router.ID),
		client: engines.NewClient(engines.Options{
			PrefillTimeout:    cfg.Engine.PrefillTimeout(),
			FirstTokenTimeout: cfg.Engine.FirstTokenTimeout(),
			DecodeReadTimeout: cfg.Engine.DecodeReadTimeout(), // 0: no per-chunk bound (R-TMO-4)
			HandoffMaxAge:     cfg.Handoff.MaxAge(),
			Transport:         opts.Transport,
			RootCAs:           cfg.Engine.RootCAs(),
		}),
		reg:     reg,
		budget:  newRetryBudget(cfg.Recovery.RetryBudgetRatio, 10*time.Second, 3),
		limits:  schemas.Limits{MaxN: cfg.Request.MaxN, MaxTokens: cfg.Request.MaxTokensLimit},
		watcher: w,
		placer:  placer,
		ready:   opts.Ready,
		grace:   opts.ShutdownGrace,
	}
	rt.base, rt.baseCancel = context.WithCancelCause(context.Background())
	rt.view, err = meshview.New(meshview.Options{
		Config:       cfg,
		Logger:       rt.log,
		Registry:     reg,
		HTTPClient:   rt.client.HTTPClient(),
		Context:      rt.base,
		Go:           rt.goOwned,
		KeepsIndex:   placer.policy.weighsPrefix(),
		ModelRefresh: opts.ModelRefresh,
		Joined:       func(m *member) { rt.metrics.initEngine(m) },
		Left:         func(id string) { rt.metrics.forgetEngine(id) },
		Listed:       func(model string) { rt.metrics.series(model) },
	})
	if err != nil {
		w.close()
		return nil, fmt.Errorf("router: %w", err)
	}
	rt.mesh = rt.view
	if rt.view.IndexMode() != config.IndexApproximate {
		rt.tokenizer = newTokenizer(rt.client.HTTPClient(), cfg.Placement.TokenizeTimeout(), cfg.Request.Timeout())
		reg.MustRegister(rt.tokenizer.collectors()...)
	}
	if opts.TracerProvider != nil {
		rt.tracer = opts.TracerProvider.Tracer(TracerName)
	}
	rt.retry = retryPolicy{retries: cfg.Recovery.RetryAttempts, minLeft: 10 * time.Millisecond, budget: rt.budget}
	if rt.grace <= 0 {
		rt.grace = 10 * time.Second
	}
	rt.metrics = newMetrics(reg, rt.fleet, cfg.Router.ID, cfg.Request.Timeout())
	rt.resources = newResourceFaults(reg)
	opts.UnreadyAnswers.moveInto(rt.metrics.requests.vec)
	for _, m := range rt.fleet().Members() {
		rt.metrics.initEngine(m)
	}
	reg.MustRegister(placer.decisions)
	if cfg.Server.TLS() {
		rt.tlsCert, err = newCertificate(cfg.Server.TLSCertFile, cfg.Server.TLSKeyFile, rt.log)
		if err != nil {
			w.close()
			return nil, fmt.Errorf("router: %w", err)
		}
	}
	rt.SetAPIKeys(cfg.Auth.APIKeys)
	rt.metricsH = fasthttpadaptor.NewFastHTTPHandler(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	rt.server = &fasthttp.Server{
		Handler:                       rt.serve,
		Name:                          "narwhal",
		MaxRequestBodySize:            cfg.Request.MaxBodyBytes,
		ErrorHandler:                  rt.serverError,
		NoDefaultServerHeader:         true,
		NoDefaultDate:                 false,
		DisableHeaderNamesNormalizing: false,
		CloseOnShutdown:               true,
		StreamRequestBody:             false,
		Logger:                        fasthttpLogger{rt.log},
	}
	// Deadlines, caps and the body bound of the front door (R-API-7, R-API-8).
	rt.front = newFrontDoor(cfg, rt.log, reg, rt.server)
	rt.front.unauthenticated = rt.auth.refuses
	rt.server.ExpectHandler = rt.expectContinue
	rt.server.Concurrency = maxConns
	rt.maxConns = maxConns
	rt.log.Info("client connections bounded", "max_connections", maxConns, "derived", derivedConns, "nofile", nofile)
	return rt, nil
}

// ConnectionLimit is the server.max_connections a Router made from cfg
// uses under the process's descriptor limit now (nofile, the soft
// RLIMIT_NOFILE; 0 when unknown), and whether it was derived; or New's
// error, with the arithmetic, when cfg's value leaves no descriptors for
// engine legs (behaviour.md R-API-7, R-FAIL-9). A process can check it
// before it waits for anything (the bus), so that the refusal comes at
// once.
func ConnectionLimit(cfg *config.Config) (n int, derived bool, nofile uint64, err error) {
	nofile = descriptorLimit()
	n, derived, err = cfg.Server.ConnectionLimit(nofile)
	if err != nil {
		return 0, false, nofile, fmt.Errorf("router: %w", err)
	}
	return n, derived, nofile, nil
}

// fasthttpLogger sends fasthttp's own messages (malformed requests,
// connection errors) to the router's structured log.
type fasthttpLogger struct{ log *slog.Logger }

// Printf logs one fasthttp message at debug level: they concern single
// client connections and are counted in the request metrics already.
func (l fasthttpLogger) Printf(format string, args ...any) {
	if l.log.Enabled(context.Background(), slog.LevelDebug) {
		l.log.Debug(fmt.Sprintf(format, args...), "source", "fasthttp")
	}
}

// MaxConnections returns the server.max_connections in force: the value
// configured, or the one derived from the descriptor limit at New when it
// is unset (config.Server.ConnectionLimit, behaviour.md R-FAIL-9).
func (rt *Router) MaxConnections() int { return rt.maxConns }

// ID returns the router's id (router_id in events).
func (rt *Router) ID() string { return rt.id }

// Registry returns the registry the router's metrics are in.
func (rt *Router) Registry() *prometheus.Registry { return rt.reg }

// Serve refreshes the fleet's models in the background and serves HTTP on
// ln until Shutdown. It returns nil after a clean shutdown.
func (rt *Router) Serve(ln net.Listener) error {
	// Accept errors such as EMFILE back off instead of ending Serve (R-API-7).
	ln = rt.front.listener(ln)
	rt.lifeMu.Lock()
	if rt.stopping {
		rt.lifeMu.Unlock()
		ln.Close()
		return nil
	}
	if rt.tlsCert != nil {
		ln = tls.NewListener(ln, rt.tlsCert.serverConfig())
	}
	rt.ln = ln
	rt.lifeMu.Unlock()
	rt.RefreshModels(rt.base)
	// Shutdown may have begun meanwhile: it then closed ln, and nothing
	// more starts.
	if !rt.view.Start() || !rt.goOwned(func() { rt.front.bodies.sweepLoop(rt.base) }) {
		return nil
	}
	err := rt.server.Serve(ln)
	if err != nil && rt.base.Err() != nil {
		return nil
	}
	return err
}

// goOwned runs fn in a goroutine the router owns: Shutdown waits for it. It
// starts nothing and returns false once Shutdown has begun, so that no
// WaitGroup.Add races Shutdown's Wait.
func (rt *Router) goOwned(fn func()) bool {
	rt.lifeMu.Lock()
	defer rt.lifeMu.Unlock()
	if rt.stopping {
		return false
	}
	rt.wg.Add(1)
	go func() {
		defer rt.wg.Done()
		fn()
	}()
	return true
}

// Shutdown stops accepting connections, lets in-flight requests finish for
// the grace period, then ends the rest with an error (a terminal SSE error
// event for committed streams) and waits for them, bounded by ctx.
func (rt *Router) Shutdown(ctx context.Context) error {
	rt.shutdownOnce.Do(func() { rt.shutdownErr = rt.shutdown(ctx) })
	return rt.shutdownErr
}

func (rt *Router) shutdown(ctx context.Context) error {
	// A Serve that has not reached fasthttp yet must not start serving
	// after this: close its listener ourselves.
	rt.lifeMu.Lock()
	rt.stopping = true
	if rt.ln != nil {
		_ = rt.ln.Close()
	}
	rt.lifeMu.Unlock()
	graceCtx, cancel := context.WithTimeout(ctx, rt.grace)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.server.ShutdownWithContext(graceCtx) }()
	err := <-done
	// Whatever is still running after the grace period ends now: streams
	// with a terminal error event, waiting requests with a 503.
	rt.baseCancel(engines.ErrRouterShutdown)
	for rt.inflight.Load() > 0 && ctx.Err() == nil {
		t := time.NewTimer(5 * time.Millisecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
	}
	rt.wg.Wait()
	rt.watcher.close()
	rt.client.CloseIdleConnections()
	if (errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil) || errors.Is(err, net.ErrClosed) {
		err = nil // the grace period ended as planned; or the listener was ours to close
	}
	if err == nil && rt.inflight.Load() > 0 {
		err = fmt.Errorf("router: %d requests still running at the end of shutdown", rt.inflight.Load())
	}
	return err
}

// InFlight returns the number of client requests in progress.
func (rt *Router) InFlight() int64 { return rt.inflight.Load() }

// ShutdownGrace returns how long Shutdown lets the requests in flight
// finish before it ends them (Options.ShutdownGrace, 10 s by default): a
// stream cut then gets a terminal error event, a waiting request a 503
// "router shutting down" (docs/failures.md, router_shutdown).
func (rt *Router) ShutdownGrace() time.Duration { return rt.grace }

// Reservations returns the total reserved prefill and decode slots over
// the fleet (R-OWN-3); both are 0 when the router is idle.
func (rt *Router) Reservations() (prefill, decode int64) {
	for _, m := range rt.fleet().Members() {
		prefill += m.Reserved(prefillPhase)
		decode += m.Reserved(decodePhase)
	}
	return
}

// fleet returns the fleet as of now: a snapshot that the live fleet's
// watch replaces whole on a change (R-FLEET-1).
func (rt *Router) fleet() *fleet { return rt.mesh.Fleet() }

// inFleet reports whether engine id is in the fleet as of now.
func (rt *Router) inFleet(id string) bool { return rt.fleet().Member(id) != nil }

// SetEligible applies the breaker's verdict for an engine (R-BRK-8). It
// returns false for an engine not in the fleet.
func (rt *Router) SetEligible(engineID string, eligible bool) bool {
	return rt.view.SetEligible(engineID, eligible)
}

// Quarantine keeps an engine out of this router's placement until until
// (R-QUAR-1). It returns false for an engine not in the fleet.
func (rt *Router) Quarantine(engineID string, until time.Time) bool {
	return rt.view.Quarantine(engineID, until)
}

// JoinMesh makes the router a member of the mesh on b (behaviour.md §9):
// its view follows the breakers' placement (checked against the leader
// lease), the other routers' quarantines, the live fleet and, under the
// prefix policy, the mesh-wide prefix index, and the router writes its
// in-flight report; meshview.View.Join says how, and what it ignores.
// The goroutines it starts belong to the router and stop at Shutdown.
// JoinMesh waits until the initial placement is loaded or wait passes
// (the router then serves on "everyone eligible" until it is); it returns
// an error when the prefix index cannot be shared, or
// "router: shutting down" once Shutdown has begun (nothing is then
// started). From then on a permissions violation the bus reports on b
// (another role's credential: R-BUS-8) makes /readyz answer 503 naming
// it, since the bus drops what the router writes.
//
// Once the bus revokes or refuses the router's credential
// (bus.Bus.CredentialRefused, R-BUS-11) the router logs it at ERROR once
// and /readyz answers 503 naming the credential file and how to get a new
// one; requests in flight finish, and the router serves on the view it
// last had, since the connection does not come back.
func (rt *Router) JoinMesh(b *bus.Bus, wait time.Duration) error {
	rt.joined.Store(b)
	go func() {
		select {
		case <-b.Refused():
			rt.log.Error("the bus refused this router's credential: /readyz answers 503 until the router restarts with a new one",
				"router_id", rt.id, "err", b.CredentialRefused())
		case <-rt.base.Done():
		}
	}()
	return rt.view.Join(b, wait)
}

// PlacementLoaded reports whether the router has read the placement bucket
// at least once.
func (rt *Router) PlacementLoaded() bool { return rt.view.PlacementLoaded() }

// FleetIDs returns the ids of the engines in the router's fleet now, in
// fleet order, with their fleet states (R-FLEET-1).
func (rt *Router) FleetIDs() map[string]string { return rt.view.FleetIDs() }

// RefreshModels reads every engine's /v1/models once, bounded by ctx and 2
// seconds per engine. Engines that fail keep their last known list; each
// call's outcome is recorded and logged (meshview.View.RefreshModels).
func (rt *Router) RefreshModels(ctx context.Context) { rt.view.RefreshModels(ctx) }

func nowNano() int64 { return time.Now().UnixNano() }

// requestID returns the request's id — the client's X-Request-Id when it
// sent a valid one, else a new one — and sets it on the response (R-API-6).
func requestID(ctx *fasthttp.RequestCtx) string {
	var id string
	if h := ctx.Request.Header.Peek("X-Request-Id"); validRequestID(h) {
		id = string(h)
	} else {
		id = newID()
	}
	ctx.Response.Header.Set("X-Request-Id", id)
	return id
}

// serve routes one request. Every response carries an X-Request-Id
// (R-API-6); the completion handler sets its own.
func (rt *Router) serve(ctx *fasthttp.RequestCtx) {
	path := ctx.Path()
	// A body reservation the handler did not take over ends with the
	// handler (R-API-8).
	defer rt.front.dropBody(ctx)
	switch string(path) {
	case schemas.EndpointChat, schemas.EndpointCompletions:
		if !ctx.IsPost() {
			requestID(ctx)
		}
	default:
		requestID(ctx)
	}
	var key *clientKey
	if bytes.HasPrefix(path, apiPrefix) {
		var ok bool
		if key, ok = rt.authenticate(ctx); !ok {
			return
		}
	}
	switch string(path) {
	case schemas.EndpointChat:
		if rt.post(ctx) {
			rt.serveCompletion(ctx, schemas.EndpointChat, key)
		}
	case schemas.EndpointCompletions:
		if rt.post(ctx) {
			rt.serveCompletion(ctx, schemas.EndpointCompletions, key)
		}
	case "/v1/models":
		rt.serveModels(ctx, key)
	case "/healthz":
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"status":"ok"}`)
	case "/readyz":
		rt.serveReady(ctx)
	case "/metrics":
		if rt.cfg.Server.MetricsOnAdmin {
			writeError(ctx, 404, "Not Found: "+schemas.BoundField(string(path)))
			return
		}
		rt.metricsH(ctx)
	default:
		writeError(ctx, 404, "Not Found: "+schemas.BoundField(string(path)))
	}
}

func (rt *Router) post(ctx *fasthttp.RequestCtx) bool {
	if ctx.IsPost() {
		return true
	}
	ctx.Response.Header.Set("Allow", "POST")
	writeError(ctx, 405, "Method Not Allowed")
	return false
}

func writeError(ctx *fasthttp.RequestCtx, status int, message string) {
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(schemas.AppendErrorJSON(nil, status, message))
}

// apiPrefix starts every path that requires an API key (R-API-9).
var apiPrefix = []byte("/v1/")

// serveModels answers GET /v1/models with the fleet's models, only those
// key may call when it has a list (R-API-2, R-API-9).
func (rt *Router) serveModels(ctx *fasthttp.RequestCtx, key *clientKey) {
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	out := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: []model{}}
	now := time.Now().Unix()
	for _, id := range modelsFor(key, rt.fleet().Models()) {
		out.Data = append(out.Data, model{ID: id, Object: "model", Created: now, OwnedBy: "narwhal"})
	}
	b, _ := json.Marshal(out)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// serveReady is 200 when the extra readiness check passes, each phase
// has at least one available engine with known models (R-API-2) and the
// router ran out of none of its own resources in the last 5 s (R-FAIL-9). Its
// JSON body is {"status":"ready"|"not ready", "problems":[…] (when not
// ready), "engines":[{"id","role","problem"}…] (each engine the router
// cannot place on now, and why; absent when there is none)}.
func (rt *Router) serveReady(ctx *fasthttp.RequestCtx) {
	var problems []string
	if (rt.ready != nil && !rt.ready()) || !rt.view.Ready() {
		problems = append(problems, "bus unreachable and no placement known")
	}
	if why := rt.resources.problem(time.Now()); why != "" {
		problems = append(problems, why) // R-FAIL-9
	}
	if b := rt.joined.Load(); b != nil {
		if err := b.CredentialRefused(); err != nil {
			// Revoked or refused for good: the router hears no more of
			// the mesh and writes nothing to it (R-BUS-11).
			problems = append(problems, err.Error())
		}
		if err := b.PermissionError(); err != nil {
			// Another role's or router's credential: the bus drops what
			// the router writes — its events, its reports (R-BUS-8,
			// R-BUS-11).
			problems = append(problems, "the bus refuses what this router writes ("+err.Error()+"): NARWHAL_NATS_CREDS must be this router's own file, "+
				bus.IdentityCredsFile(bus.RoleRouter, rt.id)+" (narwhal bus creds --out DIR --router "+rt.id+")")
		}
	}
	if !rt.fleet().CanServe(prefillPhase) {
		problems = append(problems, "no eligible engine for prefill")
	}
	if !rt.fleet().CanServe(decodePhase) {
		problems = append(problems, "no eligible engine for decode")
	}
	var out readyAnswer
	now := time.Now().UnixNano()
	for _, m := range rt.fleet().Members() {
		if why := m.Unplaceable(now); why != "" {
			out.Engines = append(out.Engines, engineProblem{ID: m.ID, Role: string(m.Role), Problem: why})
		}
	}
	out.Status = "ready"
	if len(problems) > 0 {
		out.Status, out.Problems = "not ready", problems
		ctx.SetStatusCode(503)
	}
	b, _ := json.Marshal(out)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// readyAnswer is the JSON body of /readyz, from serveReady and from the
// stand-in of ServeUnready alike, so that its keys come in one order:
// status, problems, engines (docs/mesh.md, behaviour.md R-API-2).
type readyAnswer struct {
	// Status is "ready" or "not ready".
	Status string `json:"status"`
	// Problems says why the router is not ready; absent when it is.
	Problems []string `json:"problems,omitempty"`
	// Engines are the engines the router cannot place on now, and why;
	// absent when there is none.
	Engines []engineProblem `json:"engines,omitempty"`
}

// engineProblem is one engine of readyAnswer.Engines.
type engineProblem struct {
	ID      string `json:"id"`
	Role    string `json:"role"`
	Problem string `json:"problem"`
}

// newID returns a random 16-byte hex id.
func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// validRequestID reports whether a client's X-Request-Id may be kept
// (R-API-6): 1 to 128 printable ASCII characters from [A-Za-z0-9._:-].
func validRequestID(b []byte) bool {
	if len(b) == 0 || len(b) > 128 {
		return false
	}
	for _, c := range b {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == ':', c == '-':
		default:
			return false
		}
	}
	return true
}
