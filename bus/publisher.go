package bus

import (
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Publisher tuning.
const (
	// maxPendingAcks bounds the async publishes awaiting their ack.
	maxPendingAcks = 256
	// ackTimeout is how long an async publish may wait for its ack before
	// it counts as dropped.
	ackTimeout = 5 * time.Second
	// stallWait is how long the publisher's goroutine waits for a free ack
	// slot before it drops an event.
	stallWait = 50 * time.Millisecond
	// reconnectPoll is how often a publisher waiting for the connection
	// checks it, besides the connection's status notifications.
	reconnectPoll = 250 * time.Millisecond
	// closeDrainBound bounds how long Close spends publishing what is
	// buffered and waiting for acks.
	closeDrainBound = 2 * time.Second
	// maxPublishAttempts is how often one event is published before its
	// failure counts as a drop: an event whose ack the connection's loss
	// (or a server going down) took away is published again once the
	// connection is back, under the same message id, so that it is stored
	// once however often it is sent (R-BUS-3, R-BUS-6).
	maxPublishAttempts = 4
	// republishPause is the pause before an event is published again, so
	// that a server still shutting down or starting is not hammered.
	republishPause = 100 * time.Millisecond
)

// Reasons for dropping an event: the "reason" label of
// narwhal_events_dropped_total.
const (
	// DropBufferFull: Publish found the buffer full (the bus is down or
	// slower than the event rate).
	DropBufferFull = "buffer_full"
	// DropBusError: the publish failed or its ack did not arrive in time.
	DropBusError = "bus_error"
	// DropInvalid: the event could not be marshalled or its subject is not
	// a valid NATS subject (an empty id).
	DropInvalid = "invalid"
	// DropClosed: the event arrived after Close began, or was still
	// buffered when Close's bound ran out.
	DropClosed = "closed"
)

// Publisher publishes events to stream NARWHAL_EVENTS from its own
// goroutine so that Publish never blocks its caller (SPEC R-BUS-6): events
// wait in a bounded buffer, and when it is full they are dropped and
// counted. While the connection is down the goroutine waits for it, so the
// buffer carries events across a short outage; an event that was in flight
// when the connection went (its ack never came) is published again once it
// is back, up to maxPublishAttempts times in all. Each event's ID is its
// JetStream message id, so a re-published event is dropped by the stream
// as a duplicate (R-BUS-3). Safe for concurrent use.
type Publisher struct {
	nc     *nats.Conn
	js     jetstream.JetStream // the publisher's own, with its ack handlers
	events chan schemas.Event
	status chan nats.Status // connection status notifications
	stop   chan struct{}    // closed by Close
	done   chan struct{}    // closed when the goroutine exits

	mu     sync.RWMutex // held for reading by Publish, for writing by Close
	closed bool

	// again holds events to publish once more (see retry); attempts
	// counts the publishes of each, by message id. Both are guarded by
	// againMu; againClosed is set when nothing will read again any more.
	again       chan *nats.Msg
	againMu     sync.Mutex
	attempts    map[string]int
	againClosed bool

	published atomic.Uint64
	// outstanding counts publishes whose ack or error handler has not run
	// yet, so Close can wait for the handlers, not only for the acks.
	outstanding atomic.Int64
	dropped     atomic.Uint64

	publishedTotal prometheus.Counter
	droppedTotal   *prometheus.CounterVec
}

// NewPublisher returns a Publisher on b with room for buffer waiting events
// (buffer < 1 is taken as 1) and starts its goroutine; the caller owns it
// and must Close it before closing b. When reg is not nil it registers
// narwhal_events_published_total (events the stream acknowledged) and
// narwhal_events_dropped_total{reason} (events given up on, see the Drop*
// reasons); publishers sharing a registry share these counters.
func NewPublisher(b *Bus, buffer int, reg prometheus.Registerer) *Publisher {
	if buffer < 1 {
		buffer = 1
	}
	p := &Publisher{
		nc:       b.nc,
		events:   make(chan schemas.Event, buffer),
		again:    make(chan *nats.Msg, buffer),
		attempts: map[string]int{},
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
		publishedTotal: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_events_published_total",
			Help: "Bus events acknowledged by the stream.",
		}),
		droppedTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_events_dropped_total",
			Help: "Bus events given up on, by reason (buffer_full, bus_error, invalid, closed).",
		}, []string{"reason"}),
	}
	if reg != nil {
		p.publishedTotal = register(reg, p.publishedTotal)
		p.droppedTotal = register(reg, p.droppedTotal)
	}
	js, err := jetstream.New(b.nc,
		jetstream.WithPublishAsyncMaxPending(maxPendingAcks),
		jetstream.WithPublishAsyncTimeout(ackTimeout),
		jetstream.WithPublishAsyncAckHandler(func(_ jetstream.JetStream, m *nats.Msg, _ *jetstream.PubAck) {
			p.settled(m)
			p.published.Add(1)
			p.publishedTotal.Inc()
			p.outstanding.Add(-1)
		}),
		jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, m *nats.Msg, _ error) {
			if !p.retry(m) {
				p.drop(DropBusError)
			}
			p.outstanding.Add(-1)
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

// register registers c on reg, or returns the collector already registered
// under the same name.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		// A different collector holds the name: count locally only.
	}
	return c
}

