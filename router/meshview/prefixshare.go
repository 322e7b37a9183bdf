package meshview

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
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
	// placements, or half of bus.PrefixMaxBatch in bytes (long prompts
	// fill a batch by bytes first).
	shareFlushEntries = 256
	// shareQueuedBatches is how many full batches may wait for the flush
	// loop: a placement that does not fit the batch being filled seals
	// it and starts the next, and is dropped only when this many wait
	// already (a burst of long prompts faster than the loop publishes).
	shareQueuedBatches = 4
	// sharePendingBatches and sharePendingBytes bound the other routers'
	// live batches received and not yet applied (256 of the largest):
	// past them NATS drops what comes, counted as slow_consumer.
	sharePendingBatches = 1024
	sharePendingBytes   = 64 << 20
	// shareWarmTimeout bounds one warm-up read of stream NARWHAL_PREFIX.
	shareWarmTimeout = 10 * time.Second
	// shareWarmPull is how many batches the warm-up's consumer has asked
	// for or buffered at most: the server streams that many per round
	// trip, and the warm-up holds no more (a few MiB for batches of a
	// few KB; shareWarmPullBytes bounds larger ones). A limit in bytes
	// as well (PullMaxMessagesWithBytesLimit) made the client's buffer
	// overflow: "slow consumer, messages dropped", and the ordered
	// consumer made again.
	shareWarmPull = 1024
	// shareWarmPullBytes bounds the bytes one pull of the warm-up asks
	// for: without it, a pull of 1024 KV batches of up to 256 KiB each
	// (one engine filling the stream with large batches) is 256 MiB the
	// server queues for the router at once, past its per-client limit
	// (64 MiB): the server cut the router off as a slow consumer, the
	// router read the stream again on reconnecting, and so on.
	shareWarmPullBytes = 8 << 20
	// shareWarmOverlap is how far before a disconnection a reconnected
	// router reads the stream again.
	shareWarmOverlap = 2 * time.Second
	// shareLogEvery rate-limits the log lines of refused batches.
	shareLogEvery = 10 * time.Second
)

// Reasons of narwhal_prefix_batches_dropped_total.
const (
	// dropBufferFull: a placement did not fit the batch being filled (it
	// holds 256 KiB at most) while shareQueuedBatches full ones waited,
	// so it is not published.
	dropBufferFull = "buffer_full"
	// dropPublishFailed: a batch could not be handed to NATS (the
	// connection is closed, or its reconnect buffer is full).
	dropPublishFailed = "publish_failed"
	// dropSlowConsumer: live batches NATS dropped because they came
	// faster than this router applied them (sharePendingBatches,
	// sharePendingBytes): a router flooding its subject, or this one
	// starved of CPU.
	dropSlowConsumer = "slow_consumer"
	// dropInvalid: a batch received from the bus was malformed.
	dropInvalid = "invalid"
	// dropRouterMismatch: a valid batch came on another router's subject
	// than the one it names: one router speaking for another
	// (behaviour.md R-BUS-11).
	dropRouterMismatch = schemas.MismatchRouterID
)

// Outcomes of narwhal_prefix_warmup_batches_total.
const (
	// warmOutcomeRead: batches a warm-up read back from the stream.
	warmOutcomeRead = "read"
	// warmOutcomeMissed: batches a warm-up cut short did not read (the stream's
	// last sequence, when it began, minus the last one it read).
	warmOutcomeMissed = "missed"
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
	// share is placement.share_index: this router's placements are
	// published and the other routers' applied. kv, when set, applies
	// the engines' KV batches to the exact index (R-PLACE-4); the
	// warm-ups read both from the stream.
	share bool
	kv    *kvShare

	mu   sync.Mutex
	cur  *bus.PrefixBatch   // being filled by placements
	full []*bus.PrefixBatch // sealed, waiting for the flush (at most shareQueuedBatches)
	free []*bus.PrefixBatch // published, to be filled again
	kick chan struct{}      // a batch to publish now (full, 256 placements or half its bytes)
	out  []*bus.PrefixBatch // the flush loop's own: the batches it publishes
	// sub is the live subscription to the other routers' batches (nil
	// until shareIndex makes it); slowSeen is how many of them NATS had
	// dropped at the flush loop's last look (countSlow).
	sub      *nats.Subscription
	slowSeen int

	published, applied prometheus.Counter
	dropped            *prometheus.CounterVec
	ignored            prometheus.Counter
	warmBatches        *prometheus.CounterVec
	warmLimit          time.Duration // bounds one warm-up: the view's, shareWarmTimeout
	log                *slog.Logger  // the view's
	lastLog            atomic.Int64  // UnixNano of the last refused-batch line
	liveHashes         []uint64      // receive's buffer of hashes
}

