package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
)

func init() {
	commands["bus"] = command{
		summary:   "run a NATS server with JetStream that Narwhal processes share (--listen HOST:PORT --data DIR); bus setup, bus creds, bus revoke, bus authd",
		run:       withOutput(runBus),
		checkArgs: true,
	}
}

// Defaults and bounds of `narwhal bus`.
const (
	// defaultBusListen is where `narwhal bus` listens without --listen:
	// NATS's standard client port, on loopback only.
	defaultBusListen = "127.0.0.1:4222"
	// defaultBusData is the JetStream store without --data.
	defaultBusData = "./narwhal-bus-data"
	// busSetupBound bounds setting up the streams and the buckets at the
	// start of a single-node bus, and `narwhal bus setup`'s wait for the
	// bus by default.
	busSetupBound = 10 * time.Second
)

const busUsage = `usage: narwhal bus [--listen HOST:PORT] [--data DIR] [--config FILE] [--auth DIR]
                   [--name NAME --cluster HOST:PORT --routes URL,...] [--verbose]
       narwhal bus setup [--config FILE] [--connect-timeout DUR]
       narwhal bus creds --out DIR [--authd] [--engine ID]... [--router ID]...
       narwhal bus revoke --creds DIR [--engine ID]... [--router ID]... [--user PUBKEY]...
       narwhal bus authd --creds FILE --signing-key FILE --jwks FILE|URL --roles NS/SA=ROLE,...

narwhal bus         serves NATS with JetStream and sets up Narwhal's streams and
                    buckets before it says it is listening; point Narwhal
                    processes at it with NARWHAL_NATS_URL=nats://HOST:PORT.
                    --auth DIR enforces the credentials of narwhal bus creds;
                    --cluster and --routes join servers into a JetStream cluster.
narwhal bus setup   creates or updates the streams and the buckets on the NATS at
                    NARWHAL_NATS_URL with the admin credential (NARWHAL_NATS_CREDS).
narwhal bus creds   writes one credential per role (breaker, chaos, viewer, admin)
                    and the server side (auth.conf, route.secret, sys.creds) into DIR;
                    each --engine ID / --router ID writes that engine's or router's
                    own credential (engine-ID.creds, router-ID.creds), also into a
                    DIR that holds a mesh already (running servers accept it);
                    --authd adds the auth callout (authd.creds, keys/authd-signing.nk).
narwhal bus revoke  revokes credentials in the mesh's account (no new account, no
                    restart) and pushes it to NARWHAL_NATS_URL with DIR's sys.creds.
narwhal bus authd   the bus's auth callout: exchanges a pod's service-account token
                    for a short-lived user of its identity (docs/kubernetes.md).
See docs/mesh.md.
`

// runBus is `narwhal bus` and its subcommands `setup` and `creds` (behaviour.md
// §14, R-BUS-4, R-BUS-8).
func runBus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case "setup", "creds", "revoke":
			if argsChecked(ctx) != nil {
				return fmt.Errorf("--check-args: not supported by narwhal bus %s", args[0])
			}
		}
		switch args[0] {
		case "setup":
			return runBusSetup(ctx, args[1:], stdout, stderr)
		case "creds":
			return runBusCreds(args[1:], stdout, stderr)
		case "revoke":
			return runBusRevoke(ctx, args[1:], stdout, stderr)
		case "authd":
			return runBusAuthd(ctx, args[1:], stderr)
		case "help":
			fmt.Fprint(stderr, busUsage)
			return flag.ErrHelp
		}
	}
	return runBusServe(ctx, args, stdout, stderr)
}

// busConfig loads the configuration of a bus command: the file at path
// when it is not "", else the defaults and the environment.
func busConfig(path string) (*config.Config, error) {
	if path != "" {
		return config.Load(path)
	}
	return config.Parse(nil)
}

