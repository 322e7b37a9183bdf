package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/router"
	"github.com/narwhalmesh/narwhal/schemas"
)

// newLogger builds the process logger from the router section of cfg:
// text or JSON on stderr at the configured level.
func newLogger(cfg *config.Config, w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: cfg.Router.Level()}
	if cfg.Router.LogFormat == config.LogFormatJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// joinBus connects to cfg.Bus.URL when it is set — binding to what the
// admin set up, waiting for the bus (and logging what it waits for) at most
// bus.connect_timeout_s, or for ever when that is 0 (R-BUS-8) — or else
// starts an embedded NATS server with JetStream whose store is
// NARWHAL_DATA_DIR (a fresh temporary folder, removed at exit, when that is
// unset) and which sets itself up (behaviour.md R-BUS-4). role is the bus
// role of the process (busOptions). The returned stop function closes
// everything it started.
//
// A bus that answers but is not set up yet (no `narwhal bus setup` has
// run) is waited for too, within the same bound: the process logs what is
// missing once and then every 30 s, and goes on by itself once the set-up
// has run (docs/mesh.md, "Start-up: what a process waits for").
func joinBus(ctx context.Context, cfg *config.Config, name, role string, log *slog.Logger) (*bus.Bus, func(), error) {
	return joinBusTelling(ctx, cfg, name, role, log, nil)
}

// joinBusTelling is joinBus that also tells missing (when not nil) what a
// bus that is not set up lacks each time that changes, and nil once it
// has everything (bus.SetUpWait.Missing).
func joinBusTelling(ctx context.Context, cfg *config.Config, name, role string, log *slog.Logger, missing func(*bus.NotSetUpError)) (*bus.Bus, func(), error) {
	if url := cfg.Bus.URL; url != "" {
		if d := cfg.Bus.ConnectTimeout(); d > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, d)
			defer cancel()
		}
		opts := busOptions(cfg.Bus, name, role, log)
		if role == bus.RoleRouter {
			opts.ID = cfg.Router.ID // its credential is router-<id>.creds (R-BUS-11)
		}
		opts.Buckets = roleBuckets(role)
		if role == bus.RoleBreaker {
			// It reads the engines' registrations (R-FLEET-5).
			opts.Streams = []string{bus.RegistrationsStream}
		}
		opts.WaitSetUp = &bus.SetUpWait{Missing: missing}
		b, err := bus.Connect(ctx, opts)
		if err != nil {
			return nil, nil, fmt.Errorf("bus %s: %w", redactNATSURL(url), err)
		}
		log.Info("bus connected", "url", b.Conn().ConnectedUrlRedacted())
		return b, b.Close, nil
	}
	dir := config.EmbeddedDataDir()
	cleanup := func() {}
	if dir == "" {
		d, err := os.MkdirTemp("", "narwhal-data-")
		if err != nil {
			return nil, nil, err
		}
		dir = d
		cleanup = func() { os.RemoveAll(d) }
	}
	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: dir, Port: 0, LeaseTTL: cfg.Breaker.LeaseTTL()})
	if err != nil {
		cleanup()
		return nil, nil, fmt.Errorf("embedded bus: %w", err)
	}
	b, err := bus.Connect(ctx, bus.ConnectOptions{Embedded: emb, Name: name, Log: log})
	if err != nil {
		emb.Shutdown()
		cleanup()
		return nil, nil, fmt.Errorf("embedded bus: %w", err)
	}
	log.Info("embedded bus started", "data_dir", dir)
	return b, func() {
		b.Close()
		emb.Shutdown()
		cleanup()
	}, nil
}

// unreadyUnreachable is what a router's /readyz says until its bus answers.
const unreadyUnreachable = "bus unreachable"

// roleBuckets are the buckets besides narwhal_placement that a process of
// role binds to as it starts (bus.ConnectOptions.Buckets), so that it
// waits for the whole set-up rather than start on part of it.
func roleBuckets(role string) []string {
	switch role {
	case bus.RoleRouter, bus.RoleBreaker:
		return []string{bus.LeaseBucket, bus.FleetBucket, bus.RoutersBucket}
	case bus.RoleChaos:
		return []string{bus.ChaosBucket}
	}
	return nil
}