// newIndexShare makes the share of v's prefix index and registers its
// metrics: narwhal_prefix_batches_published_total,
// narwhal_prefix_batches_applied_total,
// narwhal_prefix_batches_dropped_total{reason},
// narwhal_prefix_placements_ignored_total and
// narwhal_prefix_warmup_batches_total{outcome}.
func newIndexShare(v *View) *indexShare {
	s := &indexShare{
		v: v, index: v.PrefixIndex(), subject: bus.PrefixSubject(v.id), share: v.cfg.Placement.ShareIndex,
		cur: new(bus.PrefixBatch), kick: make(chan struct{}, 1),
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
			Help: "Prefix placements not shared, by reason: buffer_full (a placement that found the batch being filled and the 4 waiting to be published full), publish_failed (a batch NATS did not take), slow_consumer (other routers' batches NATS dropped because they came faster than this router applied them), invalid (a malformed batch received), router_id_mismatch (a batch received on another router's subject than the one it names).",
		}, []string{"reason"})),
		ignored: promreg.Register(v.reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_prefix_placements_ignored_total",
			Help: "Placements in other routers' batches not applied: the engine is not a prefill engine of this router's fleet, or not placeable (ejected, draining, drained).",
		})),
		warmBatches: promreg.Register(v.reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_prefix_warmup_batches_total",
			Help: "Batches of stream NARWHAL_PREFIX the prefix index warm-ups dealt with, by outcome: read (read back from the stream), missed (left unread by a warm-up cut short by its 10 s limit or the bus).",
		}, []string{"outcome"})),
		warmLimit: v.warmLimit, log: v.log,
	}
	for _, r := range []string{dropBufferFull, dropPublishFailed, dropSlowConsumer, dropInvalid, dropRouterMismatch} {
		s.dropped.WithLabelValues(r)
	}
	for _, o := range []string{warmOutcomeRead, warmOutcomeMissed} {
		s.warmBatches.WithLabelValues(o)
	}
	if len(v.id) <= bus.PrefixMaxID { // a longer id shares nothing (shareIndex)
		s.cur.Reset(v.id)
	}
	return s
}

// placed takes one placement of this router (the PlacedFunc of OnPlaced):
// it copies it into the batch being filled, without blocking. One that
// does not fit seals that batch for the flush loop and starts the next;
// it is dropped, and counted, only when shareQueuedBatches full batches
// wait already.
func (s *indexShare) placed(engineID string, hashes []uint64) {
	if len(hashes) > bus.PrefixMaxHashes {
		hashes = hashes[:bus.PrefixMaxHashes] // the leading blocks matter most
	}
	if engineID == "" || len(engineID) > bus.PrefixMaxID || len(hashes) == 0 {
		s.dropped.WithLabelValues(dropBufferFull).Inc() // no batch can hold it
		return
	}
	s.mu.Lock()
	ok := s.cur.Add(engineID, hashes)
	if !ok && s.cur.Len() > 0 && len(s.full) < shareQueuedBatches {
		s.full = append(s.full, s.cur)
		s.cur = s.freeBatch()
		ok = s.cur.Add(engineID, hashes)
	}
	kick := !ok || len(s.full) > 0 || s.cur.Len() >= shareFlushEntries || s.cur.Size() >= bus.PrefixMaxBatch/2
	s.mu.Unlock()
	if !ok {
		s.dropped.WithLabelValues(dropBufferFull).Inc()
	}
	if kick {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

// freeBatch returns an empty batch of this router: a published one, or a
// new one when none is free. At most 2 × (shareQueuedBatches + 1) exist:
// the ones a flush publishes (the full ones and the one being filled
// when it began) and as many filled meanwhile; the published ones are
// kept for reuse (up to 2.5 MiB after a burst of the longest prompts).
// The caller holds s.mu.
func (s *indexShare) freeBatch() *bus.PrefixBatch {
	var b *bus.PrefixBatch
	if n := len(s.free); n > 0 {
		b, s.free = s.free[n-1], s.free[:n-1]
	} else {
		b = new(bus.PrefixBatch)
	}
	b.Reset(s.v.id)
	return b
}

// flushLoop publishes the batch being filled every shareFlushEvery, or
// at once when kicked (placed), until the router shuts down.
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
		s.countSlow(s.sub)
	}
}

