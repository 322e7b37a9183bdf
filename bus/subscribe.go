package bus

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/nats-io/nats.go/jetstream"
)

// Subscribe starts an ordered, ephemeral JetStream consumer on stream
// NARWHAL_EVENTS (SPEC R-BUS-5) and calls fn with each message's subject
// and JSON payload, one message at a time, in stream order. filter is a
// subject filter within narwhal.events.> (e.g. "narwhal.events.failure.*");
// "" means every event. With deliverAll it starts at the oldest stored
// event, else with the events published after Subscribe returns.
//
// It is meant for tests, `narwhal events` and dashboards; services that
// must not lose events use durable consumers instead (R-BRK-1). The
// consumer runs until stop is called or ctx ends; stop waits until fn is no
// longer running and is safe to call more than once. fn may keep payload.
// It returns an error when filter is outside narwhal.events.> or the
// consumer cannot be created.
func Subscribe(ctx context.Context, b *Bus, filter string, deliverAll bool, fn func(subject string, payload []byte)) (stop func(), err error) {
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
	if deliverAll {
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
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
