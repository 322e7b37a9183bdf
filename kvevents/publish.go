package kvevents

import (
	"context"
	"math/bits"
	"sync"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
)

// BusPublisher is what the agent publishes KV batches with: a core NATS
// connection under the engine's own credential (*nats.Conn is one).
// Publish must not block while the bus is away: with the connection's
// reconnect buffer off (bus.Connect), it fails at once.
type BusPublisher interface {
	Publish(subject string, data []byte) error
	IsConnected() bool
}

// defaultBlockSize is a batch's block size when it carries only
// KVCleared or KVLost ops and no stored block has told the engine's.
const defaultBlockSize = 16

// assembler gathers the ranks' ops into one engine's KV batches
// (bus.KVBatch) and hands full ones, or ones older than the flush
// interval, to the publishing goroutine, through a bounded queue. It
// never blocks a rank's reader: when the queue is full the batch being
// made is dropped, counted, and its ranks get a KVLost once the bus
// takes batches again.
type assembler struct {
	engineID string
	epoch    uint64
	subject  string
	flush    time.Duration
	m        *metrics

	mu        sync.Mutex
	seq       uint64 // of cur
	cur       *bus.KVBatch
	curRanks  uint64
	curBlock  int
	lastBlock int
	ready     []readyBatch
	maxReady  int
	free      []*bus.KVBatch
	lost      uint64 // ranks owed a KVLost
	started   chan struct{}
	kick      chan struct{}
}

type readyBatch struct {
	b     *bus.KVBatch
	ranks uint64
}

func newAssembler(engineID string, epoch uint64, maxReady int, flush time.Duration, m *metrics) *assembler {
	a := &assembler{engineID: engineID, epoch: epoch, subject: bus.KVSubject(engineID), flush: flush, m: m,
		maxReady: maxReady, started: make(chan struct{}, 1), kick: make(chan struct{}, 1), seq: 1}
	a.cur = new(bus.KVBatch)
	return a
}

// add appends an op of rank, splitting keys into ops of at most
// bus.KVMaxKeys; blockSize 0 is the batch's (removed, cleared, lost ops).
func (a *assembler) add(op bus.KVOp, rank int, medium bus.KVMedium, blockSize int, keys []uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for {
		n := min(len(keys), bus.KVMaxKeys)
		a.addLocked(op, rank, medium, blockSize, keys[:n])
		keys = keys[n:]
		if len(keys) == 0 {
			return
		}
	}
}

func (a *assembler) addLocked(op bus.KVOp, rank int, medium bus.KVMedium, blockSize int, keys []uint64) {
	if blockSize == 0 {
		blockSize = a.curBlock
		if a.cur.Len() == 0 {
			blockSize = a.lastBlock
		}
		if blockSize == 0 {
			blockSize = defaultBlockSize
		}
	} else {
		a.lastBlock = blockSize
	}
	if a.cur.Len() > 0 && blockSize != a.curBlock {
		a.finishLocked()
	}
	for try := 0; try < 2; try++ {
		if a.cur.Len() == 0 {
			a.cur.Reset(a.engineID, a.epoch, a.seq, blockSize)
			a.curBlock, a.curRanks = blockSize, 0
			select {
			case a.started <- struct{}{}:
			default:
			}
		}
		if a.cur.Add(op, rank, medium, keys) {
			a.curRanks |= 1 << uint(rank)
			return
		}
		a.finishLocked() // full: the op goes into the next
	}
}

// finishLocked moves cur to the queue, or drops it when the queue is
// full.
func (a *assembler) finishLocked() {
	if a.cur.Len() == 0 {
		return
	}
	if len(a.ready) >= a.maxReady {
		a.m.batches.WithLabelValues("dropped").Inc()
		a.lost |= a.curRanks
		a.cur.Reset(a.engineID, a.epoch, a.seq, a.curBlock) // emptied; the seq is not spent
		a.curRanks = 0
		return
	}
	a.ready = append(a.ready, readyBatch{b: a.cur, ranks: a.curRanks})
	a.seq++
	a.cur = a.emptyLocked()
	a.curRanks = 0
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// emptyLocked returns a batch to fill: one of the free list, else a new
// one (at most maxReady+2 exist: the queue's, the one being published,
// cur).
func (a *assembler) emptyLocked() *bus.KVBatch {
	if n := len(a.free); n > 0 {
		b := a.free[n-1]
		a.free = a.free[:n-1]
		return b
	}
	return new(bus.KVBatch)
}

// freeLocked empties b and keeps it for a next batch.
func (a *assembler) freeLocked(b *bus.KVBatch) {
	b.Reset(a.engineID, a.epoch, a.seq, defaultBlockSize)
	a.free = append(a.free, b)
}

// run publishes the queued batches until ctx ends.
func (a *assembler) run(ctx context.Context, pub BusPublisher) {
	timer := time.NewTimer(a.flush)
	timer.Stop()
	defer timer.Stop()
	retry := time.NewTicker(lostRetry)
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.started:
			timer.Reset(a.flush)
			continue
		case <-timer.C:
			a.mu.Lock()
			a.finishLocked()
			a.mu.Unlock()
		case <-a.kick:
		case <-retry.C:
		}
		a.publishReady(pub)
	}
}

// lostRetry is how often the publishing goroutine looks whether the bus
// is back for the KVLost ops it owes.
const lostRetry = 100 * time.Millisecond

// publishReady publishes every queued batch, first the KVLost ops owed
// when the bus is up.
func (a *assembler) publishReady(pub BusPublisher) {
	for {
		a.mu.Lock()
		if a.lost != 0 && pub.IsConnected() {
			lost := a.lost
			a.lost = 0
			for lost != 0 {
				r := bits.TrailingZeros64(lost)
				lost &^= 1 << uint(r)
				a.addLocked(bus.KVLost, r, bus.KVGPU, 0, nil)
			}
			a.finishLocked()
		}
		if len(a.ready) == 0 {
			a.mu.Unlock()
			return
		}
		rb := a.ready[0]
		copy(a.ready, a.ready[1:])
		a.ready = a.ready[:len(a.ready)-1]
		a.mu.Unlock()

		err := pub.Publish(a.subject, rb.b.Bytes())

		a.mu.Lock()
		if err != nil {
			a.m.batches.WithLabelValues("dropped").Inc()
			a.lost |= rb.ranks
		} else {
			a.m.batches.WithLabelValues("published").Inc()
		}
		a.freeLocked(rb.b)
		a.mu.Unlock()
		if err != nil && !pub.IsConnected() {
			// Everything queued meets the same fate: drop it now, so that
			// the ZeroMQ side finds room again; the KVLost follows once
			// the bus is back.
			a.dropReady()
			return
		}
	}
}

func (a *assembler) dropReady() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, rb := range a.ready {
		a.m.batches.WithLabelValues("dropped").Inc()
		a.lost |= rb.ranks
		a.freeLocked(rb.b)
	}
	a.ready = a.ready[:0]
}
