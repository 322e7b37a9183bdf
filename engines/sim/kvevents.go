package sim

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
	"github.com/vmihailenco/msgpack/v5"
)

// KV cache events, vLLM's wire format (docs/connectors.md "KV events"),
// what placement's exact index reads through the agent: the prefix cache (prefixcache.go) reports the
// blocks it stores and evicts; each change becomes one batch, published on
// a ZeroMQ PUB socket as three frames [topic, 8-byte big-endian sequence
// number, msgpack payload], the payload [ts, [events…],
// data_parallel_rank]. A ROUTER socket answers replay requests from the
// last batches. Publishing never blocks a request: batches wait in a
// bounded queue that drops its oldest batch when the socket falls behind.

// KV event formats (Config.KVEventsFormat): how each event is encoded.
const (
	// KVEventsArray is the tagged positional array vLLM sent before its
	// events became maps (vLLM 0.9 to 0.23), and SGLang sends: the members
	// up to lora_name, later nil ones left out as msgspec does.
	KVEventsArray = "array"
	// KVEventsMap is a map with a "type" tag, the encoding of current vLLM
	// (after 0.23; seen in 0.26.0), members as 0.26.0 sends them.
	KVEventsMap = "map"
)

// KV event flavors (Config.KVEventsFlavor): whose publisher the engine
// plays.
const (
	// KVEventsVLLM publishes as vLLM does: one BlockStored per contiguous
	// run of new blocks, one BlockRemoved per batch.
	KVEventsVLLM = "vllm"
	// KVEventsSGLang publishes as SGLang's radix cache does: one
	// BlockStored and one BlockRemoved per block (page), tagged arrays,
	// the batch's last member its attention DP rank.
	KVEventsSGLang = "sglang"
)

// Defaults of the KV event settings.
const (
	// DefaultKVEventsBuffer is vLLM's buffer_steps: how many batches the
	// replay socket can answer from.
	DefaultKVEventsBuffer = 10_000
	// kvEventsQueue bounds the batches waiting for the PUB socket.
	kvEventsQueue = 4096
	// kvEventsHWM bounds the messages zmq4 queues for its subscribers;
	// beyond it zmq4 drops messages, as libzmq's PUB does at its HWM.
	kvEventsHWM = 10_000
	// kvMaxInboundFrame bounds a frame a peer of the event sockets may send
	// (a subscription, a replay request); a larger one closes the
	// connection.
	kvMaxInboundFrame = 64 << 10
	// kvHandshakeTimeout bounds a peer's ZMTP greeting and handshake.
	kvHandshakeTimeout = 5 * time.Second
)

// mediumGPU is the medium of every block the simulator holds.
const mediumGPU = "GPU"

// replayEnd is vLLM's END_SEQ: the sequence frame (-1, 8 bytes big-endian)
// of the message that ends a replay.
var replayEnd = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// kvEventEncoder encodes batches of KV events in one format and flavor.
// It is not safe for concurrent use: the prefix cache calls it under its
// lock.
type kvEventEncoder struct {
	format, flavor string
	rank           int // data_parallel_rank; negative = nil
	buf            bytes.Buffer
	enc            *msgpack.Encoder
}

func newKVEventEncoder(format, flavor string, rank int) *kvEventEncoder {
	e := &kvEventEncoder{format: format, flavor: flavor, rank: rank}
	e.enc = msgpack.NewEncoder(&e.buf)
	return e
}

// kvChange is what one cache operation did, in cache order: blocks
// removed (evicted), then blocks stored, or the whole cache cleared.
type kvChange struct {
	cleared   bool
	removed   []uint64
	stored    []int32  // indices into hashes of the blocks stored, ascending
	hashes    []uint64 // the request's block hashes
	tokens    []uint32 // the request's token ids (at least len(hashes)·blockSize)
	blockSize int
}

