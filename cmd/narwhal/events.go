package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

func init() {
	commands["events"] = command{
		summary: "follow the bus's events, one line each ([--kind K] [--engine ID] [--since DUR] [--json])",
		run: func(ctx context.Context, args []string) error {
			return runEvents(ctx, args, os.Stdout, os.Stderr)
		},
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

// eventKinds are the kinds --kind accepts, in the order of SPEC R-BUS-1.
var eventKinds = []string{
	schemas.KindFailure, schemas.KindQuarantine, schemas.KindHandoff,
	schemas.KindRequest, schemas.KindProbe, schemas.KindEligibility,
	schemas.KindChaos,
}

// runEvents is `narwhal events [--kind K] [--engine ID] [--since DUR]
// [--json] [--connect-timeout DUR]` (SPEC §14, R-BUS-5): it follows stream
// NARWHAL_EVENTS on NARWHAL_NATS_URL (default nats://127.0.0.1:4222, with
// the credentials and TLS variables of natsFromEnv) and writes each event to
// stdout, one line per event: readable (see eventPrinter) or, with --json,
// the JSON object exactly as published. A line naming the filter and start
// goes to stderr once the consumer exists, and so do connection notices.
//
// --kind keeps one kind. --engine ID keeps the events whose subject ends in
// ID — the engine id for failure, quarantine, handoff, probe and
// eligibility events, the router id for request events — and also the
// request events whose producer_id or consumer_id is ID. --since starts
// that far back (a duration such as 10m, or an RFC 3339 time; 0 or all: the
// oldest stored event); without it only new events are shown.
//
// It runs until ctx ends (SIGINT) and then returns nil. It returns an error
// for bad flags, when the bus is not reachable within --connect-timeout
// (default 5 s), or when stdout cannot be written.
func runEvents(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal events", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: narwhal events [--kind K] [--engine ID] [--since DUR] [--json] [--connect-timeout DUR]")
		fmt.Fprintln(stderr, "Follows the bus at NARWHAL_NATS_URL (default "+defaultNATSURL+"), one line per event.")
		fs.PrintDefaults()
	}
	kind := fs.String("kind", "", "only events of `KIND`: "+strings.Join(eventKinds, ", "))
	engine := fs.String("engine", "", "only events whose subject ends in `ID` (the engine id; the router id for request events), plus request events whose producer or consumer is ID")
	since := fs.String("since", "", "start `DUR` ago (e.g. 10m) or at an RFC 3339 time; 0 or all: from the oldest stored event; default: new events only")
	asJSON := fs.Bool("json", false, "print each event's JSON object exactly as published, one per line")
	bound := fs.Duration("connect-timeout", defaultEventsConnectBound, "give up when the bus is not reachable within `DUR`")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *kind != "" && !slices.Contains(eventKinds, *kind) {
		return fmt.Errorf("--kind %q: want one of %s", *kind, strings.Join(eventKinds, ", "))
	}
	if *engine != "" && !subjectToken(*engine) {
		return fmt.Errorf("--engine %q: not a subject token (no dots, wildcards or spaces)", *engine)
	}
	if *bound <= 0 {
		return fmt.Errorf("--connect-timeout %v: must be > 0", *bound)
	}
	sel := eventSelection{kind: *kind, engine: *engine}
	start, startDesc, err := parseSince(*since, time.Now())
	if err != nil {
		return err
	}
	start.Filter = sel.filter()

	natsURL := os.Getenv("NARWHAL_NATS_URL")
	if natsURL == "" {
		natsURL = defaultNATSURL
	}
	opts := natsFromEnv(natsURL, "narwhal-events")
	var closing atomic.Bool // set at exit: closing the connection is no news
	opts.Log = slog.New(quietAfter{slog.NewTextHandler(stderr, nil), &closing})
	connectCtx, cancel := context.WithTimeout(ctx, *bound)
	b, err := bus.Connect(connectCtx, opts)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted while connecting
		}
		return fmt.Errorf("bus %s not reachable within %v: %w", redactNATSURL(natsURL), *bound, err)
	}
	defer func() {
		closing.Store(true)
		b.Close()
	}()

	p := &eventPrinter{w: stdout, json: *asJSON}
	failed := make(chan error, 1)
	var mu sync.Mutex // one event at a time, also across consumer resets
	stop, err := bus.SubscribeWith(ctx, b, start, func(subject string, payload []byte) {
		mu.Lock()
		defer mu.Unlock()
		if p.err != nil || !sel.keep(subject, payload) {
			return
		}
		if err := p.print(subject, payload); err != nil {
			failed <- fmt.Errorf("write: %w", err) // once: p.err is set now
		}
	})
	if err != nil {
		return err
	}
	defer stop()
	fmt.Fprintf(stderr, "following %s on %s, %s\n", start.Filter, b.Conn().ConnectedUrlRedacted(), startDesc)
	select {
	case <-ctx.Done():
		return nil
	case err := <-failed:
		return err
	}
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

