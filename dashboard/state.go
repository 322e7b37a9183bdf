package dashboard

import (
	"encoding/json"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Bounds of what the page keeps. Everything it shows comes from the bus,
// which anyone with a write credential (or a forged event) can fill: each
// collection is bounded so that no input grows the process without limit.
const (
	// maxEngines bounds the engines shown; keys beyond it are ignored
	// (and counted).
	maxEngines = 1024
	// maxRouters bounds the routers shown.
	maxRouters = 256
	// maxFailures is how many of the last failures the page lists.
	maxFailures = 50
	// maxTimeline is how many ejections, readmissions and other state
	// changes the timeline keeps.
	maxTimeline = 200
	// maxFaults bounds the armed chaos faults listed.
	maxFaults = 256
	// latencySamples is how many of an engine's last requests its
	// latencies are the median of.
	latencySamples = 32
	// latencyMaxAge drops latency samples older than this: "recent" means
	// the last five minutes.
	latencyMaxAge = 5 * time.Minute
	// rateWindow is the window of the request and error rates.
	rateWindow = 10 * time.Second
	// reportMaxAge ignores a router's in-flight report older than this
	// (a stopped router's key lingers until the bucket's TTL).
	reportMaxAge = 10 * time.Second
	// routerMaxSilence is how long a router without a request event or
	// a report keeps its row when room is needed for another.
	routerMaxSilence = 5 * time.Minute
	// maxText is the longest text (message, reason) kept, in bytes; longer
	// ones are cut at a rune boundary and end in "…".
	maxText = 400
	// maxID is the longest id kept, in bytes.
	maxID = 128
)

// Engine states the page shows, from the most to the least decisive
// source: the live fleet's draining, drained and joining states, the
// breaker's ejection, a router's quarantine, else eligible.
const (
	stateEligible    = "eligible"
	stateEjected     = "ejected"
	stateQuarantined = "quarantined"
	stateDraining    = "draining"
	stateDrained     = "drained"
	// stateProbing is a joining engine: out of placement while the
	// breaker runs its readmission checks (R-FLEET-2).
	stateProbing = "probing"
)

// Timeline entries (timelineEntry.What).
const (
	whatEjected     = "ejected"
	whatReadmitted  = "readmitted"
	whatEligible    = "eligible"
	whatQuarantined = "quarantined"
	whatFleet       = "fleet"
)

// engine is what the page knows of one engine.
type engine struct {
	id string
	// inFleet and inPlacement say which bucket holds a key for it, and
	// configured whether the dashboard was told of it (Options.Fleet); an
	// engine with none of them is forgotten.
	inFleet, inPlacement, configured bool
	// role is the live fleet's, else the configured one.
	role, configuredRole, fleetState string
	eligible                         bool
	placementState                   string
	streak                           int
	reason                           string
}

// engineStats is what the events say of one engine id. It is kept apart
// from the engines the buckets name because events replayed at start may
// come before the buckets' first read: an id the buckets never name is
// not shown, and its record is dropped when room is needed.
type engineStats struct {
	quarantinedUntil     time.Time
	quarantineReason     string
	probe                *probeView
	failures             int
	ttft, firstByte, itl samples
}

// samples is a ring of the last latencySamples observations, in seconds.
type samples struct {
	v  [latencySamples]float64
	at [latencySamples]time.Time
	n  int // observations stored, ≤ latencySamples
	i  int // next slot
}

func (s *samples) add(v float64, at time.Time) {
	s.v[s.i], s.at[s.i] = v, at
	s.i = (s.i + 1) % latencySamples
	s.n = min(s.n+1, latencySamples)
}

// median returns the median of the samples newer than since, or nil
// when there is none.
func (s *samples) median(since time.Time) *float64 {
	vals := make([]float64, 0, s.n)
	for k := range s.n {
		if !s.at[k].Before(since) {
			vals = append(vals, s.v[k])
		}
	}
	if len(vals) == 0 {
		return nil
	}
	sort.Float64s(vals)
	m := vals[len(vals)/2]
	if len(vals)%2 == 0 {
		m = (vals[len(vals)/2-1] + vals[len(vals)/2]) / 2
	}
	return &m
}

// routerStats is what the page knows of one router.
type routerStats struct {
	id       string
	lastSeen time.Time // its last request event or in-flight report
	report   time.Time // its in-flight report's "at"
	inFlight map[string]int64
	// requests and errors are counted per second, in a ring indexed by
	// the Unix second modulo len.
	secs     [60]int64 // the Unix second each slot counts
	requests [60]int
	errors   [60]int
	total    int64
	failed   int64
}

func (r *routerStats) count(at time.Time, failed bool) {
	sec := at.Unix()
	k := int(sec % int64(len(r.secs)))
	if r.secs[k] != sec {
		r.secs[k], r.requests[k], r.errors[k] = sec, 0, 0
	}
	r.requests[k]++
	r.total++
	if failed {
		r.errors[k]++
		r.failed++
	}
}

// rates returns the requests per second and the share of them that
// failed (0…1) over the rateWindow before now.
func (r *routerStats) rates(now time.Time) (perSec, errShare float64) {
	from := now.Add(-rateWindow).Unix()
	var req, errs int
	for k := range r.secs {
		if r.secs[k] > from && r.secs[k] <= now.Unix() {
			req += r.requests[k]
			errs += r.errors[k]
		}
	}
	if req > 0 {
		errShare = float64(errs) / float64(req)
	}
	return float64(req) / rateWindow.Seconds(), errShare
}

// state is everything the page shows, fed by the bus (feed.go) and read
// as a Snapshot. It is safe for concurrent use.
type state struct {
	mu       sync.Mutex
	now      func() time.Time
	engines  map[string]*engine
	stats    map[string]*engineStats // by engine id, ≤ maxEngines
	routers  map[string]*routerStats
	failures []failureView  // oldest first, ≤ maxFailures
	timeline []timelineView // oldest first, ≤ maxTimeline
	faults   map[string]faultView
	ignored  int64 // values and events refused (invalid, over a bound)
	busUp    bool
	busURL   string

	version uint64
	changed chan struct{} // closed and replaced at each change
	cached  []byte        // the JSON of Snapshot at cachedV
	cachedV uint64
	cachedT time.Time
}

func newState(now func() time.Time) *state {
	return &state{
		now:     now,
		engines: map[string]*engine{},
		stats:   map[string]*engineStats{},
		routers: map[string]*routerStats{},
		faults:  map[string]faultView{},
		changed: make(chan struct{}),
	}
}

// touch records a change; the caller holds mu.
func (s *state) touch() {
	s.version++
	close(s.changed)
	s.changed = make(chan struct{})
}

// wait returns a channel closed at the next change.
func (s *state) wait() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

// clip returns t cut to at most n bytes at a rune boundary, with "…"
// when cut, and with invalid UTF-8 replaced.
func clip(t string, n int) string {
	if !utf8.ValidString(t) {
		t = strings.ToValidUTF8(t, "\uFFFD")
	}
	if len(t) <= n {
		return t
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(t[cut]) {
		cut--
	}
	return t[:cut] + "…"
}

// engineFor returns the engine id's record, creating it unless that
// would pass maxEngines (then nil). The caller holds mu.
func (s *state) engineFor(id string) *engine {
	if e := s.engines[id]; e != nil {
		return e
	}
	if len(s.engines) >= maxEngines || id == "" || len(id) > maxID {
		s.ignored++
		return nil
	}
	e := &engine{id: id}
	s.engines[id] = e
	return e
}

// statsFor returns the event record of engine id, creating it when
// there is room: when maxEngines records exist, those of ids no bucket
// names are dropped first; nil when there is still none. The caller
// holds mu.
func (s *state) statsFor(id string) *engineStats {
	if st := s.stats[id]; st != nil {
		return st
	}
	if id == "" || len(id) > maxID {
		return nil
	}
	if len(s.stats) >= maxEngines {
		for k := range s.stats {
			if s.engines[k] == nil {
				delete(s.stats, k)
			}
		}
		if len(s.stats) >= maxEngines {
			s.ignored++
			return nil
		}
	}
	st := &engineStats{}
	s.stats[id] = st
	return st
}

// forget drops e when no bucket names it any more. The caller holds mu.
func (s *state) forget(e *engine) {
	if !e.inFleet && !e.inPlacement && !e.configured {
		delete(s.engines, e.id)
	}
}

// configure lists the engines of a config file's fleet.
func (s *state) configure(engines []Engine) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	for _, c := range engines {
		e := s.engineFor(c.ID)
		if e == nil {
			continue
		}
		e.configured, e.configuredRole = true, clip(c.Role, maxID)
		if !e.inFleet {
			e.role = e.configuredRole
		}
	}
}

// setBus records the bus link's state.
func (s *state) setBus(up bool, url string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.busUp != up || s.busURL != url {
		s.busUp, s.busURL = up, url
		s.touch()
	}
}

// refuse counts one value or event that was not applied.
func (s *state) refuse() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ignored++
	s.touch()
}