// runBusServe is `narwhal bus [--listen HOST:PORT] [--data DIR] [--config
// FILE] [--verbose]` (behaviour.md §14, R-BUS-4): the embedded NATS server with
// JetStream as a process of its own, so that several Narwhal processes
// share a bus with NARWHAL_NATS_URL=nats://HOST:PORT. As the bus's admin it
// creates every stream and bucket of bus.SetUpNames (bus.Setup: replicas
// bus.replicas on creation, the lease bucket's TTL breaker.lease_ttl_s;
// R-BUS-8) before it writes `bus listening on nats://HOST:PORT (data DIR)`
// to stdout, serves until ctx ends (SIGINT/SIGTERM) and then shuts the
// server down, which flushes the store: restarting on the same DIR keeps
// every stored event and key. Port 0 picks a free port (the line names
// it); an empty host listens on every interface. Server warnings and
// errors go to stderr as slog text (notices too with --verbose). It
// returns an error for bad flags or configuration, an unusable DIR, a port
// in use, or a set-up that fails within 10 s.
func runBusServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal bus", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, busUsage)
		fs.PrintDefaults()
	}
	listen := fs.String("listen", defaultBusListen, "`HOST:PORT` for NATS clients (port 0: any free port; empty host: every interface)")
	data := fs.String("data", defaultBusData, "JetStream store `DIR`; restarting on the same DIR keeps the events and the placement")
	cfgPath := fs.String("config", "", "YAML configuration `FILE` for bus.replicas and breaker.lease_ttl_s (default: defaults and environment)")
	verbose := fs.Bool("verbose", false, "log the NATS server's notices, not only its warnings and errors")
	authDir := fs.String("auth", "", "enforce the credentials `DIR` of narwhal bus creds (its auth.conf; the set-up uses its admin.creds)")
	name := fs.String("name", "", "this server's `NAME` in a cluster, unique per server (default narwhal)")
	cluster := fs.String("cluster", "", "`HOST:PORT` to listen on for the other servers of a JetStream cluster")
	routes := fs.String("routes", "", "the other servers' cluster `URL`s, comma-separated (nats://h2:6222,nats://h3:6222)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *routes != "" && *cluster == "" {
		return errors.New("--routes needs --cluster HOST:PORT, this server's cluster address")
	}
	var routeList []string
	for r := range strings.SplitSeq(*routes, ",") {
		if r = strings.TrimSpace(r); r != "" {
			routeList = append(routeList, r)
		}
	}
	host, port, err := parseListen(*listen)
	if err != nil {
		return err
	}
	if *data == "" {
		return errors.New("--data: a directory is required")
	}
	cfg, err := busConfig(*cfgPath)
	if err != nil {
		return err
	}
	if *authDir != "" {
		if _, err := os.Stat(filepath.Join(*authDir, bus.AuthConfFile)); err != nil {
			return fmt.Errorf("--auth %s: %w", *authDir, err)
		}
	}
	if err := argsChecked(ctx); err != nil {
		return err
	}
	dir, err := filepath.Abs(*data)
	if err != nil {
		return fmt.Errorf("--data %s: %w", *data, err)
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("--data: %w", err)
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))

	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: dir, Host: host, Port: port, Log: log, NoSetup: true,
		AuthDir: *authDir, ServerName: *name, Cluster: *cluster, Routes: routeList})
	if le := (*bus.ListenError)(nil); errors.As(err, &le) {
		flagName := "--listen"
		if le.Port == "cluster" {
			flagName = "--cluster"
		}
		return fmt.Errorf("%w; choose another with %s HOST:PORT", err, flagName)
	}
	if err != nil {
		return err
	}
	defer emb.Shutdown()
	// A single server sets up at once; a cluster's server waits for the
	// others (a JetStream quorum) as long as it takes, saying so.
	setupCtx, cancel := ctx, context.CancelFunc(func() {})
	if *cluster == "" {
		setupCtx, cancel = context.WithTimeout(ctx, busSetupBound)
	}
	setupLog := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	co := bus.ConnectOptions{
		Embedded: emb,
		Name:     "narwhal-bus",
		Log:      log,
		Setup:    &bus.SetupOptions{Replicas: cfg.Bus.Replicas, LeaseTTL: cfg.Breaker.LeaseTTL(), Log: setupLog},
	}
	if *authDir != "" {
		co.CredsFile = filepath.Join(*authDir, bus.CredsFile(bus.RoleAdmin))
	}
	b, err := bus.Connect(setupCtx, co)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted while starting
		}
		return err
	}
	b.Close()
	fmt.Fprintf(stdout, "bus listening on %s (data %s)\n", emb.ClientURL(), dir)
	<-ctx.Done()
	return nil
}

