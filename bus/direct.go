package bus

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// Timing and size of a direct reader (behaviour.md R-BUS-11): a reader of
// a process holding a role's credential, which owns no consumer and reads
// a stream by batches of direct gets ($JS.API.DIRECT.GET.<stream>, served
// by any replica of a stream with allow_direct).
const (
	// directBatch is how many messages one batch get asks for: enough
	// that a reader catching up on a busy stream asks rarely, few enough
	// that one answer stays small.
	directBatch = 256
	// directMaxBytes bounds the bytes of one batch's messages (the
	// server stops the batch past it): a reader holds at most one batch.
	directMaxBytes = 1 << 20
	// directPoll is how long a reader of a busy stream (NARWHAL_EVENTS,
	// NARWHAL_PREFIX, NARWHAL_REGISTRATIONS) waits once caught up before
	// it asks again, and the pause after a failed get. A core
	// subscription there would take every event only to wake a get that
	// reads it again, and no credential but the admin's subscribes to
	// event subjects (R-BUS-11); 200 ms is below what a person following
	// `narwhal events` or a dashboard's refresh notices, and one small
	// request per reader five times a second costs the server nothing.
	directPoll = 200 * time.Millisecond
	// directBackstop is how long a reader of a KV bucket, woken by a core
	// subscription on the bucket's subjects, waits at most between two
	// gets: the markers the server writes itself when a key's TTL runs
	// out reach no core subscriber, and a wake-up published while the
	// connection was down is lost.
	directBackstop = time.Second
	// directStreamCheck is how often an idle reader reads the stream's
	// info, to notice a stream made anew (its creation time) and events
	// removed before they were read (its first sequence).
	directStreamCheck = 2 * time.Second
	// directRequestBound bounds one stream-info or batch request.
	directRequestBound = 2 * time.Second
)

// directOptions says what a directReader reads and from where.
type directOptions struct {
	stream, filter string
	// wake, when set, is the subject of a core subscription whose
	// messages wake the reader at once (a KV bucket's, "$KV.<bucket>.>").
	wake string
	// deliver is the first start: DeliverAllPolicy,
	// DeliverLastPerSubjectPolicy (read as all: a bucket's stream holds
	// its keys' last values, and the caller keeps the last one per key),
	// DeliverNewPolicy, DeliverByStartSequencePolicy (startSeq) or
	// DeliverByStartTimePolicy (startTime).
	deliver   jetstream.DeliverPolicy
	startSeq  uint64
	startTime time.Time
	// whole says the filter takes every message of the stream: a jump in
	// sequences is messages removed before they were read.
	whole bool
	// onStart, when set, is called once with the number of messages
	// pending at the start, before anything is delivered.
	onStart func(pending uint64)
	// resumed, when set, is called with a stream made anew (NewStream,
	// Start 1) or messages removed before they were read (Lost), before
	// the message after them.
	resumed func(Resumption)
}

// directReader reads a stream without a consumer (behaviour.md R-BUS-11):
// in stream order, each message once, by batches of direct gets from the
// next sequence; caught up, it waits for a wake-up (a core subscription
// on opts.wake, else directPoll) and reads on. A lagging replica that
// answers with less, or "no message", is asked again later; a reconnect
// reads the stream's info first, so that a stream made anew meanwhile is
// read from its start and events its retention removed are counted
// (ResumeFrom). One goroutine delivers, one message at a time.
type directReader struct {
	b    *Bus
	opts directOptions
	fn   func(jetstream.Msg)

	mark      StreamMark // guarded by the delivering goroutine alone
	delivered uint64     // messages delivered, the Consumer sequence of their metadata
	first     []*jetstream.RawStreamMsg
	pending   uint64 // of the first batch, for onStart

	wakeC chan struct{}

	mu     sync.Mutex
	resets int // resumptions after a reconnect or a stream made anew

	cancel context.CancelFunc
	done   chan struct{}
}

// startDirect starts a directReader: it reads the stream's info and the
// first batch at once, so that a missing stream or a credential that may
// not read it is an error here, then delivers from a goroutine until ctx
// ends or the credential is refused for good.
func startDirect(ctx context.Context, b *Bus, opts directOptions, fn func(jetstream.Msg)) (*directReader, error) {
	if opts.stream == "" {
		return nil, errors.New("bus: direct reader: want a stream")
	}
	ctx, cancel := context.WithCancel(ctx)
	d := &directReader{b: b, opts: opts, fn: fn, wakeC: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{})}
	statuses := b.nc.StatusChanged(nats.CONNECTED)
	fail := func(err error) (*directReader, error) {
		b.nc.RemoveStatusListener(statuses)
		cancel()
		return nil, fmt.Errorf("bus: read %s by direct gets: %w", opts.stream, err)
	}
	var sub *nats.Subscription
	if opts.wake != "" {
		var err error
		sub, err = b.nc.Subscribe(opts.wake, func(*nats.Msg) { d.wake() })
		if err != nil {
			return fail(err)
		}
	}
	rctx, rcancel := context.WithTimeout(ctx, directRequestBound)
	err := d.begin(rctx)
	rcancel()
	if err != nil {
		if sub != nil {
			_ = sub.Unsubscribe()
		}
		return fail(err)
	}
	go func() {
		defer close(d.done)
		defer b.nc.RemoveStatusListener(statuses)
		if sub != nil {
			defer func() { _ = sub.Unsubscribe() }()
		}
		d.run(ctx, statuses)
	}()
	return d, nil
}

