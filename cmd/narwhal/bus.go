package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
)

func init() {
	commands["bus"] = command{
		summary: "run a standalone NATS server with JetStream that Narwhal processes share (--listen HOST:PORT --data DIR)",
		run: func(ctx context.Context, args []string) error {
			return runBus(ctx, args, os.Stdout, os.Stderr)
		},
	}
}

// Defaults and bounds of `narwhal bus`.
const (
	// defaultBusListen is where `narwhal bus` listens without --listen:
	// NATS's standard client port, on loopback only.
	defaultBusListen = "127.0.0.1:4222"
	// defaultBusData is the JetStream store without --data.
	defaultBusData = "./narwhal-bus-data"
	// busSetupBound bounds setting up the stream and the bucket at start.
	busSetupBound = 10 * time.Second
)

// runBus is `narwhal bus [--listen HOST:PORT] [--data DIR] [--verbose]`
// (SPEC §14, R-BUS-4): the embedded NATS server with JetStream as a process
// of its own, so that several Narwhal processes on one machine share a bus
// with NARWHAL_NATS_URL=nats://HOST:PORT. It sets up stream NARWHAL_EVENTS
// and bucket narwhal_placement with create-or-update only (R-BUS-7), writes
// `bus listening on nats://HOST:PORT (data DIR)` to stdout, serves until ctx
// ends (SIGINT/SIGTERM) and then shuts the server down, which flushes the
// store: restarting on the same DIR keeps every stored event and key. Port 0
// picks a free port (the line names it); an empty host listens on every
// interface. Server warnings and errors go to stderr as slog text
// (notices too with --verbose). It returns an error for bad flags, an
// unusable DIR, a port in use, or a stream/bucket set-up that fails within
// 10 s.
func runBus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal bus", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: narwhal bus [--listen HOST:PORT] [--data DIR] [--verbose]")
		fmt.Fprintln(stderr, "Serves NATS with JetStream; point Narwhal processes at it with NARWHAL_NATS_URL=nats://HOST:PORT.")
		fs.PrintDefaults()
	}
	listen := fs.String("listen", defaultBusListen, "`HOST:PORT` for NATS clients (port 0: any free port; empty host: every interface)")
	data := fs.String("data", defaultBusData, "JetStream store `DIR`; restarting on the same DIR keeps the events and the placement")
	verbose := fs.Bool("verbose", false, "log the NATS server's notices, not only its warnings and errors")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	host, port, err := parseListen(*listen)
	if err != nil {
		return err
	}
	if *data == "" {
		return errors.New("--data: a directory is required")
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

	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: dir, Host: host, Port: port, Log: log})
	if err != nil {
		return err
	}
	defer emb.Shutdown()
	setupCtx, cancel := context.WithTimeout(ctx, busSetupBound)
	b, err := bus.Connect(setupCtx, bus.ConnectOptions{Embedded: emb, Name: "narwhal-bus"})
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

// natsFromEnv returns the options to connect to the external NATS at
// natsURL with the credentials file and TLS files named by
// NARWHAL_NATS_CREDS, NARWHAL_NATS_TLS_CA, NARWHAL_NATS_TLS_CERT and
// NARWHAL_NATS_TLS_KEY (each unset = not used), under client name name
// (SPEC R-BUS-4, §14). Every process that joins a mesh uses it.
func natsFromEnv(natsURL, name string) bus.ConnectOptions {
	return bus.ConnectOptions{
		URL:       natsURL,
		Name:      name,
		CredsFile: os.Getenv("NARWHAL_NATS_CREDS"),
		TLSCA:     os.Getenv("NARWHAL_NATS_TLS_CA"),
		TLSCert:   os.Getenv("NARWHAL_NATS_TLS_CERT"),
		TLSKey:    os.Getenv("NARWHAL_NATS_TLS_KEY"),
		Replicas:  natsReplicas(),
	}
}

// natsReplicas reads NARWHAL_NATS_REPLICAS (replicas of the stream and the
// buckets on a NATS cluster); unset or invalid means 1.
func natsReplicas() int {
	n, err := strconv.Atoi(os.Getenv("NARWHAL_NATS_REPLICAS"))
	if err != nil || n < 1 {
		return 1
	}
	return n
}

// redactNATSURL returns natsURL (one URL or a comma-separated list) with
// any password or token replaced by "xxxxx", for messages.
func redactNATSURL(natsURL string) string {
	parts := strings.Split(natsURL, ",")
	for i, p := range parts {
		u, err := url.Parse(strings.TrimSpace(p))
		if err != nil || u.User == nil {
			continue
		}
		if _, hasPassword := u.User.Password(); hasPassword {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		} else {
			u.User = url.User("xxxxx") // a token
		}
		parts[i] = u.String()
	}
	return strings.Join(parts, ",")
}
