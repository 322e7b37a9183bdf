package kvevents

import (
	"context"
	"encoding/binary"
	"strconv"
	"sync"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/prefix"
)

// replayEnd is the sequence of vLLM's end-of-replay marker: -1 as 8
// big-endian bytes.
const replayEnd = ^uint64(0)

// block is what the agent knows of one engine block: its key and the
// media (bits of 1<<bus.KVMedium) the engine holds it on.
type block struct {
	key   uint64
	media uint8
}

// rank is one data-parallel rank's publisher as the agent follows it:
// the sequence, the bounded map of engine hashes to keys, and the ops it
// hands the assembler. Its reader and its checkpoints use it, one at a
// time (mu).
type rank struct {
	src   Source
	label string
	br    *Bridge

	mu        sync.Mutex
	blocks    map[uint64]block
	keys      []uint64
	payload   Payload
	lost      bool        // events lost since the last clear: no checkpoint
	blockSize int         // of the last stored event
	restate   [3][]uint64 // a checkpoint's keys, by medium

	started   bool
	next      uint64 // the sequence expected next
	dupActive bool   // live messages of dupFrom…dupTo were replayed already
	dupFrom   uint64
	dupTo     uint64
}

func newRank(src Source, br *Bridge) *rank {
	return &rank{src: src, label: strconv.Itoa(src.Rank), br: br, blocks: make(map[uint64]block)}
}

// onMessage takes one ZeroMQ message of the rank's publisher: [topic,
// sequence (8 bytes, big-endian), payload].
func (r *rank) onMessage(ctx context.Context, frames [][]byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.br.m
	if len(frames) != 3 || len(frames[1]) != 8 {
		m.msgs.WithLabelValues(r.label, msgFrames).Inc()
		r.br.rlog.warn("frames"+r.label, "KV events: a message that is not [topic, 8-byte sequence, payload]; ignored", "rank", r.src.Rank, "frames", len(frames))
		return
	}
	if len(frames[0]) < len(r.br.cfg.Topic) || string(frames[0][:len(r.br.cfg.Topic)]) != r.br.cfg.Topic {
		m.msgs.WithLabelValues(r.label, msgTopic).Inc()
		return
	}
	r.sequence(ctx, binary.BigEndian.Uint64(frames[1]), frames[2])
}

// sequence follows the publisher's sequence (behaviour.md R-PLACE-4):
// the next one is applied; a forward gap is filled from the replay
// socket or else lost; one that goes back is the publisher restarted
// (vLLM counts from 0 again): the rank is cleared.
func (r *rank) sequence(ctx context.Context, s uint64, payload []byte) {
	replay := r.src.Replay != ""
	switch {
	case !r.started:
		r.started = true
		if replay && s > 0 {
			// The replay buffer may hold the engine's recent past: read
			// it from the start; what it no longer holds stays unknown.
			r.fill(ctx, 0, s, payload, true)
			return
		}
		r.applyLive(s, payload)
	case s == r.next:
		r.applyLive(s, payload)
	case s > r.next:
		r.dupActive = false
		if replay {
			r.fill(ctx, r.next, s, payload, false)
			return
		}
		r.lose("a gap in the sequence and no replay socket", gapLost)
		r.applyLive(s, payload)
	default:
		if r.dupActive && s >= r.dupFrom && s <= r.dupTo {
			r.br.m.msgs.WithLabelValues(r.label, msgDuplicate).Inc()
			return
		}
		r.dupActive = false
		r.br.m.gaps.WithLabelValues(r.label, gapRestarted).Inc()
		r.br.rlog.warn("restart"+r.label, "KV events: the publisher's sequence went back: it restarted; the rank's blocks are cleared", "rank", r.src.Rank, "seq", s, "expected", r.next)
		r.clear()
		if s > 0 && replay {
			r.fill(ctx, 0, s, payload, false)
			return
		}
		if s > 0 {
			r.lose("the restarted publisher's first messages were missed", gapLost)
		}
		r.applyLive(s, payload)
	}
}