// runRouter serves a router for cfg on listen until ctx ends, then shuts it
// down gracefully. Without a bus URL it also runs an in-process
// breaker on its embedded bus, stopped after the router's shutdown and
// before the bus closes. onReady, when set, is called with the router's
// base URL once it accepts connections.
func runRouter(ctx context.Context, cfg *config.Config, listen string, log *slog.Logger, onReady func(baseURL string)) error {
	return runRouterWith(ctx, routerRun{cfg: cfg, listen: listen, log: log, onReady: onReady})
}

// routerRun is what runRouterWith runs.
type routerRun struct {
	cfg     *config.Config
	listen  string
	log     *slog.Logger
	onReady func(baseURL string) // nil: none
	// stopNotice, when set, receives the line of stoppingLine when the
	// router starts its shutdown (narwhal dev: the terminal, whose log
	// shows only warnings).
	stopNotice io.Writer
	// admin is HOST:PORT of the admin listener (pprof; /metrics with
	// server.metrics_on_admin); "" for none.
	admin string
	// hup delivers SIGHUP; each one calls reload and applies the API keys
	// and the TLS certificate of its result (R-API-9). nil: no reloads.
	hup    <-chan os.Signal
	reload func() (*config.Config, error)
	// reg is the registry the router's /metrics serves (the router's own
	// series are added to it); nil: a new one.
	reg *prometheus.Registry
}

// runRouterWith is runRouter with an admin listener and reloads on SIGHUP.
func runRouterWith(ctx context.Context, r routerRun) error {
	cfg, listen, log, onReady := r.cfg, r.listen, r.log, r.onReady
	// A max_connections the descriptor limit cannot hold is refused now,
	// not once the bus is reached (R-FAIL-9).
	if _, _, _, err := router.ConnectionLimit(cfg); err != nil {
		return err
	}
	// The router's address answers at once: until the bus is reached,
	// /readyz says 503 "bus unreachable" and requests get 503 (R-BUS-8).
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", listen, err)
	}
	defer ln.Close()
	// Its 503s are counted and logged as the router's own answers are,
	// and reach its narwhal_requests_total once it runs.
	// Until the bus is set up they name what is missing and the command
	// that creates it.
	waited := &router.UnreadyAnswers{}
	why := router.NewUnreadyWhy(unreadyUnreachable)
	stopWaiting := router.ServeUnreadyWhy(ln, cfg.Server, why, log, waited)
	b, stopBus, err := joinBusTelling(ctx, cfg, "narwhal-router-"+cfg.Router.ID, bus.RoleRouter, log, func(m *bus.NotSetUpError) {
		if m != nil {
			why.Set(m.Problem())
		}
	})
	stopWaiting()
	if err != nil {
		return err
	}
	defer stopBus()
	reg := r.reg
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	pub := bus.NewPublisher(b, cfg.Router.EventBuffer, reg)
	defer pub.Close()
	if cfg.Bus.URL == "" {
		// A single node seeds the live fleet from its config file
		// (create-if-absent: runtime changes kept, R-FLEET-1).
		if err := seedFleet(ctx, cfg, b, "router-"+cfg.Router.ID, log); err != nil {
			return err
		}
		// A single node is complete: on its own embedded bus the router
		// runs its own breaker (behaviour.md §14). It outlives the router's
		// graceful shutdown and stops before the bus closes.
		stopBreaker, err := startBreaker(context.WithoutCancel(ctx), cfg, b, "breaker-"+cfg.Router.ID, reg, log)
		if err != nil {
			return err
		}
		defer stopBreaker()
	}

	tp, stopTracing, err := startTracing(ctx, routerService, cfg.Router.ID, log)
	if err != nil {
		return err
	}
	defer stopTracing()
	rt, err := router.New(router.Options{
		Config:         cfg,
		Publisher:      pub,
		Registry:       reg,
		Logger:         log,
		TracerProvider: tp,
		UnreadyAnswers: waited,
	})
	if err != nil {
		return err
	}
	if err := rt.JoinMesh(b, 5*time.Second); err != nil {
		return err
	}
	if r.admin != "" {
		var metrics *prometheus.Registry
		if cfg.Server.MetricsOnAdmin {
			metrics = reg
		}
		if err := serveAdmin(ctx, r.admin, log, metrics); err != nil {
			return err
		}
	}
	if r.hup != nil && r.reload != nil {
		go reloadOnHUP(ctx, r.hup, r.reload, rt, log)
	}
	errc := make(chan error, 1)
	go func() { errc <- rt.Serve(ln) }()
	base := "http://" + ln.Addr().String()
	if cfg.Server.TLS() {
		base = "https://" + ln.Addr().String()
	}
	// engines is the router's fleet once it joined the mesh: the config
	// file's engines and those of the live fleet (narwhal_fleet, read by
	// JoinMesh unless it warned that it was not loaded yet);
	// config_engines the config file's alone.
	log.Info("router listening", "url", base, "engines", len(rt.FleetIDs()), "config_engines", len(cfg.Fleet))
	if onReady != nil {
		onReady(base)
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	grace, inflight := rt.ShutdownGrace(), rt.InFlight()
	log.Info("router shutting down", "grace", grace, "inflight", inflight)
	if r.stopNotice != nil {
		fmt.Fprintln(r.stopNotice, stoppingLine(grace, inflight))
	}
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := rt.Shutdown(sctx); err != nil {
		log.Warn("router shutdown", "err", err)
	}
	<-errc
	return nil
}