// applyFleet applies the value of key in narwhal_fleet (nil: deleted).
func (s *state) applyFleet(key string, entry *schemas.FleetEntry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	if entry == nil {
		if e := s.engines[key]; e != nil {
			e.inFleet, e.role, e.fleetState = false, e.configuredRole, ""
			s.forget(e)
		}
		return
	}
	e := s.engineFor(key)
	if e == nil {
		return
	}
	e.inFleet, e.role, e.fleetState = true, clip(entry.Role, maxID), clip(entry.State, maxID)
}

// applyPlacement applies the value of key in narwhal_placement (nil:
// deleted).
func (s *state) applyPlacement(key string, entry *schemas.Eligibility) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	if entry == nil {
		if e := s.engines[key]; e != nil {
			e.inPlacement = false
			s.forget(e)
		}
		return
	}
	e := s.engineFor(key)
	if e == nil {
		return
	}
	e.inPlacement, e.eligible, e.placementState = true, entry.Eligible, clip(entry.State, maxID)
	e.streak, e.reason = entry.Streak, clip(entry.Reason, maxText)
}

// applyRouterReport applies the value of key in narwhal_routers (nil:
// deleted).
func (s *state) applyRouterReport(key string, r *schemas.RouterReport) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	if r == nil {
		if rs := s.routers[key]; rs != nil {
			rs.inFlight, rs.report = nil, time.Time{}
		}
		return
	}
	rs := s.routerFor(key)
	if rs == nil {
		return
	}
	rs.report, rs.lastSeen = r.At, latest(rs.lastSeen, r.At)
	rs.inFlight = map[string]int64{}
	for id, n := range r.InFlight {
		if len(rs.inFlight) >= maxEngines {
			break
		}
		if n > 0 && len(id) <= maxID {
			rs.inFlight[id] = n
		}
	}
}

