package bus

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/internal/promreg"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Publisher tuning.
const (
	// publishWindow bounds the events published at once, awaiting their
	// acks: the publisher sends up to this many, waits until each is
	// acknowledged or has failed, and only then sends the next ones, so
	// that a failed event is published again before any later one
	// (R-BUS-10: each publisher's order is kept).
	publishWindow = 256
	// ackTimeout is how long one publish waits for its ack before it
	// counts as failed (and is published again).
	ackTimeout = 2 * time.Second
	// retryPauseMin and retryPauseMax bound the pause before a window
	// with failed events is published again; it doubles after each
	// window that failed entirely and resets after an ack.
	retryPauseMin = 50 * time.Millisecond
	retryPauseMax = time.Second
	// RetryHorizon is how long an event that was sent but not acknowledged
	// is published again under its message id. It stays a minute inside
	// StreamDuplicates, so the stream still remembers the id of any
	// earlier attempt that was stored although its ack was lost, and
	// stores the event once (R-BUS-3, R-BUS-10). An event older than that
	// is given up on and counted (DropExpired).
	RetryHorizon = StreamDuplicates - time.Minute
	// reconnectPoll is how often a publisher waiting for the connection
	// checks it, besides the connection's status notifications.
	reconnectPoll = 250 * time.Millisecond
	// closeDrainBound bounds how long Close spends publishing what is
	// buffered and waiting for acks.
	closeDrainBound = 2 * time.Second
	// dropLogEvery rate-limits the "events dropped" log line.
	dropLogEvery = 5 * time.Second
)

// Reasons for dropping an event: the "reason" label of
// narwhal_events_dropped_total.
const (
	// DropBufferFull: Publish found the buffer (router.event_buffer) full:
	// the bus has been unable to take events for longer than the buffer
	// lasts, or is slower than the event rate.
	DropBufferFull = "buffer_full"
	// DropExpired: the event was published again for RetryHorizon without
	// an ack; past it a further attempt could be stored twice.
	DropExpired = "expired"
	// DropInvalid: the event could not be marshalled, its subject is not
	// a valid NATS subject (an empty id), or the stream refused it for
	// good (e.g. larger than the stream's maximum message size).
	DropInvalid = "invalid"
	// DropClosed: the event arrived after Close began, or was still
	// waiting when Close's bound ran out.
	DropClosed = "closed"
)

// Publisher publishes events to stream NARWHAL_EVENTS from its own
// goroutine so that Publish never blocks its caller (behaviour.md R-BUS-6): events
// wait in a bounded buffer and are dropped, counted per kind, only when it
// is full. Every other event is published, in the order of Publish, and
// published again under its own message id until the stream acknowledges
// it — across a stream leader election, a lost quorum, a reconnect or a
// server restart — for up to RetryHorizon (behaviour.md R-BUS-10). The message id
// makes the stream drop a re-published event that was stored already
// (R-BUS-3). Safe for concurrent use.
type Publisher struct {
	nc     *nats.Conn
	js     jetstream.JetStream
	log    *slog.Logger
	events chan schemas.Event
	status chan nats.Status // connection status notifications
	stop   chan struct{}    // closed by Close
	done   chan struct{}    // closed when the goroutine exits

	mu     sync.RWMutex // held for reading by Publish, for writing by Close
	closed bool

	// capacity is the buffer's size; pending counts the events accepted
	// and not yet acknowledged or dropped (buffered, in the window, or
	// waiting to be published again), at most capacity.
	capacity int64
	pending  atomic.Int64

	published atomic.Uint64
	dropped   atomic.Uint64
	// lastDropLog is the UnixNano of the last "events dropped" line;
	// droppedLogged the dropped count it reported.
	lastDropLog   atomic.Int64
	droppedLogged atomic.Uint64

	publishedTotal prometheus.Counter
	droppedTotal   *prometheus.CounterVec

	// Owned by the publisher's goroutine: the encoder and its sink,
	// outbounds free for reuse, and the timer bounding a window's wait.
	sink  appendSink
	enc   *json.Encoder
	free  []*outbound
	bound *time.Timer

	// flightMu guards inFlight (the messages of the window being
	// published, by the message the JetStream client hands back to its
	// callbacks), their outbounds' state and err, outstanding (how many
	// of them have no outcome yet) and sent (the whole window was handed
	// to the client). windowDone receives once outstanding reaches 0
	// after sent.
	flightMu    sync.Mutex
	inFlight    map[*nats.Msg]*outbound
	outstanding int
	sent        bool
	windowDone  chan struct{}
}

