package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/kvevents"
	"github.com/narwhalmesh/narwhal/membership"
	"github.com/narwhalmesh/narwhal/schemas"
)

func init() {
	commands["agent"] = command{
		summary:   "register an engine in the live fleet, heartbeat, and drain it on SIGTERM (a pod's sidecar)",
		run:       withOutput(runAgent),
		checkArgs: true,
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
// answers GET /health and lists a model on GET /v1/models, registers it
// (a registration on narwhal.registrations.<id>, which the leading
// breaker turns into its entry of narwhal_fleet, R-FLEET-5) with
// membership.registration_ttl_s and heartbeats;
// on SIGTERM or SIGINT it drains the engine — no router places new work
// there, running streams finish — waiting until every router reports no
// leg on it or --drain-timeout passes, then removes it, creates
// --drained-file when given, and exits 0. The bus is NARWHAL_NATS_URL
// (NARWHAL_NATS_CREDS); a bus not set up yet is waited for. With
// --kv-events (or --kv-events-bind) it also carries the engine's ZeroMQ
// KV events onto the bus, on narwhal.kv.<id> under the same credential
// (behaviour.md R-PLACE-4, kvevents.Bridge), from registration until it
// leaves; --metrics serves its series.
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
	apiKeyEnv := fs.String("api-key-env", "", "`VAR` holding the engine's API key, in the agent's, every router's and breaker's environment: empty or NARWHAL_ENGINE_KEY_<ID> (the id upper-cased, '-' as '_')")
	drainTimeout := fs.Duration("drain-timeout", 25*time.Second, "on SIGTERM, how long to wait for the routers' streams on the engine to finish (keep it below the pod's terminationGracePeriodSeconds)")
	drainedFile := fs.String("drained-file", "", "once the engine is drained and out of the fleet, create this `FILE` (a shared volume the engine container's preStop hook waits on)")
	var kvConnect, kvBind, kvReplay idList
	fs.Var(&kvConnect, "kv-events", "the engine's KV event publisher to connect to, `[RANK=]ENDPOINT` (tcp://HOST:PORT or ipc://PATH; rank 0 when plain); once per data-parallel rank")
	fs.Var(&kvBind, "kv-events-bind", "an endpoint to bind for a KV event publisher that connects out (llm-d's simulator), `[RANK=]ENDPOINT`; once per rank")
	fs.Var(&kvReplay, "kv-events-replay", "the replay socket of a rank's publisher (vLLM's replay_endpoint), `[RANK=]ENDPOINT`")
	kvTopic := fs.String("kv-events-topic", "", "subscribe to KV event topics starting with this `PREFIX` (empty: all)")
	kvMaxBlocks := fs.Int("kv-events-max-blocks", kvevents.DefaultMaxBlocks, "engine blocks the agent keeps the key of, per rank (about 35 bytes each)")
	kvCheckpoint := fs.Duration("kv-events-checkpoint", kvevents.DefaultCheckpoint, "how often to restate every block the agent knows of each rank on the bus, so that a router that started late or dropped the engine's exact index is exact again (0: never)")
	metricsAddr := fs.String("metrics", "", "`HOST:PORT` to serve the agent's /metrics on (off when empty)")
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
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var kv *kvevents.Bridge
	if len(kvConnect)+len(kvBind) > 0 {
		sources, err := kvSources(kvConnect, kvBind, kvReplay)
		if err != nil {
			return err
		}
		if *kvMaxBlocks < 1 {
			return errors.New("--kv-events-max-blocks must be >= 1")
		}
		if *kvCheckpoint < 0 {
			return errors.New("--kv-events-checkpoint must be >= 0")
		}
		ck := *kvCheckpoint
		if ck == 0 {
			ck = -1 // never
		}
		kv, err = kvevents.New(kvevents.Config{EngineID: *id, Sources: sources, Topic: *kvTopic, MaxBlocks: *kvMaxBlocks, Checkpoint: ck,
			Registry: reg, Log: slog.New(slog.NewTextHandler(stderr, nil)).With("agent", *id)})
		if err != nil {
			return err
		}
	} else if len(kvReplay) > 0 || *kvTopic != "" || *kvCheckpoint != kvevents.DefaultCheckpoint {
		return errors.New("--kv-events-replay, --kv-events-topic and --kv-events-checkpoint need --kv-events or --kv-events-bind")
	}
	if err := argsChecked(ctx); err != nil {
		if _, perr := config.Parse(nil); perr != nil {
			return perr // the environment registered() reads
		}
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil)).With("agent", *id)
	if *metricsAddr != "" {
		stop, err := serveMetrics(*metricsAddr, reg, log)
		if err != nil {
			return err
		}
		defer stop()
	}
	cred := engines.NewCredential("")
	if *apiKeyEnv != "" {
		cred = engines.NewCredential(os.Getenv(*apiKeyEnv))
	}
	if err := waitEngine(ctx, spec.URL, cred, log); err != nil {
		return err
	}
	if err := registered(ctx, spec, "agent-"+*id, *drainTimeout, log, stdout, kv); err != nil {
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
// hold: the first problem specFlagProblems finds (config.EngineSpec.Validate
// is the rule), after a missing --engine-url, --id or --role.
func checkSpec(s config.EngineSpec) error {
	if s.ID == "" || s.URL == "" || s.Role == "" {
		return errors.New("--engine-url, --id and --role are required")
	}
	ps := specFlagProblems(s, agentFlags)
	if want := schemas.EngineKeyEnv(s.ID); len(ps) == 0 && s.APIKeyEnv != "" && s.APIKeyEnv != want {
		// behaviour.md R-FLEET-5: the breaker refuses any other name.
		return fmt.Errorf("--api-key-env %s: an engine that registers itself names only %s, its id's key variable (put the engine's key there in every router's and breaker's environment)", s.APIKeyEnv, want)
	}
	if len(ps) == 0 {
		return nil
	}
	// The wording is the agent's own, kept from before config's rule was
	// the one the agent applies: config words each problem for a key of
	// a configuration file, the agent for the flag its user typed.
	p := ps[0]
	switch {
	case p.field == "id":
		return fmt.Errorf("%s %q: 1 to 128 of A-Z a-z 0-9 _ -", p.flag, s.ID)
	case p.field == "url":
		return fmt.Errorf("%s %q: an absolute http or https URL", p.flag, s.URL)
	case p.field == "role" && !s.Role.Valid():
		return fmt.Errorf("%s %q: prefill, decode or both", p.flag, s.Role)
	case p.field == "connector" && !connectorPattern.MatchString(s.Connector):
		return fmt.Errorf("%s %q: 1 to 64 of a-z 0-9 _ -", p.flag, s.Connector)
	case p.field == "connector" && !slices.Contains(connector.Names(), s.Connector):
		// A name of the schema's pattern that no connector is registered
		// under: config's rule refuses it, in fleet add's words.
		return fmt.Errorf("%s %q: want one of %s", p.flag, s.Connector, strings.Join(connector.Names(), ", "))
	case p.field == "prefill_slots" || p.field == "decode_slots":
		return errors.New("--prefill-slots and --decode-slots must be >= 0")
	}
	// The connector's own rule (connector.CheckEngine): config's problem.
	return fmt.Errorf("%s: %s", p.flag, p.problem)
}

// agentFlags names the flag of `narwhal agent` that sets each field of
// an engine spec config.EngineSpec.Validate reports (its YAML key).
var agentFlags = map[string]string{
	"id": "--id", "url": "--engine-url", "role": "--role", "connector": "--connector",
	"bootstrap_port": "--bootstrap-port", "prefill_slots": "--prefill-slots", "decode_slots": "--decode-slots",
}

// flagProblem is one field of an engine spec that a command refuses:
// field is its YAML key (config.KeyError.Key), flag the command's flag
// that sets it, problem config's words for it.
type flagProblem struct {
	field, flag, problem string
}

// maxEngineIDLen is the longest engine_id a fleet entry holds
// (schemas/narwhal.engine.v1.json).
const maxEngineIDLen = 128

// specFlagProblems returns the problems of s that config.EngineSpec.Validate
// finds — the one check of an engine's settings: id, URL, role, a
// registered connector, the connector's own rule (behaviour.md R-DESC-7)
// and slots >= 0 (R-OWN-3) — in its order, each named by the flag flags
// gives its field ("--" and the key with '-' for '_' when flags has
// none). An id longer than maxEngineIDLen, which a fleet entry cannot
// hold though a configuration file's fleet may, is a problem of field id
// too: both commands write fleet entries.
func specFlagProblems(s config.EngineSpec, flags map[string]string) []flagProblem {
	flag := func(field string) string {
		if f, ok := flags[field]; ok {
			return f
		}
		return "--" + strings.ReplaceAll(field, "_", "-")
	}
	var out []flagProblem
	for _, ke := range config.KeyErrors(s.Validate()) {
		out = append(out, flagProblem{field: ke.Key, flag: flag(ke.Key), problem: ke.Problem})
	}
	if len(s.ID) > maxEngineIDLen && !hasFlagProblem(out, "id") {
		// Validate reports the id first, so its problem goes first.
		out = slices.Insert(out, 0, flagProblem{field: "id", flag: flag("id"), problem: fmt.Sprintf("longer than %d characters", maxEngineIDLen)})
	}
	return out
}

// hasFlagProblem reports whether ps holds a problem of field.
func hasFlagProblem(ps []flagProblem, field string) bool {
	return slices.ContainsFunc(ps, func(p flagProblem) bool { return p.field == field })
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
// once registered. When the bus revokes or refuses the engine's
// credential it returns that *bus.CredentialRefusedError at once, without
// a drain or a leave (behaviour.md R-BUS-11). A non-nil kv runs on the
// connection from the registration until the leave (R-PLACE-4).
func registered(ctx context.Context, spec config.EngineSpec, by string, drainBound time.Duration, log *slog.Logger, stdout io.Writer, kv *kvevents.Bridge) error {
	cfg, err := config.Parse(nil)
	if err != nil {
		return err
	}
	if cfg.Bus.URL == "" {
		cfg.Bus.URL = defaultNATSURL
	}
	opts := busOptions(cfg.Bus, by, bus.RoleEngine, log)
	// Wait, as a router does, for a bus whose set-up has not run yet
	// (docs/mesh.md, "Start-up: what a process waits for").
	opts.Buckets = []string{bus.FleetBucket, bus.RoutersBucket}
	opts.Streams = []string{bus.RegistrationsStream}
	opts.WaitSetUp = &bus.SetUpWait{}
	opts.ID = spec.ID // its credential is engine-<id>.creds (R-BUS-11)
	b, err := bus.Connect(ctx, opts)
	if err != nil {
		return fmt.Errorf("bus %s: %w", redactNATSURL(cfg.Bus.URL), err)
	}
	defer b.Close()
	// A revoked credential stops the engine's registration for good: exit
	// non-zero saying so (R-BUS-11), for an orchestrator to restart it.
	ctx, stop := untilRefused(ctx, b)
	defer stop()
	ttl := cfg.Membership.RegistrationTTL()
	reg, err := membership.Register(ctx, b, spec, ttl, by, log)
	if err != nil {
		if refused := refusedCause(ctx); refused != nil {
			return refused
		}
		return err
	}
	fmt.Fprintf(stdout, "registered %s (%s, %s) in the live fleet, TTL %v\n", spec.ID, spec.Role, spec.URL, ttl)
	runCtx, stopRun := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- reg.Run(runCtx) }()
	if kv != nil {
		kvDone := make(chan struct{})
		go func() {
			defer close(kvDone)
			_ = kv.Run(runCtx, b.Conn())
		}()
		defer func() { <-kvDone }()
		defer stopRun()
		log.Info("carrying the engine's KV events onto the bus", "subject", bus.KVSubject(spec.ID), "epoch", kv.Epoch())
	}
	<-ctx.Done()
	if refused := refusedCause(ctx); refused != nil {
		// Nothing more reaches the bus: no drain, no leave; the
		// registration lapses after its TTL.
		log.Error("the bus refused the engine's credential; exiting", "engine_id", spec.ID, "err", refused)
		stopRun()
		<-done
		return refused
	}
	if drainBound > 0 {
		log.Info("draining the engine before leaving", "engine_id", spec.ID, "bound", drainBound)
		dctx, cancel := context.WithTimeout(context.Background(), drainBound)
		err := reg.Drain(dctx)
		cancel()
		if err != nil {
			// Drain waits for every router's word that it holds no leg on
			// the engine: legs still in flight, or a bus or routers that
			// cannot say so, look the same from here.
			log.Warn("drain bound passed before the routers said the engine has no leg in flight (legs still running, or the bus or the routers unreachable); leaving anyway", "engine_id", spec.ID, "bound", drainBound, "err", err)
		} else {
			log.Info("engine drained: no router has a leg on it", "engine_id", spec.ID)
		}
	}
	stopRun()
	<-done
	lctx, cancel := context.WithTimeout(context.Background(), leaveBound)
	defer cancel()
	if err := reg.Leave(lctx); err != nil {
		log.Warn("could not ask for the engine's removal from the fleet; its registration lapses after the TTL", "engine_id", spec.ID, "err", err)
	}
	return nil
}

// kvSources returns the KV event publishers of `narwhal agent`'s flags:
// --kv-events and --kv-events-bind values, [RANK=]ENDPOINT each, with
// the --kv-events-replay of their rank. Two publishers of one rank, or a
// replay socket of a rank without one, is an error naming the flag.
func kvSources(connect, bind, replay []string) ([]kvevents.Source, error) {
	var out []kvevents.Source
	add := func(flag string, v string, isBind bool) error {
		rank, ep, err := kvevents.ParseSource(v)
		if err != nil {
			return fmt.Errorf("%s %w", flag, err)
		}
		if slices.ContainsFunc(out, func(s kvevents.Source) bool { return s.Rank == rank }) {
			return fmt.Errorf("%s %q: rank %d has a publisher already (one endpoint per data-parallel rank)", flag, v, rank)
		}
		out = append(out, kvevents.Source{Rank: rank, Endpoint: ep, Bind: isBind})
		return nil
	}
	for _, v := range connect {
		if err := add("--kv-events", v, false); err != nil {
			return nil, err
		}
	}
	for _, v := range bind {
		if err := add("--kv-events-bind", v, true); err != nil {
			return nil, err
		}
	}
	for _, v := range replay {
		rank, ep, err := kvevents.ParseSource(v)
		if err != nil {
			return nil, fmt.Errorf("--kv-events-replay %w", err)
		}
		i := slices.IndexFunc(out, func(s kvevents.Source) bool { return s.Rank == rank })
		switch {
		case i < 0:
			return nil, fmt.Errorf("--kv-events-replay %q: no --kv-events or --kv-events-bind of rank %d", v, rank)
		case out[i].Replay != "":
			return nil, fmt.Errorf("--kv-events-replay %q: rank %d has a replay socket already", v, rank)
		}
		out[i].Replay = ep
	}
	return out, nil
}

// connectorPattern is the fleet entry schema's
// (schemas/narwhal.engine.v1.json) pattern of connector: checkSpec words
// a connector outside it as it always has.
var connectorPattern = regexp.MustCompile(`^[a-z0-9_-]{1,64}$`)