func latest(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// routerFor returns the router's record, creating it unless that would
// pass maxRouters (then nil). The caller holds mu.
func (s *state) routerFor(id string) *routerStats {
	if r := s.routers[id]; r != nil {
		return r
	}
	if id == "" || len(id) > maxID {
		s.ignored++
		return nil
	}
	if len(s.routers) >= maxRouters {
		// Room first: routers silent for routerMaxSilence go.
		now := s.now()
		for k, r := range s.routers {
			if now.Sub(r.lastSeen) > routerMaxSilence {
				delete(s.routers, k)
			}
		}
		if len(s.routers) >= maxRouters {
			s.ignored++
			return nil
		}
	}
	r := &routerStats{id: id}
	s.routers[id] = r
	return r
}

// applyFault applies the value of key in narwhal_chaos (nil: deleted).
func (s *state) applyFault(key string, f *faultView) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	if f == nil {
		delete(s.faults, key)
		return
	}
	if _, ok := s.faults[key]; !ok && len(s.faults) >= maxFaults {
		s.ignored++
		return
	}
	s.faults[key] = *f
}

// appliers are the event kinds the page shows, each with what applies
// one event of it (decoded from its JSON); the other kinds of
// schemas.EventKinds (handoff, chaos, kv_recomputed) are not followed.
// Every key is a kind of the table (TestAppliersAreKinds).
var appliers = map[string]func(s *state, payload []byte) bool{
	schemas.KindRequest:     decoded((*state).applyRequest),
	schemas.KindFailure:     decoded((*state).applyFailure),
	schemas.KindEligibility: decoded((*state).applyEligibilityEvent),
	schemas.KindQuarantine:  decoded((*state).applyQuarantine),
	schemas.KindProbe:       decoded((*state).applyProbe),
	schemas.KindFleet:       decoded((*state).applyFleetChange),
}

// decoded returns an applier that decodes the payload as an E and hands
// it to apply; it reports false, applying nothing, when the payload does
// not decode.
func decoded[E any](apply func(*state, *E)) func(*state, []byte) bool {
	return func(s *state, payload []byte) bool {
		var e E
		if json.Unmarshal(payload, &e) != nil {
			return false
		}
		apply(s, &e)
		return true
	}
}

