package meshview

import (
	"fmt"
	"hash/maphash"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/promreg"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Tuning of the load exchange (behaviour.md R-PLACE-3).
const (
	// loadEvery is how often a router looks at its in-flight work and
	// publishes it when it changed: another router sees it within this
	// plus one NATS hop.
	loadEvery = 5 * time.Millisecond
	// loadHeartbeat is how often an unchanged report with work in it is
	// published again, so that the other routers can tell a router with
	// steady work from a silent one.
	loadHeartbeat = 500 * time.Millisecond
	// loadStaleAfter is how long a router's last report counts: one not
	// heard from for this long has its work forgotten.
	loadStaleAfter = time.Second
	// loadMaxPeers bounds the routers whose reports are kept.
	loadMaxPeers = 1024
	// peerPlacedMaxLife is how long at most another router's placement
	// in flight (bus.AppendPlaced) credits its engine (R-PLACE-4) when
	// the end of its attempt (bus.AppendPlacedEnd) is never heard: a
	// lost message, or a router gone mid-attempt. Longer than a prefill's
	// queue and computation under heavy load, short against how long a
	// just-computed prompt stays in an engine's cache.
	peerPlacedMaxLife = 10 * time.Second
	// peerPlacedGrace is how long after another router's prefill
	// completed its credit lasts: the engine's KV events for the blocks
	// are due by then (the router's own grace is the same).
	peerPlacedGrace = 250 * time.Millisecond
)

// Reasons of narwhal_load_reports_ignored_total.
const (
	// loadIgnoredInvalid: a malformed or oversized report.
	loadIgnoredInvalid = "invalid"
	// loadIgnoredRouterMismatch: a valid report whose router id is not
	// its subject's (behaviour.md R-BUS-11).
	loadIgnoredRouterMismatch = schemas.MismatchRouterID
	// loadIgnoredTooManyRouters: a report of a router beyond
	// loadMaxPeers.
	loadIgnoredTooManyRouters = "too_many_routers"
)

// engineLoad is one router's work in flight on one engine: its counts,
// the UnixNano moments (on this router's clock, 0 unknown) its prefills
// there began to be in flight without a break and last ended, and its
// pace there (bus.EngineLoad).
type engineLoad struct {
	prefill, decode, tokens int64
	busy, end               int64
	mean, meanTokens        int64
	// paces is, in sum's totals only, how many peers told a pace.
	paces int64
}

// peerLoad is another router's last report.
type peerLoad struct {
	heard time.Time
	loads map[*Member]engineLoad
}

// loadShare is one router's part of the mesh's load (behaviour.md
// R-PLACE-3): it publishes, every loadEvery while it changes (and every
// loadHeartbeat while it has work in flight), the legs and uncached
// prefill tokens this router has in flight on each engine on
// narwhal.load.<router_id>, keeps the other routers' last reports, and
// writes their sum per engine into each Member (peerReserved,
// peerTokens, and the head: peerHeadBusy, peerHeadEnd, peerMean,
// peerMeanTokens) for placement to read without a lock. A router not
// heard from for staleAfter stops counting; the last end heard of an
// engine stays (it is a fact about the engine, not about that router).
type loadShare struct {
	v          *View
	subject    string
	now        func() time.Time
	staleAfter time.Duration

	// The tick's own: only the publishing goroutine touches them.
	report   bus.LoadReport
	counts   []int64 // the report's entries as (member, prefill, decode, tokens, busy, end moments)
	last     []int64 // counts of the last report published
	lastSent time.Time

	mu    sync.Mutex // guards peers, sums
	peers map[string]*peerLoad
	sums  map[*Member]engineLoad // scratch of sum

	published prometheus.Counter
	ignored   *prometheus.CounterVec
	lastLog   atomic.Int64

	// nc publishes this router's placements in flight (SharePlaced);
	// placedKeys is the receiving goroutine's decode buffer.
	nc         *nats.Conn
	placedKeys []uint64
	placed     *prometheus.CounterVec // narwhal_prefix_inflight_shared_total{outcome}
	// Its busy series, held so that counting one allocates nothing.
	placedPub, placedApp, endPub, ended, endUnmatched prometheus.Counter
}

// Outcomes of narwhal_prefix_inflight_shared_total.
const (
	placedPublished     = "published"
	placedApplied       = "applied"
	placedUnknownEngine = "unknown_engine"
	placedEndPublished  = "end_published"
	placedEnded         = "ended"
	placedEndUnmatched  = "end_unmatched"
)

// newLoadShare makes v's load exchange and registers its metrics:
// narwhal_load_reports_published_total and
// narwhal_load_reports_ignored_total{reason}, created at zero.
func newLoadShare(v *View) *loadShare {
	s := &loadShare{v: v, subject: bus.LoadSubject(v.id), now: time.Now, staleAfter: loadStaleAfter,
		peers: map[string]*peerLoad{}, sums: map[*Member]engineLoad{},
		published: promreg.Register(v.reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_load_reports_published_total",
			Help: "Reports of this router's in-flight work per engine published on the bus for the other routers' placement.",
		})),
		ignored: promreg.Register(v.reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_load_reports_ignored_total",
			Help: "Other routers' load reports not applied, by reason: invalid (malformed or oversized), router_id_mismatch (its router id is not its subject's), too_many_routers.",
		}, []string{"reason"})),
	}
	for _, r := range []string{loadIgnoredInvalid, loadIgnoredRouterMismatch, loadIgnoredTooManyRouters} {
		s.ignored.WithLabelValues(r)
	}
	s.placed = promreg.Register(v.reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "narwhal_prefix_inflight_shared_total",
		Help: "Placements in flight on exact-index engines shared between routers: published (this router's), applied (another router's, credited to its engine until its attempt ends, 10 s at most), unknown_engine (another router's, on an engine not a prefill engine of this router's fleet), end_published (this router's attempt ended), ended (another router's attempt ended, its credit settled), end_unmatched (another router's attempt ended and no credit of it was kept).",
	}, []string{"outcome"}))
	for _, o := range []string{placedPublished, placedApplied, placedUnknownEngine, placedEndPublished, placedEnded, placedEndUnmatched} {
		s.placed.WithLabelValues(o)
	}
	s.placedPub, s.placedApp = s.placed.WithLabelValues(placedPublished), s.placed.WithLabelValues(placedApplied)
	s.endPub, s.ended = s.placed.WithLabelValues(placedEndPublished), s.placed.WithLabelValues(placedEnded)
	s.endUnmatched = s.placed.WithLabelValues(placedEndUnmatched)
	return s
}

