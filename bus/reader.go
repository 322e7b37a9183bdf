package bus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/internal/pause"
)

// Timing of a Reader.
const (
	// readerHeartbeat is the idle heartbeat of a Reader's pulls: a lost
	// consumer is noticed within two of them.
	readerHeartbeat = time.Second
	// readerExpiry is how long one pull request waits.
	readerExpiry = 5 * time.Second
	// readerInactive is the consumer's InactiveThreshold: the server
	// removes the consumer of a process that went away after it.
	readerInactive = 10 * time.Second
	// readerRetry is the pause between two attempts to make the consumer
	// again.
	readerRetry = 250 * time.Millisecond
	// readerRequestBound bounds one consumer request (delete, create).
	readerRequestBound = 2 * time.Second
)

// ReaderOptions says what a Reader reads and from where.
type ReaderOptions struct {
	// Stream is the stream read, e.g. StreamName or "KV_narwhal_fleet".
	Stream string
	// Filter is the subject filter, e.g. "$KV.narwhal_fleet.>".
	Filter string
	// Name is the consumer's name (Bus.ConsumerName): the same for
	// every consumer the Reader makes (behaviour.md R-BUS-11).
	Name string
	// Deliver is the first consumer's start: jetstream.DeliverAllPolicy,
	// DeliverNewPolicy, DeliverLastPerSubjectPolicy,
	// DeliverByStartSequencePolicy (StartSeq) or DeliverByStartTimePolicy
	// (StartTime). Every later consumer starts by sequence, after the
	// last message delivered.
	Deliver jetstream.DeliverPolicy
	// StartSeq is the first stream sequence, for
	// DeliverByStartSequencePolicy.
	StartSeq uint64
	// StartTime is the first storage time, for DeliverByStartTimePolicy.
	StartTime time.Time
	// OnStart, when set, is called once with the first consumer's
	// number of pending messages, before the Reader delivers anything.
	OnStart func(pending uint64)
}

// Reader reads a stream through a consumer whose name it keeps
// (behaviour.md R-BUS-11), as an ordered consumer does but under one
// fixed name, the only one an identity's credential may make: AckNone,
// memory storage, one replica, a short InactiveThreshold, idle
// heartbeats. On a gap (a consumer sequence that is not the last + 1),
// missed heartbeats, a deleted consumer or a reconnect it deletes its
// consumer and creates it again under the same name at the next stream
// sequence, so that nothing is lost or delivered twice. It is safe for
// concurrent use.
type Reader struct {
	b    *Bus
	opts ReaderOptions
	fn   func(jetstream.Msg)

	consumerGen        // its mu also guards next; held while fn runs
	next        uint64 // the next stream sequence to deliver

	cancel context.CancelFunc
	done   chan struct{}
	resets int // consumers made again (Resets)

	// direct, when set, reads instead of any consumer (Bus.ReadsDirect).
	direct *directReader
}

// StartReader makes the reader's first consumer (taking its name back
// from a consumer of that name left there, OwnConsumer) and calls fn with
// every message, one at a time, in stream order, each once, until ctx
// ends or Stop is called (behaviour.md R-BUS-11). fn may keep the
// message. It returns an error when opts.Name or opts.Stream is empty or
// the first consumer cannot be made (the stream is missing, the
// credential lacks the right).
func StartReader(ctx context.Context, b *Bus, opts ReaderOptions, fn func(jetstream.Msg)) (*Reader, error) {
	if b.direct {
		d, err := startDirect(ctx, b, directOptions{
			stream: opts.Stream, filter: opts.Filter, wake: wakeSubject(opts.Stream, opts.Filter),
			deliver: opts.Deliver, startSeq: opts.StartSeq, startTime: opts.StartTime, onStart: opts.OnStart,
		}, fn)
		if err != nil {
			return nil, err
		}
		return &Reader{b: b, opts: opts, fn: fn, direct: d, cancel: d.cancel, done: d.done}, nil
	}
	if opts.Name == "" || opts.Stream == "" {
		return nil, errors.New("bus: reader: want a stream and a consumer name")
	}
	ctx, cancel := context.WithCancel(ctx)
	r := &Reader{b: b, opts: opts, fn: fn, consumerGen: newConsumerGen(), cancel: cancel, done: make(chan struct{})}
	// Listen before the first consumer exists, so that no reconnect is
	// missed.
	statuses := b.nc.StatusChanged(nats.CONNECTED)
	rctx, rcancel := context.WithTimeout(ctx, readerRequestBound)
	err := r.start(rctx, true)
	rcancel()
	if err != nil {
		b.nc.RemoveStatusListener(statuses)
		cancel()
		return nil, fmt.Errorf("bus: read %s through consumer %s: %w", opts.Stream, opts.Name, err)
	}
	go func() {
		defer close(r.done)
		defer b.nc.RemoveStatusListener(statuses)
		r.run(ctx, statuses)
	}()
	return r, nil
}

