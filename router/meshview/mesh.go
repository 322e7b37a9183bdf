package meshview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Tuning of the placement watch (R-BUS-2, R-BUS-10).
const (
	// watchHeartbeat is the idle heartbeat of the placement watch's
	// consumer (the server's minimum): the server sends one while there is
	// nothing to deliver, and a watch that misses two (its consumer or the
	// server holding it is gone) is replaced at once, so a dead watch is
	// noticed within 2 × watchHeartbeat = 1 s even while the connection
	// lives elsewhere. A watch on the connection's own server ends sooner:
	// the reconnect restarts it.
	watchHeartbeat = 500 * time.Millisecond
	// watchExpiry is how long one pull of the watch waits.
	watchExpiry = 5 * time.Second
	// watchRetry is the pause before a failed watch is set up again.
	watchRetry = 100 * time.Millisecond
	// watchSetupTimeout bounds the creation of the watch's consumer.
	watchSetupTimeout = 2 * time.Second
	// watchCheck is how often the router reads its watch's consumer back
	// (bounded by watchCheck as well): a client that may read the bucket
	// may also update a consumer whose name it learns (JetStream lets
	// consumer names be listed and consumers be updated by name), e.g. to
	// a filter that matches nothing — heartbeats still come, so only
	// reading the consumer shows it. A consumer that is gone or is not
	// the watch's any more is replaced like a dead watch (R-BUS-9,
	// R-BRK-8).
	watchCheck = 500 * time.Millisecond
	// watchInactive is how long the server keeps a consumer nobody pulls
	// from (one left behind by a dead connection).
	watchInactive = 10 * time.Second
	// leaseRefreshMin is the least time between two reads of the leader
	// lease caused by placement values naming another term.
	leaseRefreshMin = 50 * time.Millisecond
	// pendingRecheckMin and pendingRecheckMax bound the pause between two
	// reads of the lease while a placement value waits for it (see
	// mesh.pending): the first comes after pendingRecheckMin, each next
	// after twice the last, at most pendingRecheckMax, so a lagging
	// replica's stale lease delays a new leader's value by well under the
	// second R-BRK-8 allows, and a forged value that never becomes valid
	// costs one lease read per pendingRecheckMax.
	pendingRecheckMin = 50 * time.Millisecond
	pendingRecheckMax = 500 * time.Millisecond
	// bridgePoll is how often a router whose placement watch is being
	// set up again reads each fleet engine's key directly (see
	// mesh.bridge), and bridgeGetTimeout bounds one such read.
	bridgePoll       = 200 * time.Millisecond
	bridgeGetTimeout = 500 * time.Millisecond
	// maxPlacementValue is the largest placement value a router reads;
	// a larger one is ignored as invalid.
	maxPlacementValue = 4096
)

// Reasons a placement value is ignored: the reason label of
// narwhal_placement_ignored_total (R-BUS-9).
const (
	// ignoredInvalid: not a placement value (not JSON, not schema-valid,
	// too large, or for another key).
	ignoredInvalid = "invalid"
	// ignoredNotLeader: schema-valid, but not written by the current
	// lease holder in its term.
	ignoredNotLeader = "not_leader"
	// ignoredDeleted: the key was deleted or purged, which no breaker
	// does; the engine keeps its state.
	ignoredDeleted = "deleted"
)

// mesh is the placement watch's state: the leader lease it checks
// placement values against, and which keys' ignored values it has logged.
// Used by the placement loop's goroutine only, except where noted.
type mesh struct {
	bus   *bus.Bus
	lease bus.Lease // the current lease as last read; zero when unknown
	// leaseKV is bucket narwhal_breaker, bound on first use.
	leaseKV     jetstream.KeyValue
	leaseReadAt time.Time
	// logged holds the keys whose ignored value was logged, until a valid
	// value arrives for the key.
	logged map[string]bool
	// pending holds, per key, the latest value that was ignored because
	// it names a newer lease term than the lease as read — which a lagging
	// replica of the lease bucket can serve after a new leader took over,
	// while that leader's values already arrive. The lease is read again
	// (see pendingRecheckMin) while any value is pending, and each pending
	// value is applied once the lease confirms its writer and term; a
	// later value for its key, or a lease beyond its term, drops it. At
	// most one per key of the fleet.
	pending map[string]schemas.Eligibility
	// recheckDelay is the pause before the next read of the lease for the
	// pending values; 0 when none is scheduled.
	recheckDelay time.Duration
	// bridged holds, per key, the revision of the last value a direct read
	// found while the watch was being set up again (see bridge), so that
	// each value is judged once.
	bridged map[string]uint64
}

