package meshview

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/promreg"
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Tuning of the shared prefix index (behaviour.md R-PLACE-2).
const (
	// shareFlushEvery is how often the placements a router made are
	// published, at the latest: well within the 250 ms in which another
	// router applies them.
	shareFlushEvery = 25 * time.Millisecond
	// shareFlushEntries publishes a batch at once when it holds this many
	// placements.
	shareFlushEntries = 256
	// shareWarmTimeout bounds one warm-up read of stream NARWHAL_PREFIX.
	shareWarmTimeout = 10 * time.Second
	// shareWarmFetch is how many batches one fetch of the warm-up asks for.
	shareWarmFetch = 256
	// shareWarmOverlap is how far before a disconnection a reconnected
	// router reads the stream again.
	shareWarmOverlap = 2 * time.Second
	// shareLogEvery rate-limits the log lines of refused batches.
	shareLogEvery = 10 * time.Second
)

// Reasons of narwhal_prefix_batches_dropped_total.
const (
	// dropBufferFull: a placement did not fit the batch being filled (it
	// holds 256 KiB at most), so it is not published.
	dropBufferFull = "buffer_full"
	// dropPublishFailed: a batch could not be handed to NATS (the
	// connection is closed, or its reconnect buffer is full).
	dropPublishFailed = "publish_failed"
	// dropInvalid: a batch received from the bus was malformed.
	dropInvalid = "invalid"
	// dropRouterMismatch: a valid batch came on another router's subject
	// than the one it names: one router speaking for another
	// (behaviour.md R-BUS-11).
	dropRouterMismatch = schemas.MismatchRouterID
)

// indexShare is one router's part of the mesh-wide prefix index (behaviour.md
// R-PLACE-2): it publishes the placements this router makes, batched on
// narwhal.prefix.<router_id>, applies those of the other routers to the
// index, and warms the index from stream NARWHAL_PREFIX when the router
// joins the mesh and whenever its connection comes back.
type indexShare struct {
	v       *View
	index   *prefix.Index
	subject string // this router's

	mu    sync.Mutex
	cur   *bus.PrefixBatch // being filled by placements
	spare *bus.PrefixBatch // being published
	kick  chan struct{}    // a full batch waits

	published, applied prometheus.Counter
	dropped            *prometheus.CounterVec
	ignored            prometheus.Counter
	lastLog            atomic.Int64 // UnixNano of the last refused-batch line
}

// newIndexShare makes the share of v's prefix index and registers its
// metrics: narwhal_prefix_batches_published_total,
// narwhal_prefix_batches_applied_total,
// narwhal_prefix_batches_dropped_total{reason} and
// narwhal_prefix_placements_ignored_total.
func newIndexShare(v *View) *indexShare {
	s := &indexShare{
		v: v, index: v.PrefixIndex(), subject: bus.PrefixSubject(v.id),
		cur: new(bus.PrefixBatch), spare: new(bus.PrefixBatch), kick: make(chan struct{}, 1),
		published: promreg.Register(v.reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_prefix_batches_published_total",
			Help: "Batches of this router's prefix placements published on the bus for the other routers.",
		})),
		applied: promreg.Register(v.reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_prefix_batches_applied_total",
			Help: "Batches of other routers' prefix placements applied to this router's prefix index (live or read back from the stream).",
		})),
		dropped: promreg.Register(v.reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_prefix_batches_dropped_total",
			Help: "Prefix placements not shared, by reason: buffer_full (a placement that did not fit the batch), publish_failed (a batch NATS did not take), invalid (a malformed batch received), router_id_mismatch (a batch received on another router's subject than the one it names).",
		}, []string{"reason"})),
		ignored: promreg.Register(v.reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_prefix_placements_ignored_total",
			Help: "Placements in other routers' batches not applied: the engine is not a prefill engine of this router's fleet, or not placeable (ejected, draining, drained).",
		})),
	}
	for _, r := range []string{dropBufferFull, dropPublishFailed, dropInvalid, dropRouterMismatch} {
		s.dropped.WithLabelValues(r)
	}
	s.cur.Reset(v.id)
	s.spare.Reset(v.id)
	return s
}

