// Package kvevents carries an engine's KV cache events onto the bus
// (behaviour.md R-PLACE-4; docs/connectors.md, "KV events"): `narwhal
// agent --kv-events` subscribes to the engine's ZeroMQ publishers (vLLM's
// format, one per data-parallel rank), maps each engine block to a key of
// our own (prefix.TokenBlockKey of its token ids, chained from its
// parent's), and publishes compact batches (bus.KVBatch) on
// bus.KVSubject(engine id) under the engine's own credential. It follows
// each publisher's sequence: a gap is filled from vLLM's replay socket or
// else published as KVLost, a sequence that goes back (a restarted
// publisher) as KVCleared. Every bound — message size, events, blocks
// per rank, the queue to the bus — holds against a hostile or broken
// publisher.
package kvevents

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/pause"
)

// Defaults of Config (docs/connectors.md, "The agent's flags").
const (
	// DefaultMaxBlocks bounds the engine blocks the agent knows per rank:
	// 200000 blocks (3.2 M tokens at vLLM's default 16 per block), 6.7 MiB
	// of map per rank as TestBlockMapMemory measures it (Go's maps grow
	// by doubling: 2^18 blocks would take 13.3 MiB).
	DefaultMaxBlocks = 200_000
	// DefaultFlush is how long the first op of a batch waits for more
	// before the batch goes to the bus.
	DefaultFlush = 5 * time.Millisecond
	// DefaultReplayWait bounds one replay: connecting to the replay
	// socket, asking, and every answer up to the end marker.
	DefaultReplayWait = time.Second
	// DefaultQueue is how many batches (each at most bus.KVMaxBatch,
	// 256 KiB) wait for the bus at most: 8 MiB.
	DefaultQueue = 32
	// DefaultCheckpoint is how often the agent restates what each rank
	// holds (a KVCleared of the rank and every block it knows, in one
	// batch where they fit): a router that starts, or that dropped the
	// engine's exact index, is exact again at the next checkpoint it
	// reads, live or from stream NARWHAL_PREFIX's 10 minutes.
	DefaultCheckpoint = time.Minute
	// defaultHandshake bounds a ZeroMQ peer's greeting and READY.
	defaultHandshake = 2 * time.Second
	// defaultMessageWait bounds one message, from its first frame's
	// header to its last byte: a 4 MiB message takes milliseconds on any
	// network an engine and its agent share, so a publisher still
	// sending one after 5 s is stuck or hostile and its connection ends
	// (the agent dials again). Silence between messages is not bounded.
	defaultMessageWait = 5 * time.Second
	// redialMin and redialMax bound the wait before the agent dials a
	// publisher again after its connection ended or a dial failed.
	redialMin = 50 * time.Millisecond
	redialMax = time.Second
)

// Source is one data-parallel rank's publisher.
type Source struct {
	// Rank is the publisher's data-parallel rank, 0…bus.KVMaxRanks-1.
	Rank int
	// Endpoint is its PUB socket, tcp://HOST:PORT or ipc://PATH.
	Endpoint string
	// Bind makes the agent bind Endpoint and wait for the publisher to
	// connect (llm-d's simulator dials out), instead of connecting.
	Bind bool
	// Replay is its replay socket (vLLM's ROUTER, replay_endpoint), ""
	// for none.
	Replay string
}

// ParseSource parses a flag's value, RANK=ENDPOINT or ENDPOINT (rank 0).
// It returns an error for a rank outside 0…bus.KVMaxRanks-1 or an
// endpoint that is not tcp://HOST:PORT or ipc://PATH.
func ParseSource(v string) (rank int, endpoint string, err error) {
	endpoint = v
	if r, ep, ok := strings.Cut(v, "="); ok && !strings.Contains(r, "://") {
		n, err := strconv.Atoi(r)
		if err != nil || n < 0 || n >= bus.KVMaxRanks {
			return 0, "", fmt.Errorf("%q: the rank before '=' must be 0…%d", v, bus.KVMaxRanks-1)
		}
		rank, endpoint = n, ep
	}
	if _, err := guardedEndpoint(endpoint); err != nil {
		return 0, "", err
	}
	return rank, endpoint, nil
}

// Config is what a Bridge reads and where it publishes.
type Config struct {
	// EngineID is the engine whose events these are (its subject's id).
	EngineID string
	// Sources are its publishers, one per rank.
	Sources []Source
	// Topic is the subscription prefix; "" takes every topic.
	Topic string
	// MaxBlocks bounds the blocks known per rank (0: DefaultMaxBlocks).
	MaxBlocks int
	// MaxMessage bounds one ZeroMQ message in bytes (0:
	// DefaultMaxMessage); a larger one ends its connection.
	MaxMessage int
	// MessageWait bounds one ZeroMQ message from its first frame's header
	// to its last byte (0: 5 s); a publisher slower than that has its
	// connection ended.
	MessageWait time.Duration
	// Flush is how long a batch waits for more ops (0: DefaultFlush).
	Flush time.Duration
	// ReplayWait bounds one replay (0: DefaultReplayWait).
	ReplayWait time.Duration
	// Queue bounds the batches waiting for the bus (0: DefaultQueue).
	Queue int
	// Checkpoint is how often each rank's blocks are restated in full
	// (0: DefaultCheckpoint; negative: never).
	Checkpoint time.Duration
	// Epoch is the run's epoch (0: a random one, never 0).
	Epoch uint64
	// Registry, when set, gets the agent's KV series.
	Registry prometheus.Registerer
	// Log gets the bridge's warnings (at most one per kind per 10 s).
	Log *slog.Logger
}

