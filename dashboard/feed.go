package dashboard

import (
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Feed tuning.
const (
	// watchRetry is the pause before a bucket watch or an event
	// subscription that ended or failed is set up again.
	watchRetry = time.Second
	// setupBound bounds binding a bucket or creating a consumer.
	setupBound = 5 * time.Second
	// historyWindow is how far back the page starts: the events of the
	// kinds NARWHAL_HISTORY keeps (ejections, readmissions, failures,
	// fleet changes) of the last hour are replayed from the stream at
	// start (request events are not: rates start from now).
	historyWindow = time.Hour
	// busPoll is how often the bus link's state is read.
	busPoll = 500 * time.Millisecond
	// maxValue is the largest bucket value read; a larger one is
	// ignored.
	maxValue = 64 << 10
)

// feed keeps st up to date from b until ctx ends: one watch per bucket
// and one ordered consumer per event kind the page shows (appliers),
// each set up again when it ends (the connection was lost, the consumer
// deleted). A kind whose row of schemas.EventKinds sets History (the
// mesh's history: failures, ejections, readmissions, fleet changes) is
// replayed from historyWindow before start; the others (request events)
// count from start on. It returns when every one of them has stopped.
func feed(ctx context.Context, b *bus.Bus, st *state, start time.Time, log *slog.Logger) {
	var wg sync.WaitGroup
	run := func(f func()) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f()
		}()
	}
	run(func() { watchBus(ctx, b, st) })
	run(func() { watchBucket(ctx, b, bus.FleetBucket, st, log, st.fleetValue) })
	run(func() { watchBucket(ctx, b, bus.PlacementBucket, st, log, st.placementValue) })
	run(func() { watchBucket(ctx, b, bus.RoutersBucket, st, log, st.routerValue) })
	run(func() { watchBucket(ctx, b, bus.ChaosBucket, st, log, st.faultValue) })
	for _, kind := range schemas.EventKinds() {
		if appliers[kind.Name] == nil {
			continue
		}
		since := start
		if kind.History {
			since = start.Add(-historyWindow)
		}
		run(func() { follow(ctx, b, kind, bus.SubscribeOptions{Since: since}, st, log) })
	}
	wg.Wait()
}

// watchBus records the link's state every busPoll.
func watchBus(ctx context.Context, b *bus.Bus, st *state) {
	st.setBus(b.Connected(), b.URL())
	pause.Every(ctx, busPoll, func(time.Time) {
		st.setBus(b.Connected(), b.URL())
	})
}

// watchBucket keeps a watch on bucket name until ctx ends, handing every
// key's value (nil when deleted) to apply; a full read of the bucket
// after each (re)start forgets the keys that are gone.
func watchBucket(ctx context.Context, b *bus.Bus, name string, st *state, log *slog.Logger, apply func(key string, value []byte)) {
	warned := false
	known := map[string]bool{}
	for ctx.Err() == nil {
		sctx, cancel := context.WithTimeout(ctx, setupBound)
		_, err := b.BindBucket(sctx, name)
		cancel()
		if err == nil {
			// By direct gets with the viewer's credential: no consumer
			// (behaviour.md R-BUS-11).
			err = bus.WatchBucket(ctx, b, name, b.ConsumerName(bus.PurposeView), func(snap map[string]jetstream.KeyValueEntry) {
				for key := range known {
					if _, ok := snap[key]; !ok {
						apply(key, nil)
						delete(known, key)
					}
				}
				for key, e := range snap {
					known[key] = applyEntry(e, apply)
				}
			}, func(e jetstream.KeyValueEntry) {
				known[e.Key()] = applyEntry(e, apply)
			})
		}
		if ctx.Err() != nil {
			return
		}
		if err != nil && !warned {
			log.Warn("dashboard: bucket watch could not be set up; retrying", "bucket", name, "err", err)
			warned = true
		} else if err == nil {
			warned = false
		}
		if !pause.For(ctx, watchRetry) {
			return
		}
	}
}

// applyEntry applies one watched entry and reports whether its key
// holds a value now.
func applyEntry(e jetstream.KeyValueEntry, apply func(key string, value []byte)) bool {
	if e.Operation() != jetstream.KeyValuePut {
		apply(e.Key(), nil)
		return false
	}
	apply(e.Key(), e.Value())
	return true
}

// fleetValue applies a narwhal_fleet value (R-FLEET-1); an invalid one
// is counted and changes nothing.
func (s *state) fleetValue(key string, value []byte) {
	if value == nil {
		s.applyFleet(key, nil)
		return
	}
	entry, err := bus.ParseFleetEntry(key, value)
	if err != nil {
		s.refuse()
		return
	}
	s.applyFleet(key, &entry)
}