// encode returns the msgpack payload of one batch holding ch's events,
// stamped ts (seconds since the epoch): a new slice the caller owns.
func (e *kvEventEncoder) encode(ts float64, ch *kvChange) []byte {
	e.buf.Reset()
	enc := e.enc
	// msgpack's Encoder writes into a bytes.Buffer, which cannot fail.
	_ = enc.EncodeArrayLen(3)
	_ = enc.EncodeFloat64(ts)
	_ = enc.EncodeArrayLen(e.countEvents(ch))
	if ch.cleared {
		e.tagged("AllBlocksCleared", 0)
	}
	if len(ch.removed) > 0 {
		if e.flavor == KVEventsSGLang {
			for i := range ch.removed {
				e.blockRemoved(ch.removed[i : i+1])
			}
		} else {
			e.blockRemoved(ch.removed)
		}
	}
	for i := 0; i < len(ch.stored); {
		j := i + 1
		if e.flavor != KVEventsSGLang {
			for j < len(ch.stored) && ch.stored[j] == ch.stored[j-1]+1 {
				j++
			}
		}
		e.blockStored(ch, int(ch.stored[i]), int(ch.stored[j-1])+1)
		i = j
	}
	if e.rank < 0 {
		_ = enc.EncodeNil()
	} else {
		_ = enc.EncodeInt(int64(e.rank))
	}
	return bytes.Clone(e.buf.Bytes())
}

// countEvents is the number of events encode writes for ch.
func (e *kvEventEncoder) countEvents(ch *kvChange) int {
	n := 0
	if ch.cleared {
		n++
	}
	if e.flavor == KVEventsSGLang {
		return n + len(ch.removed) + len(ch.stored)
	}
	if len(ch.removed) > 0 {
		n++
	}
	for i := range ch.stored {
		if i == 0 || ch.stored[i] != ch.stored[i-1]+1 {
			n++
		}
	}
	return n
}

// tagged opens an event of tag with members more members: a tagged array
// [tag, …] or a map {"type": tag, …}.
func (e *kvEventEncoder) tagged(tag string, members int) {
	if e.format == KVEventsMap {
		_ = e.enc.EncodeMapLen(1 + members)
		_ = e.enc.EncodeString("type")
	} else {
		_ = e.enc.EncodeArrayLen(1 + members)
	}
	_ = e.enc.EncodeString(tag)
}

// key writes a map member's name (nothing for a tagged array).
func (e *kvEventEncoder) key(name string) {
	if e.format == KVEventsMap {
		_ = e.enc.EncodeString(name)
	}
}

// blockRemoved writes a BlockRemoved of hashes.
func (e *kvEventEncoder) blockRemoved(hashes []uint64) {
	if e.format == KVEventsMap {
		e.tagged("BlockRemoved", 3)
	} else {
		e.tagged("BlockRemoved", 2)
	}
	e.key("block_hashes")
	_ = e.enc.EncodeArrayLen(len(hashes))
	for _, h := range hashes {
		_ = e.enc.EncodeUint(h)
	}
	e.key("medium")
	_ = e.enc.EncodeString(mediumGPU)
	if e.format == KVEventsMap {
		e.key("group_idx")
		_ = e.enc.EncodeUint(0)
	}
}

// blockStored writes a BlockStored of ch's blocks [from, to): their
// hashes, the parent (the hash of block from-1, nil for the prompt's first
// block), their token ids and the block size. Members after block_size
// follow vLLM's (or SGLang's) declaration order: lora_id, medium,
// lora_name, and in the map encoding extra_keys (one nil per block),
// group_idx and kv_cache_spec_kind.
func (e *kvEventEncoder) blockStored(ch *kvChange, from, to int) {
	enc := e.enc
	switch {
	case e.format == KVEventsMap:
		e.tagged("BlockStored", 10)
	case e.flavor == KVEventsSGLang:
		e.tagged("BlockStored", 6)
	default:
		e.tagged("BlockStored", 7)
	}
	e.key("block_hashes")
	_ = enc.EncodeArrayLen(to - from)
	for _, h := range ch.hashes[from:to] {
		_ = enc.EncodeUint(h)
	}
	e.key("parent_block_hash")
	if from == 0 {
		_ = enc.EncodeNil()
	} else {
		_ = enc.EncodeUint(ch.hashes[from-1])
	}
	e.key("token_ids")
	tokens := ch.tokens[from*ch.blockSize : to*ch.blockSize]
	_ = enc.EncodeArrayLen(len(tokens))
	for _, t := range tokens {
		_ = enc.EncodeUint(uint64(t))
	}
	e.key("block_size")
	_ = enc.EncodeUint(uint64(ch.blockSize))
	e.key("lora_id")
	_ = enc.EncodeNil()
	e.key("medium")
	_ = enc.EncodeString(mediumGPU)
	if e.flavor == KVEventsSGLang {
		return
	}
	e.key("lora_name")
	_ = enc.EncodeNil()
	if e.format != KVEventsMap {
		return
	}
	e.key("extra_keys")
	_ = enc.EncodeArrayLen(to - from)
	for range to - from {
		_ = enc.EncodeNil()
	}
	e.key("group_idx")
	_ = enc.EncodeUint(0)
	e.key("kv_cache_spec_kind")
	_ = enc.EncodeString("full_attention")
}