// Bridge carries one engine's KV events from its publishers to the bus.
type Bridge struct {
	cfg  Config
	m    *metrics
	asm  *assembler
	rlog *rateLog
	zlog *log.Logger
}

// New checks cfg and returns a Bridge. It returns an error for an engine
// id that is empty or longer than bus.PrefixMaxID, no source, two sources
// of one rank, a bad endpoint, or a negative bound.
func New(cfg Config) (*Bridge, error) {
	if cfg.EngineID == "" || len(cfg.EngineID) > bus.PrefixMaxID {
		return nil, errors.New("kv events: the engine id must be 1…255 bytes")
	}
	if len(cfg.Sources) == 0 {
		return nil, errors.New("kv events: no publisher endpoint")
	}
	if cfg.MaxBlocks < 0 || cfg.MaxMessage < 0 || cfg.MessageWait < 0 || cfg.Flush < 0 || cfg.ReplayWait < 0 || cfg.Queue < 0 {
		return nil, errors.New("kv events: bounds must be >= 0")
	}
	var ranks []int
	for _, s := range cfg.Sources {
		if s.Rank < 0 || s.Rank >= bus.KVMaxRanks {
			return nil, fmt.Errorf("kv events: rank %d: want 0…%d", s.Rank, bus.KVMaxRanks-1)
		}
		if slices.Contains(ranks, s.Rank) {
			return nil, fmt.Errorf("kv events: rank %d has two publishers (one endpoint per rank)", s.Rank)
		}
		ranks = append(ranks, s.Rank)
		if _, err := guardedEndpoint(s.Endpoint); err != nil {
			return nil, fmt.Errorf("kv events: rank %d: %w", s.Rank, err)
		}
		if _, err := guardedEndpoint(s.Replay); s.Replay != "" && err != nil {
			return nil, fmt.Errorf("kv events: rank %d's replay socket: %w", s.Rank, err)
		}
	}
	if err := registerTransports(); err != nil {
		return nil, err
	}
	cfg.MaxBlocks = orDefault(cfg.MaxBlocks, DefaultMaxBlocks)
	cfg.MaxMessage = orDefault(cfg.MaxMessage, DefaultMaxMessage)
	cfg.MessageWait = orDefault(cfg.MessageWait, defaultMessageWait)
	cfg.Flush = orDefault(cfg.Flush, DefaultFlush)
	cfg.ReplayWait = orDefault(cfg.ReplayWait, DefaultReplayWait)
	cfg.Queue = orDefault(cfg.Queue, DefaultQueue)
	cfg.Checkpoint = orDefault(cfg.Checkpoint, DefaultCheckpoint)
	for cfg.Epoch == 0 {
		var b [8]byte
		_, _ = rand.Read(b[:])
		cfg.Epoch = binary.LittleEndian.Uint64(b[:])
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	m := newMetrics(cfg.Registry, ranks)
	br := &Bridge{cfg: cfg, m: m, rlog: newRateLog(cfg.Log),
		asm: newAssembler(cfg.EngineID, cfg.Epoch, cfg.Queue, cfg.Flush, m)}
	// zmq4 logs a refused handshake on every attempt: through the
	// rate-limited log, not straight to stderr.
	br.zlog = log.New(logWriter{br.rlog}, "", 0)
	return br, nil
}

func orDefault[T int | time.Duration](v, d T) T {
	if v == 0 {
		return d
	}
	return v
}

// Epoch returns the run's epoch, the one every batch carries.
func (b *Bridge) Epoch() uint64 { return b.cfg.Epoch }

// Run reads every publisher and publishes on pub until ctx ends; it
// returns nil then. A publisher that cannot be reached is dialled again
// (from 50 ms up to every second); a bound endpoint that cannot be bound
// is tried again every second.
func (b *Bridge) Run(ctx context.Context, pub BusPublisher) error {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		b.asm.run(ctx, pub)
	}()
	for _, s := range b.cfg.Sources {
		r := newRank(s, b)
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.read(ctx)
		}()
		if b.cfg.Checkpoint > 0 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.checkpoints(ctx, b.cfg.Checkpoint)
			}()
		}
	}
	wg.Wait()
	return nil
}

// limits returns the guarded transport's bounds for a socket of rank.
func (b *Bridge) limits(label string) guardLimits {
	return guardLimits{maxMessage: b.cfg.MaxMessage, handshake: defaultHandshake, message: b.cfg.MessageWait,
		refused: func(reason string) {
			b.m.conns.WithLabelValues(label, connRefused).Inc()
			b.rlog.warn("stream"+label, "KV events: a ZeroMQ connection refused", "rank", label, "why", reason)
		},
		connected: func() { b.m.conns.WithLabelValues(label, connConnected).Inc() },
	}
}