// applyEvent applies one event of the stream (already schema-checked),
// of kind (the subject's kind token), decoded from payload; one that
// does not decode is counted as refused, one of a kind the page does not
// show is ignored.
func (s *state) applyEvent(kind string, payload []byte) {
	apply := appliers[kind]
	if apply == nil {
		return // handoff, chaos, kv_recomputed: not shown
	}
	if !apply(s, payload) {
		s.refuse()
	}
}

// eventTime is an event's "at", or now when it has none or is in the
// future (a clock ahead, or a forged event, cannot sit at the top).
func (s *state) eventTime(at time.Time) time.Time {
	now := s.now()
	if at.IsZero() || at.After(now) {
		return now
	}
	return at
}

// applyRequest counts a request-completed event for its router and, when
// it succeeded, records its latencies: TTFT for the producer, first byte
// and the mean inter-token latency for the consumer.
func (s *state) applyRequest(e *schemas.RequestCompleted) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	at := s.eventTime(e.At)
	if r := s.routerFor(e.RouterID); r != nil {
		r.lastSeen = latest(r.lastSeen, at)
		r.count(at, e.Status >= 500)
	}
	if e.Status != 200 || e.ErrorKind != "" {
		return
	}
	if e.TTFTSeconds != nil && *e.TTFTSeconds >= 0 {
		if p := s.statsFor(e.ProducerID); p != nil {
			p.ttft.add(*e.TTFTSeconds, at)
		}
	}
	if e.FirstByteSeconds == nil || *e.FirstByteSeconds < 0 {
		return
	}
	c := s.statsFor(e.ConsumerID)
	if c == nil {
		return
	}
	c.firstByte.add(*e.FirstByteSeconds, at)
	// The mean gap between generated tokens after the first: the decode
	// time after the first output over the tokens after it.
	// A count the engine did not report is absent (nil).
	if e.CompletionTokens != nil && *e.CompletionTokens > 1 && e.DurationSeconds >= *e.FirstByteSeconds {
		c.itl.add((e.DurationSeconds-*e.FirstByteSeconds)/float64(*e.CompletionTokens-1), at)
	}
}

// applyFailure keeps a failure event among the last ones.
func (s *state) applyFailure(e *schemas.Failure) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	if st := s.statsFor(e.EngineID); st != nil {
		st.failures++
	}
	s.failures = appendBounded(s.failures, failureView{
		At:       s.eventTime(e.At),
		EngineID: clip(e.EngineID, maxID),
		RouterID: clip(e.RouterID, maxID),
		Phase:    clip(e.Phase, maxID),
		Kind:     clip(e.Kind, maxID),
		Status:   e.Status,
		Message:  clip(e.Message, maxText),
		Counts:   e.Counts,
	}, maxFailures)
}

// applyEligibilityEvent puts an ejection or a readmission on the
// timeline.
func (s *state) applyEligibilityEvent(e *schemas.Eligibility) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	what := whatEjected
	if e.Eligible {
		what = whatEligible
		if s.lastWhat(e.EngineID) == whatEjected || strings.HasPrefix(e.Reason, "readmitted") {
			what = whatReadmitted
		}
	}
	s.addTimeline(e.At, e.EngineID, what, e.Reason)
}

// lastWhat is the engine's last ejection or readmission on the
// timeline, or "". The caller holds mu.
func (s *state) lastWhat(id string) string {
	for i := len(s.timeline) - 1; i >= 0; i-- {
		t := s.timeline[i]
		if t.EngineID == id && (t.What == whatEjected || t.What == whatReadmitted || t.What == whatEligible) {
			return t.What
		}
	}
	return ""
}

// addTimeline appends an entry. The caller holds mu.
func (s *state) addTimeline(at time.Time, id, what, reason string) {
	s.timeline = appendBounded(s.timeline, timelineView{
		At: s.eventTime(at), EngineID: clip(id, maxID), What: what, Reason: clip(reason, maxText),
	}, maxTimeline)
	// Replayed history may arrive out of order across kinds: keep the
	// timeline sorted by time.
	if n := len(s.timeline); n > 1 && s.timeline[n-1].At.Before(s.timeline[n-2].At) {
		slices.SortStableFunc(s.timeline, func(a, b timelineView) int { return a.At.Compare(b.At) })
	}
}