// kvEventQueue holds encoded batches until the publisher sends them: at
// most capacity; when full, pushing drops the oldest (counted).
type kvEventQueue struct {
	mu       sync.Mutex
	batches  [][]byte // ring
	head, n  int
	ready    chan struct{} // a token when batches may be waiting
	dropped  atomic.Int64
	capacity int
}

func newKVEventQueue(capacity int) *kvEventQueue {
	return &kvEventQueue{batches: make([][]byte, capacity), capacity: capacity, ready: make(chan struct{}, 1)}
}

// push queues payload without blocking.
func (q *kvEventQueue) push(payload []byte) {
	q.mu.Lock()
	if q.n == q.capacity {
		q.batches[q.head] = nil
		q.head = (q.head + 1) % q.capacity
		q.n--
		q.dropped.Add(1)
	}
	q.batches[(q.head+q.n)%q.capacity] = payload
	q.n++
	q.mu.Unlock()
	select {
	case q.ready <- struct{}{}:
	default:
	}
}

// pop takes the oldest batch, if any.
func (q *kvEventQueue) pop() ([]byte, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.n == 0 {
		return nil, false
	}
	p := q.batches[q.head]
	q.batches[q.head] = nil
	q.head = (q.head + 1) % q.capacity
	q.n--
	return p, true
}

// kvReplayBuffer keeps the last batches sent, with their sequence
// numbers, for the replay socket (vLLM's buffer of buffer_steps).
type kvReplayBuffer struct {
	mu       sync.Mutex
	seqs     []uint64
	payloads [][]byte
	head, n  int
}

func (b *kvReplayBuffer) add(seq uint64, payload []byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.seqs) == 0 {
		return
	}
	i := (b.head + b.n) % len(b.seqs)
	if b.n == len(b.seqs) {
		b.head = (b.head + 1) % len(b.seqs)
	} else {
		b.n++
	}
	b.seqs[i], b.payloads[i] = seq, payload
}

// since returns the buffered batches whose sequence is at least start,
// oldest first.
func (b *kvReplayBuffer) since(start uint64) (seqs []uint64, payloads [][]byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for k := 0; k < b.n; k++ {
		i := (b.head + k) % len(b.seqs)
		if b.seqs[i] >= start {
			seqs = append(seqs, b.seqs[i])
			payloads = append(payloads, b.payloads[i])
		}
	}
	return seqs, payloads
}

// kvEventPublisher owns the event sockets: it sends the queue's batches
// on the PUB socket, numbering them from 0, and answers replay requests
// on the ROUTER socket.
type kvEventPublisher struct {
	queue     *kvEventQueue
	replay    kvReplayBuffer
	topic     []byte
	published atomic.Int64

	ctx    context.Context
	cancel context.CancelFunc
	pub    zmq4.Socket
	router zmq4.Socket // nil without a replay endpoint
	dial   string      // the endpoint to dial; "" when pub listens
	wg     sync.WaitGroup
}

// guardedTCP and guardedPubTCP are the zmq4 transports the event sockets
// use for tcp:// endpoints: TCP whose connections time out a peer that
// does not finish its ZMTP handshake within kvHandshakeTimeout and close
// on a frame larger than kvMaxInboundFrame, so that a hostile peer can
// neither stall zmq4's accept loop nor make it allocate a frame of its
// choosing. guardedPubTCP, the PUB socket's, also closes a peer that
// sends anything but single-frame subscriptions: zmq4 queues such
// messages for a reader a PUB socket never has, and would park that
// connection's goroutine (and keep its socket open) for good.
const (
	guardedTCP    = "narwhal-tcp"
	guardedPubTCP = "narwhal-tcp-pub"
)

var (
	registerGuarded sync.Once
	registerErr     error
)

// zmqEndpoint checks a tcp://HOST:PORT endpoint and returns it on the
// guarded transport (the PUB socket's when pub).
func zmqEndpoint(ep string, pub bool) (string, error) {
	addr, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return "", fmt.Errorf("endpoint %q: want tcp://HOST:PORT", ep)
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return "", fmt.Errorf("endpoint %q: %w", ep, err)
	}
	registerGuarded.Do(func() {
		registerErr = errors.Join(zmq4.RegisterTransport(guardedTCP, guardTransport{}),
			zmq4.RegisterTransport(guardedPubTCP, guardTransport{subscriptionsOnly: true}))
	})
	if registerErr != nil {
		return "", registerErr
	}
	if pub {
		return guardedPubTCP + "://" + addr, nil
	}
	return guardedTCP + "://" + addr, nil
}

