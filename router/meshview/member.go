package meshview

import (
	"slices"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Phase is a leg's phase; it indexes a member's per-phase state.
type Phase int

// The two phases of an attempt.
const (
	// Prefill is the producer's leg.
	Prefill Phase = iota
	// Decode is the consumer's leg.
	Decode
)

// String returns the phase as events and metrics name it: "prefill" or
// "decode".
func (p Phase) String() string {
	if p == Prefill {
		return schemas.PhasePrefill
	}
	return schemas.PhaseDecode
}

// Member is one engine of the fleet with its live placement state as
// this router sees it. All mutable state is atomic: placement reads it
// without a lock (behaviour.md R-OWN-3: no global lock on the placement
// path). The view's watches write the mesh's verdicts (SetEligible,
// SetEntry, SetModels, a quarantine from another router); the request
// path reads them and writes only its own: the slots it reserves and
// releases, a back-off or quarantine after a fault.
type Member struct {
	engines.Engine
	// limit is the slot limit per phase (0 = none, R-OWN-3).
	limit [2]int64
	// reserved is the number of reserved slots per phase.
	reserved [2]atomic.Int64
	// tokens is the estimated uncached prefill tokens of this router's
	// producer attempts in flight on the engine, reserved with their
	// prefill slot and released with it (behaviour.md R-PLACE-3).
	tokens atomic.Int64
	// peerReserved and peerTokens are the same counts summed over the
	// other routers heard from within the last second (the load
	// exchange, loadshare.go; R-PLACE-3).
	peerReserved [2]atomic.Int64
	peerTokens   atomic.Int64
	// headBusy is the UnixNano moment this router's first prefill slot
	// there was reserved while none was (it counts while one is held),
	// headEnd the moment the last of its prefills there ended; 0 before
	// any. The prefill the engine computes began at the later of the
	// mesh's last end and the earliest busy start of a router with work
	// there (headStart). headMean is the mean time, in nanoseconds, from
	// that start to the end of a prefill of this router's that answered
	// (PrefillEnded), headTokens the mean of those prefills' reserved
	// tokens; 0 until one is seen (behaviour.md R-PLACE-3: the cost's
	// work ahead).
	headBusy   atomic.Int64
	headEnd    atomic.Int64
	headMean   atomic.Int64
	headTokens atomic.Int64
	// peerHeadBusy, peerHeadEnd, peerMean and peerMeanTokens are the
	// same as the other routers last reported them (the load exchange,
	// on this router's clock): the earliest busy start among those with
	// prefills in flight there, the latest end, and the mean of their
	// paces; 0 when none reported one.
	peerHeadBusy   atomic.Int64
	peerHeadEnd    atomic.Int64
	peerMean       atomic.Int64
	peerMeanTokens atomic.Int64
	// running is the engine's own running requests (vLLM's
	// num_requests_running) as last read, 0 when unknown.
	running atomic.Int64
	// legsAtRead is the mesh's legs in flight on the engine when its
	// /metrics was last read (SetRunning), what its waiting and running
	// counts then included of the mesh's own.
	legsAtRead atomic.Int64
	// uncorrected is set once the engine, as a producer, answered a
	// prefill without usage.prompt_tokens_details.cached_tokens: the
	// index's correction is off for it, said once in the log (R-PLACE-3).
	uncorrected atomic.Bool
	// series is the engine's per-engine series of the request path
	// (metrics.initEngine), nil until created.
	series atomic.Pointer[engineSeries]
	// eligible is the breaker's verdict (R-BRK-8); true until told
	// otherwise.
	eligible atomic.Bool
	// quarantinedUntil is a UnixNano deadline, 0 when not quarantined
	// (R-QUAR-1).
	quarantinedUntil atomic.Int64
	// skipUntil is a UnixNano deadline before which this router places
	// nothing on the engine because it answered overload with a
	// Retry-After (R-FAIL-7); 0 when none. Local to the router, never
	// published: it is backpressure, not a quarantine.
	skipUntil atomic.Int64
	// noCacheDetails is set once the engine, as a decode consumer, reported
	// usage without prompt_tokens_details.cached_tokens: said once in the
	// log (R-FAIL-8).
	noCacheDetails atomic.Bool
	// models is the list the engine's /v1/models returned; nil until known.
	models atomic.Pointer[[]string]
	// refused is set while the engine refuses the router's credentials
	// (401/403): it is then not placeable (see View.RefuseCredentials).
	refused atomic.Bool
	// problem is why the engine's last /v1/models call gave the router
	// nothing to place on — "unreachable: …" or "serves no model" — nil
	// when it listed at least one model or before the first call ended
	// (see noteModels). A credential refusal is
	// refused's business, not problem's.
	problem atomic.Pointer[string]
	// served is every model the engine has listed since the router
	// started (at most maxServedModels): a model in it is one the fleet
	// serves even while the engine is unreachable, which makes a request
	// for it a 503, not a 404.
	served atomic.Pointer[[]string]
	// active is whether the engine's fleet state is active: a joining,
	// draining or drained engine takes no new attempt (R-FLEET-2,
	// R-FLEET-3).
	active atomic.Bool
	// waiting is the engine's own queue (vLLM's num_requests_waiting) as
	// last read, 0 when unknown; the prefix policy adds it to the load
	// (R-PLACE-2; View.SetEngineWaiting).
	waiting atomic.Int64
	// entry is the engine's fleet entry as last applied.
	entry atomic.Pointer[schemas.FleetEntry]
	// fromConfig: the engine came from this router's config file; kept
	// while narwhal_fleet has no key for it (it is seeded there).
	fromConfig bool
	// inflight is the prompts this router placed on the engine whose
	// blocks its KV events may not report yet (R-PLACE-4).
	inflight prefix.Inflight
	// peerInflight is the other routers' placements on the engine by
	// their exact index, heard on the bus (loadshare.go): slots of their
	// own, so that a flood of them cannot push this router's out.
	peerInflight prefix.Inflight
}

// maxServedModels bounds Member.served: an engine that lists ever new
// model names cannot grow the router's memory without bound.
const maxServedModels = 256

// NewMember returns the member for engine e with fleet entry entry (its
// state and slot limits) and the placement verdict eligible.
func NewMember(e engines.Engine, entry schemas.FleetEntry, eligible bool) *Member {
	m := &Member{Engine: e}
	m.limit[Prefill] = int64(entry.PrefillSlots)
	m.limit[Decode] = int64(entry.DecodeSlots)
	m.eligible.Store(eligible)
	m.SetEntry(entry)
	return m
}

// SetModels stores the model list of a successful /v1/models call and
// adds its names to those the engine has ever served (the model
// refresh's).
func (m *Member) SetModels(models []string) {
	m.models.Store(&models)
	old := m.served.Load()
	var union []string
	if old != nil {
		union = append(union, *old...)
	}
	for _, x := range models {
		if len(union) < maxServedModels && !slices.Contains(union, x) {
			union = append(union, x)
		}
	}
	if old == nil || len(union) != len(*old) {
		m.served.Store(&union)
	}
}

// Models returns the engine's model list as its last successful
// /v1/models call returned it — empty, not nil, when it listed none —
// and nil until one succeeded. The slice is the member's own: callers
// never change it.
func (m *Member) Models() []string {
	ms := m.models.Load()
	switch {
	case ms == nil:
		return nil
	case *ms == nil:
		return []string{}
	}
	return *ms
}

// EverServed reports whether the engine lists model or has listed it
// since the router started.
func (m *Member) EverServed(model string) bool {
	if m.Serves(model) {
		return true
	}
	ms := m.served.Load()
	return ms != nil && slices.Contains(*ms, model)
}

// Problem returns why the engine's last /v1/models call gave the router
// nothing to place on ("unreachable: …", "serves no model …"), "" when
// it listed a model or before the first call ended.
func (m *Member) Problem() string {
	if p := m.problem.Load(); p != nil {
		return *p
	}
	return ""
}

// Refused reports whether the engine refuses the router's credentials
// now (401 or 403): it is then not placeable.
func (m *Member) Refused() bool { return m.refused.Load() }

// Unplaceable says why the router cannot place on the engine now
// (UnixNano), "" when it can (for /readyz and the 503 of a model no
// reachable engine serves).
func (m *Member) Unplaceable(nowNano int64) string {
	switch p := m.problem.Load(); {
	case p != nil:
		return *p
	case m.refused.Load():
		return "refuses the router's credentials"
	case m.models.Load() == nil:
		return "has not answered GET /v1/models yet"
	case !m.eligible.Load():
		return "ejected by the breaker"
	case !m.active.Load():
		return "is " + m.State() + " in the live fleet"
	}
	if q := m.quarantinedUntil.Load(); q > nowNano {
		return "quarantined"
	}
	if s := m.skipUntil.Load(); s > nowNano {
		return "asked the router to back off (Retry-After)"
	}
	return ""
}

// reachableFor reports whether the engine's last /v1/models call
// succeeded and listed model.
func (m *Member) reachableFor(model string) bool {
	return m.problem.Load() == nil && m.Serves(model)
}

// SetEntry applies a fleet entry of the same spec (a state change: the
// slot limits stay those of NewMember) and returns the state before, ""
// for the first.
func (m *Member) SetEntry(e schemas.FleetEntry) string {
	prev := m.entry.Swap(&e)
	m.active.Store(e.State == schemas.FleetActive)
	if prev == nil {
		return ""
	}
	return prev.State
}

// State returns the member's fleet state (schemas.FleetActive, …).
func (m *Member) State() string { return m.entry.Load().State }

// Eligible reports the breaker's verdict as last applied (R-BRK-8).
func (m *Member) Eligible() bool { return m.eligible.Load() }

// SetEligible applies a breaker's verdict (R-BRK-8) and reports whether
// it changed the member's eligibility.
func (m *Member) SetEligible(eligible bool) bool { return m.eligible.Swap(eligible) != eligible }

// Legs returns the member's legs in flight on this router: its reserved
// prefill and decode slots.
func (m *Member) Legs() int64 {
	return m.reserved[Prefill].Load() + m.reserved[Decode].Load()
}

// Reserved returns the member's reserved slots of phase p: its legs of
// that phase in flight on this router.
func (m *Member) Reserved(p Phase) int64 { return m.reserved[p].Load() }

// Waiting returns the engine's own queue as last read (0 when unknown).
func (m *Member) Waiting() int64 { return m.waiting.Load() }

// SetWaiting records the engine's own queue (vLLM's
// num_requests_waiting) for the prefix policy's load; n < 0 is taken as
// 0 (R-PLACE-2).
func (m *Member) SetWaiting(n int64) { m.waiting.Store(max(n, 0)) }

// Running returns the engine's own running requests as last read (0
// when unknown).
func (m *Member) Running() int64 { return m.running.Load() }

// SetRunning records the engine's own running requests (vLLM's
// num_requests_running) for the cost of behaviour.md R-PLACE-3; n < 0 is
// taken as 0. It also takes the mesh's legs in flight on the engine at
// that moment (LegsAtRead): the engine's counts, read every
// placement.engine_metrics_interval_s, are compared with the mesh's legs
// of the same moment, never with later ones — a queue read two seconds
// ago less the legs of now would count the mesh's own finished requests
// as work it did not send.
func (m *Member) SetRunning(n int64) {
	m.running.Store(max(n, 0))
	m.legsAtRead.Store(m.MeshReserved(Prefill) + m.MeshReserved(Decode))
}

// LegsAtRead returns the mesh's legs in flight on the engine when its
// /metrics was last read (SetRunning): the part of its waiting and
// running counts the mesh knows the work of.
func (m *Member) LegsAtRead() int64 { return m.legsAtRead.Load() }

// Inflight returns the prompts this router placed on the engine that its
// KV events may not report yet, which placement credits to an exact
// engine (behaviour.md R-PLACE-4; prefix.Inflight).
func (m *Member) Inflight() *prefix.Inflight { return &m.inflight }

// PeerInflight returns the other routers' placements on the engine heard
// on the bus, kept apart from Inflight's (behaviour.md R-PLACE-4).
func (m *Member) PeerInflight() *prefix.Inflight { return &m.peerInflight }

// InflightMatch returns the leading blocks of keys that a prompt placed
// on the engine and not yet reported shares (this router's or another's,
// the longer), at now in UnixNano (prefix.Inflight.Match).
func (m *Member) InflightMatch(keys []uint64, now int64) int {
	return max(m.inflight.Match(keys, now), m.peerInflight.Match(keys, now))
}

// clearInflight forgets every prompt placed on the engine and not yet
// reported, this router's and the others' (its cache is gone: ejected,
// drained).
func (m *Member) clearInflight() {
	m.inflight.Clear()
	m.peerInflight.Clear()
}

// AddTokens adds n (negative: removes) to the estimated uncached prefill
// tokens this router has in flight on the engine (behaviour.md
// R-PLACE-3): a producer attempt adds its estimate when it reserves its
// prefill slot and removes the same when it releases it.
func (m *Member) AddTokens(n int64) { m.tokens.Add(n) }

// Tokens returns the estimated uncached prefill tokens this router has
// in flight on the engine.
func (m *Member) Tokens() int64 { return m.tokens.Load() }

// MeshReserved returns the legs of phase p in flight on the engine in
// the whole mesh: this router's reservations plus the other routers'
// last reports (behaviour.md R-PLACE-3).
func (m *Member) MeshReserved(p Phase) int64 {
	return m.reserved[p].Load() + m.peerReserved[p].Load()
}

// MeshTokens returns the estimated uncached prefill tokens in flight on
// the engine in the whole mesh (behaviour.md R-PLACE-3).
func (m *Member) MeshTokens() int64 { return m.tokens.Load() + m.peerTokens.Load() }

// MarkUncorrected records that the engine answered a prefill without
// usage.prompt_tokens_details.cached_tokens, and reports whether that is
// the first time: it is said once in the log (behaviour.md R-PLACE-3).
func (m *Member) MarkUncorrected() bool { return m.uncorrected.CompareAndSwap(false, true) }

// Serves reports whether the engine's last known model list has model.
func (m *Member) Serves(model string) bool {
	ms := m.models.Load()
	if ms == nil {
		return false
	}
	for _, x := range *ms {
		if x == model {
			return true
		}
	}
	return false
}

// Can reports whether the engine's role permits phase p.
func (m *Member) Can(p Phase) bool {
	if p == Prefill {
		return m.Role.CanPrefill()
	}
	return m.Role.CanDecode()
}

// Available reports whether the member may be placed on at nowNano,
// apart from its slot limit and the model: active in the live fleet,
// eligible, its credentials accepted, neither quarantined nor backing
// off (R-PLACE-1).
func (m *Member) Available(nowNano int64) bool {
	if !m.active.Load() || !m.eligible.Load() || m.refused.Load() {
		return false
	}
	if s := m.skipUntil.Load(); s > nowNano {
		return false
	}
	q := m.quarantinedUntil.Load()
	return q == 0 || q <= nowNano
}

// Takes is the member's eligibility for one leg (R-PLACE-1, R-OWN-3):
// whether it may take a leg of phase p for model at nowNano — its role
// permits the phase, it is Available, it lists model and has a free slot
// of p — and its load, the slots of p reserved on it.
func (m *Member) Takes(p Phase, model string, nowNano int64) (load int64, ok bool) {
	if !m.Can(p) || !m.Available(nowNano) || !m.Serves(model) {
		return 0, false
	}
	load = m.reserved[p].Load()
	if m.limit[p] > 0 && load >= m.limit[p] {
		return load, false
	}
	return load, true
}

// BackOff makes the member unplaceable on this router until until
// (UnixNano, R-FAIL-7); a later deadline already set is kept.
func (m *Member) BackOff(until int64) {
	for {
		cur := m.skipUntil.Load()
		if cur >= until || m.skipUntil.CompareAndSwap(cur, until) {
			return
		}
	}
}

// BackedOffUntil returns the UnixNano deadline of the member's back-off
// (R-FAIL-7), 0 when none was set.
func (m *Member) BackedOffUntil() int64 { return m.skipUntil.Load() }

// Quarantine keeps the member out of this router's placement until until
// (R-QUAR-1), replacing any quarantine before.
func (m *Member) Quarantine(until time.Time) { m.quarantinedUntil.Store(until.UnixNano()) }

// QuarantinedUntil returns the UnixNano end of the member's quarantine,
// 0 when it was never quarantined.
func (m *Member) QuarantinedUntil() int64 { return m.quarantinedUntil.Load() }

// MarkNoCacheDetails records that the engine, as a decode consumer,
// reported usage without prompt_tokens_details.cached_tokens, and
// reports whether that is the first time: it is said once in the log
// (R-FAIL-8).
func (m *Member) MarkNoCacheDetails() bool { return m.noCacheDetails.CompareAndSwap(false, true) }

// TryReserve takes one slot of phase p if the limit allows (R-OWN-3). A
// prefill slot taken while none was begins the engine's head (Head); a
// last end recorded later than that moment (the clock stepped back) is
// taken as that moment, so that it cannot hold the new head's age at
// zero.
func (m *Member) TryReserve(p Phase) bool {
	lim := m.limit[p]
	for {
		cur := m.reserved[p].Load()
		if lim > 0 && cur >= lim {
			return false
		}
		if m.reserved[p].CompareAndSwap(cur, cur+1) {
			if p == Prefill && cur == 0 {
				now := time.Now().UnixNano()
				m.headBusy.Store(now)
				if end := m.headEnd.Load(); end > now {
					m.headEnd.CompareAndSwap(end, now)
				}
			}
			return true
		}
	}
}

// PrefillEnded records, at nowNano (UnixNano), that one of this
// router's prefill attempts on the engine ended, tokens its reserved
// uncached tokens — call it before the slot's Release. When answered
// (the engine answered the leg: not failed, timed out or abandoned) the
// time since the head began (headStart) and tokens move the means a
// prefill takes there an eighth of the way (the first sets them); either
// way the next prefill in line begins now (behaviour.md R-PLACE-3; the
// means are the token ratio's EWMA, ewma).
func (m *Member) PrefillEnded(nowNano int64, answered bool, tokens int64) {
	since := m.headStart()
	m.headEnd.Store(nowNano)
	if answered && since > 0 && nowNano > since {
		ewma(&m.headMean, nowNano-since)
		ewma(&m.headTokens, min(max(tokens, 1), 1<<40))
	}
}

// headStart returns the UnixNano moment the prefill the engine computes
// began, as far as the mesh knows: the later of the last end of a
// prefill there (this router's or another's) and the earliest busy start
// among the routers with prefills in flight there (an engine computes in
// the order it was sent work: the first to arrive after the queue was
// empty began first). 0 when no router has one in flight there.
func (m *Member) headStart() int64 {
	busy := m.peerHeadBusy.Load()
	if own := m.headBusy.Load(); own > 0 && m.reserved[Prefill].Load() > 0 && (busy == 0 || own < busy) {
		busy = own
	}
	if busy == 0 {
		return 0
	}
	return max(busy, m.headEnd.Load(), m.peerHeadEnd.Load())
}

// Head returns, at nowNano (UnixNano), what the mesh knows of the
// prefill the engine computes (PrefillEnded, and the other routers'
// reports on the load exchange): how long it has been computing, and the
// mean time and reserved tokens of the prefills seen to answer there —
// this router's, or the other routers' mean until one of its own
// answered. It is the zero Progress while neither this router nor a
// router that reports the head (an older one does not) has a prefill in
// flight there; its Mean and MeanTokens are 0 until one answered
// (behaviour.md R-PLACE-3).
func (m *Member) Head(nowNano int64) prefix.Progress {
	since := m.headStart()
	if since == 0 {
		return prefix.Progress{}
	}
	if since > nowNano {
		m.clampHead(nowNano)
		since = min(m.headStart(), nowNano)
	}
	p := prefix.Progress{Mean: time.Duration(m.headMean.Load()), MeanTokens: m.headTokens.Load()}
	if p.Mean <= 0 {
		p = prefix.Progress{Mean: time.Duration(m.peerMean.Load()), MeanTokens: m.peerMeanTokens.Load()}
	}
	if nowNano > since {
		p.Age = time.Duration(nowNano - since)
	}
	if p == (prefix.Progress{}) {
		// A head just begun, of unknown pace: counted whole (Cost), not
		// as one of no router's known (half done).
		p.Age = 1
	}
	return p
}

// loadEntry returns this router's entry of its load report on the
// engine at now (behaviour.md R-PLACE-3) — its legs and tokens in
// flight, how long it has had prefills in flight there, how long ago its
// last one there ended (always while it has prefills in flight there, as
// the others take the head's start from it; within recent of now when
// it has none) and its pace there — and the UnixNano moments of the busy
// start and the end the entry carries (0 when it carries none), which
// change only when a head begins or a prefill ends. A moment later than
// now (the clock stepped back) is taken as now first.
func (m *Member) loadEntry(now time.Time, recent time.Duration) (l bus.EngineLoad, busy, end int64) {
	nowNano := now.UnixNano()
	m.clampHead(nowNano)
	l = bus.EngineLoad{
		Prefill: max(m.reserved[Prefill].Load(), 0), Decode: max(m.reserved[Decode].Load(), 0),
		Tokens: max(m.tokens.Load(), 0), PaceTokens: min(max(m.headTokens.Load(), 0), bus.LoadMaxCount),
		PaceMean: min(max(time.Duration(m.headMean.Load()), 0), bus.LoadMaxAge),
	}
	if b := m.headBusy.Load(); l.Prefill > 0 && b > 0 {
		l.HeadBusy, busy = min(max(time.Duration(nowNano-b), 1), bus.LoadMaxAge), b
	}
	if e := m.headEnd.Load(); e > 0 && (l.Prefill > 0 || time.Duration(nowNano-e) < recent) {
		l.HeadEnd, end = min(max(time.Duration(nowNano-e), 1), bus.LoadMaxAge), e
	}
	return l, busy, end
}

// clampHead takes every moment of the head later than nowNano (UnixNano;
// the wall clock stepped back since it was recorded) as nowNano, so that
// none holds the head's age at zero until the clock catches up.
func (m *Member) clampHead(nowNano int64) {
	for _, v := range [...]*atomic.Int64{&m.headBusy, &m.headEnd, &m.peerHeadBusy, &m.peerHeadEnd} {
		if t := v.Load(); t > nowNano {
			v.CompareAndSwap(t, nowNano)
		}
	}
}

// Release gives back one slot of phase p.
func (m *Member) Release(p Phase) { m.reserved[p].Add(-1) }

// Fleet is the set of engines a router places on. A Fleet value never
// changes membership: the live fleet's watch replaces it whole; each
// member's state changes atomically.
type Fleet struct {
	members []*Member
	byID    map[string]*Member
}

// NewFleet returns the fleet of members, in that order (ids unique).
func NewFleet(members ...*Member) *Fleet {
	f := &Fleet{members: members, byID: make(map[string]*Member, len(members))}
	for _, m := range members {
		f.byID[m.ID] = m
	}
	return f
}

// Members returns the fleet's members in fleet order. The slice is the
// fleet's own: callers read it and never change it.
func (f *Fleet) Members() []*Member { return f.members }

// Member returns the member of engine id, nil when the fleet has none.
func (f *Fleet) Member(id string) *Member { return f.byID[id] }

// EverServed reports whether any engine of the fleet has listed model
// since the router started: a model none has is unknown (404).
func (f *Fleet) EverServed(model string) bool {
	for _, m := range f.members {
		if m.EverServed(model) {
			return true
		}
	}
	return false
}

// UnreachableFor returns, for the first phase (prefill, then decode) in
// which engines of the fleet have served model but none of them is
// reachable and lists it now, those engines; nil when every phase whose
// engines served model has a reachable one. A phase no engine ever served
// model in is placement's business (no eligible engine).
func (f *Fleet) UnreachableFor(model string) (Phase, []*Member) {
	for _, p := range []Phase{Prefill, Decode} {
		var should []*Member
		reachable := false
		for _, m := range f.members {
			if !m.Can(p) || !m.EverServed(model) {
				continue
			}
			if m.reachableFor(model) {
				reachable = true
				break
			}
			should = append(should, m)
		}
		if !reachable && len(should) > 0 {
			return p, should
		}
	}
	return 0, nil
}

// Models returns every model any engine serves, without duplicates, in
// fleet order.
func (f *Fleet) Models() []string {
	seen := map[string]bool{}
	var out []string
	for _, m := range f.members {
		if ms := m.models.Load(); ms != nil {
			for _, x := range *ms {
				if !seen[x] {
					seen[x] = true
					out = append(out, x)
				}
			}
		}
	}
	return out
}

// CanServe reports whether at least one engine is available for phase p
// with known models (for /readyz, R-API-2).
func (f *Fleet) CanServe(p Phase) bool {
	now := time.Now().UnixNano()
	for _, m := range f.members {
		if m.Can(p) && m.Available(now) && m.models.Load() != nil && m.problem.Load() == nil {
			return true
		}
	}
	return false
}