// applyLive applies a live message s that follows what the rank has.
func (r *rank) applyLive(s uint64, payload []byte) {
	r.dupActive = false
	r.next = s + 1
	if !r.apply(payload) {
		r.lose("a message the agent could not read", gapLost)
	}
}

// fill asks the replay socket for from…s-1 (and what follows) while s,
// the live message that showed the gap, waits. frontOK (at the start)
// accepts a replay that no longer holds from: what it lacks was before
// the agent anyway. A replay that cannot give every message is a loss.
func (r *rank) fill(ctx context.Context, from, s uint64, held []byte, frontOK bool) {
	last, ok := r.replay(ctx, from, s, frontOK)
	if !ok {
		r.lose("the replay socket could not give the missed messages", gapLost)
		r.applyLive(s, held)
		return
	}
	if !frontOK || from > 0 {
		r.br.m.gaps.WithLabelValues(r.label, gapReplayed).Inc()
	}
	if last < s {
		r.applyLive(s, held)
		return
	}
	// The replay went past s: the live messages up to last are repeats.
	r.next = last + 1
	r.dupActive, r.dupFrom, r.dupTo = true, s, last
}

// lose publishes KVLost for the rank and forgets its blocks: the routers
// place the engine by the approximate index until the rank is exact again.
func (r *rank) lose(why, outcome string) {
	r.br.m.gaps.WithLabelValues(r.label, outcome).Inc()
	r.br.rlog.warn("lost"+r.label, "KV events lost: the routers fall back to the approximate index for this engine", "rank", r.src.Rank, "why", why)
	r.forget()
	r.lost = true
	r.br.asm.add(bus.KVLost, r.src.Rank, bus.KVGPU, 0, nil)
}

// clear publishes KVCleared for the rank and forgets its blocks.
func (r *rank) clear() {
	r.forget()
	r.lost = false
	r.br.asm.add(bus.KVCleared, r.src.Rank, bus.KVGPU, 0, nil)
}

// checkpoints restates the rank's blocks every period until ctx ends.
func (r *rank) checkpoints(ctx context.Context, period time.Duration) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.checkpoint()
		}
	}
}

// checkpoint restates what the rank holds, as far as the agent knows
// (behaviour.md R-PLACE-4): a KVCleared of the rank, then every block it
// knows, by medium. A router applying them holds the same blocks as
// before (one batch is applied whole; a checkpoint past one batch,
// about 32,000 blocks, leaves the rank holding less for the moments
// between its batches) and one that read the engine's batches from the
// middle of the agent's run — it started late, the stream lost the
// run's start, or it dropped the engine — is exact again from here. A
// rank whose events were lost since its last clear is not restated: the
// agent does not know what it holds (its stored events whose parents
// were lost get no key), and the routers keep placing it by the
// approximate index until the engine clears it.
func (r *rank) checkpoint() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.lost {
		r.br.m.checkpoints.WithLabelValues(r.label, ckSkippedLost).Inc()
		return
	}
	for i := range r.restate {
		r.restate[i] = r.restate[i][:0]
	}
	for _, b := range r.blocks {
		for md := range r.restate {
			if b.media&(1<<md) != 0 {
				r.restate[md] = append(r.restate[md], b.key)
			}
		}
	}
	r.br.asm.add(bus.KVCleared, r.src.Rank, bus.KVGPU, r.blockSize, nil)
	for md, keys := range r.restate {
		if len(keys) > 0 {
			r.br.asm.add(bus.KVStored, r.src.Rank, bus.KVMedium(md), r.blockSize, keys)
		}
	}
	r.br.m.checkpoints.WithLabelValues(r.label, ckPublished).Inc()
}

func (r *rank) forget() {
	// A new map: a cleared one would keep its buckets.
	r.blocks = make(map[uint64]block)
	r.br.m.blocks.WithLabelValues(r.label).Set(0)
}