// startKVEventPublisher opens the sockets of cfg's KV event settings
// (bind or dial the PUB socket, bind the ROUTER socket) and starts sending
// q's batches. Binding happens now, so a busy port fails here; dialing
// happens in the background and is retried until Close.
func startKVEventPublisher(cfg *Config, q *kvEventQueue) (*kvEventPublisher, error) {
	p := &kvEventPublisher{queue: q, topic: []byte(cfg.KVEventsTopic)}
	p.replay.seqs = make([]uint64, cfg.KVEventsBuffer)
	p.replay.payloads = make([][]byte, cfg.KVEventsBuffer)
	p.ctx, p.cancel = context.WithCancel(context.Background())
	quiet := log.New(nopWriter{}, "", 0)
	opts := []zmq4.Option{zmq4.WithLogger(quiet)}
	if cfg.KVEventsConnect != "" {
		// Dial until a subscriber answers, and again whenever it goes
		// away. (A listening socket must not: zmq4 would redial its own
		// endpoint.)
		opts = append(opts, zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(100*time.Millisecond),
			zmq4.WithAutomaticReconnect(true))
	}
	p.pub = zmq4.NewPub(p.ctx, opts...)
	if err := p.pub.SetOption(zmq4.OptionHWM, kvEventsHWM); err != nil {
		p.cancel()
		return nil, fmt.Errorf("sim: kv events: %w", err)
	}
	fail := func(err error) (*kvEventPublisher, error) {
		p.cancel()
		_ = p.pub.Close()
		if p.router != nil {
			_ = p.router.Close()
		}
		return nil, fmt.Errorf("sim: kv events: %w", err)
	}
	if cfg.KVEvents != "" {
		ep, err := zmqEndpoint(cfg.KVEvents, true)
		if err != nil {
			return fail(err)
		}
		if err := p.pub.Listen(ep); err != nil {
			return fail(err)
		}
	} else {
		ep, err := zmqEndpoint(cfg.KVEventsConnect, true)
		if err != nil {
			return fail(err)
		}
		p.dial = ep
	}
	if cfg.KVEventsReplay != "" {
		ep, err := zmqEndpoint(cfg.KVEventsReplay, false)
		if err != nil {
			return fail(err)
		}
		p.router = zmq4.NewRouter(p.ctx, zmq4.WithLogger(quiet), zmq4.WithTimeout(5*time.Second))
		if err := p.router.Listen(ep); err != nil {
			return fail(err)
		}
		p.wg.Add(1)
		go func() { defer p.wg.Done(); p.serveReplay() }()
	}
	p.wg.Add(1)
	go func() { defer p.wg.Done(); p.run() }()
	return p, nil
}

// addr returns the address the PUB socket listens on ("" when it dials).
func (p *kvEventPublisher) addr() string {
	if a := p.pub.Addr(); a != nil {
		return a.String()
	}
	return ""
}

// replayAddr returns the address the ROUTER socket listens on, "" without
// one.
func (p *kvEventPublisher) replayAddr() string {
	if p.router == nil {
		return ""
	}
	if a := p.router.Addr(); a != nil {
		return a.String()
	}
	return ""
}

// run sends the queue's batches in order, numbering them from 0, and
// keeps each in the replay buffer.
func (p *kvEventPublisher) run() {
	if p.dial != "" {
		if err := p.pub.Dial(p.dial); err != nil {
			return // closed before a subscriber answered
		}
	}
	var seq uint64
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-p.queue.ready:
		}
		for {
			payload, ok := p.queue.pop()
			if !ok {
				break
			}
			seqFrame := binary.BigEndian.AppendUint64(make([]byte, 0, 8), seq)
			// zmq4's PUB only queues the message: Send does not wait for
			// subscribers, and drops beyond its HWM.
			if err := p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, seqFrame, payload)); err != nil && p.ctx.Err() != nil {
				return
			}
			p.replay.add(seq, payload)
			p.published.Add(1)
			seq++
		}
	}
}