// countSlow adds to narwhal_prefix_batches_dropped_total{reason=
// "slow_consumer"} the live batches NATS dropped on sub since the last
// look, and says so in the log (at most every shareLogEvery). Only the
// flush loop calls it (it owns slowSeen); a nil sub counts nothing.
func (s *indexShare) countSlow(sub *nats.Subscription) {
	if sub == nil {
		return
	}
	n, err := sub.Dropped()
	if err != nil || n <= s.slowSeen {
		return
	}
	s.dropped.WithLabelValues(dropSlowConsumer).Add(float64(n - s.slowSeen))
	if now := time.Now().UnixNano(); now-s.lastLog.Load() > int64(shareLogEvery) {
		s.lastLog.Store(now)
		s.log.Warn("prefix placements of other routers dropped: they came faster than this router applies them",
			"reason", dropSlowConsumer, "dropped", n-s.slowSeen, "pending_limit_batches", sharePendingBatches)
	}
	s.slowSeen = n
}

// flush publishes the full batches waiting, in order, then the batch
// being filled, if it holds anything. NATS takes them into its buffer
// (also while reconnecting) without waiting. Only the flush loop calls
// it (it owns s.out).
func (s *indexShare) flush(nc *nats.Conn) {
	s.mu.Lock()
	out := append(s.out[:0], s.full...)
	clear(s.full)
	s.full = s.full[:0]
	if s.cur.Len() > 0 {
		out = append(out, s.cur)
		s.cur = s.freeBatch()
	}
	s.mu.Unlock()
	for _, b := range out {
		if err := nc.Publish(s.subject, b.Bytes()); err != nil {
			s.dropped.WithLabelValues(dropPublishFailed).Inc()
			continue
		}
		s.published.Inc()
	}
	s.mu.Lock()
	s.free = append(s.free, out...)
	s.mu.Unlock()
	clear(out)
	s.out = out[:0]
}

// receive applies a batch delivered live on narwhal.prefix.* (the
// subscription's goroutine is the only caller: it owns liveHashes).
func (s *indexShare) receive(msg *nats.Msg) {
	s.liveHashes = s.apply(msg.Subject, msg.Data, false, s.liveHashes)
}

// apply applies one batch received on subject to the index, only when it
// is a valid batch (R-BUS-9) of the router its subject names (R-BUS-11:
// another is counted as router_id_mismatch); a batch of
// this router's own id only when own is set (read back when the process
// starts: a router restarted with the same id made those placements in
// its previous life, and this index never recorded them). Each placement
// is learned only for a prefill-capable engine of this router's fleet
// that is placeable (eligible, active); the others are counted as
// ignored. The hashes are decoded into hashes, the caller's buffer (one
// per goroutine that applies), returned grown: a batch applied allocates
// nothing once it has grown.
func (s *indexShare) apply(subject string, data []byte, own bool, hashes []uint64) []uint64 {
	if subject == s.subject && !own {
		return hashes // ours, recorded when it was made
	}
	routerID, err := bus.CheckPrefixBatch(data)
	reason := dropInvalid
	if err == nil && !namesRouter(subject, routerID) {
		reason, err = dropRouterMismatch, fmt.Errorf("%w: names router %q", bus.ErrPrefixBatch, routerID)
	}
	if err != nil {
		s.dropped.WithLabelValues(reason).Inc()
		if now := time.Now().UnixNano(); now-s.lastLog.Load() > int64(shareLogEvery) {
			s.lastLog.Store(now)
			s.log.Warn("prefix placements ignored", "reason", reason, "subject", subject, "bytes", len(data), "err", err)
		}
		return hashes
	}
	fl := s.v.Fleet()
	hashes = bus.EachPrefixPlacement(data, hashes, func(engineID []byte, hs []uint64) {
		m := fl.byID[string(engineID)]
		if m == nil || !m.Can(Prefill) || !m.active.Load() || !m.eligible.Load() {
			s.ignored.Inc()
			return
		}
		s.index.Learn(m.ID, hs)
	})
	s.applied.Inc()
	return hashes
}

// namesRouter reports whether subject is routerID's subject of
// placements, bus.PrefixSubject(routerID), without building it.
func namesRouter(subject string, routerID []byte) bool {
	return len(subject) == len(bus.PrefixSubjectPrefix)+len(routerID) &&
		strings.HasPrefix(subject, bus.PrefixSubjectPrefix) && subject[len(bus.PrefixSubjectPrefix):] == string(routerID)
}

