package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
)

func init() {
	commands["dev"] = command{
		summary: "run the whole stack on this machine: embedded NATS, a router, 2 prefill and 2 decode simulators, the fleet page",
		run:     runDev,
	}
}

// devModel is the model the dev stack's simulators serve.
const devModel = "narwhal-sim"

// devBusPort is the port the bus of `narwhal dev` tries first: NATS's
// standard client port, the default of `narwhal events` and `narwhal
// chaos`.
const devBusPort = 4222

// devBusConnectBound bounds the dev stack's connection to its bus.
const devBusConnectBound = 10 * time.Second

// runDev is `narwhal dev [--listen HOST:PORT] [--chaos] [--dashboard
// HOST:PORT]` (behaviour.md §14): embedded NATS on TCP (see startDevBus) with the
// breaker on it, a router, two prefill and two decode simulators on free
// ports, the live fleet page (default 127.0.0.1:8090), and a banner with a
// ready-to-paste curl and the page's URL. With --chaos a chaos proxy
// stands in front of each simulator. Ctrl-C stops everything.
func runDev(ctx context.Context, args []string) error {
	fs, f := newDevFlags()
	listen, ttft, itl, chaosMode, page := f.listen, f.ttft, f.itl, f.chaos, f.page
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
	db, err := startDevBus(ctx, cfg, log, devBusPort)
	if err != nil {
		return err
	}
	defer db.close()
	if *chaosMode {
		if err := db.enableChaos(ctx); err != nil {
			return err
		}
	}
	for _, e := range []struct {
		id   string
		role connector.Role
	}{
		{"prefill-1", connector.RolePrefill}, {"prefill-2", connector.RolePrefill},
		{"decode-1", connector.RoleDecode}, {"decode-2", connector.RoleDecode},
	} {
		s, err := sim.New(sim.Config{Role: string(e.role), EngineID: e.id, Model: devModel, TTFT: *ttft, ITL: *itl})
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
			if url, err = db.front(ctx, e.id, url, log); err != nil {
				return err
			}
		}
		cfg.Fleet = append(cfg.Fleet, config.EngineSpec{ID: e.id, URL: url, Role: e.role, Connector: connector.DefaultName})
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if *page != "" {
		url, stop, err := startDevDashboard(ctx, db.b, cfg, *page, log)
		if err != nil {
			return err
		}
		defer stop() // before the bus closes
		db.page = url
	}
	if err := db.startBreaker(ctx, cfg, log); err != nil {
		return err
	}
	self := selfCommand(os.Args[0])
	return runRouterWith(ctx, routerRun{cfg: cfg, listen: *listen, log: log, reg: db.reg, stopNotice: os.Stderr, onReady: func(base string) {
		writeDevBanner(os.Stdout, base, self, db, cfg.Auth)
	}})
}

// devKeyVar is the variable the dev banner's curl reads a client API key
// from when client authentication is on: the one the OpenAI SDKs read, so
// that a client started from the same shell is authenticated too.
const devKeyVar = "OPENAI_API_KEY"

// devFlags are the flags of `narwhal dev`.
type devFlags struct {
	listen, page *string
	ttft, itl    *time.Duration
	chaos        *bool
}

// newDevFlags defines the flags of `narwhal dev` on a new flag set (README
// names them; a test checks that each one it names exists).
func newDevFlags() (*flag.FlagSet, *devFlags) {
	fs := flag.NewFlagSet("narwhal dev", flag.ContinueOnError)
	return fs, &devFlags{
		listen: fs.String("listen", "127.0.0.1:8080", "HOST:PORT for the router"),
		ttft:   fs.Duration("ttft", 0, "simulated time to first token of each decode"),
		itl:    fs.Duration("itl", 0, "simulated inter-token latency"),
		chaos:  fs.Bool("chaos", false, "put a chaos proxy in front of every simulator, armed with narwhal chaos arm (docs/chaos.md)"),
		page:   fs.String("dashboard", defaultDashboardListen, "`HOST:PORT` for the live fleet page (a free port when taken; empty: none)"),
	}
}

