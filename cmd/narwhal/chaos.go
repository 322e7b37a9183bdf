package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/chaos"
	"github.com/narwhalmesh/narwhal/config"
)

func init() {
	commands["chaos"] = command{
		summary: "inject engine faults: proxy, arm, list, disarm, run (docs/chaos.md)",
		run:     withOutput(runChaos),
	}
}

// Defaults of `narwhal chaos`.
const (
	// defaultChaosConnectBound is how long a chaos command waits for the
	// bus before it gives up.
	defaultChaosConnectBound = 5 * time.Second
	// chaosShutdownBound bounds a proxy's graceful shutdown; streams still
	// open then are cut.
	chaosShutdownBound = 5 * time.Second
	// chaosEventBuffer is the event buffer of a chaos command's publisher.
	chaosEventBuffer = 1024
	// defaultChaosArmTimeout is how long `narwhal chaos arm` waits for
	// the bus's set-up and a leader of the chaos bucket (--timeout).
	defaultChaosArmTimeout = 10 * time.Second
	// chaosArmRetry is how soon arm writes again after a write the chaos
	// bucket did not take.
	chaosArmRetry = 250 * time.Millisecond
	// chaosArmAttempt bounds one write of arm: a write the credential may
	// not make is dropped by the server, which says so only on the side
	// (bus.PermissionError), so each attempt must end soon enough for arm
	// to see that and stop, rather than wait out --timeout.
	chaosArmAttempt = 2 * time.Second
	// proxyAnswerWait is how long `narwhal chaos arm` gathers the chaos
	// proxies' answers to learn which engines they serve.
	proxyAnswerWait = 300 * time.Millisecond
)

const chaosUsage = `usage: narwhal chaos <subcommand> [flags]

subcommands:
  proxy   --target URL --listen HOST:PORT --engine-id ID
          a fault-injecting proxy in front of one engine
  arm     --engine ID --fault NAME [--phase P] [--prob 0..1] [--count N] [--for DUR] [--param k=v]... [--id FAULT_ID]
          arm a fault on an engine's proxies
  list    [--engine ID]
          the armed faults
  disarm  --engine ID [--id FAULT_ID] | --all
          remove armed faults
  run     FILE [--until DUR]
          play a timed YAML scenario of arm and disarm steps

Faults: ` + "%s" + `
Every command reaches NATS through NARWHAL_NATS_URL (default ` + defaultNATSURL + `),
with NARWHAL_NATS_CREDS and NARWHAL_NATS_TLS_{CA,CERT,KEY}. See docs/chaos.md.
`

// runChaos is `narwhal chaos proxy|arm|list|disarm|run` (behaviour.md §14,
// R-CHAOS-1). Results go to stdout, notices and usage to stderr. It
// returns flag.ErrHelp for -h, and an error for an unknown subcommand, bad
// flags, an unreachable bus or a failed operation.
func runChaos(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprintf(stderr, chaosUsage, strings.Join(chaos.Names(), ", "))
		return errors.New("a subcommand is required")
	}
	sub, rest := args[0], args[1:]
	switch sub {
	case "proxy":
		return runChaosProxy(ctx, rest, stdout, stderr)
	case "arm":
		return runChaosArm(ctx, rest, stdout, stderr)
	case "list":
		return runChaosList(ctx, rest, stdout, stderr)
	case "disarm":
		return runChaosDisarm(ctx, rest, stdout, stderr)
	case "run":
		return runChaosRun(ctx, rest, stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprintf(stderr, chaosUsage, strings.Join(chaos.Names(), ", "))
		return flag.ErrHelp
	}
	fmt.Fprintf(stderr, chaosUsage, strings.Join(chaos.Names(), ", "))
	return fmt.Errorf("unknown subcommand %q", sub)
}

// chaosBus is one chaos command's link to the bus: the connection, an
// event publisher and the fault store.
type chaosBus struct {
	b        *bus.Bus
	pub      *bus.Publisher
	store    *chaos.Store
	closeBus func() // closes b when connectChaos opened it; nil otherwise
}

