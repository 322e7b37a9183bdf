// Package eventview turns the bus's events into what a person reads: the
// selection of `narwhal events` (which kinds and engines, from when), one
// line per event (readable, or the JSON exactly as published), and the
// loop that follows stream NARWHAL_EVENTS and prints (behaviour.md R-BUS-5).
//
// It imports bus and schemas only; cmd/narwhal parses the flags and wires
// it to stdout.
package eventview

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Kinds are the event kinds a Selection accepts: every kind of
// schemas.EventKinds, in its order (behaviour.md R-BUS-1, then the kinds
// added since).
var Kinds = schemas.EventKindNames()

// Selection is which events are kept: Kind (one of Kinds) and Engine (an
// engine id, or a router id for the kinds whose subject ends in one:
// request events); "" means any.
type Selection struct {
	Kind, Engine string
}

// Filter returns the stream consumer's subject filter: without a Kind
// narwhal.events.> (every event, both shapes of behaviour.md R-BUS-11);
// with a Kind alone narwhal.events.<kind>.>; with an Engine
// narwhal.events.<kind>.<engine>, or narwhal.events.<kind>.<engine>.* for
// a router's kind about an engine (its fifth token is the router's id).
// With an Engine and no Kind, or a kind whose subject ends in a router id
// (request events, matched by their producer or consumer), it takes every
// event of the kind and Keep decides.
func (s Selection) Filter() string {
	switch {
	case s.Kind == "":
		return bus.SubjectPrefix + ">"
	case s.Engine == "" || byRouter(s.Kind):
		return bus.SubjectPrefix + s.Kind + ".>"
	}
	if k, ok := schemas.LookupEventKind(s.Kind); ok && k.Routed() {
		return k.Subject(s.Engine, "*")
	}
	return bus.SubjectPrefix + s.Kind + "." + s.Engine
}

// Keep reports whether an event that passed the consumer's Filter is
// selected: with an Engine, its subject's token after the kind is Engine,
// or its subject ends in a router id (a request event) and its
// producer_id or consumer_id is Engine.
func (s Selection) Keep(subject string, payload []byte) bool {
	if s.Engine == "" {
		return true
	}
	kind, id := subjectParts(subject)
	if id == s.Engine {
		return true
	}
	if !byRouter(kind) {
		return false
	}
	var ends struct {
		ProducerID string `json:"producer_id"`
		ConsumerID string `json:"consumer_id"`
	}
	if json.Unmarshal(payload, &ends) != nil {
		return false
	}
	return ends.ProducerID == s.Engine || ends.ConsumerID == s.Engine
}

// SubjectToken reports whether s can be one token of a NATS subject (no
// dots, wildcards or white space), as Selection.Engine must be.
func SubjectToken(s string) bool {
	return s != "" && !strings.ContainsAny(s, ".*> \t\r\n")
}

// ParseSince reads the start of `narwhal events --since` relative to now:
// "" = new events only; "0", "0s" or "all" = every stored event; a
// positive duration = since now minus it; an RFC 3339 time = since then.
// It also returns how the start reads for people ("since 10m ago"). A
// negative duration or anything else is an error naming the value.
func ParseSince(since string, now time.Time) (bus.SubscribeOptions, string, error) {
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

// byRouter reports whether the subjects of kind end in a router id
// rather than an engine id (its row of schemas.EventKinds says so).
func byRouter(kind string) bool {
	k, ok := schemas.LookupEventKind(kind)
	return ok && k.ID == schemas.IDRouter
}

// subjectParts splits narwhal.events.<kind>.<id>[.<router_id>] into kind
// and id (the token after the kind).
func subjectParts(subject string) (kind, id string) {
	kind, id, _ = strings.Cut(strings.TrimPrefix(subject, bus.SubjectPrefix), ".")
	id, _, _ = strings.Cut(id, ".")
	return kind, id
}
