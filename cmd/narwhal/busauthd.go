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
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/narwhalmesh/narwhal/authd"
	"github.com/narwhalmesh/narwhal/bus"
)

// maxAuthdTTL bounds --ttl: an issued identity outlives its pod's
// deletion by up to this long.
const maxAuthdTTL = 24 * time.Hour

const busAuthdUsage = `usage: narwhal bus authd --creds FILE --signing-key FILE --jwks FILE|URL --roles NS/SA=ROLE,...
                         [--nats URL] [--jwks-ca FILE] [--jwks-token FILE] [--audience AUD]
                         [--issuer ISS] [--ttl DUR] [--metrics-addr HOST:PORT] [--verbose]

The bus's auth callout for Kubernetes identities (docs/kubernetes.md,
docs/security.md): it verifies a pod's projected service-account token
against the cluster's signing keys and answers the bus with a user JWT of
the identity the token names (the pod name, with the role of its service
account), valid for --ttl at most. DIR of narwhal bus creds --out DIR --authd
holds --creds (authd.creds) and --signing-key (keys/authd-signing.nk).
`

// runBusAuthd is `narwhal bus authd` (behaviour.md R-BUS-11): it checks
// its flags — exit status 2 with a message for a missing or bad one —
// then, unless under --check-args, serves the bus's authorization
// requests (authd.Service) and --metrics-addr's /metrics, /healthz and
// /readyz until ctx ends (SIGINT/SIGTERM). The cluster's keys are fetched
// at start and again every 10 s until a fetch succeeds; /readyz says 200
// once they are, the bus is connected and the subscription is in place.
func runBusAuthd(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal bus authd", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, busAuthdUsage)
		fs.PrintDefaults()
	}
	busCfg, err := toolBus()
	if err != nil {
		fmt.Fprintf(stderr, "narwhal bus authd: %v\n", err)
		return reported(err, 2)
	}
	natsURL := fs.String("nats", busCfg.URL, "the bus's `URL` (default NARWHAL_NATS_URL, else "+defaultNATSURL+"; NARWHAL_NATS_TLS_CA is its CA)")
	creds := fs.String("creds", "", "the callout service's credential `FILE` ("+bus.AuthdCredsFile+" of narwhal bus creds --authd; required)")
	signing := fs.String("signing-key", "", "the seed `FILE` answers and issued users are signed with (keys/"+bus.AuthdSigningKeyFile+"; required)")
	jwks := fs.String("jwks", "", "the cluster's OIDC signing keys: a JWKS `FILE` or an https URL (required)")
	jwksCA := fs.String("jwks-ca", "", "PEM `FILE` of CAs for an https --jwks (default "+authd.InClusterCAFile+" when present)")
	jwksToken := fs.String("jwks-token", "", "`FILE` whose content is sent as bearer token with an https --jwks (default "+authd.InClusterTokenFile+" when present)")
	audience := fs.String("audience", authd.DefaultAudience, "the `AUD` a token's aud must contain")
	issuer := fs.String("issuer", "", "the `ISS` a token's iss must be exactly (default: any)")
	ttl := fs.Duration("ttl", authd.DefaultTTL, "an issued user JWT's lifetime `DUR`, at most the token's own exp")
	rolesFlag := fs.String("roles", "", "`NS/SA=ROLE,...`: the service accounts whose pods get an identity, ROLE router or engine (required)")
	metricsAddr := fs.String("metrics-addr", "", "`HOST:PORT` to serve /metrics, /healthz and /readyz on (default: none)")
	verbose := fs.Bool("verbose", false, "log every identity issued, not only refusals")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	usageErr := func(err error) error {
		fmt.Fprintf(stderr, "narwhal bus authd: %v\n", err)
		return reported(err, 2)
	}
	if fs.NArg() > 0 {
		return usageErr(fmt.Errorf("unexpected arguments %q", fs.Args()))
	}
	for _, req := range []struct{ name, v string }{{"creds", *creds}, {"signing-key", *signing}, {"jwks", *jwks}, {"roles", *rolesFlag}} {
		if req.v == "" {
			return usageErr(fmt.Errorf("--%s is required", req.name))
		}
	}
	for _, f := range []struct{ name, path string }{{"creds", *creds}, {"signing-key", *signing}} {
		if _, err := os.Stat(f.path); err != nil {
			return usageErr(fmt.Errorf("--%s: %w", f.name, err))
		}
	}
	if *natsURL == "" {
		return usageErr(errors.New("--nats: a URL is required"))
	}
	if *ttl <= 0 || *ttl > maxAuthdTTL {
		return usageErr(fmt.Errorf("--ttl %s: want more than 0 and at most %s", *ttl, maxAuthdTTL))
	}
	if *audience == "" {
		return usageErr(errors.New("--audience: must not be empty"))
	}
	roles, err := authd.ParseRoles(*rolesFlag)
	if err != nil {
		return usageErr(err)
	}
	isURL := len(*jwks) > 8 && (*jwks)[:8] == "https://"
	if !isURL {
		if *jwksCA != "" || *jwksToken != "" {
			return usageErr(errors.New("--jwks-ca and --jwks-token go with an https --jwks URL"))
		}
		if _, err := os.Stat(*jwks); err != nil {
			return usageErr(fmt.Errorf("--jwks: %w (a JWKS file, or an https:// URL)", err))
		}
	} else {
		if *jwksCA == "" && exists(authd.InClusterCAFile) {
			*jwksCA = authd.InClusterCAFile
		}
		if *jwksToken == "" && exists(authd.InClusterTokenFile) {
			*jwksToken = authd.InClusterTokenFile
		}
		if *jwksToken != "" && !exists(*jwksToken) {
			return usageErr(fmt.Errorf("--jwks-token %s: no such file", *jwksToken))
		}
	}
	keys, err := authd.NewKeySource(authd.KeySourceOptions{Location: *jwks, CAFile: *jwksCA, TokenFile: *jwksToken})
	if err != nil {
		return usageErr(err)
	}
	if *metricsAddr != "" {
		if _, _, err := net.SplitHostPort(*metricsAddr); err != nil {
			return usageErr(fmt.Errorf("--metrics-addr %q: want HOST:PORT: %w", *metricsAddr, err))
		}
	}
	if err := argsChecked(ctx); err != nil {
		return err
	}

	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	svc, err := authd.Start(authd.Options{
		URL: *natsURL, CredsFile: *creds, SigningKeyFile: *signing, TTL: *ttl, Log: log, Registry: reg, TLSCA: busCfg.TLSCA,
		Verifier: &authd.Verifier{Keys: keys, Audience: *audience, Issuer: *issuer, Roles: roles},
	})
	if err != nil {
		return err
	}
	defer svc.Close()
	go loadKeys(ctx, keys, log)
	if *metricsAddr != "" {
		ln, err := net.Listen("tcp", *metricsAddr)
		if err != nil {
			return fmt.Errorf("--metrics-addr %s: %w", *metricsAddr, err)
		}
		srv := &http.Server{Handler: svc.Handler(promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg})), ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Warn("metrics server", "err", err)
			}
		}()
		defer srv.Close()
		log.Info("metrics listening", "url", "http://"+ln.Addr().String()+"/metrics")
	}
	log.Info("authd serving the bus's auth callout", "url", bus.RedactURL(*natsURL), "roles", roles.String(), "audience", *audience, "ttl", *ttl)
	select {
	case <-ctx.Done():
		return nil
	case <-svc.Lost():
		return fmt.Errorf("the bus closed authd's connection for good (%v): is --creds %s the %s of this bus's mesh (narwhal bus creds --out DIR --authd)?", svc.Err(), *creds, bus.AuthdCredsFile)
	}
}

// loadKeys fetches the cluster's keys until a fetch succeeds or ctx ends,
// every authd.DefaultRefreshEvery, logging each failure.
func loadKeys(ctx context.Context, keys *authd.KeySource, log *slog.Logger) {
	for {
		err := keys.Load(ctx)
		if err == nil {
			log.Info("cluster signing keys fetched")
			return
		}
		log.Warn("fetching the cluster's signing keys", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(authd.DefaultRefreshEvery):
		}
	}
}

// exists reports whether path names an existing file.
func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
