package router

import (
	"context"
	"encoding/json"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// meshResyncPoll is how often the router checks its bus connection to
// resynchronise placement after a reconnect (R-BUS-6).
const meshResyncPoll = 250 * time.Millisecond

// JoinMesh makes the router a member of the mesh on b (SPEC §9):
//
//   - it reads the whole narwhal_placement bucket, then watches it, and
//     applies each engine's eligibility as it changes — a push, well within
//     the second R-BRK-8 allows (R-BUS-2);
//   - it applies quarantine events published by other routers as they
//     arrive (R-QUAR-1);
//   - when the bus goes away it keeps serving on the last known placement
//     and its own quarantines, and after a reconnect it reads the bucket
//     again (R-BUS-6).
//
// The goroutines it starts belong to the router and stop at Shutdown.
// JoinMesh waits until the initial placement is loaded or wait passes
// (the router then serves on "everyone eligible" until it is); it returns
// an error only when the quarantine subscription cannot be made.
func (rt *Router) JoinMesh(b *bus.Bus, wait time.Duration) error {
	rt.meshBus = b
	sub, err := b.Conn().Subscribe(bus.SubjectPrefix+schemas.KindQuarantine+".>", rt.applyQuarantine)
	if err != nil {
		return err
	}
	loaded := make(chan struct{})
	rt.wg.Add(1)
	go func() {
		defer rt.wg.Done()
		defer sub.Unsubscribe()
		rt.placementLoop(b, loaded)
	}()
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-loaded:
	case <-t.C:
		rt.log.Warn("placement not loaded yet; serving with every engine eligible until it is")
	}
	return nil
}

// PlacementLoaded reports whether the router has read the placement bucket
// at least once.
func (rt *Router) PlacementLoaded() bool { return rt.placementLoaded.Load() }

// meshReady is the bus half of /readyz: the bus is reachable, or the
// router runs on a placement it loaded before (R-API-2, R-BUS-6).
func (rt *Router) meshReady() bool {
	if rt.meshBus == nil {
		return true
	}
	return rt.meshBus.Connected() || rt.placementLoaded.Load()
}

// placementLoop keeps a watch on the placement bucket open, starting a new
// one (a full resync) after every reconnect, until the router shuts down.
func (rt *Router) placementLoop(b *bus.Bus, loaded chan struct{}) {
	signal := func() {
		if loaded != nil {
			close(loaded)
			loaded = nil
		}
	}
	defer signal()
	for rt.base.Err() == nil {
		if !b.Connected() {
			if !rt.sleep(meshResyncPoll) {
				return
			}
			continue
		}
		ctx, cancel := context.WithCancel(rt.base)
		w, err := b.Placement().WatchAll(ctx)
		if err != nil {
			cancel()
			rt.log.Warn("placement watch failed", "err", err)
			if !rt.sleep(meshResyncPoll) {
				return
			}
			continue
		}
		rt.watchPlacement(w, signal)
		_ = w.Stop()
		cancel()
		if !rt.sleep(meshResyncPoll / 5) { // no hot loop if a watch keeps ending
			return
		}
	}
}

// watchPlacement applies updates until the connection drops (then returns,
// so the caller resyncs) or the router shuts down.
func (rt *Router) watchPlacement(w jetstream.KeyWatcher, loaded func()) {
	tick := time.NewTicker(meshResyncPoll)
	defer tick.Stop()
	wasDown := false
	for {
		select {
		case <-rt.base.Done():
			return
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			if e == nil { // the initial values are all delivered
				rt.placementLoaded.Store(true)
				loaded()
				continue
			}
			rt.applyPlacement(e)
		case <-tick.C:
			up := rt.meshBus.Conn().Status() == nats.CONNECTED
			if !up {
				wasDown = true
			} else if wasDown {
				rt.log.Info("bus back: resynchronising placement")
				return
			}
		}
	}
}

// applyPlacement applies one entry of narwhal_placement. A deleted or
// purged key, or a value that is not an eligibility object, makes the
// engine eligible (no verdict stands against it).
func (rt *Router) applyPlacement(e jetstream.KeyValueEntry) {
	eligible := true
	if e.Operation() == jetstream.KeyValuePut {
		var ev schemas.Eligibility
		if err := json.Unmarshal(e.Value(), &ev); err != nil {
			rt.log.Warn("bad placement entry", "engine_id", e.Key(), "err", err)
		} else {
			eligible = ev.Eligible
		}
	}
	if rt.SetEligible(e.Key(), eligible) {
		rt.log.Info("placement", "engine_id", e.Key(), "eligible", eligible)
	}
}

// applyQuarantine applies another router's quarantine event (R-QUAR-1).
func (rt *Router) applyQuarantine(m *nats.Msg) {
	var q schemas.Quarantine
	if err := json.Unmarshal(m.Data, &q); err != nil || q.EngineID == "" {
		return
	}
	if q.RouterID == rt.id {
		return // ours, applied when it was made
	}
	until := q.Until
	if max := time.Now().Add(time.Duration(q.DurationSeconds * float64(time.Second))); until.After(max) {
		until = max // never trust a skewed clock beyond the stated duration
	}
	if rt.Quarantine(q.EngineID, until) {
		rt.log.Info("quarantine from another router", "engine_id", q.EngineID, "router", q.RouterID, "until", until)
	}
}

// sleep waits d unless the router shuts down; it reports whether to go on.
func (rt *Router) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-rt.base.Done():
		return false
	}
}