// consumerConfig is the configuration of the reader's consumer: the
// first one's start when first is set, else the next stream sequence.
func (r *Reader) consumerConfig(first bool) jetstream.ConsumerConfig {
	cfg := jetstream.ConsumerConfig{
		Name:              r.opts.Name,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: readerInactive,
		FilterSubject:     r.opts.Filter,
	}
	if !first {
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = max(r.next, 1)
		return cfg
	}
	cfg.DeliverPolicy = r.opts.Deliver
	switch r.opts.Deliver {
	case jetstream.DeliverByStartSequencePolicy:
		cfg.OptStartSeq = max(r.opts.StartSeq, 1)
	case jetstream.DeliverByStartTimePolicy:
		t := r.opts.StartTime.UTC()
		cfg.OptStartTime = &t
	}
	return cfg
}

// start makes a consumer (the first one when first is set) and consumes
// from it.
func (r *Reader) start(ctx context.Context, first bool) error {
	r.mu.Lock()
	defer r.mu.Unlock() // the new consumer's first message waits
	cons, err := OwnConsumer(ctx, r.b.js, r.opts.Stream, r.consumerConfig(first))
	if err != nil {
		return err
	}
	info := cons.CachedInfo()
	if first {
		// Where the consumer starts: a later one starts there when
		// nothing was delivered meanwhile.
		r.next = info.Delivered.Stream + 1
	}
	if err := r.consume(cons, r.handle); err != nil {
		return err
	}
	if first && r.opts.OnStart != nil {
		r.opts.OnStart(info.NumPending)
	}
	return nil
}

// handle delivers message m of the current consumer to fn unless it was
// delivered already (r.mu held, consumerGen.consume).
func (r *Reader) handle(m jetstream.Msg, md *jetstream.MsgMetadata) {
	if md.Sequence.Stream < r.next {
		return
	}
	r.next = md.Sequence.Stream + 1
	r.fn(m)
}

// consumerGen is what a reader of one named consumer keeps of the
// consumers it makes one after another under that name (a Reader, the
// events follower; behaviour.md R-BUS-11): the current one's number and
// last consumer sequence, its consume context, and the signal that it
// was lost. Messages of an older consumer are dropped; a gap in consumer
// sequences, missed heartbeats or a deleted consumer raise the signal.
type consumerGen struct {
	kick lossSignal

	mu   sync.Mutex // guards gen, cseq and cc, and the owner's delivery state
	gen  int        // the current consumer's number; messages of others are dropped
	cseq uint64     // the current consumer's last delivered consumer sequence
	cc   jetstream.ConsumeContext
}

func newConsumerGen() consumerGen { return consumerGen{kick: newLossSignal()} }

// lossSignal carries the number of a lost consumer to the goroutine that
// makes it again: one slot holding the newest number raised.
type lossSignal chan int

func newLossSignal() lossSignal { return make(lossSignal, 1) }

// raise reports consumer gen lost. The newer of gen and a number still
// waiting is kept (numbers only grow): a stale number, of a consumer
// dropped already, which the receiver skips, must not keep out the
// current one's, or a consumer lost after it would never be made again.
func (s lossSignal) raise(gen int) {
	for {
		select {
		case s <- gen:
			return
		default:
		}
		select {
		case old := <-s:
			gen = max(gen, old)
		default:
		}
	}
}