// Publish hands ev to the publisher and returns at once; it never blocks
// (R-BUS-6). It sets ev.Head().ID to a new NUID when empty and
// ev.Head().At to time.Now().UTC() when zero. From then on ev belongs to the
// publisher: the caller must not change it. When the buffer is full, or
// after Close, the event is dropped and counted.
func (p *Publisher) Publish(ev schemas.Event) {
	h := ev.Head()
	if h.ID == "" {
		h.ID = nuid.Next()
	}
	if h.At.IsZero() {
		h.At = time.Now().UTC()
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		p.drop(DropClosed)
		return
	}
	select {
	case p.events <- ev:
	default:
		p.drop(DropBufferFull)
	}
}

// Published returns how many of this publisher's events the stream has
// acknowledged (duplicates included: they are stored once).
func (p *Publisher) Published() uint64 { return p.published.Load() }

// Dropped returns how many of this publisher's events were given up on,
// for any reason.
func (p *Publisher) Dropped() uint64 { return p.dropped.Load() }

func (p *Publisher) drop(reason string) {
	p.dropped.Add(1)
	p.droppedTotal.WithLabelValues(reason).Inc()
}

// Close stops accepting events, publishes what is buffered and waits for
// the acks for at most 2 s in all (events still buffered then are dropped
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

// run is the publisher's goroutine: it owns the JetStream publishing and
// exits when Close closes stop.
func (p *Publisher) run() {
	defer close(p.done)
	defer p.nc.RemoveStatusListener(p.status)
	defer p.cleanup()
	for {
		select {
		case <-p.stop:
			p.drain()
			return
		case ev := <-p.events:
			if !p.awaitConnection() {
				p.drop(DropClosed)
				p.drain()
				return
			}
			p.send(ev)
		case m := <-p.again:
			// One pause, then everything queued by then goes again.
			if !p.pause() || !p.awaitConnection() {
				p.resendOrDrop(m)
				p.drain()
				return
			}
			p.resend(m)
			p.resendQueued(false)
		}
	}
}

// cleanup fails (and so counts) the acks still pending when the publisher
// stops. With none pending it leaves the JetStream publisher alone: its
// helper goroutine, started by the first publish, then ends when the
// connection closes, whereas cleaning up before that goroutine has run
// would strand it for good (nats.go's jetstream reads a nil status channel
// then).
func (p *Publisher) cleanup() {
	if p.js.PublishAsyncPending() > 0 {
		p.js.CleanupPublisher()
	}
}

// retry queues m, whose publish failed, to be published again; it returns
// false when m has had its maxPublishAttempts, the queue is full or the
// publisher is closing, and m then counts as dropped. Called from the
// publisher's ack handling.
func (p *Publisher) retry(m *nats.Msg) bool {
	id := m.Header.Get(jetstream.MsgIDHeader)
	p.againMu.Lock()
	defer p.againMu.Unlock()
	n := p.attempts[id] + 1 // publishes so far
	if p.againClosed || id == "" || n >= maxPublishAttempts {
		delete(p.attempts, id)
		return false
	}
	select {
	case p.again <- m:
		p.attempts[id] = n
		return true
	default:
		delete(p.attempts, id)
		return false
	}
}