// parseSince reads --since relative to now: "" = new events only; "0",
// "0s" or "all" = every stored event; a positive duration = since now minus
// it; an RFC 3339 time = since then. It also returns how the start reads
// for people.
func parseSince(since string, now time.Time) (bus.SubscribeOptions, string, error) {
	switch since {
	case "":
		return bus.SubscribeOptions{}, "new events only", nil
	case "0", "all":
		return bus.SubscribeOptions{DeliverAll: true}, "from the oldest stored event", nil
	}
	if d, err := time.ParseDuration(since); err == nil {
		switch {
		case d < 0:
			return bus.SubscribeOptions{}, "", fmt.Errorf("--since %s: must not be negative", since)
		case d == 0:
			return bus.SubscribeOptions{DeliverAll: true}, "from the oldest stored event", nil
		}
		return bus.SubscribeOptions{Since: now.Add(-d)}, "since " + since + " ago", nil
	}
	if t, err := time.Parse(time.RFC3339Nano, since); err == nil {
		return bus.SubscribeOptions{Since: t}, "since " + t.UTC().Format(time.RFC3339Nano), nil
	}
	return bus.SubscribeOptions{}, "", fmt.Errorf("--since %q: want a duration such as 10m, an RFC 3339 time, 0 or all", since)
}

// subjectToken reports whether s can be one token of a NATS subject.
func subjectToken(s string) bool {
	return s != "" && !strings.ContainsAny(s, ".*> \t\r\n")
}

// eventSelection is what --kind and --engine keep.
type eventSelection struct {
	kind, engine string // "" = any
}

// filter returns the stream consumer's subject filter,
// narwhal.events.<kind|*>.<engine|*>, widened to every id when --engine may
// also match request events by their producer or consumer (keep then
// decides).
func (s eventSelection) filter() string {
	kind, id := s.kind, s.engine
	if kind == "" {
		kind = "*"
	}
	if id == "" || kind == "*" || kind == schemas.KindRequest {
		id = "*"
	}
	return bus.SubjectPrefix + kind + "." + id
}

// keep reports whether an event that passed the consumer's filter is
// selected: with --engine ID, its subject ends in ID, or it is a request
// event whose producer_id or consumer_id is ID.
func (s eventSelection) keep(subject string, payload []byte) bool {
	if s.engine == "" {
		return true
	}
	kind, id := subjectParts(subject)
	if id == s.engine {
		return true
	}
	if kind != schemas.KindRequest {
		return false
	}
	var ends struct {
		ProducerID string `json:"producer_id"`
		ConsumerID string `json:"consumer_id"`
	}
	if json.Unmarshal(payload, &ends) != nil {
		return false
	}
	return ends.ProducerID == s.engine || ends.ConsumerID == s.engine
}

// subjectParts splits narwhal.events.<kind>.<id> into kind and id.
func subjectParts(subject string) (kind, id string) {
	kind, id, _ = strings.Cut(strings.TrimPrefix(subject, bus.SubjectPrefix), ".")
	return kind, id
}

// Layout of a readable line.
const (
	// lineTimeLayout is the "at" column: UTC, milliseconds.
	lineTimeLayout = "2006-01-02T15:04:05.000Z07:00"
	// timeWidth is the width of a time in lineTimeLayout.
	timeWidth = len("2006-01-02T15:04:05.000Z")
	// kindWidth fits the longest kind, "eligibility".
	kindWidth = 11
	// minIDWidth is the narrowest id column.
	minIDWidth = 2
)

// eventPrinter writes one line per event to w, reusing one buffer. It is
// not safe for concurrent use.
//
// A readable line is `<at> <kind> <id> <details>`, columns aligned, where
// id is the subject's last token (engine id; router id for request events)
// and the details depend on the kind:
//
//	failure      decode first_token_timeout 504 counts p1→d1 "engine first token timeout" (router rt-1, req abc)
//	request      200 /v1/chat/completions p1→d1 ttft=0.120s first_byte=0.340s attempts=1 (req abc, model m, 1.250s)
//	eligibility  ejected streak=3 "ejected after 3 failures" (breaker b1)
//	probe        success decode p1→d1 (breaker b1)
//	quarantine   5.000s first_token_timeout until 2026-11-30T05:59:19.123Z (router rt-1)
//	handoff      abandoned decode_failed released p1→d1 nixl age=0.100s (router rt-1, req abc)
//
// An event that does not decode is shown with its raw JSON.
type eventPrinter struct {
	w       io.Writer
	json    bool
	buf     []byte
	idWidth int
	err     error // the first write error; nothing is written after it
}

