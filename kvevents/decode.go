package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/prefix"
)

// Bounds of one decoded message (docs/connectors.md, "KV events").
const (
	// DefaultMaxMessage is the largest message (all its frames) the agent
	// reads by default, in bytes; a larger one ends its connection and is
	// counted.
	DefaultMaxMessage = 4 << 20
	// MaxEvents bounds the events of one message.
	MaxEvents = 1 << 16
	// maxDepth bounds how deep the agent follows nested msgpack values it
	// skips (extra_keys, members it does not know).
	maxDepth = 32
	// maxHashBytes bounds a block hash sent as bytes.
	maxHashBytes = 64
	// maxName bounds a medium's or LoRA adapter's name, in bytes.
	maxName = 1024
)

// ErrPayload is wrapped by every error of Payload.Decode: the message is
// refused whole.
var ErrPayload = errors.New("kv events: invalid payload")

// EventKind is what one decoded event says.
type EventKind uint8

const (
	// EventStored is vLLM's BlockStored: the engine holds new blocks.
	EventStored EventKind = iota + 1
	// EventRemoved is vLLM's BlockRemoved.
	EventRemoved
	// EventCleared is vLLM's AllBlocksCleared.
	EventCleared
)

// Event is one decoded KV cache event of a Payload. Its slices are views
// of the Payload's buffers, valid until its next Decode.
type Event struct {
	Kind EventKind
	// Hashes are the engine's block hashes (stored: in chain order), a
	// hash sent as bytes taken as its last 8 bytes, big-endian.
	Hashes []uint64
	// Parent is the engine's hash of the block before the first one, 0
	// for none (stored only).
	Parent uint64
	// Tokens are the token ids of the stored blocks, BlockSize each.
	Tokens []uint32
	// BlockSize is the stored blocks' size in tokens (1…MaxTokenBlockSize).
	BlockSize int
	// Medium is where the blocks are (stored and removed).
	Medium bus.KVMedium
	// Salts are the stored blocks' salts (prefix.BlockSalt of the LoRA
	// adapter and each block's extra_keys entry), one per block.
	Salts []uint64
}

// Payload decodes vLLM's KV event payloads — `[ts, [events…], rank]` or
// the map `{ts, events, data_parallel_rank}` — whose events are tagged
// arrays (older vLLM) or maps with a `type` member (newer), checked as
// hostile input. Its buffers are reused from message to message; the zero
// value is ready to use. It is not safe for concurrent use.
type Payload struct {
	// Rank is the payload's data_parallel_rank, -1 when it has none.
	Rank int
	// Events are the events the message holds that the agent applies.
	Events []Event
	// SkippedType counts events of a type the agent does not know
	// (skipped: forward compatible).
	SkippedType int
	// SkippedGroup counts events of a KV cache group other than 0 (a
	// hybrid model's other groups; skipped).
	SkippedGroup int
	// RefusedStored counts BlockStored events that are not valid
	// (hashes, token ids, block size, extra_keys): skipped, their blocks
	// unknown.
	RefusedStored int
	// RefusedRemoved counts BlockRemoved events that are not valid: the
	// agent cannot know what the engine removed.
	RefusedRemoved int

	r      bytes.Reader
	d      *msgpack.Decoder
	data   []byte
	hashes []uint64
	tokens []uint32
	salts  []uint64
	spans  []eventSpan
}

// eventSpan is where an event's slices are in the Payload's buffers.
type eventSpan struct{ h0, h1, t0, t1, s0, s1 int }

// pending is one event while it is decoded.
type pending struct {
	kind      EventKind
	known     bool // a type the agent knows
	h0, t0    int
	hashes    bool
	tokens    bool
	parent    uint64
	blockSize int64
	hasSize   bool
	loraID    int64
	hasLoraID bool
	lora      []byte
	medium    []byte
	extra     [][2]int // offsets in data of each extra_keys entry; {-1,-1} for nil
	hasExtra  bool
	group     int64
	bad       string
}