// applyQuarantine records a router's quarantine of an engine.
func (s *state) applyQuarantine(e *schemas.Quarantine) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	if st := s.statsFor(e.EngineID); st != nil && e.Until.After(st.quarantinedUntil) {
		st.quarantinedUntil, st.quarantineReason = e.Until, clip(e.Reason, maxText)
	}
	s.addTimeline(e.At, e.EngineID, whatQuarantined, "for "+formatSeconds(e.DurationSeconds)+": "+e.Reason)
}

// applyProbe records the last probe of an engine.
func (s *state) applyProbe(e *schemas.Probe) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	if st := s.statsFor(e.EngineID); st != nil {
		st.probe = &probeView{At: s.eventTime(e.At), Outcome: clip(e.Outcome, maxID), Message: clip(e.Message, maxText)}
	}
}

// applyFleetChange puts a fleet state change on the timeline.
func (s *state) applyFleetChange(e *schemas.FleetChange) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.touch()
	reason := e.State
	if e.Previous != "" {
		reason = e.Previous + " → " + e.State
	}
	if e.Reason != "" {
		reason += ": " + e.Reason
	}
	s.addTimeline(e.At, e.EngineID, whatFleet, reason)
}

func formatSeconds(v float64) string {
	return strconv.FormatFloat(v, 'f', -1, 64) + " s"
}

func appendBounded[T any](list []T, v T, n int) []T {
	if len(list) >= n {
		list = slices.Delete(list, 0, len(list)-n+1)
	}
	return append(list, v)
}

// Snapshot is the page's whole state at one time, as the browser
// receives it (JSON over Server-Sent Events). Times are RFC 3339 UTC;
// latencies are seconds. Every string comes from the bus: the page
// shows it as text only.
type Snapshot struct {
	// At is when the snapshot was taken, by the dashboard's clock.
	At time.Time `json:"at"`
	// Bus says whether the dashboard's bus link is up, and where (the
	// URL without credentials).
	Bus busView `json:"bus"`
	// Engines lists every engine the live fleet or the placement bucket
	// names, by id.
	Engines []engineView `json:"engines"`
	// Routers lists every router seen (request events, in-flight
	// reports), by id.
	Routers []routerView `json:"routers"`
	// Failures are the last failure events, newest first.
	Failures []failureView `json:"failures"`
	// Timeline holds ejections, readmissions, quarantines and fleet
	// changes, newest first.
	Timeline []timelineView `json:"timeline"`
	// Faults are the chaos faults armed and not expired, by engine.
	Faults []faultView `json:"faults"`
	// Ignored counts bus values and events that were not shown
	// (schema-invalid, or over a bound).
	Ignored int64 `json:"ignored"`
}

type busView struct {
	Connected bool   `json:"connected"`
	URL       string `json:"url"`
}

type engineView struct {
	ID    string `json:"id"`
	Role  string `json:"role"`
	State string `json:"state"`
	// Fleet is the live fleet's state (joining, active, draining,
	// drained), "" when the fleet bucket has no key for it.
	Fleet            string     `json:"fleet,omitempty"`
	Streak           int        `json:"streak"`
	Reason           string     `json:"reason,omitempty"`
	InFlight         int64      `json:"inflight"`
	QuarantinedUntil *time.Time `json:"quarantined_until,omitempty"`
	Failures         int        `json:"failures"`
	TTFT             *float64   `json:"ttft_s"`
	FirstByte        *float64   `json:"first_byte_s"`
	ITL              *float64   `json:"itl_s"`
	Probe            *probeView `json:"probe,omitempty"`
}

type probeView struct {
	At      time.Time `json:"at"`
	Outcome string    `json:"outcome"`
	Message string    `json:"message,omitempty"`
}

type routerView struct {
	ID string `json:"id"`
	// RequestRate is requests per second over the last 10 s.
	RequestRate float64 `json:"request_rate"`
	// ErrorRate is the share (0…1) of those answered with a 5xx.
	ErrorRate float64   `json:"error_rate"`
	Requests  int64     `json:"requests"`
	Errors    int64     `json:"errors"`
	InFlight  int64     `json:"inflight"`
	LastSeen  time.Time `json:"last_seen"`
}

type failureView struct {
	At       time.Time `json:"at"`
	EngineID string    `json:"engine_id"`
	RouterID string    `json:"router_id,omitempty"`
	Phase    string    `json:"phase"`
	Kind     string    `json:"kind"`
	Status   int       `json:"status"`
	Message  string    `json:"message"`
	Counts   bool      `json:"counts"`
}

type timelineView struct {
	At       time.Time `json:"at"`
	EngineID string    `json:"engine_id"`
	What     string    `json:"what"`
	Reason   string    `json:"reason,omitempty"`
}