// connectChaos connects to the bus of c (URL, credential, TLS) within
// bound (0: no limit, logging to log what it waits for) and binds to
// bucket narwhal_chaos. A bus not set up yet is waited for within bound
// too (bus.ConnectOptions.WaitSetUp); reach, when > 0, bounds only the
// wait for a server to answer (bus.ConnectOptions.ReachTimeout).
func connectChaos(ctx context.Context, c config.Bus, name string, bound, reach time.Duration, log *slog.Logger) (*chaosBus, error) {
	cctx := ctx
	if bound > 0 {
		var cancel context.CancelFunc
		cctx, cancel = context.WithTimeout(ctx, bound)
		defer cancel()
	}
	opts := busOptions(c, name, bus.RoleChaos, log)
	opts.Buckets = roleBuckets(bus.RoleChaos)
	opts.WaitSetUp = &bus.SetUpWait{}
	opts.ReachTimeout = reach
	b, err := bus.Connect(cctx, opts)
	if err != nil {
		return nil, fmt.Errorf("bus %s: %w", redactNATSURL(c.URL), err)
	}
	cb, err := openChaos(cctx, b)
	if err != nil {
		b.Close()
		return nil, err
	}
	cb.closeBus = b.Close
	return cb, nil
}

// openChaos opens bucket narwhal_chaos on b, with an event publisher of
// its own; close closes the publisher but not b.
func openChaos(ctx context.Context, b *bus.Bus) (*chaosBus, error) {
	pub := bus.NewPublisher(b, chaosEventBuffer, nil)
	store, err := chaos.OpenStore(ctx, b, pub)
	if err != nil {
		pub.Close()
		return nil, err
	}
	return &chaosBus{b: b, pub: pub, store: store}, nil
}

// connectChaosTool is connectChaos for a chaos command: the bus section
// from the environment (default nats://127.0.0.1:4222), bound by the
// command's --connect-timeout.
func connectChaosTool(ctx context.Context, name string, bound time.Duration, log *slog.Logger) (*chaosBus, error) {
	c, err := toolBus()
	if err != nil {
		return nil, err
	}
	return connectChaos(ctx, c, name, bound, 0, log)
}

// explain adds to err the permission the credential lacked, when the
// server reported one: NATS drops a denied write, which then fails by its
// timeout only (R-BUS-8).
func (c *chaosBus) explain(err error) error {
	if perm := c.b.PermissionError(); perm != nil {
		return fmt.Errorf("%w (the credential may not do this: %v)", err, perm)
	}
	return err
}

// close publishes the buffered events and, when connectChaos opened it,
// closes the connection.
func (c *chaosBus) close() {
	c.pub.Close()
	if c.closeBus != nil {
		c.closeBus()
	}
}