// read subscribes to the rank's publisher, again after every end, until
// ctx ends.
func (r *rank) read(ctx context.Context) {
	ep, _ := guardedEndpoint(r.src.Endpoint)
	wait := redialMin
	for ctx.Err() == nil {
		sock := zmq4.NewSub(withLimits(ctx, r.br.limits(r.label)), zmq4.WithDialerMaxRetries(0),
			zmq4.WithDialerTimeout(r.br.cfg.ReplayWait), zmq4.WithTimeout(r.br.cfg.ReplayWait), zmq4.WithLogger(r.br.zlog))
		_ = sock.SetOption(zmq4.OptionSubscribe, r.br.cfg.Topic)
		var err error
		if r.src.Bind {
			err = sock.Listen(ep)
		} else {
			err = sock.Dial(ep)
		}
		if err != nil {
			closeSocket(sock)
			what := "connect to"
			if r.src.Bind {
				what, wait = "bind", redialMax
			}
			r.br.rlog.warn("dial"+r.label, "KV events: cannot "+what+" the publisher's endpoint; trying again", "rank", r.src.Rank, "endpoint", r.src.Endpoint, "err", err)
			if !pause.For(ctx, wait) {
				return
			}
			wait = min(2*wait, redialMax)
			continue
		}
		wait = redialMin
		for {
			msg, err := sock.Recv()
			if ctx.Err() != nil {
				closeSocket(sock)
				return
			}
			if err != nil {
				r.br.m.conns.WithLabelValues(r.label, connEnded).Inc()
				if r.src.Bind {
					continue // that publisher's connection ended; others may come
				}
				r.br.rlog.warn("ended"+r.label, "KV events: the publisher's connection ended; connecting again", "rank", r.src.Rank, "endpoint", r.src.Endpoint, "err", err)
				break
			}
			r.onMessage(ctx, msg.Frames)
		}
		closeSocket(sock)
		if !pause.For(ctx, wait) {
			return
		}
	}
}

// replay asks the rank's replay socket — vLLM's ROUTER: a request
// ["", start sequence as 8 bytes big-endian] from a DEALER, answered by
// ["", sequence, payload] for every buffered batch from start on, then
// ["", -1 as 8 bytes, ""] — for from…, applying each answer, all within
// ReplayWait. It returns the last sequence applied and whether the
// replay gave every message from from (frontOK: from its oldest, which
// must not be after s) up to at least s-1.
func (r *rank) replay(ctx context.Context, from, s uint64, frontOK bool) (last uint64, ok bool) {
	ep, _ := guardedEndpoint(r.src.Replay)
	rctx, cancel := context.WithTimeout(ctx, r.br.cfg.ReplayWait)
	defer cancel()
	d := zmq4.NewDealer(withLimits(rctx, r.br.limits(r.label)), zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(r.br.cfg.ReplayWait), zmq4.WithTimeout(r.br.cfg.ReplayWait), zmq4.WithLogger(r.br.zlog))
	defer closeSocket(d)
	if err := d.Dial(ep); err != nil {
		r.br.rlog.warn("replaydial"+r.label, "KV events: cannot connect to the replay socket", "rank", r.src.Rank, "endpoint", r.src.Replay, "err", err)
		return 0, false
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], from)
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, start[:])); err != nil {
		return 0, false
	}
	expect, first := from, true
	for {
		msg, err := d.Recv()
		if err != nil {
			r.br.rlog.warn("replaywait"+r.label, "KV events: the replay did not end within its bound", "rank", r.src.Rank, "bound", r.br.cfg.ReplayWait, "err", err)
			return 0, false
		}
		f := msg.Frames
		if len(f) != 3 || len(f[0]) != 0 || len(f[1]) != 8 {
			return 0, false
		}
		seq := binary.BigEndian.Uint64(f[1])
		if seq == replayEnd {
			break
		}
		if first {
			first = false
			if seq != from && !(frontOK && seq > from && seq <= s) {
				return 0, false // the buffer no longer holds from
			}
			expect = seq
		}
		if seq != expect || !r.apply(f[2]) {
			return 0, false
		}
		expect++
	}
	if first || expect < s {
		return 0, false // it ended before the live message
	}
	return expect - 1, true
}

// closeSocket closes a zmq4 socket and takes what its readers still hold:
// zmq4's reader goroutine blocks on a full queue, so it could not end.
func closeSocket(s zmq4.Socket) {
	_ = s.Close()
	for i := 0; i < 256; i++ {
		_, _ = s.Recv()
	}
}

// logWriter turns zmq4's log lines into rate-limited warnings.
type logWriter struct{ l *rateLog }

func (w logWriter) Write(p []byte) (int, error) {
	w.l.warn("zmq4", "KV events: ZeroMQ", "msg", strings.TrimSpace(string(p)))
	return len(p), nil
}