type faultView struct {
	EngineID    string    `json:"engine_id"`
	FaultID     string    `json:"fault_id"`
	Fault       string    `json:"fault"`
	Phase       string    `json:"phase"`
	Probability float64   `json:"probability"`
	Count       int       `json:"count"`
	Left        int       `json:"left"`
	Params      string    `json:"params,omitempty"`
	Expires     time.Time `json:"expires"`
}

// snapshot returns the state now. The caller holds mu.
func (s *state) snapshot() Snapshot {
	now := s.now()
	snap := Snapshot{
		At:       now,
		Bus:      busView{Connected: s.busUp, URL: s.busURL},
		Engines:  make([]engineView, 0, len(s.engines)),
		Routers:  make([]routerView, 0, len(s.routers)),
		Failures: make([]failureView, 0, len(s.failures)),
		Timeline: make([]timelineView, 0, len(s.timeline)),
		Faults:   make([]faultView, 0, len(s.faults)),
		Ignored:  s.ignored,
	}
	inFlight := map[string]int64{}
	for _, r := range s.routers {
		var sum int64
		if !r.report.IsZero() && now.Sub(r.report) <= reportMaxAge {
			for id, n := range r.inFlight {
				inFlight[id] += n
				sum += n
			}
		}
		rate, errShare := r.rates(now)
		snap.Routers = append(snap.Routers, routerView{
			ID: r.id, RequestRate: rate, ErrorRate: errShare, Requests: r.total, Errors: r.failed,
			InFlight: sum, LastSeen: r.lastSeen,
		})
	}
	since := now.Add(-latencyMaxAge)
	none := &engineStats{}
	for _, e := range s.engines {
		st := s.stats[e.id]
		if st == nil {
			st = none
		}
		v := engineView{
			ID: e.id, Role: e.role, Fleet: e.fleetState, Streak: e.streak, Reason: e.reason,
			InFlight: inFlight[e.id], Failures: st.failures, Probe: st.probe,
			TTFT: st.ttft.median(since), FirstByte: st.firstByte.median(since), ITL: st.itl.median(since),
		}
		if st.quarantinedUntil.After(now) {
			until := st.quarantinedUntil
			v.QuarantinedUntil = &until
		}
		v.State = e.shownState(st, now)
		snap.Engines = append(snap.Engines, v)
	}
	for i := len(s.failures) - 1; i >= 0; i-- {
		snap.Failures = append(snap.Failures, s.failures[i])
	}
	for i := len(s.timeline) - 1; i >= 0; i-- {
		snap.Timeline = append(snap.Timeline, s.timeline[i])
	}
	for _, f := range s.faults {
		if f.Expires.IsZero() || f.Expires.After(now) {
			snap.Faults = append(snap.Faults, f)
		}
	}
	slices.SortFunc(snap.Engines, func(a, b engineView) int { return strings.Compare(a.ID, b.ID) })
	slices.SortFunc(snap.Routers, func(a, b routerView) int { return strings.Compare(a.ID, b.ID) })
	slices.SortFunc(snap.Faults, func(a, b faultView) int {
		return strings.Compare(a.EngineID+"\x00"+a.FaultID, b.EngineID+"\x00"+b.FaultID)
	})
	return snap
}

// shownState is the one state the page shows for e, with its events'
// record st, at now.
func (e *engine) shownState(st *engineStats, now time.Time) string {
	switch e.fleetState {
	case schemas.FleetDraining:
		return stateDraining
	case schemas.FleetDrained:
		return stateDrained
	case schemas.FleetJoining:
		return stateProbing
	}
	if e.inPlacement && !e.eligible {
		return stateEjected
	}
	if st.quarantinedUntil.After(now) {
		return stateQuarantined
	}
	return stateEligible
}

// snapshotJSON returns the JSON of the state now, reusing the last one
// when nothing changed within the last 250 ms (time alone moves rates
// and quarantines, so a snapshot is never older than that).
func (s *state) snapshotJSON() ([]byte, uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if s.cached != nil && s.cachedV == s.version && now.Sub(s.cachedT) < 250*time.Millisecond {
		return s.cached, s.version
	}
	b, err := json.Marshal(s.snapshot())
	if err != nil {
		b = []byte(`{}`) // every field is marshalable: not reached
	}
	s.cached, s.cachedV, s.cachedT = b, s.version, now
	return b, s.version
}