// chaosFlags returns a flag set for a chaos subcommand with
// --connect-timeout.
func chaosFlags(name string, stderr io.Writer) (*flag.FlagSet, *time.Duration) {
	fs := flag.NewFlagSet("narwhal chaos "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	bound := fs.Duration("connect-timeout", defaultChaosConnectBound, "give up when the bus is not reachable within `DUR`")
	return fs, bound
}

// parseChaosFlags parses args, refusing positional arguments unless
// positional is set.
func parseChaosFlags(fs *flag.FlagSet, args []string, positional bool) error {
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if !positional && fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	return nil
}

// runChaosArm is `narwhal chaos arm`: it arms one fault, prints
// "armed <fault>" and publishes an arm event. It waits up to --timeout
// (default 10 s) for the bus's set-up and a leader of bucket narwhal_chaos
// that takes the write, then fails saying what was missing and which
// command creates it (docs/chaos.md).
func runChaosArm(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, bound := chaosFlags("arm", stderr)
	timeout := fs.Duration("timeout", defaultChaosArmTimeout, "give up when the fault is not stored within `DUR`: the bus set up and the chaos bucket with a leader")
	engine := fs.String("engine", "", "the engine `ID` whose chaos proxies inject the fault (required)")
	name := fs.String("fault", "", "the fault `NAME`: "+strings.Join(chaos.Names(), ", ")+" (required)")
	id := fs.String("id", "", "the fault's `ID` on the engine (default: its name); arming an id again replaces the fault")
	phase := fs.String("phase", chaos.PhaseAny, "the `PHASE` it strikes: prefill, decode or any")
	prob := fs.Float64("prob", 1, "the `PROBABILITY` (0..1) that it strikes a request it applies to")
	count := fs.Int("count", 0, "strike `N` requests, then disarm (0: unlimited)")
	lifetime := fs.Duration("for", chaos.DefaultFor, "disarm after `DUR` (at most 24h)")
	params := map[string]string{}
	fs.Func("param", "a fault parameter `k=v` (repeatable): delay_ms, after_tokens, code, message, type", func(s string) error {
		k, v, err := chaos.ParseParam(s)
		if err != nil {
			return err
		}
		params[k] = v
		return nil
	})
	if err := parseChaosFlags(fs, args, false); err != nil {
		return err
	}
	if *engine == "" || *name == "" {
		return errors.New("--engine and --fault are required")
	}
	if *lifetime <= 0 {
		return errors.New("--for must be > 0")
	}
	f := chaos.Fault{EngineID: *engine, ID: *id, Name: *name, Phase: *phase, Probability: *prob, Count: *count, Params: params}
	if len(params) == 0 {
		f.Params = nil
	}
	if *timeout <= 0 {
		return errors.New("--timeout must be > 0")
	}
	c, err := toolBus()
	if err != nil {
		return err
	}
	actx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	cb, err := connectChaos(actx, c, "narwhal-chaos-arm", 0, *bound, nil)
	if err != nil {
		if errors.Is(err, bus.ErrNotSetUp) || (actx.Err() != nil && ctx.Err() == nil && !errors.Is(err, bus.ErrUnreachable)) {
			return fmt.Errorf("no fault armed within --timeout %v: %w", *timeout, err)
		}
		return err
	}
	defer cb.close()
	armed, err := armUntil(ctx, actx, cb, f, *lifetime, *timeout)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(stdout, "armed %s\n", armed.String()); err != nil {
		return err
	}
	warnUnserved(ctx, cb.store, stderr, []string{armed.EngineID})
	return nil
}

// armUntil arms f on cb's store, trying again while the chaos bucket
// cannot take the write for a while (no leader yet: a cluster electing
// one, or without a quorum) until actx ends — the command's --timeout,
// which began before it connected. It returns the fault as stored, or an
// error that says what was missing; a permission the credential lacks is
// an error at once. ctx is the command's own context (an interrupt).
func armUntil(ctx, actx context.Context, cb *chaosBus, f chaos.Fault, lifetime, timeout time.Duration) (chaos.Fault, error) {
	for {
		tctx, cancel := context.WithTimeout(actx, chaosArmAttempt)
		armed, err := cb.store.Arm(tctx, f, lifetime)
		cancel()
		if err == nil {
			return armed, nil
		}
		if cb.b.PermissionError() != nil || !bus.Temporary(err) {
			return chaos.Fault{}, cb.explain(err)
		}
		retry := time.NewTimer(chaosArmRetry)
		select {
		case <-retry.C:
			continue
		case <-actx.Done():
			retry.Stop()
		}
		if ctx.Err() != nil {
			return chaos.Fault{}, err
		}
		return chaos.Fault{}, fmt.Errorf("no fault armed within --timeout %v: bucket %s took no write "+
			"(no leader: a bus cluster still electing one, or without a quorum; `narwhal bus setup` creates the bucket): %w",
			timeout, bus.ChaosBucket, err)
	}
}

// warnUnserved asks the chaos proxies on the bus which engines they serve
// and writes a warning to w for each of engines that none serves, naming
// the served ones. A fault armed for such an engine is kept (a proxy
// started later loads it), but it is likely a typo. When the proxies
// cannot be asked it says nothing.
func warnUnserved(ctx context.Context, store *chaos.Store, w io.Writer, engines []string) {
	served, err := store.Proxies(ctx, proxyAnswerWait)
	if err != nil {
		return
	}
	answer := "no chaos proxy answered on this bus"
	if len(served) > 0 {
		answer = "proxies serve " + strings.Join(served, ", ")
	}
	for _, e := range engines {
		if !slices.Contains(served, e) {
			fmt.Fprintf(w, "warning: no chaos proxy serves engine %s (%s); the fault strikes once a proxy for it starts\n", e, answer)
		}
	}
}

// runChaosList is `narwhal chaos list`: a table of the armed faults.
func runChaosList(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, bound := chaosFlags("list", stderr)
	engine := fs.String("engine", "", "only the faults of engine `ID`")
	if err := parseChaosFlags(fs, args, false); err != nil {
		return err
	}
	cb, err := connectChaosTool(ctx, "narwhal-chaos-list", *bound, nil)
	if err != nil {
		return err
	}
	defer cb.close()
	faults, err := cb.store.List(ctx, *engine)
	if err != nil {
		return err
	}
	return writeFaultTable(stdout, faults, time.Now())
}

// writeFaultTable writes faults as a table: ENGINE, FAULT, PHASE, PROB,
// COUNT LEFT, EXPIRES, PARAMS; "no faults armed" when there are none.
func writeFaultTable(w io.Writer, faults []chaos.Fault, now time.Time) error {
	if len(faults) == 0 {
		_, err := fmt.Fprintln(w, "no faults armed")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ENGINE\tFAULT\tPHASE\tPROB\tCOUNT LEFT\tEXPIRES\tPARAMS")
	for _, f := range faults {
		name := f.Name
		if f.ID != f.Name {
			name += " (id " + f.ID + ")"
		}
		left := "unlimited"
		if f.Count > 0 {
			left = strconv.Itoa(f.Left) + " of " + strconv.Itoa(f.Count)
		}
		expires := f.Expires.UTC().Format(time.RFC3339) + " (in " + f.Expires.Sub(now).Round(time.Second).String() + ")"
		params := chaos.ParamString(f.Params)
		if params == "" {
			params = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", f.EngineID, name, f.Phase,
			strconv.FormatFloat(f.Probability, 'g', -1, 64), left, expires, params)
	}
	return tw.Flush()
}

// runChaosDisarm is `narwhal chaos disarm`: it removes armed faults,
// prints "disarmed <fault>" for each, and publishes disarm events.
func runChaosDisarm(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, bound := chaosFlags("disarm", stderr)
	engine := fs.String("engine", "", "disarm the faults of engine `ID`")
	id := fs.String("id", "", "with --engine, only the fault `FAULT_ID`")
	all := fs.Bool("all", false, "disarm every fault of every engine")
	if err := parseChaosFlags(fs, args, false); err != nil {
		return err
	}
	if *all == (*engine != "") {
		return errors.New("want one of --engine ID and --all")
	}
	if *all && *id != "" {
		return errors.New("--id needs --engine")
	}
	cb, err := connectChaosTool(ctx, "narwhal-chaos-disarm", *bound, nil)
	if err != nil {
		return err
	}
	defer cb.close()
	gone, err := cb.store.Disarm(ctx, *engine, *id)
	if err != nil {
		return cb.explain(err)
	}
	if len(gone) == 0 {
		_, err = fmt.Fprintln(stdout, "nothing armed")
		return err
	}
	for _, f := range gone {
		if _, err := fmt.Fprintf(stdout, "disarmed %s\n", f.String()); err != nil {
			return err
		}
	}
	return nil
}

// runChaosRun is `narwhal chaos run FILE [--until DUR]`: it plays a
// scenario, printing each step as it runs, and returns after the last
// step or at --until.
func runChaosRun(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, bound := chaosFlags("run", stderr)
	until := fs.Duration("until", 0, "stop `DUR` after the start (skipping later steps, or waiting when the steps end sooner)")
	// Accept flags before or after FILE.
	var file string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		file, args = args[0], args[1:]
	}
	if err := parseChaosFlags(fs, args, file == ""); err != nil {
		return err
	}
	if file == "" {
		if fs.NArg() != 1 {
			return errors.New("want one scenario FILE")
		}
		file = fs.Arg(0)
	}
	if *until < 0 {
		return errors.New("--until must not be negative")
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	sc, err := chaos.ParseScenario(data)
	if err != nil {
		return err
	}
	cb, err := connectChaosTool(ctx, "narwhal-chaos-run", *bound, nil)
	if err != nil {
		return err
	}
	defer cb.close()
	var armed []string
	for _, st := range sc.Steps {
		if st.Arm != nil && !slices.Contains(armed, st.Arm.Engine) {
			armed = append(armed, st.Arm.Engine)
		}
	}
	warnUnserved(ctx, cb.store, stderr, armed)
	fmt.Fprintf(stdout, "scenario %s: %d steps\n", file, len(sc.Steps))
	if err := sc.Run(ctx, cb.store, stdout, *until); err != nil {
		return cb.explain(err)
	}
	_, err = fmt.Fprintln(stdout, "scenario done")
	return err
}

// runChaosProxy is `narwhal chaos proxy --target URL --listen HOST:PORT
// --engine-id ID`: it serves a chaos proxy for one engine until ctx ends
// (SIGINT), printing "chaos proxy <id> listening on <url> -> <target>".
func runChaosProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal chaos proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	bound := fs.Duration("connect-timeout", 0, "give up when the bus is not reachable within `DUR` (0: bus.connect_timeout_s, whose default 0 keeps trying)")
	target := fs.String("target", "", "the engine's base `URL`, e.g. http://10.0.0.21:8000 (required)")
	listen := fs.String("listen", "127.0.0.1:0", "`HOST:PORT` to serve on (port 0: any free port)")
	engine := fs.String("engine-id", "", "the engine's `ID` in the fleet: the proxy injects the faults armed for it (required)")
	verbose := fs.Bool("verbose", false, "log debug notices (upstream errors)")
	if err := parseChaosFlags(fs, args, false); err != nil {
		return err
	}
	if *target == "" || *engine == "" {
		return errors.New("--target and --engine-id are required")
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	c, err := toolBus()
	if err != nil {
		return err
	}
	if *bound == 0 {
		*bound = c.ConnectTimeout()
	}
	cb, err := connectChaos(ctx, c, "narwhal-chaos-proxy-"+*engine, *bound, 0, log)
	if err != nil {
		return err
	}
	defer cb.close()
	// A revoked chaos credential stops the proxy: it exits non-zero
	// saying so (R-BUS-11, docs/security.md).
	ctx, stopRefused := untilRefused(ctx, cb.b)
	defer stopRefused()
	base, stop, err := serveChaosProxy(ctx, cb.store, *engine, *target, *listen, log)
	if err != nil {
		return err
	}
	defer stop()
	_, err = fmt.Fprintf(stdout, "chaos proxy %s listening on %s -> %s\n", *engine, base, *target)
	if err != nil {
		return err
	}
	<-ctx.Done()
	return refusedCause(ctx)
}

// serveChaosProxy starts a chaos proxy for engine in front of target and
// serves it on listen. It returns the proxy's base URL and a stop function
// that shuts the server down (cutting streams still open after
// chaosShutdownBound) and closes the proxy.
func serveChaosProxy(ctx context.Context, store *chaos.Store, engine, target, listen string, log *slog.Logger) (string, func(), error) {
	p, err := chaos.NewProxy(chaos.ProxyOptions{Target: target, EngineID: engine, Store: store, Log: log})
	if err != nil {
		return "", nil, err
	}
	if err := p.Start(ctx); err != nil {
		p.Close()
		return "", nil, err
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		p.Close()
		return "", nil, fmt.Errorf("listen %s: %w", listen, err)
	}
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 30 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	stop := func() {
		sctx, cancel := context.WithTimeout(context.Background(), chaosShutdownBound)
		defer cancel()
		if srv.Shutdown(sctx) != nil {
			_ = srv.Close()
		}
		<-served
		p.Close()
	}
	return "http://" + ln.Addr().String(), stop, nil
}