// Join makes the view follow the mesh on b (behaviour.md §9):
//
//   - it reads the whole narwhal_placement bucket, then watches it, and
//     applies each engine's eligibility as it changes — a push, well within
//     the second R-BRK-8 allows (R-BUS-2) — but only values that are
//     schema-valid and written by the current holder of the breakers'
//     leader lease in its term; anything else is ignored, logged once per
//     key and counted in narwhal_placement_ignored_total, and the engine
//     keeps its state (R-BUS-9); a value naming a newer lease term than
//     the lease as read (a lagging replica served an old one) is kept and
//     applied once a new read of the lease confirms it;
//   - the watch's consumer sends idle heartbeats: when two are missed (the
//     NATS server holding it died while the connection lived elsewhere)
//     or the connection comes back, it is set up again and the whole
//     bucket read anew; until the new watch exists — its creation waits
//     for the JetStream API, which may take seconds after a node loss —
//     the router reads each fleet engine's key directly every 200 ms
//     (R-BUS-10, R-BRK-8);
//   - it applies quarantine events published by other routers as they
//     arrive, never for longer than recovery.max_quarantine_s (R-QUAR-1,
//     R-BUS-9), read from stream NARWHAL_EVENTS through an ordered
//     consumer of its own, never through a core subscription: a forged
//     push delivery on an event subject does not reach it (R-BUS-11;
//     followQuarantines);
//   - when the bus goes away it keeps serving on the last known placement
//     and its own quarantines (R-BUS-6);
//   - it watches the live fleet, KV bucket narwhal_fleet, and applies
//     each engine's arrival, state change and removal on arrival
//     (R-FLEET-1…3; membership.go), and writes its in-flight report to
//     narwhal_routers every second (R-FLEET-3);
//   - when it keeps the prefix index (Options.KeepsIndex: the prefix
//     policy) and placement.share_index is on, it shares the
//     prefix index with the other routers: it publishes its placements
//     and applies theirs, and warms the index from the recent past
//     (R-PLACE-2; prefixshare.go).
//
// The goroutines it starts are the owner's (Options.Go) and stop when its
// context ends. Join waits until the initial placement is loaded or wait
// passes (the router then serves on "everyone eligible" until it is); it
// returns an error when the prefix index cannot be shared (shareIndex), or
// errShuttingDown once the owner is ending (nothing is then started).
func (v *View) Join(b *bus.Bus, wait time.Duration) error {
	v.meshBus.Store(b)
	m := &mesh{bus: b, logged: map[string]bool{}, pending: map[string]schemas.Eligibility{}, bridged: map[string]uint64{}}
	loaded := make(chan struct{})
	fleetLoaded := make(chan struct{})
	var once sync.Once
	if !v.goFn(func() { v.placementLoop(m, loaded) }) {
		return errShuttingDown
	}
	v.followQuarantines(b)
	v.goFn(func() { v.watchFleet(b, func() { once.Do(func() { close(fleetLoaded) }) }) })
	v.goFn(func() { v.reportLoop(b) })
	if v.keepsIndex {
		if err := v.shareIndex(b); err != nil {
			return err
		}
		if err := v.shareLoad(b); err != nil {
			return err
		}
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-loaded:
	case <-t.C:
		v.log.Warn("placement not loaded yet; serving with every engine eligible until it is")
		return nil
	}
	select {
	case <-fleetLoaded:
	case <-t.C:
		v.log.Warn("live fleet not loaded yet; serving the config file's engines until it is")
	}
	return nil
}

