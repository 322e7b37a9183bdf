package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync/atomic"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/dashboard"
)

func init() {
	commands["dashboard"] = command{
		summary:   "serve the live fleet page, a read-only view of the bus ([--listen HOST:PORT])",
		run:       withOutput(runDashboard),
		checkArgs: true,
	}
}

// defaultDashboardListen is where `narwhal dashboard` and the dev stack
// serve the fleet page: 8090, clear of the routers' 8080, 8081 and 8082 of
// the documentation and examples/mesh.sh, so that `narwhal dev` and the
// mesh example run side by side.
const defaultDashboardListen = "127.0.0.1:8090"

// runDashboard is `narwhal dashboard [--listen HOST:PORT] [--config FILE]
// [--connect-timeout DUR]` (behaviour.md §14, R-BUS-5): it follows the bus at
// NARWHAL_NATS_URL (default nats://127.0.0.1:4222, with the credential and
// TLS variables of the bus section; the viewer credential suffices and it
// changes nothing on the bus, R-BUS-8) and serves the live fleet page on
// --listen (default 127.0.0.1:8090). With --config, the file's bus
// section is used instead, and its fleet is listed even before the live
// fleet's bucket names it. It prints the page's URL on stdout once it
// serves.
//
// It waits for the bus — reachable, and set up by `narwhal bus setup` —
// (saying so on stderr) for --connect-timeout, or for ever when that is 0
// (the default), and runs until ctx ends (SIGINT,
// SIGTERM); then it returns nil. It returns an error for bad flags, an
// address it cannot listen on, or a bus not reached in time.
func runDashboard(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal dashboard", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: narwhal dashboard [--listen HOST:PORT] [--config FILE] [--connect-timeout DUR]")
		fmt.Fprintln(stderr, "Serves the live fleet page for the bus at NARWHAL_NATS_URL (default "+defaultNATSURL+"); the page is read-only.")
		fs.PrintDefaults()
	}
	listen := fs.String("listen", defaultDashboardListen, "`HOST:PORT` to serve the page on")
	cfgPath := fs.String("config", "", "optional YAML configuration `FILE`: its bus section, and its fleet listed before the live fleet names it")
	bound := fs.Duration("connect-timeout", 0, "give up when the bus is not reachable within `DUR` (0: wait)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *bound < 0 {
		return fmt.Errorf("--connect-timeout %v: must be ≥ 0", *bound)
	}
	busCfg, err := toolBus()
	if err != nil {
		return err
	}
	var fleet []dashboard.Engine
	if *cfgPath != "" {
		cfg, err := config.Load(*cfgPath)
		if err != nil {
			return err
		}
		busCfg = cfg.Bus
		if busCfg.URL == "" {
			busCfg.URL = defaultNATSURL
		}
		fleet = dashboardFleet(cfg)
	}
	if err := argsChecked(ctx); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", *listen, err)
	}
	defer ln.Close()

	var closing atomic.Bool // set at exit: closing the connection is no news
	log := slog.New(quietAfter{slog.NewTextHandler(stderr, nil), &closing})
	connectCtx, cancel := ctx, context.CancelFunc(func() {})
	if *bound > 0 {
		connectCtx, cancel = context.WithTimeout(ctx, *bound)
	}
	opts := busOptions(busCfg, "narwhal-dashboard", bus.RoleViewer, log)
	opts.WaitSetUp = &bus.SetUpWait{} // a bus not set up yet: wait, saying so
	b, err := bus.Connect(connectCtx, opts)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted while connecting
		}
		return fmt.Errorf("bus %s: %w", redactNATSURL(busCfg.URL), err)
	}
	defer func() {
		closing.Store(true)
		b.Close()
	}()
	fmt.Fprintf(stderr, "following %s\n", b.URL())
	fmt.Fprintf(stdout, "Fleet page: %s\n", pageURL(ln.Addr()))
	// A revoked viewer credential stops the page: exit non-zero saying so
	// (R-BUS-11).
	ctx, stopRefused := untilRefused(ctx, b)
	defer stopRefused()
	err = dashboard.New(dashboard.Options{Bus: b, Log: log, Fleet: fleet}).Serve(ctx, ln)
	if refused := refusedCause(ctx); refused != nil {
		return refused
	}
	return err
}

// dashboardFleet is the fleet of cfg as the page lists it.
func dashboardFleet(cfg *config.Config) []dashboard.Engine {
	out := make([]dashboard.Engine, 0, len(cfg.Fleet))
	for _, e := range cfg.Fleet {
		out = append(out, dashboard.Engine{ID: e.ID, Role: string(e.Role)})
	}
	return out
}

// pageURL is the fleet page's URL for the listener's address.
func pageURL(addr net.Addr) string { return "http://" + addr.String() + "/" }

// startDevDashboard serves the fleet page of the dev stack on listen, or
// on a free port of the same host when that is taken, following b (with
// cfg's fleet listed) until ctx ends. It returns the page's URL and a
// function that stops it and waits until it has.
func startDevDashboard(ctx context.Context, b *bus.Bus, cfg *config.Config, listen string, log *slog.Logger) (string, func(), error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		host, _, splitErr := net.SplitHostPort(listen)
		if splitErr != nil {
			return "", nil, fmt.Errorf("dashboard --listen %s: %w", listen, splitErr)
		}
		if ln, err = net.Listen("tcp", net.JoinHostPort(host, "0")); err != nil {
			return "", nil, fmt.Errorf("dashboard listen %s: %w", listen, err)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		d := dashboard.New(dashboard.Options{Bus: b, Log: log, Fleet: dashboardFleet(cfg)})
		if err := d.Serve(ctx, ln); err != nil && !errors.Is(err, net.ErrClosed) {
			log.Warn("fleet page stopped", "err", err)
		}
	}()
	return pageURL(ln.Addr()), func() {
		cancel()
		<-done
	}, nil
}
