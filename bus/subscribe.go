package bus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// SubscribeOptions says which events SubscribeWith delivers and from where
// in stream NARWHAL_EVENTS it starts (behaviour.md R-BUS-5).
type SubscribeOptions struct {
	// Filter is a subject filter within narwhal.events.>, e.g.
	// "narwhal.events.failure.>" (both shapes of behaviour.md R-BUS-11:
	// narwhal.events.<kind>.<id> and a router's
	// narwhal.events.<kind>.<engine_id>.<router_id>); "" means every event.
	Filter string
	// DeliverAll starts at the oldest event the stream still holds.
	DeliverAll bool
	// Since, when not zero, starts at the first event the stream stored at
	// or after this time (the server's storage time, not the event's "at").
	// It excludes DeliverAll.
	Since time.Time
	// Consumer names SubscribeResuming's consumer, e.g.
	// Bus.ConsumerName(PurposeQuarantine): an engine's or a router's
	// identity may make consumers of its own names only (behaviour.md
	// R-BUS-11). "" is a random name.
	Consumer string
}

// Subscribe starts an ordered, ephemeral JetStream consumer on stream
// NARWHAL_EVENTS (behaviour.md R-BUS-5) and calls fn with each message's subject
// and JSON payload, one message at a time, in stream order. filter is a
// subject filter within narwhal.events.> (e.g. "narwhal.events.failure.>");
// "" means every event. With deliverAll it starts at the oldest stored
// event, else with the events published after Subscribe returns.
//
// It is meant for tests, `narwhal events` and dashboards; services that
// must not lose events use durable consumers instead (R-BRK-1). The
// consumer runs until stop is called or ctx ends; stop waits until fn is no
// longer running and is safe to call more than once. fn may keep payload.
// It returns an error when filter is outside narwhal.events.> or the
// consumer cannot be created. It is SubscribeWith with Filter and
// DeliverAll set.
func Subscribe(ctx context.Context, b *Bus, filter string, deliverAll bool, fn func(subject string, payload []byte)) (stop func(), err error) {
	return SubscribeWith(ctx, b, SubscribeOptions{Filter: filter, DeliverAll: deliverAll}, fn)
}

// SubscribeWith is Subscribe with a choice of start (behaviour.md R-BUS-5): the
// events published after it returns (the zero SubscribeOptions), every
// stored event (DeliverAll), or the events stored since a time (Since, e.g.
// time.Now().Add(-10*time.Minute)). It calls fn with each message's subject
// and JSON payload, one message at a time, in stream order; fn may keep
// payload. The consumer runs until stop is called or ctx ends; stop waits
// until fn is no longer running and is safe to call more than once. It
// returns an error when opts.Filter is outside narwhal.events.>, when both
// DeliverAll and Since are set, or when the consumer cannot be created.
// On a connection that reads by direct gets (Bus.ReadsDirect: a role's
// credential, behaviour.md R-BUS-11) it makes no consumer and reads as
// SubscribeResuming does.
func SubscribeWith(ctx context.Context, b *Bus, opts SubscribeOptions, fn func(subject string, payload []byte)) (stop func(), err error) {
	filter := opts.Filter
	if filter == "" {
		filter = SubjectPrefix + ">"
	}
	if !strings.HasPrefix(filter, SubjectPrefix) || len(filter) == len(SubjectPrefix) {
		return nil, fmt.Errorf("bus: subscribe: filter %q is not within %s>", filter, SubjectPrefix)
	}
	cfg := jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{filter},
		DeliverPolicy:  jetstream.DeliverNewPolicy,
	}
	switch {
	case opts.DeliverAll && !opts.Since.IsZero():
		return nil, errors.New("bus: subscribe: DeliverAll and Since exclude each other")
	case opts.DeliverAll:
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	case !opts.Since.IsZero():
		since := opts.Since.UTC()
		cfg.DeliverPolicy = jetstream.DeliverByStartTimePolicy
		cfg.OptStartTime = &since
	}
	if b.direct {
		// No consumer with a role's credential (behaviour.md R-BUS-11).
		return subscribeDirect(ctx, b, opts, filter, fn, nil)
	}
	cons, err := b.js.OrderedConsumer(ctx, StreamName, cfg)
	if err != nil {
		return nil, fmt.Errorf("bus: subscribe %s: %w", filter, err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) { fn(m.Subject(), m.Data()) })
	if err != nil {
		return nil, fmt.Errorf("bus: subscribe %s: %w", filter, err)
	}
	stopOnCancel := context.AfterFunc(ctx, cc.Stop)
	var once sync.Once
	return func() {
		once.Do(func() {
			stopOnCancel()
			cc.Stop()
		})
		<-cc.Closed()
	}, nil
}
