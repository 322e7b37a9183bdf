// Package meshview is a router's view of the mesh (behaviour.md §9,
// §9a): which engines are in the fleet (the config file's, then the live
// fleet's bucket narwhal_fleet), what the breakers' leader says of each
// (the placement bucket narwhal_placement, checked against the leader
// lease), the other routers' quarantines, what each engine serves and
// whether it accepts the router's credentials (its /v1/models), its load
// (this router's reservations and the engine's own queue), and the
// prefix index shared with the other routers.
//
// The request path reads the view — View.Fleet, each Member's
// eligibility (Member.Takes), load and reservations, the prefix index's
// matches — and writes only its own: the slots it reserves and releases,
// the prompt blocks it placed (View.RecordPrefix), what a fault tells
// (a back-off, a quarantine, a refusal of credentials). Everything else
// is written here, by the watches of the bus and the engines. This
// package never imports the router.
package meshview

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/prefix"
)

// Options configures a View.
type Options struct {
	// Config is the router's validated configuration (required): its
	// fleet is the view's first, and it gives the router id,
	// recovery.max_quarantine_s and the placement section (the prefix
	// index's size, share_index, engine_metrics_interval_s).
	Config *config.Config
	// Logger is the router's logger; nil means slog.Default().
	Logger *slog.Logger
	// Registry receives the view's metrics; nil means a new registry.
	Registry prometheus.Registerer
	// HTTPClient reads the engines' /v1/models and /metrics; nil means
	// http.DefaultClient.
	HTTPClient *http.Client
	// Context is the owner's life: every loop of the view ends with it.
	// Nil means one that never ends.
	Context context.Context
	// Go runs fn in a goroutine its owner waits for at its end, or runs
	// nothing and returns false once the owner is ending (the router's
	// own goroutines, which its Shutdown waits for). Nil runs every fn in
	// a plain goroutine.
	Go func(fn func()) bool
	// KeepsIndex says the placement policy records prompts in the prefix
	// index (R-PLACE-2): the view then shares the index with the other
	// routers (placement.share_index) and keeps it true to the engines'
	// caches (enginewatch.go).
	KeepsIndex bool
	// ModelRefresh is how often each engine's /v1/models is read again;
	// 0 means 30 s. An engine the router cannot place on is asked every
	// second.
	ModelRefresh time.Duration
	// Joined, when set, is called for each engine that joins the fleet
	// after New (the owner's per-engine series).
	Joined func(*Member)
	// Left, when set, is called with the id of each engine that leaves
	// the fleet (removed from the live fleet, its key lapsed), once the
	// fleet no longer holds it: the owner deletes every series labelled
	// with it (behaviour.md R-FLEET-5). It runs off the request path, with
	// the fleet's changes held back until it returns.
	Left func(id string)
	// Listed, when set, is called with every model an engine lists (the
	// owner's per-model series).
	Listed func(model string)
}

// View is one router's view of the mesh. Create it with New, make it
// follow the mesh with Join (the bus) and Start (the engines). Its
// methods are safe for concurrent use.
type View struct {
	cfg        *config.Config
	id         string
	log        *slog.Logger
	reg        prometheus.Registerer
	http       *http.Client
	base       context.Context
	goFn       func(func()) bool
	keepsIndex bool
	refresh    time.Duration
	joined     func(*Member)
	left       func(string)
	listed     func(string)
	metrics    *metrics

	live  atomic.Pointer[Fleet] // the fleet as of now; replaced whole on a change (membership.go)
	index *prefix.Index
	// exact is the exact index of the blocks the engines report they
	// hold (R-PLACE-4), nil under placement.index approximate or a
	// policy that keeps no index.
	exact  *prefix.ExactIndex
	placed atomic.Pointer[PlacedFunc]
	// loads is the load exchange while the router shares it (nil
	// before, or without placement.share_index): SharePlaced publishes
	// through it.
	loads atomic.Pointer[loadShare]
	// warmLimit bounds each warm-up of the shared index
	// (shareWarmTimeout; a test may set it before Join).
	warmLimit time.Duration
	tokens    tokenTable // per model: bytes per token, mean uncached prefill (correction.go)

	// fleetMu orders changes of the fleet's membership (the live fleet's
	// watch) against verdicts for engines not (yet) in it (the placement
	// watch); it guards knownEligible. Placement never takes it.
	fleetMu sync.Mutex
	// knownEligible is the latest valid placement verdict of every key of
	// narwhal_placement, members or not, so that an engine that joins
	// starts with its verdict.
	knownEligible map[string]bool
	// fleetIgnoredLogged holds the keys of narwhal_fleet whose ignored
	// value was logged (membership.go), until a valid one arrives.
	fleetIgnoredLogged map[string]bool

	meshBus         atomic.Pointer[bus.Bus] // set by Join, read by Ready
	placementLoaded atomic.Bool
}

