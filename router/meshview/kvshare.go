package meshview

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/promreg"
	"github.com/narwhalmesh/narwhal/prefix"
)

// Tuning of the exact index's consumption of the engines' KV batches
// (behaviour.md R-PLACE-4).
const (
	// kvLiveBuffer is how many live batches wait for the index at most
	// (while a warm-up or a gap's fill reads the stream): past it NATS
	// drops them (a slow consumer), and the gaps they leave are filled
	// from the stream or drop the engine.
	kvLiveBuffer = 8192
	// kvFillTimeout bounds one read of stream NARWHAL_PREFIX that fills a
	// gap in an engine's batches.
	kvFillTimeout = 2 * time.Second
	// kvFillEvery is the least time between two fills of one engine's
	// gaps: an engine whose batches keep skipping is dropped, not read
	// back again and again.
	kvFillEvery = time.Second
	// kvFillOverlap is how far before the last batch applied of an engine
	// a fill reads the stream from (clocks of the router and the server
	// differ a little; what is read twice is skipped by its seq).
	kvFillOverlap = 2 * time.Second
)

// Outcomes of narwhal_kv_batches_total.
const (
	kvApplied     = "applied"
	kvInvalid     = "refused_invalid"
	kvMismatch    = "refused_id_mismatch"
	kvUnknown     = "unknown_engine"
	kvGap         = "gap"
	kvDuplicate   = "duplicate"
	kvEpoch       = "new_epoch"
	kvOutcomeHelp = "Engines' KV batches (narwhal.kv.<engine_id>, live or read back from stream NARWHAL_PREFIX) by outcome: applied (to the exact index), refused_invalid (malformed), refused_id_mismatch (a valid batch on another engine's subject than the one it names), unknown_engine (an engine that is not a prefill engine of this router's fleet), gap (applied after batches the router missed and could not read back: the engine's exact index was dropped first), duplicate (seen before, skipped), new_epoch (the first of an agent run, or of its engine's batches this router sees)."
)

// kvShare applies the engines' KV batches to the router's exact index
// (behaviour.md R-PLACE-4): live from the core subscription
// narwhal.kv.*, and read back from stream NARWHAL_PREFIX by the warm-ups
// of indexShare and by the fills of gaps. Every batch is applied by one
// goroutine (indexShare.run), so an engine's batches apply in the order
// of their seq.
type kvShare struct {
	v     *View
	exact *prefix.ExactIndex
	live  chan *nats.Msg

	batches *prometheus.CounterVec
	outcome [7]prometheus.Counter // by kvOutcomes' order
	lastLog atomic.Int64          // UnixNano of the last refused-batch line
	keys    []uint64              // the keys of an op, decoded (ReadKVOps' buffer)
	// cur is the engine of the batch being applied; opFn is k.applyOp,
	// bound once (a method value made per batch would allocate).
	cur  *prefix.ExactEngine
	opFn func(bus.KVOp, int, bus.KVMedium, []uint64)
	hdr  bus.KVHeader // ReadKVOps' header, reused
	// lastSeen is by engine id, fleet prefill engines only.
	lastSeen map[string]engineFeed
}

// engineFeed is what the router last applied of an engine's batches:
// when (the router's clock, or the stream's for a batch read back) and
// when a gap was last filled from the stream; and when its last gap was
// logged (the router's clock) with the gaps not logged since.
type engineFeed struct {
	applied, filled time.Time
	gapLogged       time.Time
	gapsUnlogged    int
}

var kvOutcomes = [...]string{kvApplied, kvInvalid, kvMismatch, kvUnknown, kvGap, kvDuplicate, kvEpoch}

// newKVShare makes the consumer of v's exact index and registers
// narwhal_kv_batches_total{outcome}.
func newKVShare(v *View) *kvShare {
	k := &kvShare{v: v, exact: v.exact, live: make(chan *nats.Msg, kvLiveBuffer), lastSeen: map[string]engineFeed{},
		batches: promreg.Register(v.reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_kv_batches_total",
			Help: kvOutcomeHelp,
		}, []string{"outcome"}))}
	for i, o := range kvOutcomes {
		k.outcome[i] = k.batches.WithLabelValues(o)
	}
	k.opFn = k.applyOp
	return k
}

func (k *kvShare) count(outcome int) { k.outcome[outcome].Inc() }

// Indexes of kvShare.outcome.
const (
	iApplied = iota
	iInvalid
	iMismatch
	iUnknown
	iGap
	iDuplicate
	iEpoch
)

// subscribe starts the live subscription narwhal.kv.* into k.live.
func (k *kvShare) subscribe(nc *nats.Conn) (*nats.Subscription, error) {
	sub, err := nc.ChanSubscribe(bus.KVSubjectPrefix+"*", k.live)
	if err != nil {
		return nil, err
	}
	// The channel is the bound: NATS drops what does not fit.
	_ = sub.SetPendingLimits(kvLiveBuffer, bus.KVMaxBatch*64)
	return sub, nil
}