// SharePlaced publishes, when the router shares its load
// (placement.share_index), that it placed a prompt of token-block keys
// keys on engine m by its exact index (R-PLACE-4): the other routers
// credit m with it until SharePlacedEnd says its attempt ended, for
// peerPlacedMaxLife at most. buf is the caller's encoding
// buffer, returned grown for reuse, with whether the placement was
// published (SharePlacedEnd is then due). It does not block (a core NATS
// publish into the connection's buffer) and, once buf has grown, does
// not allocate; a failed publish is dropped (the credit is a hint).
func (v *View) SharePlaced(m *Member, keys []uint64, buf []byte) ([]byte, bool) {
	s := v.loads.Load()
	if s == nil || s.nc == nil {
		return buf, false
	}
	data, ok := bus.AppendPlaced(buf[:0], v.id, m.ID, keys)
	if ok && s.nc.Publish(s.subject, data) == nil {
		s.placedPub.Inc()
		return data, true
	}
	return data, false
}

// SharePlacedEnd publishes, when the router shares its load, that the
// attempt of a placement SharePlaced published on m ended (R-PLACE-4):
// count and last are bus.PlacedChain of the keys SharePlaced was given;
// completed says its prefill
// completed (the other routers keep the credit for peerPlacedGrace) or
// not (they drop it at once). Like SharePlaced it does not block, a
// failed publish is dropped (the credit then lasts peerPlacedMaxLife),
// and it allocates nothing: the message, about 30 bytes, is encoded on
// the stack.
func (v *View) SharePlacedEnd(m *Member, count int, last uint64, completed bool) {
	s := v.loads.Load()
	if s == nil || s.nc == nil {
		return
	}
	outcome := bus.PlacedFailed
	if completed {
		outcome = bus.PlacedCompleted
	}
	var b [4 + 2*(1+bus.PrefixMaxID) + 1 + 2 + 8]byte
	data, ok := bus.AppendPlacedEnd(b[:0], v.id, m.ID, count, last, outcome)
	if ok && s.nc.Publish(s.subject, data) == nil {
		s.endPub.Inc()
	}
}

