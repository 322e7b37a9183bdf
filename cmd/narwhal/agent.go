package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/membership"
)

func init() {
	commands["agent"] = command{
		summary: "register an engine in the live fleet, heartbeat, and drain it on SIGTERM (a pod's sidecar)",
		run:     withOutput(runAgent),
	}
}

// Bounds of `narwhal agent` and `narwhal sim --register`.
const (
	// engineWaitEvery is how often the agent asks a starting engine.
	engineWaitEvery = time.Second
	// leaveBound bounds the removal of the key at the end.
	leaveBound = 5 * time.Second
)

// runAgent is `narwhal agent --engine-url URL --id ID --role ROLE
// [--connector C] …` (behaviour.md §14, R-FLEET-4): it waits until the engine
// answers GET /health and lists a model on GET /v1/models, registers it in
// bucket narwhal_fleet with membership.registration_ttl_s and heartbeats;
// on SIGTERM or SIGINT it drains the engine — no router places new work
// there, running streams finish — waiting until every router reports no
// leg on it or --drain-timeout passes, then removes it, creates
// --drained-file when given, and exits 0. The bus is NARWHAL_NATS_URL
// (NARWHAL_NATS_CREDS).
func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	engineURL := fs.String("engine-url", "", "the engine's base `URL` as routers reach it, e.g. http://10.1.2.3:8000 (required)")
	id := fs.String("id", "", "fleet-unique engine `ID` (required)")
	role := fs.String("role", "", "prefill, decode or both (required)")
	conn := fs.String("connector", "nixl", "the engine's KV connector")
	bootstrapPort := fs.Int("bootstrap-port", 0, "a prefill SGLang engine's bootstrap `PORT` (its --disaggregation-bootstrap-port)")
	prefillSlots := fs.Int("prefill-slots", 0, "prefill phases at once on the engine (0: no limit)")
	decodeSlots := fs.Int("decode-slots", 0, "decode phases at once on the engine (0: no limit)")
	apiKeyEnv := fs.String("api-key-env", "", "`VAR` holding the engine's API key, in the agent's and every router's environment")
	drainTimeout := fs.Duration("drain-timeout", 25*time.Second, "on SIGTERM, how long to wait for the routers' streams on the engine to finish (keep it below the pod's terminationGracePeriodSeconds)")
	drainedFile := fs.String("drained-file", "", "once the engine is drained and out of the fleet, create this `FILE` (a shared volume the engine container's preStop hook waits on)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	spec := config.EngineSpec{ID: *id, URL: *engineURL, Role: connector.Role(*role), Connector: *conn, BootstrapPort: *bootstrapPort,
		PrefillSlots: *prefillSlots, DecodeSlots: *decodeSlots, APIKeyEnv: *apiKeyEnv}
	if err := checkSpec(spec); err != nil {
		return err
	}
	if *drainTimeout <= 0 {
		return errors.New("--drain-timeout must be > 0")
	}
	log := slog.New(slog.NewTextHandler(stderr, nil)).With("agent", *id)
	cred := engines.NewCredential("")
	if *apiKeyEnv != "" {
		cred = engines.NewCredential(os.Getenv(*apiKeyEnv))
	}
	if err := waitEngine(ctx, spec.URL, cred, log); err != nil {
		return err
	}
	if err := registered(ctx, spec, "agent-"+*id, *drainTimeout, log, stdout); err != nil {
		return err
	}
	if *drainedFile != "" {
		if err := os.WriteFile(*drainedFile, []byte("drained "+*id+"\n"), 0o644); err != nil {
			return fmt.Errorf("--drained-file: %w", err)
		}
	}
	return nil
}