// runBusCreds is `narwhal bus creds --out DIR [--engine ID]… [--router
// ID]…` (behaviour.md R-BUS-8, R-BUS-11). Into a DIR without a mesh's keys
// it creates DIR when missing and writes a new credential set for one mesh
// (bus.WriteCredentials: breaker.creds, chaos.creds, viewer.creds,
// admin.creds, auth.conf, route.secret and keys/), refusing a DIR that
// holds any of these files; into a DIR that holds a mesh (keys/account.nk)
// it writes only the identities. Each --engine ID writes engine-ID.creds,
// each --router ID router-ID.creds (bus.IssueIdentity), which running
// servers accept without a restart. It lists what it wrote on stdout (the
// header of the identities only above one that was written) and
// refuses, before writing any, an id that config.ValidID rejects, an id
// given twice, and an identity whose file exists.
// With --kubernetes-secrets [--namespace NS] it then writes
// DIR/kubernetes-secrets.yaml (writeKubernetesSecrets), also for a DIR
// that holds a mesh and no new identity: a re-run never rotates a key.
func runBusCreds(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal bus creds", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("out", "", "the `DIR` to write the credentials into (created when missing; required)")
	var ids []identity
	fs.Func("engine", "also write engine-`ID`.creds, engine ID's own credential (repeatable)", func(v string) error {
		ids = append(ids, identity{bus.RoleEngine, v})
		return nil
	})
	fs.Func("router", "also write router-`ID`.creds, router ID's own credential (repeatable)", func(v string) error {
		ids = append(ids, identity{bus.RoleRouter, v})
		return nil
	})
	withAuthd := fs.Bool("authd", false, "also add the auth callout of narwhal bus authd to the mesh ("+bus.AuthdCredsFile+", keys/"+bus.AuthdSigningKeyFile+", auth.conf's sentinel; docs/kubernetes.md); DIR may hold a mesh already")
	k8s := fs.Bool("kubernetes-secrets", false, "also write DIR/"+KubernetesSecretsFile+": Secret manifests of the bus's side and of every credential in DIR (docs/kubernetes.md); DIR may hold a mesh already")
	namespace := fs.String("namespace", "", "the `NS` of the Secrets of --kubernetes-secrets (default: none, kubectl's current namespace)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *out == "" {
		return errors.New("--out DIR is required")
	}
	if *namespace != "" && !*k8s {
		return errors.New("--namespace needs --kubernetes-secrets")
	}
	if err := checkNamespace(*namespace); err != nil {
		return err
	}
	secrets := func() error {
		if !*k8s {
			return nil
		}
		names, err := writeKubernetesSecrets(*out, *namespace)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "Kubernetes Secrets written to %s (kubectl apply -f it; keep it as secret as DIR):\n", filepath.Join(*out, KubernetesSecretsFile))
		for _, n := range names {
			fmt.Fprintf(stdout, "  %s\n", n)
		}
		return nil
	}
	seen := map[identity]bool{}
	for _, id := range ids {
		if !config.ValidID(id.id) {
			return fmt.Errorf("--%s %q: an id is non-empty and holds only letters, digits, '-' and '_'", id.kind, id.id)
		}
		if seen[id] {
			return fmt.Errorf("--%s %s given twice", id.kind, id.id)
		}
		seen[id] = true
		if err := bus.IdentityReplaceable(*out, id.kind, id.id); err != nil {
			return err // a valid credential; a revoked one is replaced
		}
	}
	mesh := bus.HasMesh(*out)
	// w is the longest name listed, so that every row's text lines up.
	w := 0
	for _, id := range ids {
		w = max(w, len(bus.IdentityCredsFile(id.kind, id.id)))
	}
	if !mesh {
		for _, role := range bus.Roles {
			w = max(w, len(bus.CredsFile(role)))
		}
		for _, name := range []string{bus.AuthConfFile, bus.RouteSecretFile, bus.SysCredsFile, "keys/"} {
			w = max(w, len(name))
		}
		if err := bus.WriteCredentials(*out); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "credentials written to %s:\n", *out)
		for _, role := range bus.Roles {
			fmt.Fprintf(stdout, "  %-*s NARWHAL_NATS_CREDS for the %s role\n", w, bus.CredsFile(role), role)
		}
		fmt.Fprintf(stdout, "  %-*s the server side: narwhal bus --auth %s, or include it in a nats-server config\n", w, bus.AuthConfFile, *out)
		fmt.Fprintf(stdout, "  %-*s the password the servers of a cluster present to one another\n", w, bus.RouteSecretFile)
		fmt.Fprintf(stdout, "  %-*s the system account's user: pushes revocations (narwhal bus revoke)\n", w, bus.SysCredsFile)
		fmt.Fprintf(stdout, "  %-*s the operator's and account's seeds, to issue more users; keep them off the servers\n", w, "keys/")
	}
	if *withAuthd {
		if mesh && bus.HasAuthd(*out) {
			return fmt.Errorf("%s holds the auth callout already (%s)", *out, bus.AuthdCredsFile)
		}
		if err := bus.WriteAuthd(*out); err != nil {
			return err
		}
		if mesh {
			fmt.Fprintf(stdout, "auth callout added to the mesh of %s (restart each bus server with the new %s, one at a time):\n", *out, bus.AuthConfFile)
		}
		aw := max(w, len(bus.AuthdCredsFile), len("keys/"+bus.AuthdSigningKeyFile))
		fmt.Fprintf(stdout, "  %-*s narwhal bus authd --creds: the callout service's credential\n", aw, bus.AuthdCredsFile)
		fmt.Fprintf(stdout, "  %-*s narwhal bus authd --signing-key: signs the identities it issues; keep it secret\n", aw, "keys/"+bus.AuthdSigningKeyFile)
	}
	if mesh && len(ids) == 0 {
		if *k8s || *withAuthd {
			return secrets()
		}
		return fmt.Errorf("%s holds a mesh already: add identities with --engine ID or --router ID, the auth callout with --authd, or write a new mesh into an empty directory", *out)
	}
	// The rows of the identities are listed once written: a header with
	// nothing under it would claim what an error below then denies. Those
	// written before an error are listed before it.
	var rows strings.Builder
	list := func() {
		if rows.Len() == 0 {
			return
		}
		if mesh {
			fmt.Fprintf(stdout, "identities added to the mesh of %s:\n", *out)
		}
		_, _ = io.WriteString(stdout, rows.String())
	}
	for _, id := range ids {
		_, existed := os.Stat(filepath.Join(*out, bus.IdentityCredsFile(id.kind, id.id)))
		path, err := bus.IssueIdentity(*out, id.kind, id.id)
		if err != nil {
			list()
			return err
		}
		replaced := ""
		if existed == nil {
			replaced = " (replaces the revoked one)"
		}
		fmt.Fprintf(&rows, "  %-*s NARWHAL_NATS_CREDS for %s %s only%s\n", w, filepath.Base(path), id.kind, id.id, replaced)
	}
	list()
	return secrets()
}