// Decode decodes data, one message's payload. It returns an error
// wrapping ErrPayload when data is not a payload (not msgpack, not a
// batch, trailing bytes, more than MaxEvents events, a rank out of
// 0…bus.KVMaxRanks-1); an event that is not valid is counted and left
// out instead.
func (p *Payload) Decode(data []byte) error {
	p.Rank, p.Events = -1, p.Events[:0]
	p.SkippedType, p.SkippedGroup, p.RefusedStored, p.RefusedRemoved = 0, 0, 0, 0
	p.hashes, p.tokens, p.salts, p.spans = p.hashes[:0], p.tokens[:0], p.salts[:0], p.spans[:0]
	p.data = data
	p.r.Reset(data)
	if p.d == nil {
		p.d = msgpack.NewDecoder(&p.r)
	} else {
		p.d.Reset(&p.r)
	}
	if err := p.decodeBatch(); err != nil {
		p.Events = p.Events[:0]
		return fmt.Errorf("%w: %v", ErrPayload, err)
	}
	if p.r.Len() != 0 {
		p.Events = p.Events[:0]
		return fmt.Errorf("%w: bytes after the batch", ErrPayload)
	}
	for i, s := range p.spans {
		e := &p.Events[i]
		e.Hashes = p.hashes[s.h0:s.h1:s.h1]
		e.Tokens = p.tokens[s.t0:s.t1:s.t1]
		e.Salts = p.salts[s.s0:s.s1:s.s1]
	}
	return nil
}

func (p *Payload) pos() int { return len(p.data) - p.r.Len() }

func (p *Payload) decodeBatch() error {
	c, err := p.d.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := p.d.DecodeArrayLen()
		if err != nil {
			return err
		}
		if n < 2 || n > 3 {
			return fmt.Errorf("a batch of %d members, want [ts, events, rank]", n)
		}
		if err := p.number(); err != nil {
			return fmt.Errorf("ts: %v", err)
		}
		if err := p.decodeEvents(); err != nil {
			return err
		}
		if n == 3 {
			return p.decodeRank()
		}
		return nil
	case isMap(c):
		n, err := p.d.DecodeMapLen()
		if err != nil {
			return err
		}
		events := false
		for i := 0; i < n; i++ {
			key, err := p.str()
			if err != nil {
				return fmt.Errorf("batch member name: %v", err)
			}
			switch string(key) {
			case "ts":
				err = p.number()
			case "events":
				if events {
					return errors.New("events twice")
				}
				events = true
				err = p.decodeEvents()
			case "data_parallel_rank":
				err = p.decodeRank()
			default:
				err = p.skip(0)
			}
			if err != nil {
				return fmt.Errorf("batch member %q: %v", key, err)
			}
		}
		if !events {
			return errors.New("a batch without events")
		}
		return nil
	}
	return fmt.Errorf("msgpack code %#x: not a batch (array or map)", c)
}

func (p *Payload) decodeRank() error {
	if p.isNil() {
		return p.d.DecodeNil()
	}
	r, ok, err := p.intIn(0, bus.KVMaxRanks-1)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("data_parallel_rank not an integer of 0…%d", bus.KVMaxRanks-1)
	}
	p.Rank = int(r)
	return nil
}

func (p *Payload) decodeEvents() error {
	n, err := p.d.DecodeArrayLen()
	if err != nil {
		return fmt.Errorf("events: %v", err)
	}
	if n > MaxEvents {
		return fmt.Errorf("%d events, more than %d", n, MaxEvents)
	}
	for i := 0; i < n; i++ {
		if err := p.decodeEvent(); err != nil {
			return fmt.Errorf("event %d: %v", i, err)
		}
	}
	return nil
}