// warm reads back the batches stream NARWHAL_PREFIX holds from since on
// and applies them (the other routers' placements of the recent past,
// and this router id's own when own is set), up to the last batch the
// stream held when it began, or until s.warmLimit passes. Every wait on
// the server is bounded, so a bus that does not answer cannot hold the
// router. A warm-up that read up to that batch logs how many it read and
// how long it took; one cut short (by its limit, or the bus) logs at WARN
// `prefix index warm-up cut short` with how many it read and how many it
// missed (the stream's last sequence minus the last one read), and both
// are counted in narwhal_prefix_warmup_batches_total{outcome}. It reports
// whether it read the stream (false when the stream or the consumer could
// not be had: nothing was read).
func (s *indexShare) warm(b *bus.Bus, since time.Time, own bool) bool {
	ctx, cancel := context.WithTimeout(s.v.base, s.warmLimit)
	defer cancel()
	start := time.Now()
	st, err := b.JetStream().Stream(ctx, bus.PrefixStream)
	if err != nil {
		s.log.Warn("prefix index not warmed from the bus", "stream", bus.PrefixStream, "err", err)
		return false
	}
	last := st.CachedInfo().State.LastSeq
	var r warmRead
	if last > 0 {
		if r, err = s.readBack(ctx, b, since, last, own); err != nil && !r.started {
			s.log.Warn("prefix index not warmed from the bus", "stream", bus.PrefixStream, "err", err)
			return false
		}
	}
	s.warmBatches.WithLabelValues(warmOutcomeRead).Add(float64(r.batches))
	took := time.Since(start).Round(time.Millisecond)
	if err != nil {
		missed := last - r.upTo
		s.warmBatches.WithLabelValues(warmOutcomeMissed).Add(float64(missed))
		s.log.Warn("prefix index warm-up cut short", "stream", bus.PrefixStream, "batches", r.batches, "missed", missed,
			"last_read", r.upTo, "last", last, "limit", s.warmLimit, "took", took, "err", err)
		return true
	}
	s.log.Info("prefix index warmed from the bus", "batches", r.batches, "since", since.UTC().Format(time.RFC3339), "took", took)
	return true
}

// warmRead is what one read-back of stream NARWHAL_PREFIX did.
type warmRead struct {
	started bool   // the consumer was made: the read began
	batches int    // batches read (applied or refused)
	upTo    uint64 // stream sequence of the last batch read, or the one before the first to read
}

// prefixWarmConsumer makes the consumer, of this router's own name
// (R-BUS-11), that reads the subjects filters of stream NARWHAL_PREFIX
// back from since. Its one name serves every read, one at a time: the
// warm-ups of the placements and the KV batches, and the fills of gaps
// in an engine's KV batches.
func prefixWarmConsumer(ctx context.Context, b *bus.Bus, since time.Time, filters []string) (jetstream.Consumer, error) {
	cfg := jetstream.ConsumerConfig{
		Name:              b.ConsumerName(bus.PurposePrefix), // its own name (R-BUS-11)
		DeliverPolicy:     jetstream.DeliverByStartTimePolicy,
		OptStartTime:      &since,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: 5 * time.Second,
	}
	if len(filters) == 1 {
		cfg.FilterSubject = filters[0]
	} else {
		cfg.FilterSubjects = filters
	}
	return bus.OwnConsumer(ctx, b.JetStream(), bus.PrefixStream, cfg)
}

// warmFilters returns the subjects a warm-up reads: the other routers'
// placements when the index is shared, the engines' KV batches when the
// exact index is kept.
func (s *indexShare) warmFilters() []string {
	var f []string
	if s.share {
		f = append(f, bus.PrefixSubjectPrefix+"*")
	}
	if s.kv != nil {
		f = append(f, bus.KVSubjectPrefix+"*")
	}
	return f
}

// readBack applies the stream's batches from since up to sequence last
// (applying this router id's batches too when own is set): the other
// routers' placements, and the engines' KV batches when the exact index
// is kept. It returns what it read and, when it stopped before last (ctx
// done, the bus gone), why.
func (s *indexShare) readBack(ctx context.Context, b *bus.Bus, since time.Time, last uint64, own bool) (warmRead, error) {
	var hashes []uint64 // apply's buffer
	return readStream(ctx, b, since, last, s.warmFilters(), func(msg jetstream.Msg, at time.Time) {
		if s.kv != nil && strings.HasPrefix(msg.Subject(), bus.KVSubjectPrefix) {
			s.kv.apply(msg.Subject(), msg.Data(), at, false)
			return
		}
		hashes = s.apply(msg.Subject(), msg.Data(), own, hashes)
	})
}

