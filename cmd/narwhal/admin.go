package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// serveAdmin serves Go's profiling endpoints (/debug/pprof/…) on addr until
// ctx ends: an opt-in listener of its own, never the client-facing one, so
// profiling is neither exposed to clients nor on the hot path. With a
// non-nil metrics registry it also serves it at /metrics
// (server.metrics_on_admin). It returns once the listener is open; errors
// after that are logged.
func serveAdmin(ctx context.Context, addr string, log *slog.Logger, metrics *prometheus.Registry) error {
	mux := http.NewServeMux()
	if metrics != nil {
		mux.Handle("/metrics", promhttp.HandlerFor(metrics, promhttp.HandlerOpts{}))
	}
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("admin listener", "err", err)
		}
	}()
	context.AfterFunc(ctx, func() { _ = srv.Close() })
	log.Info("admin listening", "url", "http://"+ln.Addr().String()+"/debug/pprof/", "metrics", metrics != nil)
	return nil
}