// settled forgets the publish attempts of m (acknowledged or dropped).
func (p *Publisher) settled(m *nats.Msg) {
	p.againMu.Lock()
	if len(p.attempts) > 0 {
		delete(p.attempts, m.Header.Get(jetstream.MsgIDHeader))
	}
	p.againMu.Unlock()
}

// pause waits republishPause; it returns false when Close was called
// meanwhile.
func (p *Publisher) pause() bool {
	t := time.NewTimer(republishPause)
	defer t.Stop()
	select {
	case <-p.stop:
		return false
	case <-t.C:
		return true
	}
}

// resendQueued publishes again every event queued to be (see retry); when
// closing, only while the connection is up (the others are dropped).
func (p *Publisher) resendQueued(closing bool) {
	for {
		select {
		case m := <-p.again:
			if closing {
				p.resendOrDrop(m)
			} else {
				p.resend(m)
			}
		default:
			return
		}
	}
}

// resendOrDrop publishes m again while the connection is up, else drops it
// (Close is under way).
func (p *Publisher) resendOrDrop(m *nats.Msg) {
	if p.nc.IsConnected() {
		p.resend(m)
		return
	}
	p.settled(m)
	p.drop(DropClosed)
}

// resend publishes m again, with its message id (a new message: m holds
// the reply subject of its last attempt).
func (p *Publisher) resend(m *nats.Msg) {
	p.publish(&nats.Msg{Subject: m.Subject, Header: m.Header, Data: m.Data})
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

// send marshals ev and publishes it asynchronously with its ID as the
// message id.
func (p *Publisher) send(ev schemas.Event) {
	subject := ev.Subject()
	if !validSubject(subject) {
		p.drop(DropInvalid)
		return
	}
	data, err := json.Marshal(ev)
	if err != nil {
		p.drop(DropInvalid)
		return
	}
	p.publish(&nats.Msg{Subject: subject, Data: data, Header: nats.Header{jetstream.MsgIDHeader: []string{ev.Head().ID}}})
}

// publish publishes m asynchronously; when that fails at once (the
// connection broke under the write, too many acks pending) m is queued to
// be published again (see retry) or, past its attempts, dropped.
func (p *Publisher) publish(m *nats.Msg) {
	p.outstanding.Add(1)
	if _, err := p.js.PublishMsgAsync(m, jetstream.WithStallWait(stallWait)); err != nil {
		p.outstanding.Add(-1) // no handler will run for it
		if !p.retry(m) {
			p.drop(DropBusError)
		}
	}
}

// drain publishes what is buffered while the connection is up, then waits
// for the pending acks, all within closeDrainBound; what is left is
// dropped, and from then on a failed publish is not retried.
func (p *Publisher) drain() {
	bound := time.NewTimer(closeDrainBound)
	defer bound.Stop()
	defer p.closeAgain()
	p.resendQueued(true)
	for {
		select {
		case ev := <-p.events:
			select {
			case <-bound.C:
				p.drop(DropClosed)
				p.dropBuffered()
				return
			default:
			}
			if p.nc.IsConnected() {
				p.send(ev)
			} else {
				p.drop(DropClosed)
			}
			continue
		default:
		}
		break
	}
	select {
	case <-p.js.PublishAsyncComplete():
	case <-bound.C:
		return
	}
	// The acks are in; their handlers (which count them) may still run.
	for p.outstanding.Load() > 0 {
		t := time.NewTimer(time.Millisecond)
		select {
		case <-t.C:
		case <-bound.C:
			t.Stop()
			return
		}
	}
}

// closeAgain stops retries: every event still queued to be published
// again is dropped and counted.
func (p *Publisher) closeAgain() {
	p.againMu.Lock()
	defer p.againMu.Unlock()
	p.againClosed = true
	for {
		select {
		case <-p.again:
			p.drop(DropClosed)
		default:
			clear(p.attempts)
			return
		}
	}
}

// dropBuffered drops and counts every buffered event.
func (p *Publisher) dropBuffered() {
	for {
		select {
		case <-p.events:
			p.drop(DropClosed)
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