// apply decodes one payload and applies its events; false when the
// message is refused whole or holds a removal the agent cannot read (it
// then applies nothing).
func (r *rank) apply(payload []byte) bool {
	p := &r.payload
	m := r.br.m
	if err := p.Decode(payload); err != nil {
		m.msgs.WithLabelValues(r.label, msgRefused).Inc()
		r.br.rlog.warn("payload"+r.label, "KV events: a payload refused", "rank", r.src.Rank, "err", err)
		return false
	}
	if p.Rank >= 0 && p.Rank != r.src.Rank {
		m.msgs.WithLabelValues(r.label, msgRankMismatch).Inc()
		r.br.rlog.warn("rankmismatch"+r.label, "KV events: a payload of another data-parallel rank than its endpoint's; refused", "rank", r.src.Rank, "payload_rank", p.Rank)
		return false
	}
	m.events.WithLabelValues(r.label, outSkippedType).Add(float64(p.SkippedType))
	m.events.WithLabelValues(r.label, outSkippedGroup).Add(float64(p.SkippedGroup))
	m.events.WithLabelValues(r.label, outRefused).Add(float64(p.RefusedStored + p.RefusedRemoved))
	if p.RefusedRemoved > 0 {
		m.msgs.WithLabelValues(r.label, msgRefused).Inc()
		return false
	}
	m.msgs.WithLabelValues(r.label, msgApplied).Inc()
	for i := range p.Events {
		r.applyEvent(&p.Events[i])
	}
	m.blocks.WithLabelValues(r.label).Set(float64(len(r.blocks)))
	return true
}

func (r *rank) applyEvent(e *Event) {
	m := r.br.m
	switch e.Kind {
	case EventCleared:
		r.clear()
		m.events.WithLabelValues(r.label, outApplied).Inc()
	case EventRemoved:
		bit := uint8(1) << e.Medium
		r.keys = r.keys[:0]
		unknown := false
		for _, h := range e.Hashes {
			b, ok := r.blocks[h]
			if !ok || b.media&bit == 0 {
				unknown = true
				continue
			}
			r.keys = append(r.keys, b.key)
			if b.media &^= bit; b.media == 0 {
				delete(r.blocks, h)
			} else {
				r.blocks[h] = b
			}
		}
		if len(r.keys) > 0 {
			r.br.asm.add(bus.KVRemoved, r.src.Rank, e.Medium, 0, r.keys)
		}
		if unknown {
			m.events.WithLabelValues(r.label, outUnknownRemoval).Inc()
		} else {
			m.events.WithLabelValues(r.label, outApplied).Inc()
		}
	case EventStored:
		r.blockSize = e.BlockSize
		outcome := r.store(e)
		if len(r.keys) > 0 {
			r.br.asm.add(bus.KVStored, r.src.Rank, e.Medium, e.BlockSize, r.keys)
		}
		m.events.WithLabelValues(r.label, outcome).Inc()
	}
}

// store maps a stored event's blocks to keys (r.keys, in chain order) and
// returns the event's outcome. A block gets a key only when its parent's
// is known; the map never grows past MaxBlocks; a hash already known
// under another key (a publisher that contradicts itself) stops the
// chain there. An unknown parent while the map is full counts as over
// the bound: that parent was most likely refused by it, and the chain
// built on it is what the bound cost.
func (r *rank) store(e *Event) string {
	r.keys = r.keys[:0]
	var parent uint64
	if e.Parent != 0 {
		b, ok := r.blocks[e.Parent]
		if !ok {
			if len(r.blocks) >= r.br.cfg.MaxBlocks {
				return outOverBound
			}
			return outUnknownParent
		}
		parent = b.key
	}
	bit := uint8(1) << e.Medium
	for i, h := range e.Hashes {
		key := prefix.TokenBlockKey(parent, e.Tokens[i*e.BlockSize:(i+1)*e.BlockSize], e.Salts[i])
		b, ok := r.blocks[h]
		switch {
		case ok && b.key != key:
			return outRefused
		case ok:
			b.media |= bit
		case len(r.blocks) >= r.br.cfg.MaxBlocks:
			return outOverBound
		default:
			b = block{key: key, media: bit}
		}
		r.blocks[h] = b
		r.keys = append(r.keys, key)
		parent = key
	}
	return outApplied
}