// applyPlaced credits, until its attempt's end is heard and for
// peerPlacedMaxLife at most, the engine of another
// router's placement in flight received on subject (R-PLACE-4): only a
// valid message (R-BUS-9) of the router its subject names (R-BUS-11), on
// a prefill engine of the fleet; this router's own is skipped.
func (s *loadShare) applyPlaced(subject string, data []byte) {
	if subject == s.subject {
		return
	}
	routerID, engineID, keys, err := bus.ParsePlaced(data, s.placedKeys)
	s.placedKeys = keys
	reason := loadIgnoredInvalid
	if err == nil && bus.LoadSubject(string(routerID)) != subject {
		reason, err = loadIgnoredRouterMismatch, fmt.Errorf("%w: names router %q", bus.ErrLoadReport, routerID)
	}
	if err != nil {
		s.ignore("placement in flight ignored", reason, subject, data, err)
		return
	}
	m := s.v.Fleet().byID[string(engineID)]
	if m == nil || !m.Can(Prefill) {
		s.placed.WithLabelValues(placedUnknownEngine).Inc()
		return
	}
	now := s.now()
	f := m.PeerInflight()
	// Never refused: its slots hold only settled credits, and the one
	// ending soonest makes room.
	f.Settle(f.AddOwned(keys, peerOwner(routerID), now.UnixNano()), now.Add(peerPlacedMaxLife).UnixNano())
	s.placedApp.Inc()
}

// peerSeed seeds peerOwner.
var peerSeed = maphash.MakeSeed()

// peerOwner is the owner (prefix.Inflight.AddOwned) of another router's
// credits: a hash of its id, never 0, so that one router's end cannot
// settle another's credit of the same prompt.
func peerOwner(routerID []byte) uint64 { return maphash.Bytes(peerSeed, routerID) | 1 }

// applyPlacedEnd settles the credit applyPlaced gave another router's
// placement whose attempt ended, received on subject (R-PLACE-4): kept
// peerPlacedGrace more when its prefill completed, dropped when not.
// Only a valid message (R-BUS-9) of the router its subject names
// (R-BUS-11) is applied, to a credit of that router's own placement
// only (peerOwner); it only ever shortens a credit.
func (s *loadShare) applyPlacedEnd(subject string, data []byte) {
	if subject == s.subject {
		return
	}
	e, err := bus.ParsePlacedEnd(data)
	reason := loadIgnoredInvalid
	if err == nil && bus.LoadSubject(string(e.RouterID)) != subject {
		reason, err = loadIgnoredRouterMismatch, fmt.Errorf("%w: names router %q", bus.ErrLoadReport, e.RouterID)
	}
	if err != nil {
		s.ignore("placement end ignored", reason, subject, data, err)
		return
	}
	m := s.v.Fleet().byID[string(e.EngineID)]
	if m == nil || !m.Can(Prefill) {
		s.placed.WithLabelValues(placedUnknownEngine).Inc()
		return
	}
	until := int64(0)
	if e.Outcome == bus.PlacedCompleted {
		until = s.now().Add(peerPlacedGrace).UnixNano()
	}
	if m.PeerInflight().SettleChain(peerOwner(e.RouterID), e.Count, e.Last, until) {
		s.ended.Inc()
	} else {
		s.endUnmatched.Inc()
	}
}