// queued is one event the publisher's goroutine holds: encoded, with
// the time of its first publish (zero until then).
type queued struct {
	out   *outbound
	kind  string
	first time.Time
}

// outbound is one encoded event and the message that carries it. Its
// buffer and message are reused for a later event only once the stream
// has acknowledged this one: until then the JetStream client keeps the
// message (and its Data) to publish it again itself (no responders), and
// the publisher keeps it to publish it again under the same id.
type outbound struct {
	msg nats.Msg
	id  [1]string // the message id header's value; msg.Header refers to it
	buf []byte    // msg.Data is buf
	// state and err are the outcome of the latest publish, written by the
	// JetStream client's callbacks under Publisher.flightMu.
	state int
	err   error
	// stale: a publish of it was given up on without an outcome; the
	// JetStream client may still hold it, so it is never reused.
	stale bool
}

// States of an outbound's latest publish.
const (
	outPending = iota
	outAcked
	outFailed
)

// Encoder reuse bounds: an outbound whose buffer grew past
// maxReusedBuffer is left to the collector, and at most maxFree outbounds
// wait for reuse.
const (
	maxReusedBuffer = 16 << 10
	maxFree         = 2 * publishWindow
)

// appendSink is the json.Encoder's writer: it appends to buf.
type appendSink struct{ buf []byte }

func (s *appendSink) Write(b []byte) (int, error) {
	s.buf = append(s.buf, b...)
	return len(b), nil
}

// NewPublisher returns a Publisher on b with room for buffer waiting events
// (router.event_buffer; buffer < 1 is taken as 1) and starts its
// goroutine; the caller owns it and must Close it before closing b. When
// reg is not nil it registers narwhal_events_published_total (events the
// stream acknowledged), narwhal_events_dropped_total{reason,kind} (events
// given up on, see the Drop* reasons), narwhal_events_pending (events
// accepted and not yet acknowledged) and narwhal_bus_connected (1 while
// the connection is up); publishers sharing a registry share these. It
// logs drops (at most every 5 s) to the Bus's logger (ConnectOptions.Log).
func NewPublisher(b *Bus, buffer int, reg prometheus.Registerer) *Publisher {
	if buffer < 1 {
		buffer = 1
	}
	p := &Publisher{
		nc:         b.nc,
		log:        b.log,
		events:     make(chan schemas.Event, buffer),
		capacity:   int64(buffer),
		stop:       make(chan struct{}),
		done:       make(chan struct{}),
		inFlight:   make(map[*nats.Msg]*outbound, publishWindow),
		windowDone: make(chan struct{}, 1),
		publishedTotal: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_events_published_total",
			Help: "Bus events acknowledged by the stream.",
		}),
		droppedTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_events_dropped_total",
			Help: "Bus events given up on (never stored on the bus), by reason: buffer_full (more events waiting than router.event_buffer), expired (no acknowledgement from the bus in time), invalid (not publishable: bad subject, too large, or refused by the stream), closed (published during shutdown); and by event kind.",
		}, []string{"reason", "kind"}),
	}
	for _, r := range dropReasons {
		for _, k := range eventKinds {
			p.droppedTotal.WithLabelValues(r, k)
		}
	}
	if reg != nil {
		p.publishedTotal = promreg.Register(reg, p.publishedTotal)
		p.droppedTotal = promreg.Register(reg, p.droppedTotal)
		promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "narwhal_events_pending",
			Help: "Bus events accepted and not yet acknowledged by the stream (buffered or being published again).",
		}, func() float64 { return float64(p.pending.Load()) }))
		promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "narwhal_bus_connected",
			Help: "1 while the connection to NATS is up, else 0.",
		}, func() float64 {
			if p.nc.IsConnected() {
				return 1
			}
			return 0
		}))
	}
	p.enc = json.NewEncoder(&p.sink)
	p.bound = time.NewTimer(time.Hour)
	p.bound.Stop()
	// Outcomes arrive through the JetStream client's callbacks rather than
	// one future per event: the publisher waits once for a whole window,
	// then reads each event's outcome.
	js, err := jetstream.New(b.nc,
		jetstream.WithPublishAsyncMaxPending(publishWindow),
		jetstream.WithPublishAsyncTimeout(ackTimeout),
		jetstream.WithPublishAsyncAckHandler(func(_ jetstream.JetStream, m *nats.Msg, _ *jetstream.PubAck) {
			p.outcome(m, nil)
		}),
		jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, m *nats.Msg, err error) {
			p.outcome(m, err)
		}),
	)
	if err != nil { // only for invalid options, which are constants here
		panic("bus: jetstream publisher options: " + err.Error())
	}
	p.js = js
	p.status = b.nc.StatusChanged(nats.CONNECTED, nats.CLOSED)
	go p.run()
	return p
}