// decodeEvent decodes one event, in either encoding, and keeps it when
// it is valid and of group 0. An error is one of the message's structure
// (it cannot be read past); an event's bad values only refuse the event.
func (p *Payload) decodeEvent() error {
	var ev pending
	ev.h0, ev.t0 = len(p.hashes), len(p.tokens)
	c, err := p.d.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := p.d.DecodeArrayLen()
		if err != nil {
			return err
		}
		if n < 1 {
			return errors.New("an empty event")
		}
		tag, err := p.str()
		if err != nil {
			return fmt.Errorf("tag: %v", err)
		}
		ev.setKind(tag)
		for i := 1; i < n; i++ {
			name := ""
			if ev.known {
				name = arrayMember(ev.kind, i)
			}
			if err := p.member(&ev, name); err != nil {
				return err
			}
		}
	case isMap(c):
		n, err := p.d.DecodeMapLen()
		if err != nil {
			return err
		}
		typed := false
		for i := 0; i < n; i++ {
			key, err := p.str()
			if err != nil {
				return fmt.Errorf("member name: %v", err)
			}
			if string(key) == "type" {
				tag, err := p.str()
				if err != nil {
					return fmt.Errorf("type: %v", err)
				}
				if typed {
					return errors.New("type twice")
				}
				typed = true
				ev.setKind(tag)
				continue
			}
			if err := p.member(&ev, mapMember(string(key))); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("msgpack code %#x: not an event (array or map)", c)
	}
	p.keep(&ev)
	return nil
}

func (ev *pending) setKind(tag []byte) {
	switch string(tag) {
	case "BlockStored":
		ev.kind, ev.known = EventStored, true
	case "BlockRemoved":
		ev.kind, ev.known = EventRemoved, true
	case "AllBlocksCleared":
		ev.kind, ev.known = EventCleared, true
	default:
		ev.kind, ev.known = 0, false
	}
}

// arrayMember names the i-th member (after the tag) of an event of the
// older, positional encoding.
func arrayMember(k EventKind, i int) string {
	switch k {
	case EventStored:
		names := [...]string{"", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx"}
		if i < len(names) {
			return names[i]
		}
	case EventRemoved:
		names := [...]string{"", "block_hashes", "medium", "group_idx"}
		if i < len(names) {
			return names[i]
		}
	}
	return ""
}

// mapMember returns the member name the agent reads, "" for one it skips.
func mapMember(key string) string {
	switch key {
	case "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx":
		return key
	}
	return ""
}

// member decodes one member of an event into ev. A value of the wrong
// type marks the event bad (ev.bad) but is read past.
func (p *Payload) member(ev *pending, name string) error {
	bad := func(why string) error {
		if ev.bad == "" {
			ev.bad = name + ": " + why
		}
		return p.skip(0)
	}
	// read marks the event bad for a value already read past.
	read := func(err error, why string) error {
		if err == nil && ev.bad == "" {
			ev.bad = name + ": " + why
		}
		return err
	}
	if p.isNil() && name != "" {
		return p.d.DecodeNil()
	}
	switch name {
	case "block_hashes":
		if ev.hashes {
			return bad("twice")
		}
		ev.hashes = true
		if c, _ := p.d.PeekCode(); !isArray(c) {
			return bad("not an array")
		}
		n, err := p.d.DecodeArrayLen()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			h, ok, err := p.hash()
			if err != nil {
				return err
			}
			if !ok {
				ev.bad = "block_hashes: a hash neither an integer nor 1…64 bytes"
			}
			p.hashes = append(p.hashes, h)
		}
		return nil
	case "parent_block_hash":
		h, ok, err := p.hash()
		if err != nil {
			return err
		}
		if !ok {
			ev.bad = "parent_block_hash: neither an integer nor 1…64 bytes"
		}
		ev.parent = h
		return nil
	case "token_ids":
		if ev.tokens {
			return bad("twice")
		}
		ev.tokens = true
		if c, _ := p.d.PeekCode(); !isArray(c) {
			return bad("not an array")
		}
		n, err := p.d.DecodeArrayLen()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			v, ok, err := p.intIn(0, math.MaxUint32)
			if err != nil {
				return err
			}
			if !ok {
				ev.bad = "token_ids: an id not an integer of 0…2^32-1"
				continue
			}
			p.tokens = append(p.tokens, uint32(v))
		}
		return nil
	case "block_size":
		v, ok, err := p.intIn(1, prefix.MaxTokenBlockSize)
		if err != nil || !ok {
			return read(err, "not an integer of 1…1024")
		}
		ev.blockSize, ev.hasSize = v, true
		return nil
	case "lora_id":
		v, ok, err := p.intIn(0, math.MaxInt64)
		if err != nil || !ok {
			return read(err, "not an integer >= 0")
		}
		ev.loraID, ev.hasLoraID = v, true
		return nil
	case "lora_name", "medium":
		if c, _ := p.d.PeekCode(); !isBytes(c) {
			return bad("not a string")
		}
		s, err := p.view()
		if err != nil || len(s) > maxName {
			return read(err, "longer than 1024 bytes")
		}
		if name == "medium" {
			ev.medium = s
		} else {
			ev.lora = s
		}
		return nil
	case "extra_keys":
		if c, _ := p.d.PeekCode(); !isArray(c) {
			return bad("not an array")
		}
		n, err := p.d.DecodeArrayLen()
		if err != nil {
			return err
		}
		ev.hasExtra = true
		ev.extra = ev.extra[:0]
		for i := 0; i < n; i++ {
			if p.isNil() {
				if err := p.d.DecodeNil(); err != nil {
					return err
				}
				ev.extra = append(ev.extra, [2]int{-1, -1})
				continue
			}
			start := p.pos()
			if err := p.skip(1); err != nil {
				return err
			}
			ev.extra = append(ev.extra, [2]int{start, p.pos()})
		}
		return nil
	case "group_idx":
		v, ok, err := p.intIn(math.MinInt64, math.MaxInt64)
		if err != nil || !ok {
			return read(err, "not an integer")
		}
		ev.group = v
		return nil
	}
	return p.skip(0)
}

