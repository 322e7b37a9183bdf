package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
)

func init() {
	commands["dev"] = command{
		summary: "run the whole stack on this machine: embedded NATS, a router, 2 prefill and 2 decode simulators",
		run:     runDev,
	}
}

// devModel is the model the dev stack's simulators serve.
const devModel = "narwhal-sim"

// runDev is `narwhal dev [--listen HOST:PORT]` (SPEC §14): embedded NATS, a
// router, two prefill and two decode simulators on free ports, and a
// ready-to-paste curl. The bus listens on TCP so other commands can follow
// it (see startDevChaos); with --chaos a chaos proxy stands in front of each
// simulator. Ctrl-C stops
// everything.
func runDev(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("dev", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:8080", "HOST:PORT for the router")
	ttft := fs.Duration("ttft", 0, "simulated time to first token of each decode")
	itl := fs.Duration("itl", 0, "simulated inter-token latency")
	chaosMode := fs.Bool("chaos", false, "put a chaos proxy in front of every simulator and serve the bus on TCP for narwhal chaos arm (docs/chaos.md)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	cfg, err := config.Parse(nil)
	if err != nil {
		return err
	}
	if cfg.Router.LogLevel == "info" && os.Getenv("NARWHAL_ROUTER_LOG_LEVEL") == "" {
		cfg.Router.LogLevel = "warn"
	}
	log := newLogger(cfg, os.Stderr)

	var sims []*sim.Server
	defer func() {
		for _, s := range sims {
			s.Close()
		}
	}()
	// The dev bus listens on TCP (127.0.0.1:4222, or a free port) so that
	// `narwhal events` and `narwhal chaos` can follow and steer the stack
	// from another terminal; dev runs the breaker on it itself.
	dc, err := startDevChaos(ctx, cfg, log, devChaosPort)
	if err != nil {
		return err
	}
	defer dc.close()
	for _, e := range []struct{ id, role string }{
		{"prefill-1", "prefill"}, {"prefill-2", "prefill"}, {"decode-1", "decode"}, {"decode-2", "decode"},
	} {
		s, err := sim.New(sim.Config{Role: e.role, EngineID: e.id, Model: devModel, TTFT: *ttft, ITL: *itl})
		if err != nil {
			return err
		}
		sims = append(sims, s)
		url, err := s.Start("127.0.0.1:0")
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "sim %-10s %-8s %s\n", e.id, e.role, url)
		if *chaosMode {
			if url, err = dc.front(ctx, e.id, url, log); err != nil {
				return err
			}
		}
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: e.id, URL: url, Role: connector.Role(e.role), Connector: connector.NixlName})
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := dc.startBreaker(ctx, cfg, log); err != nil {
		return err
	}
	return runRouter(ctx, cfg, *listen, log, func(base string) {
		fmt.Printf(`
Narwhal dev stack is up: router %[1]s, 2 prefill + 2 decode simulators.
Try a streamed chat completion (prefill on one sim, KV pulled by a decode sim):

curl -N %[1]s/v1/chat/completions -H 'Content-Type: application/json' -d '{"model":"%[2]s","messages":[{"role":"user","content":"Hello, narwhal!"}],"stream":true,"max_tokens":16}'

Metrics: %[1]s/metrics   Ready: %[1]s/readyz   Press Ctrl-C to stop.
Follow the events from another terminal: NARWHAL_NATS_URL=%[3]s go run ./cmd/narwhal events
`, base, devModel, redactNATSURL(dc.natsURL))
		if *chaosMode {
			fmt.Print(dc.banner())
		}
	})
}