// readStream calls fn with each message of stream NARWHAL_PREFIX on the
// subjects filters from since up to sequence last, in order, with its
// time in the stream. The server streams them in pulls of up to
// shareWarmPull, the next one asked for while the last is dealt with, so
// a read makes one consumer (prefixWarmConsumer) and costs a round trip
// per few hundred messages, and holds a bounded buffer. It returns what
// it read and, when it stopped before last (ctx done, the bus gone), why.
func readStream(ctx context.Context, b *bus.Bus, since time.Time, last uint64, filters []string, fn func(msg jetstream.Msg, at time.Time)) (warmRead, error) {
	var r warmRead
	cons, err := prefixWarmConsumer(ctx, b, since, filters)
	if err != nil {
		return r, err
	}
	it, err := cons.Messages(jetstream.PullMaxMessagesWithBytesLimit(shareWarmPull, shareWarmPullBytes))
	if err != nil {
		return r, err
	}
	defer it.Stop()
	r.started = true
	// The consumer starts at the first message from since: it has
	// delivered up to the one before, and says how many wait after it.
	if info := cons.CachedInfo(); info != nil {
		r.upTo = info.Delivered.Stream
		if info.NumPending == 0 {
			r.upTo = last // nothing from since on
		}
	}
	for r.upTo < last {
		if err := ctx.Err(); err != nil {
			return r, err
		}
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			return r, err
		}
		md, err := msg.Metadata()
		if err != nil {
			return r, err
		}
		fn(msg, md.Timestamp)
		r.batches++
		r.upTo = md.Sequence.Stream
		if md.NumPending == 0 {
			// Nothing the consumer can read follows: what is left up to
			// last is not one of its subjects (narwhal.prefix.a.b).
			return r, nil
		}
	}
	return r, nil
}

// run warms the index from the stream, publishes this router's
// placements (when shared), applies the engines' live KV batches (when
// the exact index is kept) and warms the index again after each
// reconnection (from a little before the connection was lost), until the
// router shuts down. subs are its subscriptions, ended with it.
func (s *indexShare) run(b *bus.Bus, subs ...*nats.Subscription) {
	defer func() {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
	}()
	nc := b.Conn()
	status := nc.StatusChanged(nats.DISCONNECTED, nats.CONNECTED)
	defer nc.RemoveStatusListener(status)
	if s.share {
		s.v.goFn(func() { s.flushLoop(nc) })
	}
	var live chan *nats.Msg // nil: no KV batches
	if s.kv != nil {
		live = s.kv.live
	}
	forget := time.NewTicker(10 * time.Second)
	defer forget.Stop()
	// The first read-back also takes this router id's own batches: they
	// are a previous process's. Later ones (after a reconnection) skip
	// them, as this process recorded them when it made them.
	warmed := b.Connected() && s.warm(b, time.Now().Add(-bus.PrefixMaxAge), true)
	var downSince time.Time
	for {
		select {
		case <-s.v.base.Done():
			return
		case msg := <-live:
			s.kv.receive(b, msg)
		case <-forget.C:
			if s.kv != nil {
				s.kv.forget()
			}
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

// shareIndex makes the router's prefix index the mesh's (behaviour.md
// R-PLACE-2) when placement.share_index is on: its placements are
// published on b and the other routers' applied; and, when the view
// keeps the exact index (placement.index auto or exact, R-PLACE-4), it
// applies the engines' KV batches to it. Both are warmed from stream
// NARWHAL_PREFIX. A router id longer than a batch can name (255 bytes)
// turns sharing off, with a warning.
func (v *View) shareIndex(b *bus.Bus) error {
	share := v.cfg.Placement.ShareIndex
	if share && len(v.id) > bus.PrefixMaxID {
		v.log.Warn("prefix index not shared: the router id is longer than 255 bytes")
		share = false
	}
	if !share && v.exact == nil {
		return nil
	}
	s := newIndexShare(v)
	s.share = share
	var subs []*nats.Subscription
	unsubscribe := func() {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
	}
	if share {
		sub, err := b.Conn().Subscribe(bus.PrefixSubjectPrefix+"*", s.receive)
		if err != nil {
			return err
		}
		_ = sub.SetPendingLimits(sharePendingBatches, sharePendingBytes)
		s.sub = sub
		subs = append(subs, sub)
	}
	if v.exact != nil {
		s.kv = newKVShare(v)
		sub, err := s.kv.subscribe(b.Conn())
		if err != nil {
			unsubscribe()
			return err
		}
		subs = append(subs, sub)
	}
	if !v.goFn(func() { s.run(b, subs...) }) {
		unsubscribe()
		return errShuttingDown
	}
	if share {
		v.OnPlaced(s.placed)
	}
	return nil
}
