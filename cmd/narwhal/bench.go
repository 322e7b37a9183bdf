package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/bench"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/schemas"
)

func init() {
	commands["bench"] = command{
		summary: "load-test a router (--url) or a local stack (--local), optionally against the floor (--compare-floor)",
		run:     runBench,
	}
}

// benchFlags are the flags of `narwhal bench`.
type benchFlags struct {
	url, concurrency, rate, endpoint, promptWords, maxTokens string
	model, jsonPath, svgPath, cpuProfile, routerBus          string
	local, stream, ignoreEOS, compare, routerProcess, quiet  bool
	ttft, itl, duration, warmup, timeout                     time.Duration
	requests, slices, routerPID                              int
	seed                                                     uint64
	set                                                      map[string]bool
	prefix                                                   prefixFlags
}

// runBench is `narwhal bench` (behaviour.md §14): a load generator for the
// OpenAI-compatible front end, with a side-by-side comparison against the
// floor (both legs run directly against the engines).
func runBench(ctx context.Context, args []string) error {
	var f benchFlags
	fs := flag.NewFlagSet("narwhal bench", flag.ContinueOnError)
	fs.StringVar(&f.url, "url", "", "router base URL, e.g. http://127.0.0.1:8080 (default: --local)")
	fs.BoolVar(&f.local, "local", false, "start 2 prefill + 2 decode simulators and a router on loopback (the default without --url)")
	fs.DurationVar(&f.ttft, "ttft", 0, "--local: simulated time to first token of each decode")
	fs.DurationVar(&f.itl, "itl", 0, "--local: simulated inter-token latency")
	fs.StringVar(&f.concurrency, "concurrency", "1", "closed loop: number of clients; a comma-separated list runs one workload per value")
	fs.StringVar(&f.rate, "rate", "", "open loop: Poisson arrivals per second (instead of --concurrency); a comma-separated list runs one workload per value (--workload: one value, default 32)")
	fs.DurationVar(&f.duration, "duration", 30*time.Second, "measured duration of each workload")
	fs.IntVar(&f.requests, "requests", 0, "end each workload after this many requests (0: --duration only)")
	fs.DurationVar(&f.warmup, "warmup", 2*time.Second, "warm-up before each workload (discarded; per side with --compare-floor)")
	fs.StringVar(&f.endpoint, "endpoint", "chat", "chat or completions")
	fs.StringVar(&f.promptWords, "prompt-words", "32", "prompt length in words: N or N:M (uniform)")
	fs.StringVar(&f.maxTokens, "max-tokens", "16", "max_tokens: N or N:M (uniform)")
	fs.BoolVar(&f.stream, "stream", true, "stream responses (SSE); --stream=false asks for one JSON completion")
	fs.BoolVar(&f.ignoreEOS, "ignore-eos", true, `send "ignore_eos": true so every request generates its max_tokens`)
	fs.StringVar(&f.model, "model", "", "model name (default: the first of the router's /v1/models)")
	fs.DurationVar(&f.timeout, "timeout", 60*time.Second, "per-request timeout")
	fs.Uint64Var(&f.seed, "seed", 1, "seed of prompts, lengths and arrivals")
	fs.StringVar(&f.jsonPath, "json", "", "write every figure, the parameters and the machine to this JSON file")
	fs.StringVar(&f.svgPath, "histogram", "", "write the TTFT, ITL and end-to-end histograms to this SVG file")
	fs.BoolVar(&f.compare, "compare-floor", false, "--local: measure the router and the floor (both legs run by the bench itself) interleaved")
	fs.IntVar(&f.slices, "slices", 8, "--compare-floor: number of alternating slices (even; ABBA order)")
	fs.BoolVar(&f.routerProcess, "router-process", false, "--local: run the router as a child process and report its CPU per request (default with --compare-floor)")
	fs.IntVar(&f.routerPID, "router-pid", 0, "--url: process id of the router on this machine, to report its CPU per request and its memory (RSS) per open stream")
	fs.StringVar(&f.routerBus, "router-bus", "external", "--router-process: external (a NATS server in the bench process, as in a mesh: the router's CPU excludes the bus and the breaker) or embedded (the router's own NATS and in-process breaker, single-node mode)")
	fs.StringVar(&f.cpuProfile, "cpuprofile", "", "write a CPU profile of this process (client, local sims, in-process router) to this file")
	fs.BoolVar(&f.quiet, "quiet", false, "no live progress line on stderr")
	f.prefix.register(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	f.set = map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { f.set[fl.Name] = true })
	if f.prefix.workload != "" {
		return f.runPrefix(ctx)
	}
	if name := f.prefix.setWithout(f.set); name != "" {
		return fmt.Errorf("--%s applies to --workload only", name)
	}
	return f.run(ctx)
}