// serveReplay answers replay requests as vLLM's _service_replay does: a
// request is [identity, empty, start sequence (big-endian)]; the answer
// is one message [empty, sequence, payload] per buffered batch from start
// on, then [empty, END_SEQ (-1), empty]. Other requests are ignored.
func (p *kvEventPublisher) serveReplay() {
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if p.ctx.Err() != nil {
				return
			}
			continue
		}
		if len(msg.Frames) != 3 {
			continue
		}
		id, start := msg.Frames[0], replayStart(msg.Frames[2])
		seqs, payloads := p.replay.since(start)
		for i := range seqs {
			seqFrame := binary.BigEndian.AppendUint64(make([]byte, 0, 8), seqs[i])
			if err := p.router.SendMulti(zmq4.NewMsgFrom(id, nil, seqFrame, payloads[i])); err != nil {
				break
			}
		}
		_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, replayEnd, nil))
	}
}

// replayStart reads a replay request's start sequence as Python's
// int.from_bytes(b, "big") does: any length, unsigned; one beyond 64 bits
// is later than every batch.
func replayStart(b []byte) uint64 {
	for len(b) > 8 {
		if b[0] != 0 {
			return ^uint64(0)
		}
		b = b[1:]
	}
	var v uint64
	for _, c := range b {
		v = v<<8 | uint64(c)
	}
	return v
}

// close stops the publisher and closes its sockets; batches still queued
// are not sent.
func (p *kvEventPublisher) close() {
	p.cancel()
	_ = p.pub.Close()
	if p.router != nil {
		_ = p.router.Close()
	}
	p.wg.Wait()
}

type nopWriter struct{}

func (nopWriter) Write(b []byte) (int, error) { return len(b), nil }

// guardTransport is the guardedTCP (or guardedPubTCP) transport.
type guardTransport struct{ subscriptionsOnly bool }

// Dial dials addr over TCP and guards the connection.
func (t guardTransport) Dial(ctx context.Context, dialer transport.Dialer, addr string) (net.Conn, error) {
	c, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	return newGuardedConn(c, t.subscriptionsOnly), nil
}

// Listen listens on addr over TCP; every accepted connection is guarded.
func (t guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	return guardedListener{ln, t.subscriptionsOnly}, nil
}

// Addr maps a zmq tcp address to a Go one: host "*" or "" is every
// interface, port "*" or "" any free port.
func (guardTransport) Addr(ep string) (string, error) {
	host, port, err := net.SplitHostPort(ep)
	if err != nil {
		return "", err
	}
	if host == "*" {
		host = ""
	}
	if port == "*" || port == "" {
		port = "0"
	}
	return net.JoinHostPort(host, port), nil
}

type guardedListener struct {
	net.Listener
	subscriptionsOnly bool
}

func (l guardedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newGuardedConn(c, l.subscriptionsOnly), nil
}

var (
	// errKVFrameTooLarge closes a connection whose peer sends a frame
	// larger than kvMaxInboundFrame.
	errKVFrameTooLarge = errors.New("zmtp frame too large")
	// errKVNotSubscription closes a PUB socket's connection whose peer
	// sends a message that is not a subscription.
	errKVNotSubscription = errors.New("zmtp message to a PUB socket is not a subscription")
)

// guardedConn follows the ZMTP 3 byte stream a peer sends (the 64-byte
// greeting, then frames: flags, a 1- or 8-byte size, the body) without
// copying it: it fails a read that would bring a frame larger than
// kvMaxInboundFrame (or, subscriptionsOnly, a message other than one
// frame starting with 0 or 1, an unsubscription or a subscription), and
// lifts the handshake deadline once the peer's first command (its READY)
// is complete.
type guardedConn struct {
	net.Conn
	subscriptionsOnly bool
	greeting          int    // greeting bytes still to come
	hdr               []byte // the frame header read so far
	body              uint64 // body bytes still to come
	command           bool   // the current frame is a command
	first             bool   // the next body byte is a message's first
	handshake         bool   // the handshake deadline is still set
}

func newGuardedConn(c net.Conn, subscriptionsOnly bool) *guardedConn {
	_ = c.SetDeadline(time.Now().Add(kvHandshakeTimeout))
	return &guardedConn{Conn: c, subscriptionsOnly: subscriptionsOnly, greeting: 64, hdr: make([]byte, 0, 9), handshake: true}
}

func (g *guardedConn) Read(p []byte) (int, error) {
	n, err := g.Conn.Read(p)
	if ferr := g.follow(p[:n]); ferr != nil {
		_ = g.Conn.Close()
		return 0, ferr
	}
	return n, err
}