// checkSpec returns a clear error, naming the flag, for an engine spec of
// `narwhal agent` or `narwhal sim --register` that no fleet entry can
// hold.
func checkSpec(s config.EngineSpec) error {
	if s.ID == "" || s.URL == "" || s.Role == "" {
		return errors.New("--engine-url, --id and --role are required")
	}
	if !engineIDPattern.MatchString(s.ID) {
		return fmt.Errorf("--id %q: 1 to 128 of A-Z a-z 0-9 _ -", s.ID)
	}
	if u, err := url.Parse(s.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("--engine-url %q: an absolute http or https URL", s.URL)
	}
	if !s.Role.Valid() {
		return fmt.Errorf("--role %q: prefill, decode or both", s.Role)
	}
	if !connectorPattern.MatchString(s.Connector) {
		return fmt.Errorf("--connector %q: 1 to 64 of a-z 0-9 _ -", s.Connector)
	}
	if field, problem := connector.CheckEngine(s.Connector, s.Role, s.BootstrapPort); field != "" && field != "connector" {
		return fmt.Errorf("--%s: %s", strings.ReplaceAll(field, "_", "-"), problem)
	}
	if s.PrefillSlots < 0 || s.DecodeSlots < 0 {
		return errors.New("--prefill-slots and --decode-slots must be >= 0")
	}
	return nil
}

// waitEngine asks the engine every engineWaitEvery until it answers GET
// /health with 200 and lists at least one model on GET /v1/models, or ctx
// ends; it logs what it waits for when that changes.
func waitEngine(ctx context.Context, base string, cred engines.Credential, log *slog.Logger) error {
	httpc := &http.Client{Timeout: 2 * time.Second}
	last := ""
	for {
		why := engineNotReady(ctx, httpc, base, cred)
		if why == "" {
			log.Info("engine answers; registering", "url", base)
			return nil
		}
		if why != last {
			log.Info("waiting for the engine", "url", base, "why", why)
			last = why
		}
		t := time.NewTimer(engineWaitEvery)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// engineNotReady says why the engine at base cannot be registered yet, ""
// when it can: engines.CheckHealth, then engines.ServedModels bounded by
// 2 s, both with cred.
func engineNotReady(ctx context.Context, httpc *http.Client, base string, cred engines.Credential) string {
	e := &engines.Engine{ID: base, URL: base, Credential: cred}
	if err := engines.CheckHealth(ctx, httpc, e); err != nil {
		return err.Error()
	}
	mctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := engines.ServedModels(mctx, httpc, e); err != nil {
		return err.Error()
	}
	return ""
}

// registered registers spec on the bus of the environment, heartbeats
// until ctx ends, then — drainBound > 0 — drains the engine for at most
// drainBound, and removes it from the fleet. It prints one line to stdout
// once registered.
func registered(ctx context.Context, spec config.EngineSpec, by string, drainBound time.Duration, log *slog.Logger, stdout io.Writer) error {
	cfg, err := config.Parse(nil)
	if err != nil {
		return err
	}
	if cfg.Bus.URL == "" {
		cfg.Bus.URL = defaultNATSURL
	}
	b, err := bus.Connect(ctx, busOptions(cfg.Bus, by, log))
	if err != nil {
		return fmt.Errorf("bus %s: %w", redactNATSURL(cfg.Bus.URL), err)
	}
	defer b.Close()
	ttl := cfg.Membership.RegistrationTTL()
	reg, err := membership.Register(ctx, b, spec, ttl, by, log)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "registered %s (%s, %s) in the live fleet, TTL %v\n", spec.ID, spec.Role, spec.URL, ttl)
	runCtx, stopRun := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- reg.Run(runCtx) }()
	<-ctx.Done()
	if drainBound > 0 {
		log.Info("draining the engine before leaving", "engine_id", spec.ID, "bound", drainBound)
		dctx, cancel := context.WithTimeout(context.Background(), drainBound)
		err := reg.Drain(dctx)
		cancel()
		if err != nil {
			log.Warn("drain bound passed with legs still in flight on the engine; leaving anyway", "engine_id", spec.ID, "bound", drainBound)
		} else {
			log.Info("engine drained: no router has a leg on it", "engine_id", spec.ID)
		}
	}
	stopRun()
	<-done
	lctx, cancel := context.WithTimeout(context.Background(), leaveBound)
	defer cancel()
	if err := reg.Leave(lctx); err != nil {
		log.Warn("could not remove the engine from the fleet; its registration lapses after the TTL", "engine_id", spec.ID, "err", err)
	}
	return nil
}

// engineIDPattern and connectorPattern are the fleet entry schema's
// (schemas/narwhal.engine.v1.json) patterns of engine_id and connector.
var (
	engineIDPattern  = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)
	connectorPattern = regexp.MustCompile(`^[a-z0-9_-]{1,64}$`)
)