// print writes the event's line and returns the write error, if any.
func (p *eventPrinter) print(subject string, payload []byte) error {
	b := p.buf[:0]
	if p.json {
		b = appendJSONLine(b, payload)
	} else {
		b = p.appendReadable(b, subject, payload)
	}
	p.buf = b
	if _, err := p.w.Write(b); err != nil {
		p.err = err
		return err
	}
	return nil
}

// appendJSONLine appends payload and a newline. A payload spread over
// several lines is compacted (or, when it is not JSON, its line breaks
// become spaces) so that each event stays one line.
func appendJSONLine(b, payload []byte) []byte {
	if bytes.ContainsAny(payload, "\r\n") {
		var c bytes.Buffer
		if json.Compact(&c, payload) == nil {
			payload = c.Bytes()
		} else {
			payload = bytes.Map(func(r rune) rune {
				if r == '\r' || r == '\n' {
					return ' '
				}
				return r
			}, payload)
		}
	}
	b = append(b, payload...)
	return append(b, '\n')
}

// appendReadable appends the readable line of one event.
func (p *eventPrinter) appendReadable(b []byte, subject string, payload []byte) []byte {
	kind, id := subjectParts(subject)
	var head schemas.Envelope
	detailed := json.Unmarshal(payload, &head) == nil
	if head.At.IsZero() {
		b = append(b, '-')
		b = pad(b, 1, timeWidth)
	} else {
		b = head.At.UTC().AppendFormat(b, lineTimeLayout)
	}
	b = append(b, ' ')
	b = append(b, kind...)
	b = pad(b, len(kind), kindWidth)
	b = append(b, ' ')
	p.idWidth = max(p.idWidth, len(id), minIDWidth)
	b = append(b, id...)
	b = pad(b, len(id), p.idWidth)
	b = append(b, ' ')
	if detailed {
		var withDetails []byte
		if withDetails, detailed = appendDetails(b, kind, payload); detailed {
			b = withDetails
		}
	}
	if !detailed {
		return appendJSONLine(b, payload)
	}
	return append(b, '\n')
}