// encode fills s.report with this router's work in flight per engine
// at now, with the head of each engine's queue as this router knows it
// (Member.loadEntry), and returns it; engines with no work in flight
// and no prefill ended within staleAfter are left out.
func (s *loadShare) encode(now time.Time) []byte {
	s.report.Reset(s.v.id)
	s.counts = s.counts[:0]
	for i, m := range s.v.Fleet().members {
		if l, busy, end := m.loadEntry(now, s.staleAfter); l.Prefill > 0 || l.Decode > 0 || l.Tokens > 0 || l.HeadEnd > 0 {
			if s.report.Append(m.ID, l) {
				s.counts = append(s.counts, int64(i), l.Prefill, l.Decode, l.Tokens, busy, end)
			}
		}
	}
	return s.report.Bytes()
}

// tick publishes this router's report when its entries, their counts
// or the moments their heads began and ended changed since the last one
// (the ages growing with the clock alone do not), or when it holds entries
// and the last is loadHeartbeat old; an empty report is published once,
// when the work went and its last prefill end aged past staleAfter, then
// nothing while the router stays idle. It then forgets the peers not
// heard from within staleAfter.
func (s *loadShare) tick(publish func(subject string, data []byte) error) {
	now := s.now()
	data := s.encode(now)
	changed := !slices.Equal(s.counts, s.last) || s.lastSent.IsZero()
	if changed || (s.report.Len() > 0 && now.Sub(s.lastSent) >= loadHeartbeat) {
		if err := publish(s.subject, data); err == nil {
			s.published.Inc()
			s.last = append(s.last[:0], s.counts...)
			s.lastSent = now
		}
	}
	s.expire(now)
}

// expire forgets the peers last heard from before now − staleAfter.
func (s *loadShare) expire(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	gone := false
	for id, p := range s.peers {
		if now.Sub(p.heard) >= s.staleAfter {
			delete(s.peers, id)
			gone = true
		}
	}
	if gone {
		s.sum()
	}
}

// receive applies a report, a placement in flight or its end, delivered on
// narwhal.load.*.
func (s *loadShare) receive(msg *nats.Msg) {
	if bus.IsPlaced(msg.Data) {
		s.applyPlaced(msg.Subject, msg.Data)
		return
	}
	if bus.IsPlacedEnd(msg.Data) {
		s.applyPlacedEnd(msg.Subject, msg.Data)
		return
	}
	s.apply(msg.Subject, msg.Data)
}

// apply applies one report received on subject: only a valid report
// (R-BUS-9) of the router its subject names (R-BUS-11); this router's
// own is skipped. Counts of engines outside the fleet are not kept.
func (s *loadShare) apply(subject string, data []byte) {
	if subject == s.subject {
		return
	}
	fl := s.v.Fleet()
	s.mu.Lock()
	defer s.mu.Unlock()
	scratch := s.sums // reused: sum rebuilds it after
	clear(scratch)
	now := s.now()
	routerID, err := bus.ParseLoadReport(data, func(engineID []byte, l bus.EngineLoad) {
		if m := fl.byID[string(engineID)]; m != nil {
			scratch[m] = peerEngineLoad(now, l)
		}
	})
	reason := loadIgnoredInvalid
	if err == nil && bus.LoadSubject(routerID) != subject {
		reason, err = loadIgnoredRouterMismatch, fmt.Errorf("%w: names router %q", bus.ErrLoadReport, routerID)
	}
	p := s.peers[routerID]
	if err == nil && p == nil && len(scratch) > 0 && len(s.peers) >= loadMaxPeers {
		reason, err = loadIgnoredTooManyRouters, fmt.Errorf("%w: more than %d routers", bus.ErrLoadReport, loadMaxPeers)
	}
	if err != nil {
		s.ignore("load report ignored", reason, subject, data, err)
		s.sum()
		return
	}
	switch {
	case len(scratch) == 0:
		delete(s.peers, routerID)
	case p == nil:
		p = &peerLoad{loads: make(map[*Member]engineLoad, len(scratch))}
		s.peers[routerID] = p
		fallthrough
	default:
		clear(p.loads)
		for m, l := range scratch {
			p.loads[m] = l
		}
		p.heard = now
	}
	s.sum()
}