// placementLoop keeps a watch on the placement bucket, setting up a new
// one (a full resync) whenever the last one died or the connection came
// back, until the router shuts down.
func (v *View) placementLoop(m *mesh, loaded chan struct{}) {
	signal := func() {
		if loaded != nil {
			close(loaded)
			loaded = nil
		}
	}
	defer signal()
	status := m.bus.Conn().StatusChanged(nats.CONNECTED)
	defer m.bus.Conn().RemoveStatusListener(status)
	first, failing := true, false
	for v.base.Err() == nil {
		if !m.bus.Connected() {
			if !v.sleep(watchRetry) {
				return
			}
			continue
		}
		why, err := v.watchPlacement(m, status, first, signal)
		switch {
		case v.base.Err() != nil, m.bus.CredentialRefused() != nil:
			return // revoked or refused for good: the router says so (R-BUS-11)
		case err != nil:
			if !failing {
				v.log.Warn("placement watch could not be set up; retrying", "err", err)
			}
			failing = true
			if !v.sleep(watchRetry) {
				return
			}
			continue
		}
		failing, first = false, false
		v.log.Warn("placement watch lost; re-establishing it and resynchronising", "why", why)
	}
}

// watchPlacement sets up one watch — an ephemeral consumer on the bucket's
// stream delivering the last value of every key, then every change —
// applies what it delivers, and returns why it ended (its heartbeats
// stopped, its consumer vanished, the connection came back), or the
// error that kept it from starting.
func (v *View) watchPlacement(m *mesh, status <-chan nats.Status, first bool, loaded func()) (string, error) {
	js := m.bus.JetStream()
	stream := "KV_" + bus.PlacementBucket
	cons, err := v.createWatch(m, stream, !first)
	if err != nil {
		return "", err
	}
	name := cons.CachedInfo().Name
	defer func() {
		// The next watch takes the name back (bus.OwnConsumer deletes
		// this one first); at shutdown, best effort: the server drops it
		// after watchInactive anyway.
		if v.base.Err() != nil {
			dctx, dcancel := context.WithTimeout(context.Background(), watchSetupTimeout)
			defer dcancel()
			_ = js.DeleteConsumer(dctx, stream, name)
		}
	}()
	start := time.Now()
	snapshot := cons.CachedInfo().NumPending
	seen := map[string]bool{}
	inSnapshot := true
	finish := func() {
		inSnapshot = false
		v.endSnapshot(seen)
		v.placementLoaded.Store(true)
		loaded()
		if first {
			v.log.Info("placement loaded", "keys", len(seen), "took", time.Since(start))
		} else {
			v.log.Info("placement resynchronised", "keys", len(seen), "took", time.Since(start))
		}
	}
	if snapshot == 0 {
		finish()
	}

	msgs := make(chan jetstream.Msg, 64)
	dead := make(chan error, 1)
	cc, err := cons.Consume(func(msg jetstream.Msg) {
		select {
		case msgs <- msg:
		case <-v.base.Done():
		}
	},
		jetstream.PullHeartbeat(watchHeartbeat),
		jetstream.PullExpiry(watchExpiry),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if errors.Is(err, jetstream.ErrNoHeartbeat) || errors.Is(err, jetstream.ErrConsumerDeleted) ||
				errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, nats.ErrConnectionClosed) {
				select {
				case dead <- err:
				default:
				}
			}
		}))
	if err != nil {
		return "", err
	}
	defer cc.Stop()
	// A reconnect that happened before this watch started is already
	// covered by it.
	for len(status) > 0 {
		<-status
	}
	recheck := time.NewTimer(time.Hour)
	recheck.Stop()
	defer recheck.Stop()
	check := time.NewTicker(watchCheck)
	defer check.Stop()
	var checking atomic.Bool      // a checkWatch is under way
	var recheckC <-chan time.Time // non-nil while a recheck is scheduled
	for {
		if len(m.pending) > 0 && recheckC == nil {
			m.recheckDelay = min(max(2*m.recheckDelay, pendingRecheckMin), pendingRecheckMax)
			recheck.Reset(m.recheckDelay)
			recheckC = recheck.C
		}
		select {
		case <-v.base.Done():
			return "shutdown", nil
		case err := <-dead:
			return err.Error(), nil
		case <-status:
			return "the connection came back", nil
		case <-check.C:
			if checking.CompareAndSwap(false, true) {
				go func() {
					defer checking.Store(false)
					v.checkWatch(cons, dead)
				}()
			}
		case <-recheckC:
			recheckC = nil
			m.readLease(v, true)
			v.applyPending(m)
			if len(m.pending) == 0 {
				m.recheckDelay = 0
			}
		case msg := <-msgs:
			key := v.applyPlacement(m, msg)
			if !inSnapshot {
				continue
			}
			if key != "" {
				seen[key] = true
			}
			if md, err := msg.Metadata(); err == nil && md.NumPending == 0 {
				finish()
			}
		}
	}
}