// keep checks a decoded event and appends it to Events when it is valid,
// or counts why not.
func (p *Payload) keep(ev *pending) {
	drop := func() {
		p.hashes, p.tokens = p.hashes[:ev.h0], p.tokens[:ev.t0]
	}
	if !ev.known {
		p.SkippedType++
		drop()
		return
	}
	if ev.group != 0 {
		p.SkippedGroup++
		drop()
		return
	}
	e := Event{Kind: ev.kind, Parent: ev.parent, Medium: bus.KVMediumOf(string(ev.medium))}
	span := eventSpan{h0: ev.h0, h1: len(p.hashes), t0: ev.t0, t1: len(p.tokens), s0: len(p.salts), s1: len(p.salts)}
	nh := span.h1 - span.h0
	switch ev.kind {
	case EventStored:
		switch {
		case ev.bad != "":
		case nh == 0:
			ev.bad = "no block hashes"
		case !ev.hasSize:
			ev.bad = "no block size"
		case int64(span.t1-span.t0) != int64(nh)*ev.blockSize:
			ev.bad = "token_ids not len(block_hashes) × block_size"
		case ev.hasExtra && len(ev.extra) != nh:
			ev.bad = "extra_keys not one entry per block"
		}
		if ev.bad != "" {
			p.RefusedStored++
			drop()
			return
		}
		e.BlockSize = int(ev.blockSize)
		lora := string(ev.lora)
		if lora == "" && ev.hasLoraID {
			// An adapter known by number only: a salt no router's
			// request makes (no model name holds a NUL byte).
			lora = "\x00lora_id:" + strconv.FormatInt(ev.loraID, 10)
		}
		for i := 0; i < nh; i++ {
			var extra []byte
			if ev.hasExtra && ev.extra[i][0] >= 0 {
				extra = p.data[ev.extra[i][0]:ev.extra[i][1]]
			}
			p.salts = append(p.salts, prefix.BlockSalt(lora, extra))
		}
		span.s1 = len(p.salts)
	case EventRemoved:
		if ev.bad == "" && nh == 0 {
			ev.bad = "no block hashes"
		}
		if ev.bad != "" {
			p.RefusedRemoved++
			drop()
			return
		}
		p.tokens = p.tokens[:ev.t0]
		span.t1 = span.t0
	case EventCleared:
		drop()
		span = eventSpan{h0: ev.h0, h1: ev.h0, t0: ev.t0, t1: ev.t0, s0: len(p.salts), s1: len(p.salts)}
	}
	p.Events = append(p.Events, e)
	p.spans = append(p.spans, span)
}