// Publish hands ev to the publisher and returns at once; it never blocks
// (R-BUS-6). It sets ev.Head().ID to a new schemas.NewEventID when empty and
// ev.Head().At to time.Now().UTC() when zero. From then on ev belongs to the
// publisher: the caller must not change it. When the buffer is full, or
// after Close, the event is dropped and counted (R-BUS-10).
func (p *Publisher) Publish(ev schemas.Event) {
	h := ev.Head()
	if h.ID == "" {
		h.ID = schemas.NewEventID()
	}
	if h.At.IsZero() {
		h.At = time.Now().UTC()
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		p.drop(DropClosed, kindOf(ev.Subject()))
		return
	}
	if p.pending.Add(1) > p.capacity {
		p.pending.Add(-1)
		p.drop(DropBufferFull, kindOf(ev.Subject()))
		return
	}
	p.events <- ev // never blocks: pending ≤ capacity = cap(events)
}

// Published returns how many of this publisher's events the stream has
// acknowledged (duplicates included: they are stored once).
func (p *Publisher) Published() uint64 { return p.published.Load() }

// Dropped returns how many of this publisher's events were given up on,
// for any reason.
func (p *Publisher) Dropped() uint64 { return p.dropped.Load() }

// Pending returns how many events were accepted and are not yet
// acknowledged or dropped.
func (p *Publisher) Pending() int { return int(p.pending.Load()) }

// drop counts one dropped event of kind and logs drops, at most every
// dropLogEvery.
func (p *Publisher) drop(reason, kind string) {
	n := p.dropped.Add(1)
	p.droppedTotal.WithLabelValues(reason, kind).Inc()
	if p.log == nil {
		return
	}
	now := time.Now().UnixNano()
	last := p.lastDropLog.Load()
	if now-last < int64(dropLogEvery) || !p.lastDropLog.CompareAndSwap(last, now) {
		return
	}
	since := n - p.droppedLogged.Swap(n)
	p.log.Warn("bus events dropped", "dropped", since, "dropped_total", n, "last_reason", reason, "last_kind", kind,
		"pending", p.pending.Load())
}

// settle removes one accepted event from the pending count.
func (p *Publisher) settle() { p.pending.Add(-1) }

// eventKinds are the kind label's values of narwhal_events_dropped_total
// besides "unknown": every kind of schemas.EventKinds.
var eventKinds = schemas.EventKindNames()

// dropReasons are the reason label's values of
// narwhal_events_dropped_total.
var dropReasons = []string{DropBufferFull, DropExpired, DropInvalid, DropClosed}

// kindOf returns the kind token of an event subject
// (narwhal.events.<kind>.…) when it is a kind of schemas.EventKinds, or
// "unknown".
func kindOf(subject string) string {
	rest, ok := strings.CutPrefix(subject, SubjectPrefix)
	if !ok {
		return "unknown"
	}
	kind, _, _ := strings.Cut(rest, ".")
	if slices.Contains(eventKinds, kind) {
		return kind
	}
	return "unknown"
}

// Close stops accepting events, publishes what is waiting and waits for
// the acks for at most 2 s in all (events still waiting then are dropped
// and counted), and stops the publisher's goroutine. Safe to call more than
// once.
func (p *Publisher) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		<-p.done
		return
	}
	p.closed = true
	p.mu.Unlock()
	close(p.stop)
	<-p.done
}

// run is the publisher's goroutine: it owns the queue of events being
// published and exits when Close closes stop.
func (p *Publisher) run() {
	defer close(p.done)
	defer p.nc.RemoveStatusListener(p.status)
	var (
		queue   []queued
		pause   = retryPauseMin
		waiting bool // the last window failed: an outage is under way
	)
	for {
		if len(queue) == 0 {
			select {
			case <-p.stop:
				p.drain(queue, waiting)
				return
			case ev := <-p.events:
				queue = p.enqueue(queue, ev)
			}
		}
		queue = p.take(queue)
		if len(queue) == 0 {
			continue
		}
		if !p.awaitConnection() {
			p.drain(queue, waiting)
			return
		}
		// After a failed window only the head goes, alone, until the
		// stream acknowledges it: a stream that becomes able to store
		// again part way through a window (a server restarted, recovering
		// its streams; a new leader elected) would store the window's
		// later events and refuse its earlier ones, which are published
		// again after them, out of order.
		size := publishWindow
		if waiting {
			size = 1
		}
		var acked int
		var lastErr error
		queue, acked, lastErr = p.sendWindow(queue, size)
		switch {
		case acked > 0 && lastErr == nil:
			if waiting && p.log != nil {
				p.log.Info("bus events flowing again", "pending", p.pending.Load())
			}
			waiting, pause = false, retryPauseMin
		case lastErr != nil:
			if !waiting && p.log != nil {
				p.log.Warn("bus events waiting for the stream; publishing them again until it acknowledges them",
					"err", lastErr, "pending", p.pending.Load())
			}
			waiting = true
			if acked > 0 {
				pause = retryPauseMin
			}
			if !p.sleep(pause) {
				p.drain(queue, true)
				return
			}
			if acked == 0 {
				pause = min(2*pause, retryPauseMax)
			}
		}
	}
}