// writeDevBanner writes the ready message of `narwhal dev` for the router
// at base: the curl to paste, where to look, and — with --chaos — the
// proxies and how to arm them. Every command line spells the binary as
// self. With API keys in auth (NARWHAL_AUTH_API_KEYS_FILE, behaviour.md
// R-API-9) it says that authentication is on, names the keys and prints
// the curl with "Authorization: Bearer $OPENAI_API_KEY": the router holds
// only the keys' SHA-256, never a key, so the banner cannot print one and
// prints no digest either; the user exports the key they hold.
func writeDevBanner(w io.Writer, base, self string, db *devBus, auth config.Auth) {
	natsURL := redactNATSURL(db.natsURL)
	fmt.Fprintf(w, "\nNarwhal dev stack is up: router %s, 2 prefill + 2 decode simulators.\n", base)
	bearer := ""
	if len(auth.APIKeys) > 0 {
		names := make([]string, len(auth.APIKeys))
		for i, k := range auth.APIKeys {
			names[i] = k.Name
		}
		from := ""
		if auth.APIKeysFile != "" {
			from = " from " + auth.APIKeysFile
		}
		fmt.Fprintf(w, `Client authentication is on: %[1]d API key(s)%[2]s (%[3]s); every /v1/ request needs one.
Narwhal keeps only their SHA-256, so export the key you hold for %[4]s (the curl below and the OpenAI SDKs read it):

export %[5]s='<the key of %[4]s>'

`, len(names), from, strings.Join(names, ", "), names[0], devKeyVar)
		bearer = ` -H "Authorization: Bearer $` + devKeyVar + `"`
	}
	fmt.Fprintf(w, `Try a streamed chat completion (prefill on one sim, KV pulled by a decode sim):

curl -N %[1]s/v1/chat/completions%[5]s -H 'Content-Type: application/json' -d '{"model":"%[2]s","messages":[{"role":"user","content":"Hello, narwhal!"}],"stream":true,"max_tokens":16}'

Metrics: %[1]s/metrics   Ready: %[1]s/readyz   Press Ctrl-C to stop.
Follow the events from another terminal:

NARWHAL_NATS_URL=%[3]s %[4]s events
`, base, devModel, natsURL, self, bearer)
	if db.page != "" {
		fmt.Fprintf(w, "\nWatch the fleet live in a browser: %s\n", db.page)
	}
	if db.chaos == nil {
		return
	}
	fmt.Fprintf(w, "\nChaos proxies stand in front of every simulator:\n")
	for _, f := range db.fronts {
		fmt.Fprintf(w, "  %s\n", f)
	}
	fmt.Fprintf(w, `Arm faults from another terminal (docs/chaos.md):

export NARWHAL_NATS_URL=%[1]s
%[2]s chaos arm --engine decode-1 --fault http-status --param code=503
%[2]s chaos list
%[2]s events
%[2]s chaos disarm --all
`, natsURL, self)
}

// selfCommand is how the dev banner spells this binary so that its lines
// can be pasted as they are: "go run ./cmd/narwhal" when `go run` built it
// (its executable then lives in a go-build folder, or in the build cache,
// where Go keeps the executables `go run` built), else arg0 as it was
// started (e.g. "narwhal" from PATH, or "./bin/narwhal").
func selfCommand(arg0 string) string {
	exe, err := os.Executable()
	if err != nil {
		exe = arg0
	}
	return spellSelf(exe, arg0)
}

// goBuildDir is the name of the folder `go run` builds in (go-build<N>).
var goBuildDir = regexp.MustCompile(`^go-build[0-9]+$`)

// goCacheExeDir is the name of the build cache's folder of an executable
// `go run` built and cached (<GOCACHE>/<2 hex>/<64 hex>-d/narwhal), which
// it runs from there on the next `go run`.
var goCacheExeDir = regexp.MustCompile(`^[0-9a-f]{64}-d$`)

// spellSelf is selfCommand for the executable's path exe.
func spellSelf(exe, arg0 string) string {
	dirs := strings.Split(filepath.ToSlash(filepath.Dir(exe)), "/")
	for _, dir := range dirs {
		if goBuildDir.MatchString(dir) {
			return "go run ./cmd/narwhal"
		}
	}
	if n := len(dirs); n >= 2 && goCacheExeDir.MatchString(dirs[n-1]) && len(dirs[n-2]) == 2 && strings.HasPrefix(dirs[n-1], dirs[n-2]) {
		return "go run ./cmd/narwhal"
	}
	if arg0 == "" {
		return "narwhal"
	}
	return arg0
}

// devBus is the bus of `narwhal dev`, with or without --chaos: an embedded
// NATS server with JetStream that listens on TCP, so that `narwhal events`
// and `narwhal chaos` in another terminal reach it (or the bus bus.url
// names), the dev stack's breaker on it, and with --chaos the fault store
// and a chaos proxy in front of each simulator.
type devBus struct {
	natsURL string
	emb     *bus.Embedded // nil when bus.url was set
	b       *bus.Bus
	chaos   *chaosBus // nil without --chaos
	breaker func()    // stops the dev breaker; nil when none runs
	stops   []func()  // stop the chaos proxies
	fronts  []string  // "chaos <engine> <proxy URL> -> <sim URL>"
	page    string    // the live fleet page's URL; "" when none runs
	// reg holds the dev breaker's metrics; the dev router serves it on
	// its /metrics beside its own.
	reg *prometheus.Registry
}