// consume makes cons the current consumer and consumes from it, calling
// handle (g.mu held) with each of its messages in consumer order; the
// caller holds g.mu, so the first message waits until it lets go.
func (g *consumerGen) consume(cons jetstream.Consumer, handle func(jetstream.Msg, *jetstream.MsgMetadata)) error {
	g.gen++
	g.cseq = 0
	gen := g.gen
	cc, err := cons.Consume(func(m jetstream.Msg) { g.deliver(gen, m, handle) },
		jetstream.PullHeartbeat(readerHeartbeat),
		jetstream.PullExpiry(readerExpiry),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if errors.Is(err, jetstream.ErrNoHeartbeat) || errors.Is(err, jetstream.ErrConsumerDeleted) ||
				errors.Is(err, jetstream.ErrConsumerNotFound) {
				g.kick.raise(gen)
			}
		}))
	if err != nil {
		return err
	}
	g.cc = cc
	return nil
}

// deliver hands message m of consumer gen to handle, unless that consumer
// was dropped or a message before it went missing (then no more of it is
// handled and the consumer is reported lost, to be made again from the
// missing one).
func (g *consumerGen) deliver(gen int, m jetstream.Msg, handle func(jetstream.Msg, *jetstream.MsgMetadata)) {
	md, err := m.Metadata()
	if err != nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if gen != g.gen {
		return
	}
	if md.Sequence.Consumer != g.cseq+1 {
		g.gen++ // nothing more from this consumer
		g.kick.raise(g.gen)
		return
	}
	g.cseq = md.Sequence.Consumer
	handle(m, md)
}

// stale reports whether a loss reported for consumer gen is of one
// dropped already.
func (g *consumerGen) stale(gen int) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return gen != g.gen
}

// drop stops the current consumer; its late messages are ignored.
func (g *consumerGen) drop() {
	g.mu.Lock()
	g.gen++
	cc := g.cc
	g.cc = nil
	g.mu.Unlock()
	if cc != nil {
		cc.Stop()
		<-cc.Closed()
	}
}

// run makes the consumer again when it is lost or the connection comes
// back, until ctx ends; then it stops and deletes the consumer.
func (r *Reader) run(ctx context.Context, statuses chan nats.Status) {
	defer func() {
		r.drop()
		// Best effort: the server removes it after readerInactive anyway.
		dctx, cancel := context.WithTimeout(context.Background(), readerRequestBound)
		defer cancel()
		_ = r.b.js.DeleteConsumer(dctx, r.opts.Stream, r.opts.Name)
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.b.refused.done:
			return // revoked or refused for good (R-BUS-11)
		case <-statuses:
		case gen := <-r.kick:
			if r.stale(gen) {
				continue // a consumer dropped already
			}
		}
		r.drop()
		for ctx.Err() == nil {
			rctx, cancel := context.WithTimeout(ctx, readerRequestBound)
			err := r.start(rctx, false)
			cancel()
			if err == nil {
				r.mu.Lock()
				r.resets++
				r.mu.Unlock()
				break
			}
			if r.b.log != nil {
				r.b.log.Debug("consumer not made again yet", "stream", r.opts.Stream, "consumer", r.opts.Name, "err", err)
			}
			if !pause.For(ctx, readerRetry) {
				return
			}
		}
	}
}