// New builds the view of the fleet of opts.Config, every engine
// eligible and active until the mesh says otherwise, and registers its
// metrics. It returns an error when an engine's connector is unknown
// (nothing is registered then).
func New(opts Options) (*View, error) {
	cfg := opts.Config
	configured, err := fleet.Engines(cfg.Fleet)
	if err != nil {
		return nil, err
	}
	v := &View{
		cfg:                cfg,
		warmLimit:          shareWarmTimeout,
		id:                 cfg.Router.ID,
		log:                opts.Logger,
		reg:                opts.Registry,
		http:               opts.HTTPClient,
		base:               opts.Context,
		goFn:               opts.Go,
		keepsIndex:         opts.KeepsIndex,
		refresh:            opts.ModelRefresh,
		joined:             opts.Joined,
		left:               opts.Left,
		listed:             opts.Listed,
		index:              prefix.NewIndex(cfg.Placement.PrefixIndexBlocks),
		knownEligible:      map[string]bool{},
		fleetIgnoredLogged: map[string]bool{},
	}
	if v.keepsIndex && cfg.Placement.Index != config.IndexApproximate {
		v.exact = prefix.NewExactIndex(cfg.Placement.PrefixIndexBlocks)
	}
	if v.log == nil {
		v.log = slog.Default()
	}
	if v.reg == nil {
		v.reg = prometheus.NewRegistry()
	}
	if v.http == nil {
		v.http = http.DefaultClient
	}
	if v.base == nil {
		v.base = context.Background()
	}
	if v.goFn == nil {
		v.goFn = func(fn func()) bool { go fn(); return true }
	}
	if v.refresh <= 0 {
		v.refresh = 30 * time.Second
	}
	members := make([]*Member, len(configured))
	for i, e := range configured {
		m := NewMember(e, cfg.Fleet[i].FleetEntry(cfg.Router.ID, time.Now()), true)
		m.fromConfig = true
		members[i] = m
	}
	v.live.Store(NewFleet(members...))
	v.metrics = newMetrics(v.reg, v.Fleet, v.index, v.exact)
	for _, m := range members {
		v.metrics.initEngine(m)
	}
	return v, nil
}

// errShuttingDown is returned by what may not start once the owner is
// ending (Options.Go refused).
var errShuttingDown = errors.New("router: shutting down")

// Fleet returns the fleet as of now: a snapshot that the live fleet's
// watch replaces whole on a change (R-FLEET-1).
func (v *View) Fleet() *Fleet { return v.live.Load() }

// PlacedFunc receives, after each prefix placement, the producer's
// engine id and the prompt's block hashes, what the other routers Learn
// (behaviour.md R-PLACE-2): all of them, not only those the router's
// index lacked for the engine — a Learn of blocks a router holds makes
// them the most recent, so every router's index ages a prompt that is
// placed again and again as this one does, instead of evicting it as
// unused while the engine serves it. It runs on the request path: it
// must not block, and must copy the hashes to keep them (the slice is
// reused).
type PlacedFunc func(engineID string, hashes []uint64)

// OnPlaced sets the function that receives each prefix placement's
// block hashes (for publishing them on the bus); nil removes it.
func (v *View) OnPlaced(fn PlacedFunc) {
	if fn == nil {
		v.placed.Store(nil)
		return
	}
	v.placed.Store(&fn)
}

// PrefixIndex returns the router's prefix index: what the mesh's other
// routers placed is applied to it with Learn, and an engine whose cache
// is gone (ejected, drained, restarted) is dropped from it with Drop.
func (v *View) PrefixIndex() *prefix.Index { return v.index }

// MatchPrefix returns how many leading blocks of hashes the prefix index
// holds for engine engineID (prefix.Index.Match, R-PLACE-2).
func (v *View) MatchPrefix(engineID string, hashes []uint64) int {
	return v.index.Match(engineID, hashes)
}