// placementValue applies a narwhal_placement value (R-BUS-2).
func (s *state) placementValue(key string, value []byte) {
	if value == nil {
		s.applyPlacement(key, nil)
		return
	}
	var e schemas.Eligibility
	if len(value) > maxValue || bus.ValidatePlacement(value) != nil || json.Unmarshal(value, &e) != nil {
		s.refuse()
		return
	}
	s.applyPlacement(key, &e)
}

// routerValue applies a narwhal_routers value (R-FLEET-3).
func (s *state) routerValue(key string, value []byte) {
	if value == nil {
		s.applyRouterReport(key, nil)
		return
	}
	var r schemas.RouterReport
	if len(value) > maxValue || bus.ValidateRouterReport(value) != nil || json.Unmarshal(value, &r) != nil || r.RouterID != key {
		s.refuse()
		return
	}
	s.applyRouterReport(key, &r)
}

// chaosFault is the part of a narwhal_chaos value (the chaos package's
// Fault) the page shows.
type chaosFault struct {
	EngineID    string            `json:"engine_id"`
	ID          string            `json:"id"`
	Name        string            `json:"fault"`
	Phase       string            `json:"phase"`
	Probability float64           `json:"probability"`
	Count       int               `json:"count"`
	Left        int               `json:"left"`
	Params      map[string]string `json:"params"`
	Expires     time.Time         `json:"expires"`
}

// faultValue applies a narwhal_chaos value (R-CHAOS-1): key
// <engine_id>.<fault_id>.
func (s *state) faultValue(key string, value []byte) {
	if value == nil {
		s.applyFault(key, nil)
		return
	}
	var f chaosFault
	if len(value) > maxValue || json.Unmarshal(value, &f) != nil || f.EngineID+"."+f.ID != key {
		s.refuse()
		return
	}
	params := make([]string, 0, len(f.Params))
	for k, v := range f.Params {
		params = append(params, k+"="+v)
	}
	slices.Sort(params)
	s.applyFault(key, &faultView{
		EngineID: clip(f.EngineID, maxID), FaultID: clip(f.ID, maxID), Fault: clip(f.Name, maxID),
		Phase: clip(f.Phase, maxID), Probability: f.Probability, Count: f.Count, Left: f.Left,
		Params: clip(strings.Join(params, " "), maxText), Expires: f.Expires,
	})
}

// eventIDs are the envelope fields an event's subject carries.
type eventIDs struct {
	EngineID string `json:"engine_id"`
	RouterID string `json:"router_id"`
}

// receiveEvent applies one event of kind received on subject, unless it
// is not a valid event or its payload contradicts its subject (another
// router's id, an old four-token subject of a router's kind, another
// engine: behaviour.md R-BUS-11); those are refused, counted in the
// page's ignored count and not shown.
func (s *state) receiveEvent(kind, subject string, payload []byte) {
	var ids eventIDs
	if bus.ValidateEvent(payload) != nil || json.Unmarshal(payload, &ids) != nil ||
		schemas.EventSubjectMismatch(subject, ids.EngineID, ids.RouterID) != "" {
		s.refuse()
		return
	}
	s.applyEvent(kind, payload)
}

// follow applies every event of kind from start until ctx ends, setting
// its consumer up again when it cannot be made; across a reconnect it
// resumes after the last event it applied (bus.SubscribeResuming), so the
// page misses nothing the stream still holds.
func follow(ctx context.Context, b *bus.Bus, kind schemas.EventKind, start bus.SubscribeOptions, st *state, log *slog.Logger) {
	start.Filter = kind.Filter()
	warned := false
	for ctx.Err() == nil {
		stop, err := bus.SubscribeResuming(ctx, b, start, func(subject string, payload []byte) {
			st.receiveEvent(kind.Name, subject, payload)
		}, func(r bus.Resumption) {
			if r.Lost > 0 {
				log.Warn("dashboard: events lost across a reconnect (removed by the stream's retention)", "kind", kind.Name, "lost", r.Lost)
			}
		})
		if err == nil {
			<-ctx.Done()
			stop()
			return
		}
		if ctx.Err() != nil {
			return // stopped while the consumer was being made: no news
		}
		if !warned {
			log.Warn("dashboard: event consumer could not be made; retrying", "kind", kind.Name, "err", err)
			warned = true
		}
		if !pause.For(ctx, watchRetry) {
			return
		}
	}
}
