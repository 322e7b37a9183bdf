package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
)

func init() {
	commands["breaker"] = command{
		summary:   "run a breaker (ejection, probes, readmission) on the NATS at NARWHAL_NATS_URL (--config FILE)",
		run:       runBreakerCmd,
		checkArgs: true,
	}
}

// errNoNATSURL is returned by `narwhal breaker` without NARWHAL_NATS_URL.
var errNoNATSURL = errors.New("NARWHAL_NATS_URL (bus.url) is not set: a standalone breaker joins the routers' NATS " +
	"(a router without NARWHAL_NATS_URL runs its own breaker on its embedded bus)")

// runBreakerCmd is `narwhal breaker --config FILE [--metrics HOST:PORT]`
// (behaviour.md §8, §14): it connects to the NATS at NARWHAL_NATS_URL (credentials
// and TLS from NARWHAL_NATS_CREDS, NARWHAL_NATS_TLS_CA, _CERT, _KEY) and
// runs a breaker.Service — leader or standby — until SIGINT/SIGTERM; a bus
// not set up yet is waited for, logged (joinBus). With
// --metrics it serves Prometheus text at http://HOST:PORT/metrics.
func runBreakerCmd(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("narwhal breaker", flag.ContinueOnError)
	path := fs.String("config", "", configUsage)
	metricsAddr := fs.String("metrics", "", "HOST:PORT to serve /metrics on (off when empty)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	cfg, err := loadMesh(*path)
	if err != nil {
		return err
	}
	if cfg.Bus.URL == "" {
		return errNoNATSURL
	}
	if err := argsChecked(ctx); err != nil {
		return err
	}
	log := newLogger(cfg, os.Stderr)
	id := breakerID()
	b, stopBus, err := joinBus(ctx, cfg, "narwhal-"+id, bus.RoleBreaker, log)
	if err != nil {
		return err
	}
	defer stopBus()
	// A revoked breaker credential stops the breaker: exit non-zero
	// saying so (R-BUS-11); another breaker takes the lease.
	ctx, stopRefused := untilRefused(ctx, b)
	defer stopRefused()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if *metricsAddr != "" {
		stop, err := serveMetrics(*metricsAddr, reg, log)
		if err != nil {
			return err
		}
		defer stop()
	}
	if err := seedFleet(ctx, cfg, b, id, log); err != nil {
		if refused := refusedCause(ctx); refused != nil {
			return refused
		}
		return err
	}
	err = runBreaker(ctx, cfg, b, id, reg, log)
	if refused := refusedCause(ctx); refused != nil {
		return refused
	}
	return err
}

// breakerID returns "breaker-<hostname>-<pid>", safe as a breaker_id.
func breakerID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "host"
	}
	return config.SanitizeID("breaker-" + host + "-" + strconv.Itoa(os.Getpid()))
}

// runBreaker runs a breaker.Service with breaker_id id on b until ctx ends.
func runBreaker(ctx context.Context, cfg *config.Config, b *bus.Bus, id string, reg prometheus.Registerer, log *slog.Logger) error {
	tp, stopTracing, err := startTracing(ctx, breakerService, id, log)
	if err != nil {
		return err
	}
	defer stopTracing()
	svc, err := breaker.New(breaker.Options{Config: cfg, Bus: b, ID: id, Logger: log.With("component", "breaker"), Registry: reg, TracerProvider: tp})
	if err != nil {
		return err
	}
	log.Info("breaker starting", "breaker_id", id, "engines", len(cfg.Fleet), "lease_ttl", cfg.Breaker.LeaseTTL())
	return svc.Run(ctx)
}

// startBreaker runs a breaker.Service on b in the background (the
// in-process breaker of a single-node router, behaviour.md §14) and returns the
// function that stops it and waits for it; call it before closing b.
func startBreaker(ctx context.Context, cfg *config.Config, b *bus.Bus, id string, reg prometheus.Registerer, log *slog.Logger) (stop func(), err error) {
	tp, stopTracing, err := startTracing(ctx, breakerService, id, log)
	if err != nil {
		return nil, err
	}
	svc, err := breaker.New(breaker.Options{Config: cfg, Bus: b, ID: id, Logger: log.With("component", "breaker"), Registry: reg, TracerProvider: tp})
	if err != nil {
		stopTracing()
		return nil, err
	}
	bctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := svc.Run(bctx); err != nil {
			log.Error("in-process breaker stopped", "err", err)
		}
	}()
	return func() {
		cancel()
		<-done
		stopTracing()
	}, nil
}

// serveMetrics serves reg at http://addr/metrics until stop is called.
func serveMetrics(addr string, reg *prometheus.Registry, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics listen %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("metrics server", "err", err)
		}
	}()
	log.Info("metrics listening", "url", "http://"+ln.Addr().String()+"/metrics")
	return func() {
		_ = srv.Close()
		<-done
	}, nil
}