// loads returns one Workload per --concurrency or --rate value.
func (f *benchFlags) loads() ([]bench.Workload, error) {
	if f.set["concurrency"] && f.set["rate"] {
		return nil, errors.New("--concurrency and --rate exclude each other")
	}
	endpoint := schemas.EndpointChat
	switch f.endpoint {
	case "chat":
	case "completions":
		endpoint = schemas.EndpointCompletions
	default:
		return nil, fmt.Errorf("--endpoint %q: want chat or completions", f.endpoint)
	}
	pw, err := bench.ParseRange(f.promptWords)
	if err != nil {
		return nil, fmt.Errorf("--prompt-words: %w", err)
	}
	mt, err := bench.ParseRange(f.maxTokens)
	if err != nil {
		return nil, fmt.Errorf("--max-tokens: %w", err)
	}
	base := bench.Workload{
		Endpoint: endpoint, Model: f.model, Stream: f.stream, PromptWords: pw, MaxTokens: mt, IgnoreEOS: f.ignoreEOS,
		Duration: f.duration, Requests: f.requests, Warmup: f.warmup, Timeout: f.timeout, Seed: f.seed,
	}
	if f.set["requests"] && !f.set["duration"] {
		base.Duration = 0
	}
	var out []bench.Workload
	list, isRate := f.concurrency, false
	if f.set["rate"] {
		list, isRate = f.rate, true
	}
	for _, v := range strings.Split(list, ",") {
		wl := base
		if isRate {
			r, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil || r <= 0 {
				return nil, fmt.Errorf("--rate %q: want positive numbers", f.rate)
			}
			wl.Rate = r
		} else {
			c, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil || c < 1 {
				return nil, fmt.Errorf("--concurrency %q: want integers ≥ 1", f.concurrency)
			}
			wl.Concurrency = c
		}
		out = append(out, wl)
	}
	return out, nil
}