// apply applies one batch received on subject at (the router's clock
// for a live batch, the stream's for one read back) to the exact index,
// only when it is a valid batch (R-BUS-9) of the engine its subject
// names (R-BUS-11) and that engine is a prefill engine of the fleet.
// A batch after a gap returns gap true without applying it when fill is
// set and the engine's gaps may be filled now: the caller reads the
// stream back (fillGap) and applies the batch again, with fill unset.
// It allocates nothing once k.keys has grown.
func (k *kvShare) apply(subject string, data []byte, at time.Time, fill bool) (gap bool) {
	h, err := bus.CheckKVBatch(data)
	outcome := iInvalid
	if err == nil && !namesEngine(subject, h.EngineID) {
		outcome, err = iMismatch, fmt.Errorf("%w: names engine %q", bus.ErrKVBatch, h.EngineID)
	}
	if err != nil {
		k.count(outcome)
		if now := time.Now().UnixNano(); now-k.lastLog.Load() > int64(shareLogEvery) {
			k.lastLog.Store(now)
			k.v.log.Warn("KV batch refused", "reason", kvOutcomes[outcome], "subject", subject, "bytes", len(data), "err", err)
		}
		return false
	}
	m := k.v.Fleet().byID[string(h.EngineID)]
	if m == nil || !m.Can(Prefill) {
		k.count(iUnknown)
		return false
	}
	e := k.exact.Engine(m.ID)
	if e == nil {
		k.count(iUnknown)
		return false
	}
	feed := k.lastSeen[m.ID]
	if fill && e.Check(h.Epoch, h.Seq) == prefix.SeqGap && at.Sub(feed.filled) >= kvFillEvery {
		return true
	}
	v := e.Begin(h.Epoch, h.Seq, h.BlockSize)
	if v != prefix.SeqDuplicate {
		k.cur = e
		k.keys, _ = bus.ReadKVOps(data, &k.hdr, k.keys, k.opFn)
		k.cur = nil
	}
	e.End()
	switch v {
	case prefix.SeqDuplicate:
		k.count(iDuplicate)
		return false
	case prefix.SeqGap:
		k.count(iGap)
		// One line per engine per shareLogEvery: an engine's credential
		// may publish a gap in every batch, and it must not flood the
		// router's log (the counter has every one).
		if now := time.Now(); now.Sub(feed.gapLogged) >= shareLogEvery {
			k.v.log.Info("exact prefix index dropped: KV batches missed", "engine_id", m.ID, "epoch", h.Epoch, "seq", h.Seq,
				"gaps_not_logged", feed.gapsUnlogged)
			feed.gapLogged, feed.gapsUnlogged = now, 0
		} else {
			feed.gapsUnlogged++
		}
	case prefix.SeqNewEpoch:
		k.count(iEpoch)
	}
	k.count(iApplied)
	feed.applied = at
	k.lastSeen[m.ID] = feed
	return false
}

// applyOp applies one op of the batch being applied to k.cur.
func (k *kvShare) applyOp(op bus.KVOp, rank int, medium bus.KVMedium, keys []uint64) {
	switch op {
	case bus.KVStored:
		k.cur.Store(rank, prefix.Medium(medium), keys)
	case bus.KVRemoved:
		k.cur.Remove(rank, prefix.Medium(medium), keys)
	case bus.KVCleared:
		k.cur.Clear(rank)
	case bus.KVLost:
		k.cur.Lose(rank)
	}
}

// receive applies a live batch; one after a gap is first preceded by
// what the stream holds of the engine's batches since the last one
// applied (fillGap), so that a router whose connection dropped a few
// batches stays exact.
func (k *kvShare) receive(b *bus.Bus, msg *nats.Msg) {
	now := time.Now()
	if !k.apply(msg.Subject, msg.Data, now, b != nil) {
		return
	}
	id := msg.Subject[len(bus.KVSubjectPrefix):]
	feed := k.lastSeen[id]
	feed.filled = now
	k.lastSeen[id] = feed
	k.fillGap(b, id, feed.applied.Add(-kvFillOverlap))
	k.apply(msg.Subject, msg.Data, now, false)
}

// fillGap reads engine id's batches back from stream NARWHAL_PREFIX from
// since up to the stream's last, applying them in order (their own gaps
// then drop the engine), within kvFillTimeout. It uses the router's
// consumer for PurposePrefix, which indexShare's warm-ups use in turn on
// the same goroutine.
func (k *kvShare) fillGap(b *bus.Bus, id string, since time.Time) {
	ctx, cancel := context.WithTimeout(k.v.base, kvFillTimeout)
	defer cancel()
	st, err := b.JetStream().Stream(ctx, bus.PrefixStream)
	if err != nil {
		k.v.log.Warn("KV batches not read back", "engine_id", id, "err", err)
		return
	}
	last := st.CachedInfo().State.LastSeq
	if last == 0 {
		return
	}
	r, err := readStream(ctx, b, since, last, []string{bus.KVSubject(id)}, func(msg jetstream.Msg, at time.Time) {
		k.apply(msg.Subject(), msg.Data(), at, false)
	})
	if err != nil {
		k.v.log.Warn("KV batches read back in part", "engine_id", id, "batches", r.batches, "err", err)
	}
}

// namesEngine reports whether subject is engineID's subject of KV
// batches, bus.KVSubject(engineID), without building it.
func namesEngine(subject string, engineID []byte) bool {
	return len(subject) == len(bus.KVSubjectPrefix)+len(engineID) &&
		strings.HasPrefix(subject, bus.KVSubjectPrefix) && subject[len(bus.KVSubjectPrefix):] == string(engineID)
}

// forget drops what k keeps of engines that are not prefill engines of
// the fleet any more.
func (k *kvShare) forget() {
	fl := k.v.Fleet()
	for id := range k.lastSeen {
		if m := fl.byID[id]; m == nil || !m.Can(Prefill) {
			delete(k.lastSeen, id)
		}
	}
}