// hash decodes a block hash: a msgpack integer (a negative one as its
// two's complement) or 1…64 bytes (bin or str; the last 8, big-endian).
// ok is false for another value, which is read past.
func (p *Payload) hash() (h uint64, ok bool, err error) {
	c, err := p.d.PeekCode()
	if err != nil {
		return 0, false, err
	}
	switch {
	case isInt(c):
		v, err := p.d.DecodeUint64()
		return v, err == nil, err
	case isBytes(c):
		b, err := p.view()
		if err != nil {
			return 0, false, err
		}
		if len(b) == 0 || len(b) > maxHashBytes {
			return 0, false, nil
		}
		var last [8]byte
		copy(last[8-min(8, len(b)):], b[max(0, len(b)-8):])
		return binary.BigEndian.Uint64(last[:]), true, nil
	}
	return 0, false, p.skip(0)
}

// intIn decodes the next value as an integer of lo…hi; ok is false,
// the value read past, when it is another value or out of range.
func (p *Payload) intIn(lo, hi int64) (v int64, ok bool, err error) {
	c, err := p.d.PeekCode()
	if err != nil {
		return 0, false, err
	}
	if !isInt(c) {
		return 0, false, p.skip(0)
	}
	if c == msgpcode.Uint64 {
		u, err := p.d.DecodeUint64()
		if err != nil || u > math.MaxInt64 {
			return 0, false, err
		}
		v = int64(u)
	} else if v, err = p.d.DecodeInt64(); err != nil {
		return 0, false, err
	}
	return v, v >= lo && v <= hi, nil
}

// number reads past a float or an integer.
func (p *Payload) number() error {
	c, err := p.d.PeekCode()
	if err != nil {
		return err
	}
	if !isInt(c) && c != msgpcode.Float && c != msgpcode.Double {
		return fmt.Errorf("msgpack code %#x: not a number", c)
	}
	return p.d.Skip()
}

// str returns a view of a str or bin value's bytes.
func (p *Payload) str() ([]byte, error) {
	c, err := p.d.PeekCode()
	if err != nil {
		return nil, err
	}
	if !isBytes(c) {
		return nil, fmt.Errorf("msgpack code %#x: not a string", c)
	}
	return p.view()
}

// view returns the bytes of the str or bin value next, without copying.
func (p *Payload) view() ([]byte, error) {
	n, err := p.d.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, nil
	}
	at := p.pos()
	if n > p.r.Len() {
		return nil, errors.New("a string past the end")
	}
	if _, err := p.r.Seek(int64(n), 1); err != nil {
		return nil, err
	}
	return p.data[at : at+n], nil
}

// skip reads past one value, following nested arrays and maps no deeper
// than maxDepth.
func (p *Payload) skip(depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("values nested deeper than %d", maxDepth)
	}
	c, err := p.d.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := p.d.DecodeArrayLen()
		if err != nil {
			return err
		}
		if n > p.r.Len() {
			return errors.New("an array past the end")
		}
		for i := 0; i < n; i++ {
			if err := p.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case isMap(c):
		n, err := p.d.DecodeMapLen()
		if err != nil {
			return err
		}
		if n > p.r.Len() {
			return errors.New("a map past the end")
		}
		for i := 0; i < 2*n; i++ {
			if err := p.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case isBytes(c):
		_, err := p.view()
		return err
	}
	return p.d.Skip()
}

func (p *Payload) isNil() bool {
	c, err := p.d.PeekCode()
	return err == nil && c == msgpcode.Nil
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isBytes(c byte) bool {
	return msgpcode.IsFixedString(c) || c == msgpcode.Str8 || c == msgpcode.Str16 || c == msgpcode.Str32 ||
		c == msgpcode.Bin8 || c == msgpcode.Bin16 || c == msgpcode.Bin32
}

func isInt(c byte) bool {
	if msgpcode.IsFixedNum(c) {
		return true
	}
	switch c {
	case msgpcode.Uint8, msgpcode.Uint16, msgpcode.Uint32, msgpcode.Uint64,
		msgpcode.Int8, msgpcode.Int16, msgpcode.Int32, msgpcode.Int64:
		return true
	}
	return false
}