// watchFilter is the subject filter of the placement watch: every key.
const watchFilter = "$KV." + bus.PlacementBucket + ".>"

// watchTampered returns why info is not the placement watch's consumer as
// createWatch made it — another filter, headers only, paused — or "" when
// it is. Only settings a consumer update can change are compared.
func watchTampered(info *jetstream.ConsumerInfo) string {
	c := info.Config
	switch {
	case c.FilterSubject != watchFilter || len(c.FilterSubjects) > 0 && !(len(c.FilterSubjects) == 1 && c.FilterSubjects[0] == watchFilter):
		return fmt.Sprintf("its consumer was changed by another client (filter %q %q)", c.FilterSubject, c.FilterSubjects)
	case c.HeadersOnly:
		return "its consumer was changed by another client (headers only)"
	case info.Paused:
		return "its consumer was paused by another client"
	}
	return ""
}

// checkWatch reads the watch's consumer back (bounded by watchCheck) and
// reports on dead when it is gone or tampered with (watchTampered). Other
// errors — the JetStream API is slow after a node loss — are left to the
// heartbeats and the next check.
func (v *View) checkWatch(cons jetstream.Consumer, dead chan<- error) {
	ctx, cancel := context.WithTimeout(v.base, watchCheck)
	defer cancel()
	info, err := cons.Info(ctx)
	var why error
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		why = err
	case err == nil:
		if t := watchTampered(info); t != "" {
			why = errors.New(t)
		}
	}
	if why != nil {
		select {
		case dead <- why:
		default:
		}
	}
}

// createWatch creates the placement watch's consumer. Creating it takes
// the JetStream API, which after the loss of a node may not answer for
// seconds (its meta leader is being elected) while the bucket itself
// already serves reads and takes the breaker's writes. So when bridge is
// set (the watch is being set up again, not the first time) it reads every
// fleet engine's key directly meanwhile, every bridgePoll, and applies what
// changed (mesh.bridge), keeping R-BRK-8's second across a node loss.
func (v *View) createWatch(m *mesh, stream string, bridge bool) (jetstream.Consumer, error) {
	type created struct {
		cons jetstream.Consumer
		err  error
	}
	done := make(chan created, 1)
	go func() {
		ctx, cancel := context.WithTimeout(v.base, watchSetupTimeout)
		defer cancel()
		cons, err := bus.OwnConsumer(ctx, m.bus.JetStream(), stream, jetstream.ConsumerConfig{
			Name:              m.bus.ConsumerName(bus.PurposePlacement), // its own name (R-BUS-11)
			Description:       "placement watch of router " + v.id,
			DeliverPolicy:     jetstream.DeliverLastPerSubjectPolicy,
			AckPolicy:         jetstream.AckNonePolicy,
			FilterSubject:     watchFilter,
			MemoryStorage:     true,
			Replicas:          1,
			InactiveThreshold: watchInactive,
		})
		done <- created{cons, err}
	}()
	if !bridge {
		r := <-done
		return r.cons, r.err
	}
	v.bridge(m)
	poll := time.NewTicker(bridgePoll)
	defer poll.Stop()
	for {
		select {
		case r := <-done:
			return r.cons, r.err
		case <-poll.C:
			v.bridge(m)
		}
	}
}