// wake makes a waiting reader read at once.
func (d *directReader) wake() {
	select {
	case d.wakeC <- struct{}{}:
	default:
	}
}

// begin decides where the reader starts and reads its first batch.
func (d *directReader) begin(ctx context.Context) error {
	st, err := d.b.js.Stream(ctx, d.opts.stream)
	if err != nil {
		return err
	}
	info := st.CachedInfo()
	d.mark.Created = info.Created
	var since time.Time
	switch d.opts.deliver {
	case jetstream.DeliverNewPolicy:
		d.mark.Next = info.State.LastSeq + 1
	case jetstream.DeliverByStartSequencePolicy:
		d.mark.Next = max(d.opts.startSeq, 1)
	case jetstream.DeliverByStartTimePolicy:
		since = d.opts.startTime
	default:
		// From the oldest message held: those removed before are not
		// lost to this reader, which never wanted them.
		d.mark.Next = max(info.State.FirstSeq, 1)
	}
	msgs, err := d.fetch(ctx, d.mark.Next, since)
	if err != nil {
		return err
	}
	if !since.IsZero() && len(msgs) == 0 {
		// Nothing stored since then: anything stored later is newer
		// than the info read before the get.
		d.mark.Next = info.State.LastSeq + 1
	}
	if !since.IsZero() && len(msgs) > 0 {
		d.mark.Next = msgs[0].Sequence
	}
	d.first = msgs
	if len(msgs) > 0 {
		d.pending = numPending(msgs[0]) + 1
	}
	return nil
}

// numPending is a batch message's count of messages of the filter after
// it (its Nats-Num-Pending header).
func numPending(m *jetstream.RawStreamMsg) uint64 {
	n, _ := strconv.ParseUint(m.Header.Get("Nats-Num-Pending"), 10, 64)
	return n
}

