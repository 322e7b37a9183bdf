package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/eventview"
)

func init() {
	commands["events"] = command{
		summary: "follow the bus's events, one line each ([--kind K] [--engine ID] [--since DUR] [--json])",
		run:     withOutput(runEvents),
	}
}

// Defaults of `narwhal events`.
const (
	// defaultNATSURL is the bus `narwhal events` follows when
	// NARWHAL_NATS_URL is unset: `narwhal bus` with its default --listen.
	defaultNATSURL = "nats://127.0.0.1:4222"
	// defaultEventsConnectBound is how long `narwhal events` waits for the
	// bus before it gives up.
	defaultEventsConnectBound = 5 * time.Second
)

// runEvents is `narwhal events [--kind K] [--engine ID] [--since DUR]
// [--json] [--connect-timeout DUR]` (behaviour.md §14, R-BUS-5): it follows stream
// NARWHAL_EVENTS on NARWHAL_NATS_URL (default nats://127.0.0.1:4222, with
// the credential and TLS variables of the bus section; a viewer credential
// suffices, and it changes nothing on the bus, R-BUS-8) and writes each event to
// stdout, one line per event: readable (see eventview.Printer) or, with --json,
// the JSON object exactly as published. A line naming the filter and start
// goes to stderr once the consumer exists, and so do connection notices
// and, after a reconnect, where it resumed (eventview.ResumeNotice: it
// never skips an event, and counts those the retention removed).
//
// --kind keeps one kind. --engine ID keeps the events whose subject names
// ID after the kind — the engine id for failure, quarantine, handoff,
// probe and eligibility events (a router's events then name the router
// too, behaviour.md R-BUS-11), the router id for request events — and also
// the request events whose producer_id or consumer_id is ID. --since starts
// that far back (a duration such as 10m, or an RFC 3339 time; 0 or all: the
// oldest stored event); without it only new events are shown.
//
// It runs until ctx ends (SIGINT) and then returns nil. It returns an error
// for bad flags, when the bus is not reachable within --connect-timeout
// (default 5 s), or when stdout cannot be written. A bus that answers but
// is not set up yet is waited for, saying so on stderr once and then every
// 30 s (docs/mesh.md, "Start-up: what a process waits for").
func runEvents(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal events", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: narwhal events [--kind K] [--engine ID] [--since DUR] [--json] [--connect-timeout DUR]")
		fmt.Fprintln(stderr, "Follows the bus at NARWHAL_NATS_URL (default "+defaultNATSURL+"), one line per event.")
		fs.PrintDefaults()
	}
	kind := fs.String("kind", "", "only events of `KIND`: "+strings.Join(eventview.Kinds, ", "))
	engine := fs.String("engine", "", "only events whose subject names `ID` after the kind (the engine id; the router id for request events), plus request events whose producer or consumer is ID")
	since := fs.String("since", "", "start `DUR` ago (e.g. 10m) or at an RFC 3339 time; 0 or all: from the oldest stored event; default: new events only")
	asJSON := fs.Bool("json", false, "print each event's JSON object exactly as published, one per line")
	bound := fs.Duration("connect-timeout", defaultEventsConnectBound, "give up when the bus is not reachable within `DUR`")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *kind != "" && !slices.Contains(eventview.Kinds, *kind) {
		return fmt.Errorf("--kind %q: want one of %s", *kind, strings.Join(eventview.Kinds, ", "))
	}
	if *engine != "" && !eventview.SubjectToken(*engine) {
		return fmt.Errorf("--engine %q: not a subject token (no dots, wildcards or spaces)", *engine)
	}
	if *bound <= 0 {
		return fmt.Errorf("--connect-timeout %v: must be > 0", *bound)
	}
	sel := eventview.Selection{Kind: *kind, Engine: *engine}
	start, startDesc, err := eventview.ParseSince(*since, time.Now())
	if err != nil {
		return err
	}

	busCfg, err := toolBus()
	if err != nil {
		return err
	}
	natsURL := busCfg.URL
	var closing atomic.Bool // set at exit: closing the connection is no news
	opts := busOptions(busCfg, "narwhal-events", bus.RoleViewer, slog.New(quietAfter{slog.NewTextHandler(stderr, nil), &closing}))
	// --connect-timeout bounds reaching the bus; one not set up yet is
	// waited for (logged once, then every 30 s) until ctx ends.
	opts.ReachTimeout = *bound
	opts.WaitSetUp = &bus.SetUpWait{}
	b, err := bus.Connect(ctx, opts)
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted while connecting
		}
		if errors.Is(err, bus.ErrUnreachable) {
			return fmt.Errorf("bus %s not reachable within %v: %w", redactNATSURL(natsURL), *bound, err)
		}
		return fmt.Errorf("bus %s: %w", redactNATSURL(natsURL), err)
	}
	defer func() {
		closing.Store(true)
		b.Close()
	}()

	// A revoked viewer credential ends the follow: exit non-zero saying
	// so, not silence (R-BUS-11).
	ctx, stopRefused := untilRefused(ctx, b)
	defer stopRefused()
	err = eventview.Follow(ctx, b, start, sel, stdout, stderr, *asJSON, func(filter string) {
		fmt.Fprintf(stderr, "following %s on %s, %s\n", filter, b.Conn().ConnectedUrlRedacted(), startDesc)
	})
	if refused := refusedCause(ctx); refused != nil {
		return refused
	}
	return err
}

// quietAfter is a slog.Handler that drops every record once closing is
// set, so that closing the bus connection at exit is not reported as a
// disconnect.
type quietAfter struct {
	slog.Handler
	closing *atomic.Bool
}

func (h quietAfter) Enabled(ctx context.Context, l slog.Level) bool {
	return !h.closing.Load() && h.Handler.Enabled(ctx, l)
}

func (h quietAfter) WithAttrs(attrs []slog.Attr) slog.Handler {
	return quietAfter{h.Handler.WithAttrs(attrs), h.closing}
}

func (h quietAfter) WithGroup(name string) slog.Handler {
	return quietAfter{h.Handler.WithGroup(name), h.closing}
}