// follow advances the stream state over b, the bytes just read.
func (g *guardedConn) follow(b []byte) error {
	for len(b) > 0 {
		switch {
		case g.greeting > 0:
			k := min(g.greeting, len(b))
			g.greeting -= k
			b = b[k:]
		case g.body > 0:
			if g.first {
				g.first = false
				if b[0] > 1 {
					return errKVNotSubscription
				}
			}
			k := min(g.body, uint64(len(b)))
			g.body -= k
			b = b[k:]
			if g.body == 0 {
				g.frameDone()
			}
		default:
			g.hdr = append(g.hdr, b[0])
			b = b[1:]
			flags := g.hdr[0]
			want := 2
			if flags&0x02 != 0 {
				want = 9
			}
			if len(g.hdr) < want {
				continue
			}
			var size uint64
			if want == 2 {
				size = uint64(g.hdr[1])
			} else {
				size = binary.BigEndian.Uint64(g.hdr[1:9])
			}
			g.hdr = g.hdr[:0]
			if size > kvMaxInboundFrame {
				return errKVFrameTooLarge
			}
			g.command, g.body = flags&0x04 != 0, size
			if g.subscriptionsOnly && !g.command {
				if flags&0x01 != 0 || size == 0 {
					return errKVNotSubscription
				}
				g.first = true
			}
			if size == 0 {
				g.frameDone()
			}
		}
	}
	return nil
}

// frameDone ends a frame: the first command ends the peer's handshake.
func (g *guardedConn) frameDone() {
	if g.command && g.handshake {
		g.handshake = false
		_ = g.Conn.SetDeadline(time.Time{})
	}
}

// checkKVEvents validates cfg's KV event settings and fills their
// defaults.
func checkKVEvents(cfg *Config) error {
	if cfg.KVEvents != "" && cfg.KVEventsConnect != "" {
		return errors.New("sim: kv events: bind (KVEvents) or dial (KVEventsConnect), not both")
	}
	on := cfg.KVEvents != "" || cfg.KVEventsConnect != ""
	if !on && (cfg.KVEventsReplay != "" || cfg.KVEventsTopic != "" || cfg.KVEventsFormat != "" || cfg.KVEventsFlavor != "") {
		return errors.New("sim: kv events settings need a KV events endpoint to bind or dial")
	}
	for _, ep := range []string{cfg.KVEvents, cfg.KVEventsConnect, cfg.KVEventsReplay} {
		if ep == "" {
			continue
		}
		if _, err := zmqEndpoint(ep, false); err != nil {
			return fmt.Errorf("sim: kv events: %w", err)
		}
	}
	if cfg.KVEventsBuffer < 0 {
		return errors.New("sim: kv events buffer must not be negative")
	}
	if cfg.KVEventsBuffer == 0 {
		cfg.KVEventsBuffer = DefaultKVEventsBuffer
	}
	switch cfg.KVEventsFlavor {
	case "":
		cfg.KVEventsFlavor = KVEventsVLLM
	case KVEventsVLLM, KVEventsSGLang:
	default:
		return fmt.Errorf("sim: unknown kv events flavor %q (want vllm or sglang)", cfg.KVEventsFlavor)
	}
	switch cfg.KVEventsFormat {
	case "":
		cfg.KVEventsFormat = KVEventsMap
		if cfg.KVEventsFlavor == KVEventsSGLang {
			cfg.KVEventsFormat = KVEventsArray
		}
	case KVEventsArray:
	case KVEventsMap:
		if cfg.KVEventsFlavor == KVEventsSGLang {
			return errors.New("sim: SGLang publishes its KV events as tagged arrays only")
		}
	default:
		return fmt.Errorf("sim: unknown kv events format %q (want array or map)", cfg.KVEventsFormat)
	}
	return nil
}

func (s *Server) publisher() *kvEventPublisher {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.kvPub
}

// KVEventsAddr returns the address the KV events PUB socket listens on
// ("host:port"), empty before Start, when it dials, or without KV events.
func (s *Server) KVEventsAddr() string {
	if p := s.publisher(); p != nil {
		return p.addr()
	}
	return ""
}

// KVEventsReplayAddr returns the address the replay ROUTER socket listens
// on, empty before Start or without one.
func (s *Server) KVEventsReplayAddr() string {
	if p := s.publisher(); p != nil {
		return p.replayAddr()
	}
	return ""
}

// KVEventsDropped returns how many KV event batches were dropped because
// the publisher fell behind (narwhal_sim_kv_events_dropped_total).
func (s *Server) KVEventsDropped() int64 {
	if s.events == nil {
		return 0
	}
	return s.events.dropped.Load()
}