// appendDetails appends the kind's own fields; ok is false for an unknown
// kind or a payload that does not decode as that kind.
func appendDetails(b []byte, kind string, payload []byte) (_ []byte, ok bool) {
	switch kind {
	case schemas.KindFailure:
		var e schemas.Failure
		if json.Unmarshal(payload, &e) != nil {
			return b, false
		}
		b = append(b, e.Phase...)
		b = append(b, ' ')
		b = append(b, e.Kind...)
		b = append(b, ' ')
		b = strconv.AppendInt(b, int64(e.Status), 10)
		if e.UpstreamStatus != 0 {
			b = append(b, " upstream="...)
			b = strconv.AppendInt(b, int64(e.UpstreamStatus), 10)
		}
		if e.Counts {
			b = append(b, " counts"...)
		} else {
			b = append(b, " uncounted"...)
		}
		b = appendEnds(b, e.ProducerID, e.ConsumerID)
		b = append(b, ' ')
		b = strconv.AppendQuote(b, e.Message)
		b = appendSource(b, e.Envelope, e.Attempt)
	case schemas.KindRequest:
		var e schemas.RequestCompleted
		if json.Unmarshal(payload, &e) != nil {
			return b, false
		}
		b = strconv.AppendInt(b, int64(e.Status), 10)
		if e.ErrorKind != "" {
			b = append(b, ' ')
			b = append(b, e.ErrorKind...)
		}
		b = append(b, ' ')
		b = append(b, e.Endpoint...)
		b = appendEnds(b, e.ProducerID, e.ConsumerID)
		b = append(b, " ttft="...)
		b = appendOptSeconds(b, e.TTFTSeconds)
		b = append(b, " first_byte="...)
		b = appendOptSeconds(b, e.FirstByteSeconds)
		b = append(b, " attempts="...)
		b = strconv.AppendInt(b, int64(e.Attempts), 10)
		b = append(b, " (req "...)
		b = append(b, e.RequestID...)
		if e.Model != "" {
			b = append(b, ", model "...)
			b = append(b, e.Model...)
		}
		b = append(b, ", "...)
		b = appendSeconds(b, e.DurationSeconds)
		b = append(b, ')')
	case schemas.KindEligibility:
		var e schemas.Eligibility
		if json.Unmarshal(payload, &e) != nil {
			return b, false
		}
		state := e.State
		if state == "" {
			state = "ejected"
			if e.Eligible {
				state = "eligible"
			}
		}
		b = append(b, state...)
		b = append(b, " streak="...)
		b = strconv.AppendInt(b, int64(e.Streak), 10)
		if e.Reason != "" {
			b = append(b, ' ')
			b = strconv.AppendQuote(b, e.Reason)
		}
		b = appendSource(b, e.Envelope, 0)
	case schemas.KindProbe:
		var e schemas.Probe
		if json.Unmarshal(payload, &e) != nil {
			return b, false
		}
		b = append(b, e.Outcome...)
		b = append(b, ' ')
		b = append(b, e.Phase...)
		b = appendEnds(b, e.ProducerID, e.ConsumerID)
		if e.Message != "" {
			b = append(b, ' ')
			b = strconv.AppendQuote(b, e.Message)
		}
		b = appendSource(b, e.Envelope, 0)
	case schemas.KindChaos:
		var e schemas.Chaos
		if json.Unmarshal(payload, &e) != nil {
			return b, false
		}
		b = append(b, e.Action...)
		b = append(b, ' ')
		b = append(b, e.Fault...)
		b = append(b, ' ')
		b = append(b, e.Phase...)
		if len(e.Params) > 0 {
			keys := make([]string, 0, len(e.Params))
			for k := range e.Params {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				b = append(b, ' ')
				b = append(b, k...)
				b = append(b, '=')
				b = append(b, e.Params[k]...)
			}
		}
		if e.Count > 0 {
			b = append(b, " left="...)
			b = strconv.AppendInt(b, int64(e.Left), 10)
		}
		b = appendSource(b, e.Envelope, 0)
	case schemas.KindQuarantine:
		var e schemas.Quarantine
		if json.Unmarshal(payload, &e) != nil {
			return b, false
		}
		b = appendSeconds(b, e.DurationSeconds)
		b = append(b, ' ')
		b = append(b, e.Reason...)
		if !e.Until.IsZero() {
			b = append(b, " until "...)
			b = e.Until.UTC().AppendFormat(b, lineTimeLayout)
		}
		b = appendSource(b, e.Envelope, 0)
	case schemas.KindHandoff:
		var e schemas.Handoff
		if json.Unmarshal(payload, &e) != nil {
			return b, false
		}
		b = append(b, e.Outcome...)
		b = append(b, ' ')
		b = append(b, e.Reason...)
		if e.Released {
			b = append(b, " released"...)
		} else {
			b = append(b, " not-released"...)
		}
		b = appendEnds(b, e.EngineID, e.ConsumerID)
		if e.Connector != "" {
			b = append(b, ' ')
			b = append(b, e.Connector...)
		}
		b = append(b, " age="...)
		b = appendSeconds(b, e.AgeSeconds)
		b = appendSource(b, e.Envelope, 0)
	default:
		return b, false
	}
	return b, true
}

// appendEnds appends " producer→consumer" when either is known.
func appendEnds(b []byte, producer, consumer string) []byte {
	if producer == "" && consumer == "" {
		return b
	}
	b = append(b, ' ')
	b = append(b, producer...)
	b = append(b, "→"...)
	return append(b, consumer...)
}

// appendSource appends " (router R, req X, attempt N)" or
// " (breaker B)": who published the event and for which request; attempt
// only when it is a retry (N > 1).
func appendSource(b []byte, h schemas.Envelope, attempt int) []byte {
	b = append(b, " ("...)
	n := len(b)
	if h.RouterID != "" {
		b = append(b, "router "...)
		b = append(b, h.RouterID...)
	}
	if h.BreakerID != "" {
		b = appendSep(b, n)
		b = append(b, "breaker "...)
		b = append(b, h.BreakerID...)
	}
	if h.RequestID != "" {
		b = appendSep(b, n)
		b = append(b, "req "...)
		b = append(b, h.RequestID...)
	}
	if attempt > 1 {
		b = appendSep(b, n)
		b = append(b, "attempt "...)
		b = strconv.AppendInt(b, int64(attempt), 10)
	}
	if len(b) == n {
		return b[:n-2] // nothing to say
	}
	return append(b, ')')
}

// appendSep appends ", " unless b has nothing after position start.
func appendSep(b []byte, start int) []byte {
	if len(b) > start {
		b = append(b, ", "...)
	}
	return b
}

// appendSeconds appends s seconds as "1.250s".
func appendSeconds(b []byte, s float64) []byte {
	b = strconv.AppendFloat(b, s, 'f', 3, 64)
	return append(b, 's')
}

// appendOptSeconds appends *s as appendSeconds does, or "-" for nil.
func appendOptSeconds(b []byte, s *float64) []byte {
	if s == nil {
		return append(b, '-')
	}
	return appendSeconds(b, *s)
}

// pad appends spaces to bring a column of n bytes to width.
func pad(b []byte, n, width int) []byte {
	for ; n < width; n++ {
		b = append(b, ' ')
	}
	return b
}
