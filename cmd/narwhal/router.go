package main

import (
	"context"
	"errors"
	"flag"
	"os"
	"os/signal"
	"syscall"

	"github.com/narwhalmesh/narwhal/config"
)

func init() {
	commands["router"] = command{
		summary:   "serve the OpenAI-compatible front end over a fleet (--config FILE --listen HOST:PORT)",
		run:       runRouterCmd,
		checkArgs: true,
	}
}

// runRouterCmd is `narwhal router --config FILE --listen HOST:PORT` (behaviour.md
// §14). With no NARWHAL_NATS_URL it runs its own embedded NATS.
//
// SIGHUP reads the configuration again (the file, the environment and the
// API keys file) and applies the client API keys and the TLS certificate
// without a restart; other settings apply at the next start.
func runRouterCmd(ctx context.Context, args []string) error {
	// Caught from the start, so that a SIGHUP never ends the process.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	fs := flag.NewFlagSet("narwhal router", flag.ContinueOnError)
	path := fs.String("config", "", configUsage)
	listen := fs.String("listen", "127.0.0.1:8080", "HOST:PORT to serve HTTP on")
	admin := fs.String("admin", "", "HOST:PORT of an opt-in admin listener serving /debug/pprof, and /metrics with server.metrics_on_admin (off when empty)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	cfg, err := loadMesh(*path)
	if err != nil {
		return err
	}
	if cfg.Server.MetricsOnAdmin && *admin == "" {
		return errors.New("config: server.metrics_on_admin is true: start the router with --admin HOST:PORT to serve /metrics")
	}
	if err := argsChecked(ctx); err != nil {
		return err
	}
	log := newLogger(cfg, os.Stderr)
	return runRouterWith(ctx, routerRun{cfg: cfg, listen: *listen, admin: *admin, log: log, reload: func() (*config.Config, error) {
		return config.Load(*path)
	}, hup: hup})
}