// placed takes one placement of this router (the PlacedFunc of OnPlaced):
// it copies it into the batch being filled, without blocking — a
// placement that does not fit is dropped and counted.
func (s *indexShare) placed(engineID string, fresh []uint64) {
	if len(fresh) > bus.PrefixMaxHashes {
		fresh = fresh[:bus.PrefixMaxHashes] // the leading blocks matter most
	}
	s.mu.Lock()
	ok := s.cur.Add(engineID, fresh)
	n := s.cur.Len()
	s.mu.Unlock()
	if !ok {
		s.dropped.WithLabelValues(dropBufferFull).Inc()
	}
	if !ok || n >= shareFlushEntries {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

// flushLoop publishes the batch being filled every shareFlushEvery, or
// at once when it is full, until the router shuts down.
func (s *indexShare) flushLoop(nc *nats.Conn) {
	t := time.NewTicker(shareFlushEvery)
	defer t.Stop()
	for {
		select {
		case <-s.v.base.Done():
			s.flush(nc)
			return
		case <-t.C:
		case <-s.kick:
		}
		s.flush(nc)
	}
}

// flush publishes the batch being filled, if it holds anything. NATS
// takes it into its buffer (also while reconnecting) without waiting.
func (s *indexShare) flush(nc *nats.Conn) {
	s.mu.Lock()
	if s.cur.Len() == 0 {
		s.mu.Unlock()
		return
	}
	s.cur, s.spare = s.spare, s.cur
	s.cur.Reset(s.v.id)
	s.mu.Unlock()
	if err := nc.Publish(s.subject, s.spare.Bytes()); err != nil {
		s.dropped.WithLabelValues(dropPublishFailed).Inc()
		return
	}
	s.published.Inc()
}

// receive applies a batch delivered live on narwhal.prefix.*.
func (s *indexShare) receive(msg *nats.Msg) { s.apply(msg.Subject, msg.Data, false) }

// apply applies one batch received on subject to the index, only when it
// is a valid batch (R-BUS-9) of the router its subject names (R-BUS-11:
// another is counted as router_id_mismatch); a batch of
// this router's own id only when own is set (read back when the process
// starts: a router restarted with the same id made those placements in
// its previous life, and this index never recorded them). Each placement
// is learned only for a prefill-capable engine of this router's fleet
// that is placeable (eligible, active); the others are counted as
// ignored.
func (s *indexShare) apply(subject string, data []byte, own bool) {
	if subject == s.subject && !own {
		return // ours, recorded when it was made
	}
	routerID, placements, err := bus.ParsePrefixBatch(data)
	reason := dropInvalid
	if err == nil && bus.PrefixSubject(routerID) != subject {
		reason, err = dropRouterMismatch, fmt.Errorf("%w: names router %q", bus.ErrPrefixBatch, routerID)
	}
	if err != nil {
		s.dropped.WithLabelValues(reason).Inc()
		if now := time.Now().UnixNano(); now-s.lastLog.Load() > int64(shareLogEvery) {
			s.lastLog.Store(now)
			s.v.log.Warn("prefix placements ignored", "reason", reason, "subject", subject, "bytes", len(data), "err", err)
		}
		return
	}
	fl := s.v.Fleet()
	for _, p := range placements {
		m := fl.byID[p.EngineID]
		if m == nil || !m.Can(Prefill) || !m.active.Load() || !m.eligible.Load() {
			s.ignored.Inc()
			continue
		}
		s.index.Learn(p.EngineID, p.Hashes)
	}
	s.applied.Inc()
}

// warm reads back the batches stream NARWHAL_PREFIX holds from since on
// and applies them (the other routers' placements of the recent past,
// and this router id's own when own is set), up to the last batch the
// stream held when it began, or until shareWarmTimeout passes. Every
// wait on the server is bounded, so a bus that does not answer cannot
// hold the router. It reports whether it read the stream.
func (s *indexShare) warm(b *bus.Bus, since time.Time, own bool) bool {
	ctx, cancel := context.WithTimeout(s.v.base, shareWarmTimeout)
	defer cancel()
	start := time.Now()
	st, err := b.JetStream().Stream(ctx, bus.PrefixStream)
	if err != nil {
		s.v.log.Warn("prefix index not warmed from the bus", "stream", bus.PrefixStream, "err", err)
		return false
	}
	last := st.CachedInfo().State.LastSeq
	n := 0
	if last > 0 {
		n = s.readBack(ctx, b, since, last, own)
	}
	s.v.log.Info("prefix index warmed from the bus", "batches", n, "since", since.UTC().Format(time.RFC3339), "took", time.Since(start).Round(time.Millisecond))
	return true
}

// readBack applies the stream's batches from since up to sequence last
// with an ordered consumer of the router's own (applying this router id's
// batches too when own is set), and returns how many it read.
func (s *indexShare) readBack(ctx context.Context, b *bus.Bus, since time.Time, last uint64, own bool) int {
	cons, err := bus.OwnConsumer(ctx, b.JetStream(), bus.PrefixStream, jetstream.ConsumerConfig{
		Name:              b.ConsumerName(bus.PurposePrefix), // its own name (R-BUS-11)
		FilterSubject:     bus.PrefixSubjectPrefix + "*",
		DeliverPolicy:     jetstream.DeliverByStartTimePolicy,
		OptStartTime:      &since,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: 5 * time.Second,
	})
	if err != nil {
		s.v.log.Warn("prefix index not warmed from the bus", "stream", bus.PrefixStream, "err", err)
		return 0
	}
	// Each fetch asks for no more than the consumer has pending (known from
	// the last message read; one at first), so it ends as soon as its
	// batch is full and leaves nothing waiting behind it.
	n, want := 0, 1
	for ctx.Err() == nil && want > 0 {
		batch, err := cons.Fetch(want, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			s.v.log.Warn("prefix index warm-up cut short", "stream", bus.PrefixStream, "err", err)
			return n
		}
		got, done := 0, false
		for msg := range batch.Messages() {
			got++
			if done {
				continue
			}
			s.apply(msg.Subject(), msg.Data(), own)
			md, err := msg.Metadata()
			if err != nil || md.Sequence.Stream >= last {
				done = true
				continue
			}
			want = int(min(md.NumPending, shareWarmFetch))
		}
		n += got
		if done || got == 0 {
			return n
		}
	}
	return n
}

// run subscribes to the other routers' placements, warms the index from
// the stream, publishes this router's placements, and warms the index
// again after each reconnection (from a little before the connection was
// lost), until the router shuts down.
func (s *indexShare) run(b *bus.Bus, sub *nats.Subscription) {
	defer func() { _ = sub.Unsubscribe() }()
	nc := b.Conn()
	status := nc.StatusChanged(nats.DISCONNECTED, nats.CONNECTED)
	defer nc.RemoveStatusListener(status)
	s.v.goFn(func() { s.flushLoop(nc) })
	// The first read-back also takes this router id's own batches: they
	// are a previous process's. Later ones (after a reconnection) skip
	// them, as this process recorded them when it made them.
	warmed := b.Connected() && s.warm(b, time.Now().Add(-bus.PrefixMaxAge), true)
	var downSince time.Time
	for {
		select {
		case <-s.v.base.Done():
			return
		case st := <-status:
			switch st {
			case nats.DISCONNECTED:
				if downSince.IsZero() {
					downSince = time.Now()
				}
			case nats.CONNECTED:
				since := downSince.Add(-shareWarmOverlap)
				if !warmed || downSince.IsZero() {
					since = time.Now().Add(-bus.PrefixMaxAge)
				}
				downSince = time.Time{}
				warmed = s.warm(b, since, !warmed) || warmed
			}
		}
	}
}

// shareIndex makes the router's prefix index the mesh's (behaviour.md R-PLACE-2)
// when placement.share_index is on: its placements are published on b
// and the other routers' applied. A router id longer than a batch can
// name (255 bytes) turns sharing off, with a warning.
func (v *View) shareIndex(b *bus.Bus) error {
	if !v.cfg.Placement.ShareIndex {
		return nil
	}
	if len(v.id) > bus.PrefixMaxID {
		v.log.Warn("prefix index not shared: the router id is longer than 255 bytes")
		return nil
	}
	s := newIndexShare(v)
	sub, err := b.Conn().Subscribe(bus.PrefixSubjectPrefix+"*", s.receive)
	if err != nil {
		return err
	}
	if !v.goFn(func() { s.run(b, sub) }) {
		_ = sub.Unsubscribe()
		return errShuttingDown
	}
	v.OnPlaced(s.placed)
	return nil
}