// identity is one --engine or --router of `narwhal bus creds`: the kind
// (bus.RoleEngine or bus.RoleRouter) and the id.
type identity struct{ kind, id string }

// runBusSetup is `narwhal bus setup [--config FILE] [--connect-timeout
// DUR]` (behaviour.md R-BUS-8): with the admin credential (NARWHAL_NATS_CREDS) it
// creates every stream and bucket of bus.SetUpNames on the NATS at
// NARWHAL_NATS_URL (default nats://127.0.0.1:4222), or updates those whose
// settings differ — keeping the replicas of any that exists, logged as
// found versus wanted — prints `bus set up on URL:` (`bus already set up
// on URL: nothing to change` when it wrote nothing) and the replicas of
// each stream and bucket of bus.SetUpNames, and exits. It returns an
// error when the bus is not reachable in time, the credential may not do
// it, or the server refuses a configuration.
func runBusSetup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal bus setup", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "YAML configuration `FILE` for bus.* and breaker.lease_ttl_s (default: defaults and environment)")
	bound := fs.Duration("connect-timeout", busSetupBound, "give up when the bus is not reachable and set up within `DUR`")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	cfg, err := busConfig(*cfgPath)
	if err != nil {
		return err
	}
	if cfg.Bus.URL == "" {
		cfg.Bus.URL = defaultNATSURL
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	opts := busOptions(cfg.Bus, "narwhal-bus-setup", bus.RoleAdmin, log)
	opts.Setup = &bus.SetupOptions{Replicas: cfg.Bus.Replicas, LeaseTTL: cfg.Breaker.LeaseTTL(), Log: log}
	cctx, cancel := context.WithTimeout(ctx, *bound)
	defer cancel()
	b, err := bus.Connect(cctx, opts)
	if err != nil {
		return fmt.Errorf("bus %s: %w", redactNATSURL(cfg.Bus.URL), err)
	}
	defer b.Close()
	replicas, err := b.Replicas(cctx)
	if err != nil {
		return err
	}
	if b.SetupWrites() == 0 {
		// Nothing was written: do not let a credential that may only
		// read (viewer.creds) pass for the admin's.
		fmt.Fprintf(stdout, "bus already set up on %s: nothing to change\n", redactNATSURL(cfg.Bus.URL))
	} else {
		fmt.Fprintf(stdout, "bus set up on %s:\n", redactNATSURL(cfg.Bus.URL))
	}
	for _, n := range bus.SetUpNames() {
		fmt.Fprintf(stdout, "  %s %-21s %d replicas\n", n.What, n.Name, replicas[n.Name])
	}
	return nil
}