// peerEngineLoad places another router's entry l, received at now, on
// this router's clock: its ages become moments before now. A busy start
// counts only with prefills in flight, a pace only when both its parts
// are known.
func peerEngineLoad(now time.Time, l bus.EngineLoad) engineLoad {
	e := engineLoad{prefill: l.Prefill, decode: l.Decode, tokens: l.Tokens}
	if l.HeadBusy > 0 && l.Prefill > 0 {
		e.busy = now.Add(-l.HeadBusy).UnixNano()
	}
	if l.HeadEnd > 0 {
		e.end = now.Add(-l.HeadEnd).UnixNano()
	}
	if l.PaceMean > 0 && l.PaceTokens > 0 {
		e.mean, e.meanTokens = int64(l.PaceMean), l.PaceTokens
	}
	return e
}

// ignore counts a message of subject not applied, for reason, in
// narwhal_load_reports_ignored_total and logs it as msg, at most once
// every shareLogEvery.
func (s *loadShare) ignore(msg, reason, subject string, data []byte, err error) {
	s.ignored.WithLabelValues(reason).Inc()
	if now := time.Now().UnixNano(); now-s.lastLog.Load() > int64(shareLogEvery) {
		s.lastLog.Store(now)
		s.v.log.Warn(msg, "reason", reason, "subject", subject, "bytes", len(data), "err", err)
	}
}

// sum writes into every member of the fleet the other routers' work on
// it: the sum of the counts over the peers kept, the earliest busy start
// among them, the latest end heard from any (kept when it is later than
// theirs: only a later one replaces it), and the mean of their paces (in sums,
// mean and meanTokens hold the paces' sums and busy's zero means none
// until the division below). The caller holds s.mu.
func (s *loadShare) sum() {
	clear(s.sums)
	for _, p := range s.peers {
		for m, l := range p.loads {
			t := s.sums[m]
			t.prefill += l.prefill
			t.decode += l.decode
			t.tokens += l.tokens
			if l.busy > 0 && (t.busy == 0 || l.busy < t.busy) {
				t.busy = l.busy
			}
			t.end = max(t.end, l.end)
			if l.mean > 0 {
				t.mean += min(l.mean, int64(bus.LoadMaxAge))
				t.meanTokens += min(l.meanTokens, bus.LoadMaxCount)
				t.paces++
			}
			s.sums[m] = t
		}
	}
	for _, m := range s.v.Fleet().members {
		t := s.sums[m]
		m.peerReserved[Prefill].Store(t.prefill)
		m.peerReserved[Decode].Store(t.decode)
		m.peerTokens.Store(t.tokens)
		m.peerHeadBusy.Store(t.busy)
		if t.end > m.peerHeadEnd.Load() {
			m.peerHeadEnd.Store(t.end)
		}
		if t.paces > 0 {
			t.mean, t.meanTokens = t.mean/t.paces, t.meanTokens/t.paces
		}
		m.peerMean.Store(t.mean)
		m.peerMeanTokens.Store(t.meanTokens)
	}
}

// run publishes every loadEvery until the router shuts down.
func (s *loadShare) run(nc *nats.Conn, sub *nats.Subscription) {
	defer func() { _ = sub.Unsubscribe() }()
	t := time.NewTicker(loadEvery)
	defer t.Stop()
	for {
		select {
		case <-s.v.base.Done():
			return
		case <-t.C:
			s.tick(nc.Publish)
		}
	}
}

// shareLoad makes this router's work in flight part of the mesh's load
// (behaviour.md R-PLACE-3) when placement.share_index is on: published on
// narwhal.load.<id>, the other routers' applied.
func (v *View) shareLoad(b *bus.Bus) error {
	if !v.cfg.Placement.ShareIndex || len(v.id) > bus.PrefixMaxID {
		return nil
	}
	s := newLoadShare(v)
	s.nc = b.Conn()
	sub, err := b.Conn().Subscribe(bus.LoadSubjectPrefix+"*", s.receive)
	if err != nil {
		return err
	}
	if !v.goFn(func() { s.run(b.Conn(), sub) }) {
		_ = sub.Unsubscribe()
		return errShuttingDown
	}
	v.loads.Store(s)
	return nil
}