func (f *benchFlags) run(ctx context.Context) error {
	loads, err := f.loads()
	if err != nil {
		return err
	}
	if f.url != "" && f.local {
		return errors.New("--url and --local exclude each other")
	}
	local := f.url == ""
	if f.compare && !local {
		return errors.New("--compare-floor needs --local: the floor runs the legs against the bench's own engines")
	}
	if !local && (f.set["ttft"] || f.set["itl"] || f.set["router-process"]) {
		return errors.New("--ttft, --itl and --router-process apply to --local only")
	}
	if f.slices < 2 {
		return errors.New("--slices must be at least 2")
	}
	childRouter := f.routerProcess || (f.compare && !f.set["router-process"])

	if f.cpuProfile != "" {
		pf, err := os.Create(f.cpuProfile)
		if err != nil {
			return err
		}
		defer pf.Close()
		if err := pprof.StartCPUProfile(pf); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}

	var (
		stack    *bench.LocalEngines
		routerID int
		holds    string
		target   = "local"
	)
	routerURL := f.url
	if local {
		stack, err = bench.StartLocal(bench.LocalConfig{TTFT: f.ttft, ITL: f.itl})
		if err != nil {
			return err
		}
		defer stack.Close()
		holds = fmt.Sprintf("%d sims", len(stack.Sims))
		if childRouter {
			env := []string{"NARWHAL_ROUTER_LOG_LEVEL=error"}
			switch f.routerBus {
			case "embedded":
			case "external":
				emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Host: "127.0.0.1", Port: -1})
				if err != nil {
					return err
				}
				defer emb.Shutdown()
				env = append(env, "NARWHAL_NATS_URL="+emb.ClientURL())
				holds += " + NATS"
			default:
				return fmt.Errorf("--router-bus: want external or embedded, got %q", f.routerBus)
			}
			proc, err := bench.StartRouterProcess(ctx, bench.RouterProcessOptions{
				Fleet: stack.Specs,
				Env:   env,
			})
			if err != nil {
				return err
			}
			defer func() {
				if err := proc.Stop(); err != nil {
					fmt.Fprintf(os.Stderr, "narwhal bench: router process: %v\n%s\n", err, proc.Output())
				}
			}()
			routerURL, routerID = proc.URL, proc.PID()
		} else {
			stop, url, err := startBenchRouter(ctx, stack.Specs)
			if err != nil {
				return err
			}
			defer stop()
			routerURL = url
			holds += " + router"
		}
	} else {
		target = routerURL
		routerID = f.routerPID
	}

	maxConns := 0
	for _, wl := range loads {
		maxConns = max(maxConns, wl.Concurrency, int(wl.Rate))
	}
	routerTarget := bench.NewRouterTarget(routerURL, maxConns)
	defer routerTarget.Close()
	if f.model == "" {
		models, err := routerTarget.Models(ctx)
		if err != nil {
			return err
		}
		if len(models) == 0 {
			return fmt.Errorf("%s/v1/models lists no model; pass --model", routerURL)
		}
		for i := range loads {
			loads[i].Model = models[0]
		}
	}
	var floor *bench.FloorTarget
	if f.compare {
		if floor, err = stack.Floor(); err != nil {
			return err
		}
		defer floor.Close()
	}

	var progress *bench.Progress
	if !f.quiet {
		progress = &bench.Progress{W: os.Stderr, Overwrite: isTerminal(os.Stderr)}
	}
	file := &bench.File{StartedAt: time.Now().UTC().Format(time.RFC3339Nano), Machine: bench.ThisMachine()}
	bench.WriteMachine(os.Stdout, file.Machine)
	opts := bench.RunOptions{Progress: progress, RouterPID: routerID, BenchHolds: holds}
	for _, wl := range loads {
		if ctx.Err() != nil {
			break
		}
		res := bench.Result{Params: bench.NewParams(target, wl)}
		res.Params.RouterProcess = routerID > 0
		res.Params.SimTTFTS, res.Params.SimITLS = f.ttft.Seconds(), f.itl.Seconds()
		if f.compare {
			res.Params.CompareFloor, res.Params.Slices = true, f.slices
			comparison, err := bench.Compare(ctx, routerTarget, floor, wl, bench.CompareOptions{RunOptions: opts, Slices: f.slices})
			if err != nil {
				return err
			}
			res.Comparison = comparison
		} else {
			rep, err := bench.Run(ctx, routerTarget, wl, opts)
			if err != nil {
				return err
			}
			res.Run = rep
		}
		if err := bench.WriteTable(os.Stdout, &res); err != nil {
			return err
		}
		file.Results = append(file.Results, res)
	}
	if f.jsonPath != "" {
		if err := bench.WriteFile(f.jsonPath, file); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "wrote %s\n", f.jsonPath)
	}
	if f.svgPath != "" {
		out, err := os.Create(f.svgPath)
		if err != nil {
			return err
		}
		results := make([]*bench.Result, len(file.Results))
		for i := range file.Results {
			results[i] = &file.Results[i]
		}
		title := fmt.Sprintf("narwhal bench, %s — %d CPUs, GOMAXPROCS %d, %s", file.StartedAt[:19], file.Machine.NumCPU, file.Machine.GOMAXPROCS, file.Machine.GoVersion)
		werr := bench.WriteSVG(out, title, results)
		if cerr := out.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			return werr
		}
		fmt.Fprintf(os.Stderr, "wrote %s\n", f.svgPath)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	// A run in which nothing succeeded measured nothing: say so in the exit
	// status, so that scripts and CI notice.
	for _, r := range file.Results {
		for _, rep := range []*bench.Report{r.Run, routerSide(r.Comparison)} {
			if rep != nil && rep.Requests > 0 && rep.OK == 0 {
				return fmt.Errorf("no request succeeded (%d ended in errors: %v)", rep.Requests, rep.Errors)
			}
		}
	}
	return nil
}

// routerSide returns the router's report of a comparison, or nil.
func routerSide(c *bench.Comparison) *bench.Report {
	if c == nil {
		return nil
	}
	return c.Router
}

// startBenchRouter runs a router for fleet in this process, as `narwhal
// dev` does but logging errors only, and returns its stop function and
// base URL once /readyz answers 200.
func startBenchRouter(ctx context.Context, fleet []config.EngineSpec) (stop func(), url string, err error) {
	cfg, err := config.Parse(nil)
	if err != nil {
		return nil, "", err
	}
	cfg.Router.ID = "narwhal-bench"
	cfg.Router.LogLevel = "error"
	cfg.Fleet = fleet
	if err := cfg.Validate(); err != nil {
		return nil, "", err
	}
	rctx, cancel := context.WithCancel(context.Background())
	ready := make(chan string, 1)
	errc := make(chan error, 1)
	go func() {
		errc <- runRouter(rctx, cfg, "127.0.0.1:0", newLogger(cfg, os.Stderr), func(base string) { ready <- base })
	}()
	stop = func() {
		cancel()
		<-errc
	}
	select {
	case url = <-ready:
	case err := <-errc:
		cancel()
		if err == nil {
			err = errors.New("router stopped before it was ready")
		}
		return nil, "", err
	}
	if err := bench.WaitReady(ctx, url, 20*time.Second); err != nil {
		stop()
		return nil, "", err
	}
	return stop, url, nil
}

// isTerminal reports whether f is a character device (a terminal).
func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