// fetch asks for one batch from sequence next (or, when since is set, from
// the first message stored at or after it) and returns its messages in
// order. It stops at the first message whose Nats-Last-Sequence is not
// the one before it in the batch (a message of the answer lost on the
// way): the next batch asks from there again. A stream without a message
// there ("no message": caught up, or a replica behind the others) is an
// empty batch, not an error.
func (d *directReader) fetch(ctx context.Context, next uint64, since time.Time) ([]*jetstream.RawStreamMsg, error) {
	opts := []jetstreamext.GetBatchOpt{jetstreamext.GetBatchMaxBytes(directMaxBytes)}
	if since.IsZero() {
		opts = append(opts, jetstreamext.GetBatchSeq(max(next, 1)))
	} else {
		opts = append(opts, jetstreamext.GetBatchStartTime(since))
	}
	if d.opts.filter != "" {
		opts = append(opts, jetstreamext.GetBatchSubject(d.opts.filter))
	}
	it, err := jetstreamext.GetBatch(ctx, d.b.js, d.opts.stream, directBatch, opts...)
	if err != nil {
		return nil, err
	}
	var out []*jetstream.RawStreamMsg
	var prev uint64
	for m, err := range it {
		if errors.Is(err, jetstreamext.ErrNoMessages) {
			return out, nil
		}
		if err != nil {
			if len(out) > 0 {
				return out, nil // the rest is asked again
			}
			return nil, err
		}
		if last := m.Header.Get("Nats-Last-Sequence"); last != "" && last != strconv.FormatUint(prev, 10) {
			break
		}
		prev = m.Sequence
		out = append(out, m)
	}
	if len(out) == 0 {
		// The answer ended early (its bound, a dropped connection):
		// an error, so that the reader waits before it asks again.
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// run delivers the first batch, then reads on until ctx ends or the
// credential is refused for good.
func (d *directReader) run(ctx context.Context, statuses chan nats.Status) {
	if d.opts.onStart != nil {
		d.opts.onStart(d.pending)
	}
	more := d.deliver(d.first)
	d.first = nil
	checked := time.Now()
	reconnected := false
	for ctx.Err() == nil {
		if reconnected || time.Since(checked) >= directStreamCheck {
			if d.check(ctx, reconnected) {
				reconnected = false
				checked = time.Now()
			}
		}
		failed := false
		if !more {
			rctx, cancel := context.WithTimeout(ctx, directRequestBound)
			msgs, err := d.fetch(rctx, d.mark.Next, time.Time{})
			cancel()
			if err != nil {
				failed = true
				if d.b.log != nil && ctx.Err() == nil {
					d.b.log.Debug("direct get failed; asking again", "stream", d.opts.stream, "err", err)
				}
			}
			more = d.deliver(msgs)
		}
		if more {
			more = false
			continue
		}
		wait := directPoll
		if d.opts.wake != "" && !failed {
			wait = directBackstop
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-d.b.refused.done:
			timer.Stop()
			return // revoked or refused for good (R-BUS-11)
		case <-statuses:
			reconnected = true
		case <-d.wakeC:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// check reads the stream's info and, when the stream was made anew or
// removed messages the reader had not read yet, moves the reader on as
// ResumeFrom decides and says so (opts.resumed) — after a reconnect
// (reconnected set) it says where it resumes in any case, as a follower
// through a consumer does. It reports whether the info was read.
func (d *directReader) check(ctx context.Context, reconnected bool) bool {
	rctx, cancel := context.WithTimeout(ctx, directRequestBound)
	st, err := d.b.js.Stream(rctx, d.opts.stream)
	cancel()
	if err != nil {
		return false
	}
	info := st.CachedInfo()
	r := ResumeFrom(d.mark, info.Created, info.State.FirstSeq, info.State.LastSeq)
	if !r.NewStream && r.Lost == 0 && !reconnected {
		return true
	}
	d.mark = StreamMark{Created: info.Created, Next: r.Start + r.Lost}
	d.mu.Lock()
	d.resets++
	d.mu.Unlock()
	if d.opts.resumed != nil {
		d.opts.resumed(r)
	}
	return true
}

// deliver hands msgs, in order, to fn (skipping any before the next
// sequence) and reports whether the stream holds more of the filter
// after the last one.
func (d *directReader) deliver(msgs []*jetstream.RawStreamMsg) (more bool) {
	for _, m := range msgs {
		if m.Sequence < d.mark.Next {
			continue
		}
		if d.opts.whole && m.Sequence > d.mark.Next && d.opts.resumed != nil {
			// Every message passes the filter: a jump is messages removed
			// before they were read.
			d.opts.resumed(Resumption{Start: d.mark.Next, Lost: m.Sequence - d.mark.Next})
		}
		d.mark.Next = m.Sequence + 1
		d.delivered++
		d.fn(&directMsg{raw: m, consumerSeq: d.delivered, pending: numPending(m)})
	}
	return len(msgs) > 0 && numPending(msgs[len(msgs)-1]) > 0
}

// directMsg is a message read by a direct get, as a jetstream.Msg: its
// metadata carry its stream sequence, storage time and the messages of
// the filter after it; it has no reply and cannot be acknowledged (no
// consumer delivered it).
type directMsg struct {
	raw         *jetstream.RawStreamMsg
	consumerSeq uint64
	pending     uint64
}

// errDirectNoAck is what acknowledging a directMsg returns.
var errDirectNoAck = errors.New("bus: a message read by a direct get has no consumer to acknowledge")

// Metadata returns the message's stream sequence, its number among the
// reader's deliveries (as a consumer sequence), the messages of the
// filter after it when it was read, its storage time and its stream.

func (m *directMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{
		Sequence:     jetstream.SequencePair{Stream: m.raw.Sequence, Consumer: m.consumerSeq},
		NumDelivered: 1,
		NumPending:   m.pending,
		Timestamp:    m.raw.Time,
		Stream:       m.raw.Header.Get(jetstream.StreamHeader),
	}, nil
}
func (m *directMsg) Data() []byte                     { return m.raw.Data }
func (m *directMsg) Headers() nats.Header             { return m.raw.Header }
func (m *directMsg) Subject() string                  { return m.raw.Subject }
func (m *directMsg) Reply() string                    { return "" }
func (m *directMsg) Ack() error                       { return errDirectNoAck }
func (m *directMsg) DoubleAck(context.Context) error  { return errDirectNoAck }
func (m *directMsg) Nak() error                       { return errDirectNoAck }
func (m *directMsg) NakWithDelay(time.Duration) error { return errDirectNoAck }
func (m *directMsg) InProgress() error                { return errDirectNoAck }
func (m *directMsg) Term() error                      { return errDirectNoAck }
func (m *directMsg) TermWithReason(string) error      { return errDirectNoAck }

var _ jetstream.Msg = (*directMsg)(nil)

// wakeSubject is the subject whose core messages wake a direct reader of
// stream with filter: the filter of a KV bucket's stream (few writes, and
// a watch's latency matters: a chaos arm reaching a proxy, a fleet
// change reaching the breaker), none for the other streams, read every
// directPoll.
func wakeSubject(stream, filter string) string {
	if strings.HasPrefix(stream, "KV_") {
		if filter == "" {
			return "$KV." + strings.TrimPrefix(stream, "KV_") + ".>"
		}
		return filter
	}
	return ""
}
