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
	"github.com/nats-io/nuid"

	"github.com/narwhalmesh/narwhal/internal/pause"
)

// Timing of SubscribeResuming.
const (
	// resumeRetry is the pause between two attempts to read the stream or
	// make the consumer again after a reconnect: short, so that the
	// events stored meanwhile come out as soon as the server answers.
	resumeRetry = 100 * time.Millisecond
	// resumeRequestBound bounds one stream-info or consumer request.
	resumeRequestBound = 2 * time.Second
)

// StreamMark is where a follower of stream NARWHAL_EVENTS stands: which
// stream it reads, told apart by the stream's creation time (a stream
// made anew, e.g. by a bus restarted on a fresh store, has another one and
// numbers its events from 1 again), and the stream sequence it reads next.
type StreamMark struct {
	// Created is the stream's creation time, from its StreamInfo.
	Created time.Time
	// Next is the next stream sequence to read: the last one read + 1.
	// 0 means no position is known yet (nothing read since a start by
	// time or from the oldest event), so the first start applies again.
	Next uint64
}

// Resumption is where a follower resumes after a reconnect or the loss of
// its consumer (behaviour.md R-BUS-5), as ResumeFrom decides it.
type Resumption struct {
	// Start is the stream sequence to resume at (a consumer delivering by
	// start sequence begins at the first event it still holds at or after
	// it); 0 means the first start again (see StreamMark.Next).
	Start uint64
	// Lost is how many events were removed by the stream's retention
	// (max age, max bytes, max messages, a purge) before they could be
	// read: the stream's first sequence minus the wanted one. They are
	// counted by stream sequence, whatever their subject.
	Lost uint64
	// NewStream is set when the stream is not the one read before: it is
	// then followed from its start (Start 1).
	NewStream bool
}

// ResumeFrom decides where a follower at mark resumes on the stream whose
// StreamInfo says it was created at created and holds sequences first to
// last (behaviour.md R-BUS-5):
//
//   - the same stream (same creation time, and last + 1 ≥ mark.Next):
//     at mark.Next, so nothing is read twice and nothing is skipped; when
//     mark.Next is 0, the first start again;
//   - a stream made anew meanwhile (another creation time, or sequences
//     that end before mark.Next): at 1, its start;
//   - in either case, when first is beyond the wanted sequence, the events
//     in between were removed before they could be read: Lost counts them.
//
// A stream that holds nothing has first 0 (never written) or last + 1
// (everything removed); neither counts as lost unless the removed
// sequences were wanted.
func ResumeFrom(mark StreamMark, created time.Time, first, last uint64) Resumption {
	r := Resumption{Start: mark.Next}
	if !created.Equal(mark.Created) || (mark.Next > 0 && last+1 < mark.Next) {
		r = Resumption{Start: 1, NewStream: true}
	}
	if r.Start > 0 && first > r.Start {
		r.Lost = first - r.Start
	}
	return r
}