// bridge reads each fleet engine's key of the placement bucket directly
// (a direct get, served by any replica of the bucket without the JetStream
// API's leader) and applies each value it has not judged before, with the
// same checks as the watch's (R-BUS-9). A key that cannot be read keeps
// its state.
func (v *View) bridge(m *mesh) {
	kv := m.bus.Placement()
	for _, mb := range v.Fleet().members {
		ctx, cancel := context.WithTimeout(v.base, bridgeGetTimeout)
		e, err := kv.Get(ctx, mb.ID)
		cancel()
		if err != nil || e.Revision() == m.bridged[mb.ID] {
			continue
		}
		m.bridged[mb.ID] = e.Revision()
		op := ""
		if e.Operation() != jetstream.KeyValuePut {
			op = "DEL"
		}
		if v.judgePlacement(m, mb.ID, op, e.Value()) {
			v.log.Info("placement read directly while the watch is set up again", "engine_id", mb.ID, "revision", e.Revision())
		}
	}
}

// endSnapshot makes every fleet engine without a key in a full read of
// the bucket eligible: no verdict stands against it (R-BUS-2).
func (v *View) endSnapshot(seen map[string]bool) {
	for _, mb := range v.Fleet().members {
		if !seen[mb.ID] {
			v.setEligibility(mb.ID, true, "no placement entry")
		}
	}
}

// applyPlacement applies one message of the bucket's stream and returns
// its key ("" when the subject is not a key of the bucket). A value is
// applied only when it is a schema-valid placement value for its key,
// written by the current lease holder in its term (R-BUS-9); otherwise,
// and for a deleted key, the engine keeps its state and the value is
// counted and logged once per key.
func (v *View) applyPlacement(m *mesh, msg jetstream.Msg) string {
	key, ok := cutKey(msg.Subject())
	if !ok {
		return ""
	}
	// A key of an engine not (yet) in the fleet is judged too: its
	// verdict is kept for when the engine joins (knownEligible).
	if md, err := msg.Metadata(); err == nil {
		m.bridged[key] = md.Sequence.Stream // judged; a bridge read skips it
	}
	v.judgePlacement(m, key, msg.Headers().Get("KV-Operation"), msg.Data())
	return key
}

// judgePlacement applies value, the latest of fleet engine key in the
// bucket (op is its KV-Operation header, "" for a put), when it is valid
// and written by the lease holder (see applyPlacement), and reports
// whether it did.
func (v *View) judgePlacement(m *mesh, key, op string, value []byte) bool {
	delete(m.pending, key) // the latest value of a key decides
	if op == "DEL" || op == "PURGE" {
		v.ignorePlacement(m, key, ignoredDeleted, "key "+op)
		return false
	}
	if len(value) > maxPlacementValue {
		v.ignorePlacement(m, key, ignoredInvalid, "value larger than 4096 bytes")
		return false
	}
	if err := bus.ValidatePlacement(value); err != nil {
		v.ignorePlacement(m, key, ignoredInvalid, err.Error())
		return false
	}
	var ev schemas.Eligibility
	if err := json.Unmarshal(value, &ev); err != nil || ev.EngineID != key {
		v.ignorePlacement(m, key, ignoredInvalid, "engine_id is not the key")
		return false
	}
	if !m.leader(v, ev.BreakerID, ev.LeaseTerm) {
		if ev.LeaseTerm > m.lease.Term {
			// Perhaps a lease newer than the one read (a lagging replica):
			// kept until the lease is read again.
			m.pending[key] = ev
			v.ignorePlacement(m, key, ignoredNotLeader, "written by "+ev.BreakerID+" in lease term "+strconv.FormatUint(ev.LeaseTerm, 10)+
				", newer than the lease read ("+m.lease.BreakerID+", term "+strconv.FormatUint(m.lease.Term, 10)+"); kept until the lease confirms it")
			return false
		}
		v.ignorePlacement(m, key, ignoredNotLeader, "written by "+ev.BreakerID+", not by the lease holder "+m.lease.BreakerID)
		return false
	}
	delete(m.logged, key)
	v.setEligibility(key, ev.Eligible, ev.Reason)
	return true
}