// enqueue encodes ev into a reused outbound and appends it to queue; an
// event that cannot be published is dropped and counted instead.
func (p *Publisher) enqueue(queue []queued, ev schemas.Event) []queued {
	subject := ev.Subject()
	kind := kindOf(subject)
	if !validSubject(subject) {
		p.settle()
		p.drop(DropInvalid, kind)
		return queue
	}
	o := p.outbound()
	p.sink.buf = o.buf[:0]
	err := p.enc.Encode(ev)
	o.buf = p.sink.buf
	p.sink.buf = nil
	if err != nil {
		p.release(o)
		p.settle()
		p.drop(DropInvalid, kind)
		return queue
	}
	o.msg.Subject = subject
	o.msg.Data = bytes.TrimSuffix(o.buf, newline) // Encode ends each value with one
	o.id[0] = ev.Head().ID
	return append(queue, queued{out: o, kind: kind})
}

var newline = []byte{'\n'}

// errNoAck is the outcome of a publish that had none when its window
// ended.
var errNoAck = errors.New("no ack within " + (ackTimeout + time.Second).String())

// outbound returns an outbound free for a new event.
func (p *Publisher) outbound() *outbound {
	if n := len(p.free); n > 0 {
		o := p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
		return o
	}
	o := &outbound{}
	o.msg.Header = nats.Header{jetstream.MsgIDHeader: o.id[:]}
	return o
}

// release makes o free for reuse once its event was acknowledged (or
// never published); a stale one, or one with a large buffer, is left to
// the collector.
func (p *Publisher) release(o *outbound) {
	if o.stale || cap(o.buf) > maxReusedBuffer || len(p.free) >= maxFree {
		return
	}
	o.msg.Subject, o.msg.Data, o.id[0] = "", nil, ""
	o.state, o.err = outPending, nil
	p.free = append(p.free, o)
}

// outcome records the outcome of publishing m (err nil: acknowledged);
// the JetStream client calls it once per publish, from its own
// goroutines. An acknowledgement is final: an error reported later for an
// earlier attempt of the same event does not undo it. A message of no
// window being published is ignored.
func (p *Publisher) outcome(m *nats.Msg, err error) {
	p.flightMu.Lock()
	defer p.flightMu.Unlock()
	o := p.inFlight[m]
	if o == nil || o.state == outAcked {
		return
	}
	p.settled(o)
	if err == nil {
		o.state, o.err = outAcked, nil
	} else {
		o.state, o.err = outFailed, err
	}
}

// settled counts o's outcome as known when it was still pending, and
// signals windowDone when it was the window's last; flightMu held.
func (p *Publisher) settled(o *outbound) {
	if o.state != outPending {
		return
	}
	p.outstanding--
	if p.outstanding == 0 && p.sent {
		select {
		case p.windowDone <- struct{}{}:
		default:
		}
	}
}

// take moves buffered events into queue until it holds a window's worth.
func (p *Publisher) take(queue []queued) []queued {
	for len(queue) < publishWindow {
		select {
		case ev := <-p.events:
			queue = p.enqueue(queue, ev)
		default:
			return queue
		}
	}
	return queue
}