// stoppingLine says how long a router's shutdown waits for the requests
// in flight, e.g. "stopping: waiting up to 10s for 3 requests in flight"
// (the rest then end with an error, docs/failures.md router_shutdown),
// or plain "stopping" when none is in flight: there is nothing to wait
// for.
func stoppingLine(grace time.Duration, inflight int64) string {
	if inflight <= 0 {
		return "stopping"
	}
	noun := "requests"
	if inflight == 1 {
		noun = "request"
	}
	return fmt.Sprintf("stopping: waiting up to %v for %d %s in flight", grace, inflight, noun)
}

// reloadOnHUP applies the client API keys and the TLS certificate of a
// freshly read configuration on every SIGHUP until ctx ends (R-API-9). A
// configuration that does not load changes nothing and is logged.
func reloadOnHUP(ctx context.Context, hup <-chan os.Signal, reload func() (*config.Config, error), rt *router.Router, log *slog.Logger) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
		}
		cfg, err := reload()
		if err != nil {
			log.Error("SIGHUP: configuration not reloaded; the API keys and TLS certificate in use stay", "err", err)
			continue
		}
		rt.SetAPIKeys(cfg.Auth.APIKeys)
		if err := rt.ReloadTLS(); err != nil {
			log.Error("SIGHUP: API keys reloaded; TLS certificate not reloaded, the one in use stays (other settings apply at the next start)", "err", err)
			continue
		}
		log.Info("SIGHUP: configuration reloaded (API keys, TLS certificate; other settings apply at the next start)")
	}
}

// seedFleet writes the config file's engines to KV bucket narwhal_fleet
// where the bucket has no key for them (behaviour.md R-FLEET-1): the seed never
// overwrites an engine's newer runtime state.
func seedFleet(ctx context.Context, cfg *config.Config, b *bus.Bus, by string, log *slog.Logger) error {
	entries := make([]schemas.FleetEntry, 0, len(cfg.Fleet))
	now := time.Now()
	for _, spec := range cfg.Fleet {
		entries = append(entries, spec.FleetEntry(by, now))
	}
	n, err := breaker.SeedFleet(ctx, b, entries)
	if err != nil {
		return fmt.Errorf("seed the live fleet: %w", err)
	}
	log.Info("live fleet seeded from the config file", "engines", len(entries), "created", n, "kept", len(entries)-n)
	return nil
}