// applyPending applies each pending value (see mesh.pending) that the
// lease as read now confirms — its writer holds the lease in its term —
// and drops those the lease has gone beyond; the others stay pending
// (R-BUS-9, R-BRK-8).
func (v *View) applyPending(m *mesh) {
	for key, ev := range m.pending {
		switch {
		case m.lease.Term != 0 && ev.LeaseTerm == m.lease.Term && ev.BreakerID == m.lease.BreakerID:
			delete(m.pending, key)
			delete(m.logged, key)
			v.log.Info("placement value applied once the lease confirmed its writer", "engine_id", key, "breaker_id", ev.BreakerID, "lease_term", ev.LeaseTerm)
			v.setEligibility(key, ev.Eligible, ev.Reason)
		case ev.LeaseTerm <= m.lease.Term:
			delete(m.pending, key) // a term that has passed or was never this writer's
		}
	}
}

// ignorePlacement counts an ignored placement value and logs it, once per
// key until a valid value arrives for it (R-BUS-9).
func (v *View) ignorePlacement(m *mesh, key, reason, detail string) {
	v.metrics.placementIgnored.WithLabelValues(reason).Inc()
	if m.logged[key] {
		return
	}
	m.logged[key] = true
	v.log.Warn("placement value ignored; the engine keeps its state", "engine_id", key, "reason", reason, "detail", detail)
}

// setEligibility applies a verdict and logs it only when it changes the
// engine's eligibility on this router.
func (v *View) setEligibility(id string, eligible bool, reason string) {
	v.fleetMu.Lock()
	defer v.fleetMu.Unlock()
	v.knownEligible[id] = eligible
	mb, ok := v.Fleet().byID[id]
	if !ok {
		return
	}
	if mb.eligible.Swap(eligible) != eligible {
		v.log.Info("placement changed", "engine_id", id, "eligible", eligible, "reason", reason)
	}
}

// leader reports whether breakerID in term holds the lease. A value naming
// a newer term than the one last read makes it read the lease again: a new
// leader rewrites every entry right after taking the lease, and its values
// may arrive before the router has read the new lease. A lease read that
// changes the term also settles the pending values (applyPending).
func (m *mesh) leader(v *View, breakerID string, term uint64) bool {
	if m.lease.Term == 0 || term > m.lease.Term {
		known := m.lease.Term
		m.readLease(v, term > m.lease.Term)
		if m.lease.Term != known {
			v.applyPending(m)
		}
	}
	return m.lease.Term != 0 && term == m.lease.Term && breakerID == m.lease.BreakerID
}

// readLease reads the leader lease; unless newer (a value names a newer
// term than the one known), at most every leaseRefreshMin. A lease that
// cannot be read (none is held right now, the bus is busy) leaves the last
// one known in place.
func (m *mesh) readLease(v *View, newer bool) {
	if !newer && time.Since(m.leaseReadAt) < leaseRefreshMin {
		return
	}
	m.leaseReadAt = time.Now()
	ctx, cancel := context.WithTimeout(v.base, watchSetupTimeout)
	defer cancel()
	if m.leaseKV == nil {
		kv, err := m.bus.JetStream().KeyValue(ctx, bus.LeaseBucket)
		if err != nil {
			return
		}
		m.leaseKV = kv
	}
	e, err := m.leaseKV.Get(ctx, bus.LeaseKey)
	if err != nil {
		return
	}
	if l, ok := bus.LeaseOf(e); ok && l.Term >= m.lease.Term {
		m.lease = l
	}
}