// parseListen splits a --listen HOST:PORT into the embedded server's host
// and port: port 0 becomes -1 (any free port, as bus.EmbeddedOptions
// wants it) and an empty host becomes 0.0.0.0 (every interface, as
// net.Listen reads ":PORT").
func parseListen(listen string) (host string, port int, err error) {
	host, p, err := net.SplitHostPort(listen)
	if err != nil {
		return "", 0, fmt.Errorf("--listen %q: want HOST:PORT: %w", listen, err)
	}
	port, err = strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("--listen %q: port must be 0…65535", listen)
	}
	if port == 0 {
		port = -1
	}
	if host == "" {
		host = "0.0.0.0"
	}
	return host, port, nil
}

// busOptions returns the options to connect to the NATS of c (URL,
// credential, TLS; behaviour.md R-BUS-4, R-BUS-8) under client name name, logging
// to log; role is the bus role whose credential the process needs
// (bus.RoleRouter, …, "" when it acts as several), which a refused
// credential's error names. Every process that joins a mesh uses it.
func busOptions(c config.Bus, name, role string, log *slog.Logger) bus.ConnectOptions {
	return bus.ConnectOptions{
		URL:       c.URL,
		Name:      name,
		Role:      role,
		CredsFile: c.Creds,
		TokenFile: c.TokenFile,
		TLSCA:     c.TLSCA,
		TLSCert:   c.TLSCert,
		TLSKey:    c.TLSKey,
		Log:       log,
	}
}

// toolBus returns the bus section of the configuration of a tool that
// takes no --config (`narwhal events`, `narwhal chaos`, `narwhal bus
// setup`): the defaults and the NARWHAL_NATS_* variables, with the URL
// defaulting to defaultNATSURL, the bus `narwhal bus` serves by default.
func toolBus() (config.Bus, error) {
	cfg, err := config.Parse(nil)
	if err != nil {
		return config.Bus{}, err
	}
	if cfg.Bus.URL == "" {
		cfg.Bus.URL = defaultNATSURL
	}
	return cfg.Bus, nil
}

// redactNATSURL is bus.RedactURL: a NATS URL (or list) without its
// password or token, for messages.
var redactNATSURL = bus.RedactURL
