package router

import (
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// phase indexes per-phase counters.
type phase int

const (
	prefillPhase phase = iota
	decodePhase
)

func (p phase) String() string {
	if p == prefillPhase {
		return schemas.PhasePrefill
	}
	return schemas.PhaseDecode
}

// member is one engine of the fleet with its live placement state. All
// mutable state is atomic: placement takes no lock (issue: no global lock
// on the placement path).
type member struct {
	engines.Engine
	// limit is the slot limit per phase (0 = none, R-OWN-3).
	limit [2]int64
	// reserved is the number of reserved slots per phase.
	reserved [2]atomic.Int64
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
	// (401/403): it is then not placeable (see refuseCredentials).
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
	served atomic.Pointer[[]string] // active is whether the engine's fleet state is active: a joining,
	// draining or drained engine takes no new attempt (R-FLEET-2,
	// R-FLEET-3).
	active atomic.Bool
	// waiting is the engine's own queue (vLLM's num_requests_waiting) as
	// last read, 0 when unknown; the prefix policy adds it to the load
	// (R-PLACE-2; Router.SetEngineWaiting).
	waiting atomic.Int64
	// entry is the engine's fleet entry as last applied.
	entry atomic.Pointer[schemas.FleetEntry]
	// fromConfig: the engine came from this router's config file; kept
	// while narwhal_fleet has no key for it (it is seeded there).
	fromConfig bool
}

// maxServedModels bounds member.served: an engine that lists ever new
// model names cannot grow the router's memory without bound.
const maxServedModels = 256

// setModels stores the model list of a successful /v1/models call and
// adds its names to served.
func (m *member) setModels(models []string) {
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

// everServed reports whether the engine lists model or has listed it
// since the router started.
func (m *member) everServed(model string) bool {
	if m.serves(model) {
		return true
	}
	ms := m.served.Load()
	return ms != nil && slices.Contains(*ms, model)
}

// unplaceable says why the router cannot place on the engine now, "" when
// it can (for /readyz and the 503 of a model no reachable engine serves).
func (m *member) unplaceable(nowNano int64) string {
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
		return "is " + m.state() + " in the live fleet"
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
func (m *member) reachableFor(model string) bool {
	return m.problem.Load() == nil && m.serves(model)
}

// newMember returns the member for engine e with fleet entry entry and
// the placement verdict eligible.
func newMember(e engines.Engine, entry schemas.FleetEntry, eligible bool) *member {
	m := &member{Engine: e}
	m.limit[prefillPhase] = int64(entry.PrefillSlots)
	m.limit[decodePhase] = int64(entry.DecodeSlots)
	m.eligible.Store(eligible)
	m.setEntry(entry)
	return m
}

// setEntry applies a fleet entry of the same spec (a state change) and
// returns the state before.
func (m *member) setEntry(e schemas.FleetEntry) string {
	prev := m.entry.Swap(&e)
	m.active.Store(e.State == schemas.FleetActive)
	if prev == nil {
		return ""
	}
	return prev.State
}

// state returns the member's fleet state.
func (m *member) state() string { return m.entry.Load().State }

// legs returns the member's legs in flight on this router: its reserved
// prefill and decode slots.
func (m *member) legs() int64 {
	return m.reserved[prefillPhase].Load() + m.reserved[decodePhase].Load()
}

func (m *member) serves(model string) bool {
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

func (m *member) can(p phase) bool {
	if p == prefillPhase {
		return m.Role.CanPrefill()
	}
	return m.Role.CanDecode()
}

// available reports whether the member may be placed on now, apart from
// its slot limit.
func (m *member) available(nowNano int64) bool {
	if !m.active.Load() || !m.eligible.Load() || m.refused.Load() {
		return false
	}
	if s := m.skipUntil.Load(); s > nowNano {
		return false
	}
	q := m.quarantinedUntil.Load()
	return q == 0 || q <= nowNano
}

// backOff makes the member unplaceable on this router until until
// (R-FAIL-7); a later deadline already set is kept.
func (m *member) backOff(until int64) {
	for {
		cur := m.skipUntil.Load()
		if cur >= until || m.skipUntil.CompareAndSwap(cur, until) {
			return
		}
	}
}

// tryReserve takes one slot of phase p if the limit allows.
func (m *member) tryReserve(p phase) bool {
	lim := m.limit[p]
	for {
		cur := m.reserved[p].Load()
		if lim > 0 && cur >= lim {
			return false
		}
		if m.reserved[p].CompareAndSwap(cur, cur+1) {
			return true
		}
	}
}

// release gives back one slot of phase p.
func (m *member) release(p phase) { m.reserved[p].Add(-1) }

// fleet is the set of engines a router places on. A fleet value never
// changes membership: the live fleet's watch replaces it whole
// (Router.live); each member's state changes atomically.
type fleet struct {
	members []*member
	byID    map[string]*member
}

// errNoEngine is returned by place when no engine can take a phase.
type errNoEngine struct{ phase phase }

func (e *errNoEngine) Error() string { return "no eligible engine for " + e.phase.String() }

// place chooses the least-outstanding available engine for phase p that
// serves model and reserves one of its slots (R-OWN-3). Engines in avoid
// (those that failed this phase in an earlier attempt of the request) are
// chosen only when no other engine can take the phase, and then the least
// loaded of them (R-RETRY-3). It returns *errNoEngine when none can take
// the phase.
func (f *fleet) place(model string, p phase, avoid []*member) (*member, error) {
	return f.placeIf(model, p, avoid, nil)
}

// placeConsumer is place for the decode phase among the engines of
// connector conn only: a producer and a consumer of different connectors
// cannot hand off KV, so a mixed fleet never pairs them (R-DESC-3).
func (f *fleet) placeConsumer(model string, avoid []*member, conn string) (*member, error) {
	return f.placeIf(model, decodePhase, avoid, func(m *member) bool { return m.Connector.Name() == conn })
}

// placeIf is place among the engines fit accepts (all when fit is nil).
func (f *fleet) placeIf(model string, p phase, avoid []*member, fit func(*member) bool) (*member, error) {
	now := time.Now().UnixNano()
	for try := 0; try < 4; try++ {
		// Least outstanding wins; ties are broken uniformly at random
		// (reservoir sampling), so idle engines share the load evenly.
		var best, fallback pick
		for _, m := range f.members {
			if !m.can(p) || !m.available(now) || !m.serves(model) || (fit != nil && !fit(m)) {
				continue
			}
			load := m.reserved[p].Load()
			if m.limit[p] > 0 && load >= m.limit[p] {
				continue
			}
			if slices.Contains(avoid, m) {
				fallback.offer(m, load)
				continue
			}
			best.offer(m, load)
		}
		chosen := best.m
		if chosen == nil {
			chosen = fallback.m
		}
		if chosen == nil {
			return nil, &errNoEngine{p}
		}
		if chosen.tryReserve(p) {
			return chosen, nil
		}
	}
	return nil, &errNoEngine{p}
}

// pick is the least-loaded member offered so far, ties broken uniformly at
// random.
type pick struct {
	m    *member
	load int64
	ties int
}

func (k *pick) offer(m *member, load int64) {
	switch {
	case k.m == nil || load < k.load:
		k.m, k.load, k.ties = m, load, 1
	case load == k.load:
		k.ties++
		if rand.IntN(k.ties) == 0 {
			k.m = m
		}
	}
}

// everServed reports whether any engine of the fleet has listed model
// since the router started: a model none has is unknown (404).
func (f *fleet) everServed(model string) bool {
	for _, m := range f.members {
		if m.everServed(model) {
			return true
		}
	}
	return false
}

// unreachableFor returns, for the first phase (prefill, then decode) in
// which engines of the fleet have served model but none of them is
// reachable and lists it now, those engines; nil when every phase whose
// engines served model has a reachable one. A phase no engine ever served
// model in is placement's business (no eligible engine).
func (f *fleet) unreachableFor(model string) (phase, []*member) {
	for _, p := range []phase{prefillPhase, decodePhase} {
		var should []*member
		reachable := false
		for _, m := range f.members {
			if !m.can(p) || !m.everServed(model) {
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

// models returns every model any engine serves, without duplicates, in
// fleet order.
func (f *fleet) models() []string {
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

// canServe reports whether at least one engine is available for phase p
// (for /readyz).
func (f *fleet) canServe(p phase) bool {
	now := time.Now().UnixNano()
	for _, m := range f.members {
		if m.can(p) && m.available(now) && m.models.Load() != nil && m.problem.Load() == nil {
			return true
		}
	}
	return false
}