// cutKey returns the key of a subject $KV.narwhal_placement.<key>.
func cutKey(subject string) (string, bool) {
	const prefix = "$KV." + bus.PlacementBucket + "."
	if len(subject) <= len(prefix) || subject[:len(prefix)] != prefix {
		return "", false
	}
	return subject[len(prefix):], true
}

// followQuarantines reads the other routers' quarantine events from
// stream NARWHAL_EVENTS (filter narwhal.events.quarantine.>) through an
// ordered, ephemeral consumer of the router's own, and applies each as it
// is stored (applyQuarantine; behaviour.md R-QUAR-1, R-BUS-11). Events,
// not core subscriptions: nats-server does not check a push consumer's
// deliver subject against its creator's publish permissions, so any
// credential that reads some stream could deliver a copy of its own
// message to narwhal.events.quarantine.<engine>.<another router>, where
// a core subscription would take it for that router's event; the stream
// stores only what was published on its subjects, under the subject it
// was published on, which the router's credential checks.
//
// It starts at the events stored in the last recovery.max_quarantine_s
// before Join, so that a router that starts (or joins late) applies the
// quarantines still running — each for what is left of it, as
// applyQuarantine bounds it — and misses none published while its
// consumer is being made. It follows across reconnects and the loss of
// the consumer without skipping (bus.SubscribeResuming). When the
// consumer cannot be made at once (the bus is not there yet) it tries
// again every watchRetry in a goroutine of the owner, logging once, from
// the same start.
func (v *View) followQuarantines(b *bus.Bus) {
	opts := bus.SubscribeOptions{
		Filter: bus.SubjectPrefix + schemas.KindQuarantine + ".>",
		Since:  time.Now().Add(-v.cfg.Recovery.MaxQuarantine()),
		// Its own name (R-BUS-11).
		Consumer: b.ConsumerName(bus.PurposeQuarantine),
	}
	stop, err := bus.SubscribeResuming(v.base, b, opts, v.applyQuarantine, nil)
	if err == nil {
		if !v.goFn(func() { <-v.base.Done(); stop() }) { // stop waits for applyQuarantine
			stop()
		}
		return
	}
	v.log.Warn("quarantine events not followed yet; retrying", "err", err)
	v.goFn(func() {
		for v.sleep(watchRetry) {
			stop, err := bus.SubscribeResuming(v.base, b, opts, v.applyQuarantine, nil)
			if err == nil {
				<-v.base.Done()
				stop()
				return
			}
		}
	})
}

// applyQuarantine applies another router's quarantine event (R-QUAR-1):
// until its "until", but never longer than its duration_s from arrival (a
// skewed clock cannot stretch it) nor than recovery.max_quarantine_s (a
// hostile one cannot either, R-BUS-9). Malformed events are ignored; an
// event whose payload contradicts its subject (another router's id, an old
// four-token subject, another engine) is ignored and counted in
// narwhal_quarantine_events_ignored_total (R-BUS-11).
func (v *View) applyQuarantine(subject string, payload []byte) {
	var q schemas.Quarantine
	if err := json.Unmarshal(payload, &q); err != nil || q.EngineID == "" {
		return
	}
	if why := schemas.EventSubjectMismatch(subject, q.EngineID, q.RouterID); why != "" {
		v.metrics.quarantineIgnored.WithLabelValues(why).Inc()
		return // one router speaking for another, or an old shape (R-BUS-11)
	}
	if q.RouterID == v.id {
		return // ours, applied when it was made
	}
	d := q.DurationSeconds
	if math.IsNaN(d) || d <= 0 {
		return
	}
	limit := v.cfg.Recovery.MaxQuarantine() // validated > 0
	now := time.Now()
	until := q.Until
	bound := now.Add(limit)
	if d < limit.Seconds() {
		bound = now.Add(time.Duration(d * float64(time.Second)))
	}
	if until.After(bound) {
		until = bound
	}
	if v.Quarantine(q.EngineID, until) {
		v.log.Info("quarantine from another router", "engine_id", q.EngineID, "router", q.RouterID, "until", until)
	}
}