// startDevBus starts the bus of `narwhal dev`: an embedded NATS server with
// JetStream on 127.0.0.1:port, or on a free port when that is taken or port
// is -1 (store NARWHAL_DATA_DIR, or a temporary folder removed at exit),
// which sets itself up in-process — unless cfg.Bus.URL names a bus already
// — and connects to it. It sets cfg.Bus.URL so that the dev router joins
// the same bus.
func startDevBus(ctx context.Context, cfg *config.Config, log *slog.Logger, port int) (*devBus, error) {
	d := &devBus{natsURL: cfg.Bus.URL, reg: prometheus.NewRegistry()}
	if d.natsURL == "" {
		if port > 0 && !portFree(port) {
			port = -1 // taken: a free one at once, not after the server's ready timeout
		}
		opts := bus.EmbeddedOptions{Dir: config.EmbeddedDataDir(), Host: "127.0.0.1", Port: port, LeaseTTL: cfg.Breaker.LeaseTTL()}
		emb, err := bus.StartEmbedded(opts)
		if err != nil && port != -1 {
			opts.Port = -1
			emb, err = bus.StartEmbedded(opts)
		}
		if err != nil {
			return nil, fmt.Errorf("dev bus: %w", err)
		}
		d.emb, d.natsURL = emb, emb.ClientURL()
		cfg.Bus.URL = d.natsURL
	}
	cctx, cancel := context.WithTimeout(ctx, devBusConnectBound)
	defer cancel()
	b, err := bus.Connect(cctx, busOptions(cfg.Bus, "narwhal-dev", "", log))
	if err != nil {
		d.close()
		return nil, fmt.Errorf("dev bus %s: %w", redactNATSURL(d.natsURL), err)
	}
	d.b = b
	log.Info("dev bus ready", "url", redactNATSURL(d.natsURL))
	return d, nil
}

// portFree reports whether 127.0.0.1:port can be listened on now.
func portFree(port int) bool {
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	ln.Close()
	return true
}

// enableChaos opens the fault store (bucket narwhal_chaos) on the dev bus,
// for the proxies front starts.
func (d *devBus) enableChaos(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, devBusConnectBound)
	defer cancel()
	cb, err := openChaos(cctx, d.b)
	if err != nil {
		return fmt.Errorf("dev chaos: %w", err)
	}
	d.chaos = cb
	return nil
}

// front puts a chaos proxy for engine in front of simURL and returns the
// proxy's URL, which the router's fleet then uses. It needs enableChaos.
func (d *devBus) front(ctx context.Context, engine, simURL string, log *slog.Logger) (string, error) {
	base, stop, err := serveChaosProxy(ctx, d.chaos.store, engine, simURL, "127.0.0.1:0", log)
	if err != nil {
		return "", fmt.Errorf("chaos proxy for %s: %w", engine, err)
	}
	d.stops = append(d.stops, stop)
	d.fronts = append(d.fronts, fmt.Sprintf("chaos %-10s %s -> %s", engine, base, simURL))
	return base, nil
}

// startBreaker runs the dev stack's breaker for cfg on the dev bus when
// dev started that bus itself: the router, which now reaches its bus
// through bus.url, runs none then (a router on an external bus leaves the
// breaker to `narwhal breaker`). On a bus bus.url named, it does nothing.
func (d *devBus) startBreaker(ctx context.Context, cfg *config.Config, log *slog.Logger) error {
	if d.emb == nil {
		log.Warn("dev on an external bus (bus.url): no breaker runs unless `narwhal breaker` does")
		return nil
	}
	stop, err := startBreaker(context.WithoutCancel(ctx), cfg, d.b, "breaker-"+cfg.Router.ID, d.reg, log)
	if err != nil {
		return err
	}
	d.breaker = stop
	return nil
}

// close stops the breaker, the proxies, the fault store's publisher, the
// bus link and the embedded server.
func (d *devBus) close() {
	if d.breaker != nil {
		d.breaker()
		d.breaker = nil
	}
	for i := len(d.stops) - 1; i >= 0; i-- {
		d.stops[i]()
	}
	d.stops = nil
	if d.chaos != nil {
		d.chaos.close()
		d.chaos = nil
	}
	if d.b != nil {
		d.b.Close()
		d.b = nil
	}
	if d.emb != nil {
		d.emb.Shutdown()
		d.emb = nil
	}
}