// Resets returns how many times the reader made its consumer again.
func (r *Reader) Resets() int {
	if r.direct != nil {
		r.direct.mu.Lock()
		defer r.direct.mu.Unlock()
		return r.direct.resets
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.resets
}

// Stop ends the reader, waits until fn is no longer running and deletes
// its consumer (bounded by 2 s); it is safe to call more than once.
func (r *Reader) Stop() {
	r.cancel()
	<-r.done
}

// Done is closed once the reader has ended (Stop, its context, or the
// credential refused for good).
func (r *Reader) Done() <-chan struct{} { return r.done }

// kvEntry is one message of a bucket's stream as a jetstream.KeyValueEntry.
type kvEntry struct {
	bucket, key string
	value       []byte
	revision    uint64
	created     time.Time
	delta       uint64
	op          jetstream.KeyValueOp
}

func (e *kvEntry) Bucket() string                  { return e.bucket }
func (e *kvEntry) Key() string                     { return e.key }
func (e *kvEntry) Value() []byte                   { return e.value }
func (e *kvEntry) Revision() uint64                { return e.revision }
func (e *kvEntry) Created() time.Time              { return e.created }
func (e *kvEntry) Delta() uint64                   { return e.delta }
func (e *kvEntry) Operation() jetstream.KeyValueOp { return e.op }

// entryOf reads a message of bucket's stream as its entry: the key from
// the subject, the operation from the KV-Operation header (DEL, PURGE)
// or, for the marker the server writes when a key's TTL runs out or a
// key is removed (a bucket with TTL markers, as narwhal_fleet), from its
// Nats-Marker-Reason header (MaxAge and Purge a purge, Remove a delete),
// as jetstream's own KV watch reads them.
func entryOf(bucket string, m jetstream.Msg) (*kvEntry, uint64) {
	md, _ := m.Metadata()
	e := &kvEntry{bucket: bucket, key: strings.TrimPrefix(m.Subject(), "$KV."+bucket+"."), value: m.Data(), op: jetstream.KeyValuePut}
	if md != nil {
		e.revision, e.created, e.delta = md.Sequence.Stream, md.Timestamp, md.NumPending
	}
	h := m.Headers()
	switch h.Get("KV-Operation") {
	case "DEL":
		e.op = jetstream.KeyValueDelete
	case "PURGE":
		e.op = jetstream.KeyValuePurge
	case "":
		switch h.Get(jetstream.MarkerReasonHeader) {
		case "MaxAge", "Purge":
			e.op = jetstream.KeyValuePurge
		case "Remove":
			e.op = jetstream.KeyValueDelete
		}
	}
	return e, e.delta
}

// WatchBucket is WatchSnapshot through a Reader named name (behaviour.md
// R-BUS-11; Bus.ConsumerName): it watches every key of KV bucket until ctx
// ends, calls snapshot once with the bucket's current values (key →
// latest entry, deletions included) — when the first consumer has
// nothing pending, or with the first message that leaves nothing pending
// — then update with each later put, delete or purge, in order. The
// reader makes its consumer again, under the same name and from the next
// revision, when it is lost, so the watch does not end with it. It
// returns nil when ctx ends or the credential is refused for good, and
// the error of the first consumer's creation otherwise.
func WatchBucket(ctx context.Context, b *Bus, bucket, name string, snapshot func(map[string]jetstream.KeyValueEntry), update func(jetstream.KeyValueEntry)) error {
	current := map[string]jetstream.KeyValueEntry{}
	inSnapshot := true
	finish := func() {
		inSnapshot = false
		snapshot(current)
		// A watch that lives for days must not hold the bucket as it
		// was at its start.
		current = nil
	}
	r, err := StartReader(ctx, b, ReaderOptions{
		Stream:  "KV_" + bucket,
		Filter:  "$KV." + bucket + ".>",
		Name:    name,
		Deliver: jetstream.DeliverLastPerSubjectPolicy,
		OnStart: func(pending uint64) {
			if pending == 0 {
				finish()
			}
		},
	}, func(m jetstream.Msg) {
		e, pending := entryOf(bucket, m)
		if !inSnapshot {
			update(e)
			return
		}
		current[e.key] = e
		if pending == 0 {
			finish()
		}
	})
	if err != nil {
		return err
	}
	<-r.Done()
	return nil
}

// ReadBucket returns the current value of every key of KV bucket that
// holds one (deleted and purged keys left out), read through one
// consumer named name (behaviour.md R-BUS-11; Bus.ConsumerName), which it
// deletes again; or why it could not, or ctx's error.
func ReadBucket(ctx context.Context, b *Bus, bucket, name string) ([]jetstream.KeyValueEntry, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	got := make(chan []jetstream.KeyValueEntry, 1)
	errc := make(chan error, 1)
	go func() {
		errc <- WatchBucket(ctx, b, bucket, name, func(snap map[string]jetstream.KeyValueEntry) {
			var out []jetstream.KeyValueEntry
			for _, e := range snap {
				if e.Operation() == jetstream.KeyValuePut {
					out = append(out, e)
				}
			}
			got <- out
			cancel()
		}, func(jetstream.KeyValueEntry) {})
	}()
	select {
	case out := <-got:
		<-errc // the consumer is deleted
		return out, nil
	case err := <-errc:
		select {
		case out := <-got:
			return out, nil
		default:
		}
		if err == nil {
			err = ctx.Err()
		}
		return nil, err
	}
}
