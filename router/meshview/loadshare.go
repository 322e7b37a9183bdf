package meshview

import (
	"bytes"
	"fmt"
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
	loadEvery = 50 * time.Millisecond
	// loadHeartbeat is how often an unchanged report with work in it is
	// published again, so that the other routers can tell a router with
	// steady work from a silent one.
	loadHeartbeat = 500 * time.Millisecond
	// loadStaleAfter is how long a router's last report counts: one not
	// heard from for this long has its work forgotten.
	loadStaleAfter = time.Second
	// loadMaxPeers bounds the routers whose reports are kept.
	loadMaxPeers = 1024
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

// engineLoad is one router's work in flight on one engine.
type engineLoad struct {
	prefill, decode, tokens int64
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
// peerTokens) for placement to read without a lock. A router not heard
// from for staleAfter stops counting.
type loadShare struct {
	v          *View
	subject    string
	now        func() time.Time
	staleAfter time.Duration

	// The tick's own: only the publishing goroutine touches them.
	report   bus.LoadReport
	last     []byte
	lastSent time.Time

	mu    sync.Mutex // guards peers, sums
	peers map[string]*peerLoad
	sums  map[*Member]engineLoad // scratch of sum

	published prometheus.Counter
	ignored   *prometheus.CounterVec
	lastLog   atomic.Int64
}

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
	return s
}

// encode fills s.report with this router's work in flight per engine
// and returns it; engines with none are left out.
func (s *loadShare) encode() []byte {
	s.report.Reset(s.v.id)
	for _, m := range s.v.Fleet().members {
		p, d, k := m.reserved[Prefill].Load(), m.reserved[Decode].Load(), m.tokens.Load()
		if p > 0 || d > 0 || k > 0 {
			s.report.Add(m.ID, max(p, 0), max(d, 0), max(k, 0))
		}
	}
	return s.report.Bytes()
}

// tick publishes this router's report when it changed since the last
// one, or when it holds work and the last is loadHeartbeat old; an empty
// report is published once, when the work went, then nothing while the
// router stays idle. It then forgets the peers not heard from within
// staleAfter.
func (s *loadShare) tick(publish func(subject string, data []byte) error) {
	now := s.now()
	data := s.encode()
	changed := !bytes.Equal(data, s.last)
	if changed || (s.report.Len() > 0 && now.Sub(s.lastSent) >= loadHeartbeat) {
		if err := publish(s.subject, data); err == nil {
			s.published.Inc()
			s.last = append(s.last[:0], data...)
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

// receive applies a report delivered on narwhal.load.*.
func (s *loadShare) receive(msg *nats.Msg) { s.apply(msg.Subject, msg.Data) }

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
	routerID, err := bus.ParseLoadReport(data, func(engineID []byte, prefill, decode, tokens int64) {
		if m := fl.byID[string(engineID)]; m != nil {
			scratch[m] = engineLoad{prefill, decode, tokens}
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
		s.ignored.WithLabelValues(reason).Inc()
		if now := time.Now().UnixNano(); now-s.lastLog.Load() > int64(shareLogEvery) {
			s.lastLog.Store(now)
			s.v.log.Warn("load report ignored", "reason", reason, "subject", subject, "bytes", len(data), "err", err)
		}
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
		p.heard = s.now()
	}
	s.sum()
}

// sum writes into every member of the fleet the other routers' work on
// it: the sum over the peers kept. The caller holds s.mu.
func (s *loadShare) sum() {
	clear(s.sums)
	for _, p := range s.peers {
		for m, l := range p.loads {
			t := s.sums[m]
			t.prefill += l.prefill
			t.decode += l.decode
			t.tokens += l.tokens
			s.sums[m] = t
		}
	}
	for _, m := range s.v.Fleet().members {
		t := s.sums[m]
		m.peerReserved[Prefill].Store(t.prefill)
		m.peerReserved[Decode].Store(t.decode)
		m.peerTokens.Store(t.tokens)
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
	sub, err := b.Conn().Subscribe(bus.LoadSubjectPrefix+"*", s.receive)
	if err != nil {
		return err
	}
	if !v.goFn(func() { s.run(b.Conn(), sub) }) {
		_ = sub.Unsubscribe()
		return errShuttingDown
	}
	return nil
}