// sendWindow publishes the head of queue (up to size events, at most
// publishWindow) asynchronously and waits once for the whole window: until
// the JetStream client has reported the outcome of every one (each
// settles within ackTimeout), then reads them. It returns queue
// without the acknowledged events (and those given up on), in their
// order, how many were acknowledged, and the last publish error (nil when
// every event was acknowledged).
func (p *Publisher) sendWindow(queue []queued, size int) ([]queued, int, error) {
	n := min(len(queue), size, publishWindow)
	now := time.Now()
	select {
	case <-p.windowDone: // a signal left over from an abandoned window
	default:
	}
	p.flightMu.Lock()
	p.outstanding, p.sent = n, false
	p.flightMu.Unlock()
	for i := range n {
		q := &queue[i]
		if q.first.IsZero() {
			q.first = now
		}
		o := q.out
		p.flightMu.Lock()
		o.state, o.err = outPending, nil
		p.inFlight[&o.msg] = o
		p.flightMu.Unlock()
		// The client copies Data into the connection's buffer before it
		// returns, and keeps &o.msg until the publish settles.
		if _, err := p.js.PublishMsgAsync(&o.msg); err != nil {
			p.flightMu.Lock()
			if o.state != outAcked {
				p.settled(o)
				o.state, o.err = outFailed, err
			}
			p.flightMu.Unlock()
		}
	}
	p.flightMu.Lock()
	p.sent = true
	complete := p.outstanding <= 0
	p.flightMu.Unlock()
	// The bound only guards against a publish whose outcome is lost.
	if !complete {
		p.bound.Reset(ackTimeout + time.Second)
		select {
		case <-p.windowDone:
		case <-p.bound.C:
		}
		p.bound.Stop()
	}
	var (
		acked   int
		lastErr error
		kept    = queue[:0]
	)
	p.flightMu.Lock()
	for i := range n {
		o := queue[i].out
		delete(p.inFlight, &o.msg)
		if o.state == outPending {
			// Its outcome was lost: publish it again. The client may
			// still hold it, so its buffer is never reused.
			o.state, o.err = outFailed, errNoAck
			o.stale = true
		}
	}
	p.flightMu.Unlock()
	for i := range n {
		q := queue[i]
		err := q.out.err
		switch {
		case q.out.state == outAcked:
			acked++
			p.published.Add(1)
			p.publishedTotal.Inc()
			p.settle()
			p.release(q.out)
		case permanent(err):
			lastErr = err
			p.settle()
			p.drop(DropInvalid, q.kind)
		case now.Sub(q.first) > RetryHorizon:
			lastErr = err
			p.settle()
			p.drop(DropExpired, q.kind)
		default:
			lastErr = err
			kept = append(kept, q)
		}
	}
	kept = append(kept, queue[n:]...)
	// Let the dropped tail be collected.
	clear(queue[len(kept):])
	if len(kept) == 0 && cap(kept) > 4*publishWindow {
		kept = nil
	}
	return kept, acked, lastErr
}

// permanent reports whether a publish error will not go away by waiting:
// the stream refuses the message itself.
func permanent(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum {
		return true
	}
	return errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum) || errors.Is(err, nats.ErrMaxPayload) ||
		errors.Is(err, nats.ErrBadSubject)
}

// sleep waits d; it returns false when Close was called meanwhile.
func (p *Publisher) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.stop:
		return false
	case <-t.C:
		return true
	}
}

// awaitConnection waits until the connection is up; it returns false when
// Close was called meanwhile.
func (p *Publisher) awaitConnection() bool {
	if p.nc.IsConnected() {
		return true
	}
	poll := time.NewTicker(reconnectPoll)
	defer poll.Stop()
	for !p.nc.IsConnected() {
		select {
		case <-p.stop:
			return false
		case <-p.status:
		case <-poll.C:
		}
	}
	return true
}

// drain publishes what is queued and buffered while the connection is up,
// within closeDrainBound; what is left then is dropped and counted.
// waiting tells that the last window failed.
func (p *Publisher) drain(queue []queued, waiting bool) {
	deadline := time.Now().Add(closeDrainBound)
	for {
		queue = p.take(queue)
		if len(queue) == 0 {
			break
		}
		if !p.nc.IsConnected() || time.Now().After(deadline) {
			break
		}
		size := publishWindow
		if waiting {
			size = 1 // as in run: after a failure the head goes alone
		}
		var err error
		queue, _, err = p.sendWindow(queue, size)
		waiting = err != nil
		if waiting {
			t := time.NewTimer(retryPauseMin)
			<-t.C
		}
	}
	for _, q := range queue {
		p.settle()
		p.drop(DropClosed, q.kind)
	}
	for {
		select {
		case ev := <-p.events:
			p.settle()
			p.drop(DropClosed, kindOf(ev.Subject()))
		default:
			return
		}
	}
}

// validSubject reports whether s is a publishable NATS subject: no empty
// token, no whitespace, no wildcard.
func validSubject(s string) bool {
	if s == "" || s[0] == '.' || s[len(s)-1] == '.' || strings.Contains(s, "..") {
		return false
	}
	return !strings.ContainsAny(s, " \t\r\n*>")
}