// SubscribeResuming is SubscribeWith for a follower that must not skip
// (behaviour.md R-BUS-5: a viewer such as `narwhal events`): it calls fn
// with each event's subject and JSON payload, one at a time, in stream
// order, each event once, across reconnects and the loss of its consumer.
//
// It follows with an ephemeral pull consumer named opts.Consumer (a
// random name when empty), AckNone, in memory, and remembers the stream
// sequence of the last event it delivered; a gap in the consumer's
// sequences makes the consumer again, under the same name, at the next
// stream sequence (behaviour.md R-BUS-11). When the connection drops it
// drops that consumer; as soon as the connection is back (or the consumer
// was deleted, or its heartbeats stopped) it reads the stream's info,
// retrying every 100 ms until the server answers, and makes a new ordered
// consumer at the sequence ResumeFrom decides: the next one on the same
// stream, 1 on a stream made anew. It calls resumed, when set, with that
// decision before any event of the new consumer (Lost says how many events
// the stream's retention removed before they could be read). When the
// filter takes every event (narwhal.events.>), a
// jump in stream sequences while it follows is such a loss too (a
// consumer that fell behind the retention, a deleted message): resumed
// is then called with Start the first sequence missed and Lost their
// number, before the event after them.
//
// stop ends it and waits until fn and resumed are no longer running; it
// is safe to call more than once, and ctx ending stops it too. It returns
// an error, at once, when opts.Filter is outside narwhal.events.>, when
// both DeliverAll and Since are set, or when the first consumer cannot be
// made (the stream's info cannot be read, the credential lacks the right).
func SubscribeResuming(ctx context.Context, b *Bus, opts SubscribeOptions, fn func(subject string, payload []byte), resumed func(Resumption)) (stop func(), err error) {
	filter := opts.Filter
	if filter == "" {
		filter = SubjectPrefix + ">"
	}
	if !strings.HasPrefix(filter, SubjectPrefix) || len(filter) == len(SubjectPrefix) {
		return nil, fmt.Errorf("bus: subscribe: filter %q is not within %s>", filter, SubjectPrefix)
	}
	if opts.DeliverAll && !opts.Since.IsZero() {
		return nil, errors.New("bus: subscribe: DeliverAll and Since exclude each other")
	}
	if b.direct {
		return subscribeDirect(ctx, b, opts, filter, fn, resumed)
	}
	ctx, cancel := context.WithCancel(ctx)
	name := opts.Consumer
	if name == "" {
		name = nuid.Next() // a name no other process knows
	}
	f := &resumingFollower{b: b, opts: opts, filter: filter, fn: fn, resumed: resumed, consumerGen: newConsumerGen(),
		whole: filter == SubjectPrefix+">", name: name}
	// Listen before the first consumer exists, so that no change of the
	// connection is missed.
	statuses := b.nc.StatusChanged(nats.CONNECTED, nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	info, err := b.js.Stream(ctx, StreamName)
	if err == nil {
		st := info.CachedInfo()
		f.mark.Created = st.Created
		if !opts.DeliverAll && opts.Since.IsZero() {
			f.mark.Next = st.State.LastSeq + 1 // new events only
		}
		err = f.start(ctx, nil)
	}
	if err != nil {
		b.nc.RemoveStatusListener(statuses)
		cancel()
		return nil, fmt.Errorf("bus: subscribe %s: %w", filter, err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer b.nc.RemoveStatusListener(statuses)
		f.run(ctx, statuses)
	}()
	var once sync.Once
	return func() {
		once.Do(cancel)
		<-done
	}, nil
}

// resumingFollower is the state of one SubscribeResuming.
type resumingFollower struct {
	b       *Bus
	opts    SubscribeOptions
	filter  string
	whole   bool // filter takes every event: a gap in sequences is a loss
	fn      func(subject string, payload []byte)
	resumed func(Resumption)

	name string // the consumer's name, kept across every consumer made (R-BUS-11)

	consumerGen // its mu also guards mark; held while fn runs
	mark        StreamMark
}

// start makes the ordered consumer at f.mark (or the first start when
// f.mark.Next is 0) and starts consuming. When r is set it calls f.resumed
// with it before the new consumer can deliver anything.
func (f *resumingFollower) start(ctx context.Context, r *Resumption) error {
	f.mu.Lock()
	next := f.mark.Next
	f.mu.Unlock()
	cfg := jetstream.ConsumerConfig{
		Name:              f.name,
		FilterSubject:     f.filter,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: readerInactive,
	}
	switch {
	case next > 0:
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = next
	case f.opts.DeliverAll:
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	case !f.opts.Since.IsZero():
		since := f.opts.Since.UTC()
		cfg.DeliverPolicy = jetstream.DeliverByStartTimePolicy
		cfg.OptStartTime = &since
	default:
		cfg.DeliverPolicy = jetstream.DeliverNewPolicy
	}
	cons, err := OwnConsumer(ctx, f.b.js, StreamName, cfg)
	if err != nil {
		return err
	}
	// Held until the notice is out: the new consumer's first event waits.
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.consume(cons, f.handle); err != nil {
		return err
	}
	if r != nil && f.resumed != nil {
		f.resumed(*r)
	}
	return nil
}

// handle delivers message m of the current consumer to fn unless it was
// delivered already, and reports events the stream removed before the
// consumer reached them (f.mu held, consumerGen.consume).
func (f *resumingFollower) handle(m jetstream.Msg, meta *jetstream.MsgMetadata) {
	seq := meta.Sequence.Stream
	if seq < f.mark.Next {
		return
	}
	if f.whole && f.mark.Next > 0 && seq > f.mark.Next && f.resumed != nil {
		// Every event passes the filter, so a jump in sequence is events
		// removed (retention, a deletion) before the consumer reached them.
		f.resumed(Resumption{Start: f.mark.Next, Lost: seq - f.mark.Next})
	}
	f.mark.Next = seq + 1
	f.fn(m.Subject(), m.Data())
}

// run follows the connection's changes until ctx ends: drop the consumer
// when the connection goes, resume when it is back or the consumer was
// lost.
func (f *resumingFollower) run(ctx context.Context, statuses chan nats.Status) {
	defer func() {
		f.drop()
		// Best effort: the server removes it after readerInactive anyway.
		dctx, cancel := context.WithTimeout(context.Background(), resumeRequestBound)
		defer cancel()
		_ = f.b.js.DeleteConsumer(dctx, StreamName, f.name)
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case s := <-statuses:
			switch s {
			case nats.DISCONNECTED, nats.RECONNECTING:
				f.drop()
				continue
			case nats.CLOSED:
				f.drop()
				return
			}
		case gen := <-f.kick:
			if f.stale(gen) {
				continue // a consumer dropped already
			}
		}
		f.drop()
		f.resume(ctx)
	}
}

// resume reads the stream's info and makes the consumer where ResumeFrom
// says, retrying every resumeRetry until it succeeds, the connection goes
// again (a later CONNECTED resumes) or ctx ends.
func (f *resumingFollower) resume(ctx context.Context) {
	for ctx.Err() == nil && f.b.nc.IsConnected() {
		reqCtx, cancel := context.WithTimeout(ctx, resumeRequestBound)
		err := f.resumeOnce(reqCtx)
		cancel()
		if err == nil {
			return
		}
		if f.b.log != nil {
			f.b.log.Debug("events consumer not made again yet", "err", err)
		}
		if !pause.For(ctx, resumeRetry) {
			return
		}
	}
}

// resumeOnce is one attempt of resume.
func (f *resumingFollower) resumeOnce(ctx context.Context) error {
	info, err := f.b.js.Stream(ctx, StreamName)
	if err != nil {
		return err
	}
	st := info.CachedInfo()
	f.mu.Lock()
	r := ResumeFrom(f.mark, st.Created, st.State.FirstSeq, st.State.LastSeq)
	prev := f.mark
	// At the first event still held: the lost ones are reported once.
	f.mark = StreamMark{Created: st.Created, Next: r.Start + r.Lost}
	f.mu.Unlock()
	if err := f.start(ctx, &r); err != nil {
		f.mu.Lock()
		f.mark = prev // decide again on the next attempt
		f.mu.Unlock()
		return err
	}
	return nil
}

// subscribeDirect is SubscribeResuming for a connection that reads by
// direct gets (Bus.ReadsDirect, behaviour.md R-BUS-11): no consumer, the
// same delivery — in stream order, each event once, across reconnects and
// a stream made anew; resumed is called after a reconnect, for a stream
// made anew and for events removed before they were read.
func subscribeDirect(ctx context.Context, b *Bus, opts SubscribeOptions, filter string, fn func(subject string, payload []byte), resumed func(Resumption)) (func(), error) {
	o := directOptions{stream: StreamName, filter: filter, whole: filter == SubjectPrefix+">", resumed: resumed}
	switch {
	case opts.DeliverAll:
		o.deliver = jetstream.DeliverAllPolicy
	case !opts.Since.IsZero():
		o.deliver, o.startTime = jetstream.DeliverByStartTimePolicy, opts.Since
	default:
		o.deliver = jetstream.DeliverNewPolicy
	}
	d, err := startDirect(ctx, b, o, func(m jetstream.Msg) { fn(m.Subject(), m.Data()) })
	if err != nil {
		return nil, fmt.Errorf("bus: subscribe %s: %w", filter, err)
	}
	var once sync.Once
	return func() {
		once.Do(d.cancel)
		<-d.done
	}, nil
}