// ExactIndex returns the router's exact index (behaviour.md R-PLACE-4),
// nil when the router keeps none (placement.index approximate, or a
// policy that keeps no index).
func (v *View) ExactIndex() *prefix.ExactIndex { return v.exact }

// IndexMode returns placement.index (config.IndexAuto, IndexExact or
// IndexApproximate; approximate when the router keeps no exact index).
func (v *View) IndexMode() string {
	if v.exact == nil {
		return config.IndexApproximate
	}
	return v.cfg.Placement.Index
}

// MatchExact returns the leading blocks of keys, a prompt's chain of
// token-block keys at the engine's block size (ExactBlockSize), that
// engine engineID reports it holds, and whether its exact index is exact
// (R-PLACE-4); false when the router keeps no exact index. It does not
// allocate.
func (v *View) MatchExact(engineID string, keys []uint64) (prefix.ExactMatch, bool) {
	if v.exact == nil {
		return prefix.ExactMatch{}, false
	}
	return v.exact.Match(engineID, keys)
}

// ExactBlockSize returns engine engineID's tokens per KV block as its KV
// batches say, and whether its exact index is exact (0, false when it
// is not, or the router keeps none).
func (v *View) ExactBlockSize(engineID string) (int, bool) {
	if v.exact == nil {
		return 0, false
	}
	e := v.exact.Lookup(engineID)
	if e == nil || !e.Exact() {
		return 0, false
	}
	return e.BlockSize(), true
}

// RecordPrefix records that the prompt of hashes was placed on engine
// engineID (prefix.Index.Learn: the same placement the other routers
// apply) and hands hashes to the OnPlaced function, if any (R-PLACE-2).
// It does not allocate.
func (v *View) RecordPrefix(engineID string, hashes []uint64) {
	v.index.Learn(engineID, hashes)
	if fn := v.placed.Load(); fn != nil && len(hashes) > 0 {
		(*fn)(engineID, hashes)
	}
}

// SetEligible applies the breaker's verdict for an engine (R-BRK-8). It
// returns false for an engine not in the fleet.
func (v *View) SetEligible(engineID string, eligible bool) bool {
	m := v.Fleet().Member(engineID)
	if m != nil {
		m.SetEligible(eligible)
	}
	return m != nil
}

// Quarantine keeps an engine out of this router's placement until until
// (R-QUAR-1). It returns false for an engine not in the fleet.
func (v *View) Quarantine(engineID string, until time.Time) bool {
	m := v.Fleet().Member(engineID)
	if m != nil {
		m.Quarantine(until)
	}
	return m != nil
}

// SetEngineWaiting records engineID's own queue (vLLM's
// num_requests_waiting, as last read from the engine) for placement: the
// prefix policy weighs it with the router's outstanding attempts. n < 0
// is taken as 0. Unknown engines are ignored.
func (v *View) SetEngineWaiting(engineID string, n int64) {
	if m := v.Fleet().Member(engineID); m != nil {
		m.SetWaiting(n)
	}
}

// PlacementLoaded reports whether the view has read the placement bucket
// at least once.
func (v *View) PlacementLoaded() bool { return v.placementLoaded.Load() }

// Ready is the bus half of /readyz: the view has not joined a mesh, the
// bus is reachable, or the view holds a placement it loaded before
// (R-API-2, R-BUS-6).
func (v *View) Ready() bool {
	b := v.meshBus.Load()
	if b == nil {
		return true
	}
	return b.Connected() || v.placementLoaded.Load()
}

// Start starts the view's watches of the engines, which run until the
// owner's context ends: every engine's /v1/models read again every
// ModelRefresh (every second while the router cannot place on it,
// models.go), and, when the view keeps the prefix index, its check
// against the fleet and the engines' /metrics read every
// placement.engine_metrics_interval_s (enginewatch.go). It returns false
// when the owner is ending (Options.Go refused).
func (v *View) Start() bool {
	if !v.goFn(v.refreshLoop) {
		return false
	}
	return !v.keepsIndex || v.goFn(func() { newEngineWatch(v).run(v.cfg.Placement.EngineMetricsInterval()) })
}

// sleep waits d unless the owner's context ends; it reports whether to
// go on.
func (v *View) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-v.base.Done():
		return false
	}
}
