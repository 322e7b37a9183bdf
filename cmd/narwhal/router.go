package main

import (
	"context"
	"errors"
	"flag"
	"os"

	"github.com/narwhalmesh/narwhal/config"
)

func init() {
	commands["router"] = command{
		summary: "serve the OpenAI-compatible front end over a fleet (--config FILE --listen HOST:PORT)",
		run:     runRouterCmd,
	}
}

// runRouterCmd is `narwhal router --config FILE --listen HOST:PORT` (SPEC
// §14). With no NARWHAL_NATS_URL it runs its own embedded NATS.
func runRouterCmd(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	path := fs.String("config", "", "YAML configuration file (docs/configuration.md); environment NARWHAL_<SECTION>_<KEY> overrides it")
	listen := fs.String("listen", "127.0.0.1:8080", "HOST:PORT to serve HTTP on")
	admin := fs.String("admin", "", "HOST:PORT of an opt-in admin listener serving /debug/pprof (off when empty)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return errors.New("--config is required")
	}
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	if len(cfg.Fleet) == 0 {
		return errors.New("config: fleet: at least one engine is required")
	}
	log := newLogger(cfg, os.Stderr)
	if *admin != "" {
		if err := serveAdmin(ctx, *admin, log); err != nil {
			return err
		}
	}
	return runRouter(ctx, cfg, *listen, log, nil)
}
