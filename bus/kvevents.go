package bus

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unicode/utf8"
)

// The engines' KV events on the bus (behaviour.md R-PLACE-4): `narwhal
// agent --kv-events` reads an engine's ZeroMQ events (vLLM's format) and
// publishes them, as keys of our own (prefix.TokenBlockKey), under the
// engine's own credential on KVSubject(engine id). Core NATS carries them
// to every router at once; stream PrefixStream keeps them with the
// routers' prefix placements (same retention), so that a router that
// starts or reconnects warms its exact index from the recent past.
const (
	// KVSubjectPrefix starts every subject of KV batches:
	// narwhal.kv.<engine_id>. The subject's id is the publisher's: only
	// that engine's credential may publish there.
	KVSubjectPrefix = "narwhal.kv."
	// KVMaxBatch is the largest KV batch, in bytes: KVBatch never makes a
	// larger one and ParseKVBatch refuses it.
	KVMaxBatch = PrefixMaxBatch
	// KVMaxKeys bounds the keys of one op of a batch.
	KVMaxKeys = 8192
	// KVMaxRanks bounds an engine's data-parallel ranks (0…KVMaxRanks-1).
	KVMaxRanks = 64
)

// KVSubject returns the subject engine id's agent publishes KV batches on.
func KVSubject(engineID string) string { return KVSubjectPrefix + engineID }

// KVOp is what one op of a KV batch says about an engine's cache.
type KVOp uint8

const (
	// KVStored: the engine's rank holds the blocks of the keys, on the
	// op's medium (vLLM's BlockStored).
	KVStored KVOp = 1
	// KVRemoved: the engine's rank no longer holds the blocks of the keys
	// on the op's medium (vLLM's BlockRemoved). A key the router does not
	// hold is ignored.
	KVRemoved KVOp = 2
	// KVCleared: the engine's rank holds no block on any medium any more
	// (vLLM's AllBlocksCleared, or the engine restarted); the op has no
	// keys. What follows is exact again.
	KVCleared KVOp = 3
	// KVLost: the agent lost events of the rank that it could not get
	// again (no replay socket, or the replay no longer held them): the
	// routers drop what they hold of the rank and place that engine by
	// the approximate index until a KVCleared or a new epoch
	// (behaviour.md R-PLACE-4). The op has no keys.
	KVLost KVOp = 4
)

// KVMedium is where an engine holds a block: its GPU memory, or a tier an
// offloading connector (LMCache, SGLang's hierarchical cache) loads from.
type KVMedium uint8

const (
	// KVGPU is a block in the engine's GPU memory (vLLM's medium "GPU",
	// or none).
	KVGPU KVMedium = 0
	// KVCPU is a block in host memory ("CPU", SGLang's "CPU_PINNED").
	KVCPU KVMedium = 1
	// KVDisk is a block on local disk or in remote storage ("DISK",
	// "STORAGE", and any other name).
	KVDisk KVMedium = 2
)

// KVMediumOf maps a publisher's medium name to a KVMedium: "" and "GPU"
// to KVGPU, "CPU" and "CPU_PINNED" to KVCPU, every other name to KVDisk.
func KVMediumOf(name string) KVMedium {
	switch name {
	case "", "GPU":
		return KVGPU
	case "CPU", "CPU_PINNED":
		return KVCPU
	}
	return KVDisk
}

// kvMagic starts every KV batch: the format's name and version.
const kvMagic = "NWK1"

// kvOpHeader is the size of an op before its keys.
const kvOpHeader = 1 + 1 + 1 + 2

// KVBatch encodes a batch of one engine's KV ops, a compact binary
// message (all integers little-endian):
//
//	"NWK1"                   magic and version
//	u8 len, engine id        the engine (1…255 bytes; must be the subject's id)
//	u64 epoch                the agent's run (random, not 0): a new one
//	                         means the keys of the old are unknown
//	u64 seq                  the batch's number in its epoch, from 1, +1 a batch
//	u16 block size           tokens per KV block (1…prefix.MaxTokenBlockSize)
//	u16 count                ops that follow (1…65535)
//	count × {
//	  u8 op                  KVOp
//	  u8 rank                data-parallel rank (0…KVMaxRanks-1)
//	  u8 medium              KVMedium
//	  u16 n                  keys that follow (stored/removed: 1…KVMaxKeys; else 0)
//	  n × u64                keys (prefix.TokenBlockKey), stored in chain order
//	}
//
// The zero value is unusable; call Reset first. A KVBatch is reused batch
// after batch and allocates nothing once its buffer has grown.
type KVBatch struct {
	buf   []byte
	count int
	at    int // offset of the count
}

// Reset starts a new, empty batch of engineID's agent run epoch, number
// seq, of blocks of blockSize tokens. It panics when engineID is empty or
// longer than PrefixMaxID (an engine id is checked at start).
func (b *KVBatch) Reset(engineID string, epoch, seq uint64, blockSize int) {
	if engineID == "" || len(engineID) > PrefixMaxID {
		panic("bus: KV batch engine id must be 1…255 bytes")
	}
	b.buf = append(b.buf[:0], kvMagic...)
	b.buf = append(b.buf, byte(len(engineID)))
	b.buf = append(b.buf, engineID...)
	b.buf = binary.LittleEndian.AppendUint64(b.buf, epoch)
	b.buf = binary.LittleEndian.AppendUint64(b.buf, seq)
	b.buf = binary.LittleEndian.AppendUint16(b.buf, uint16(blockSize))
	b.at = len(b.buf)
	b.buf = append(b.buf, 0, 0)
	b.count = 0
}

// KVOpSize returns the bytes an op of n keys takes in a batch.
func KVOpSize(n int) int { return kvOpHeader + 8*n }

// Add appends an op and reports whether it did: it does not when the
// batch would then exceed KVMaxBatch or hold 65535 ops, or when the op is
// not valid (an unknown op or medium, a rank of KVMaxRanks or more, a
// stored or removed op without keys or with more than KVMaxKeys, a
// cleared or lost op with keys).
func (b *KVBatch) Add(op KVOp, rank int, medium KVMedium, keys []uint64) bool {
	if !validKVOp(op, rank, medium, len(keys)) || b.count == 0xffff || len(b.buf)+KVOpSize(len(keys)) > KVMaxBatch {
		return false
	}
	b.buf = append(b.buf, byte(op), byte(rank), byte(medium))
	b.buf = binary.LittleEndian.AppendUint16(b.buf, uint16(len(keys)))
	for _, k := range keys {
		b.buf = binary.LittleEndian.AppendUint64(b.buf, k)
	}
	b.count++
	return true
}

// Len returns how many ops the batch holds.
func (b *KVBatch) Len() int { return b.count }

// Size returns the batch's size in bytes so far.
func (b *KVBatch) Size() int { return len(b.buf) }

// Bytes returns the encoded batch; it stays valid until the next Reset or
// Add.
func (b *KVBatch) Bytes() []byte {
	binary.LittleEndian.PutUint16(b.buf[b.at:], uint16(b.count))
	return b.buf
}

func validKVOp(op KVOp, rank int, medium KVMedium, n int) bool {
	if rank < 0 || rank >= KVMaxRanks || medium > KVDisk {
		return false
	}
	switch op {
	case KVStored, KVRemoved:
		return n >= 1 && n <= KVMaxKeys
	case KVCleared, KVLost:
		return n == 0
	}
	return false
}

// KVHeader is what a KV batch says before its ops.
type KVHeader struct {
	// EngineID is the engine the batch is of (a view of the batch's
	// bytes in ReadKVOps; a copy in ParseKVBatch).
	EngineID []byte
	// Epoch is the agent's run; Seq the batch's number in it, from 1.
	Epoch, Seq uint64
	// BlockSize is the engine's tokens per KV block.
	BlockSize int
}

// KVEntry is one op of a batch, as ParseKVBatch returns it.
type KVEntry struct {
	Op     KVOp
	Rank   int
	Medium KVMedium
	Keys   []uint64
}

// ErrKVBatch is wrapped by every error of ParseKVBatch and CheckKVBatch.
var ErrKVBatch = errors.New("bus: invalid KV batch")

// CheckKVBatch checks data whole (behaviour.md R-BUS-9: the bus is
// hostile) without decoding its keys or allocating (ReadKVOps then reads it): a batch larger than
// KVMaxBatch, with another magic, an engine id that is empty or not
// UTF-8, an epoch of 0, a seq of 0, a block size of 0 or above 1024, no
// ops, an invalid op (KVBatch.Add's rules), a length that runs past the
// end, or bytes after the last op is refused whole, with an error
// wrapping ErrKVBatch. The header's EngineID is a view of data.
func CheckKVBatch(data []byte) (KVHeader, error) {
	h, _, err := checkKVBatch(data)
	return h, err
}

// ReadKVOps reads data, a batch CheckKVBatch accepts, for a caller that
// applies batch after batch without allocating (behaviour.md R-PLACE-4):
// the header is written to *h (the caller's, reused;
// its EngineID a view of data), then fn is called, in order, with every
// op, its keys decoded into buf (grown when an op needs more room, and
// returned for the next batch); fn must keep neither h's id nor keys.
// Once buf has grown it allocates nothing. It returns the batch's error,
// if any, before any call, and *h is then unchanged.
func ReadKVOps(data []byte, h *KVHeader, buf []uint64, fn func(op KVOp, rank int, medium KVMedium, keys []uint64)) ([]uint64, error) {
	hdr, body, err := checkKVBatch(data)
	if err != nil {
		return buf, err
	}
	*h = hdr
	for len(body) > 0 {
		op, rank, medium := KVOp(body[0]), int(body[1]), KVMedium(body[2])
		n := int(binary.LittleEndian.Uint16(body[3:]))
		raw := body[kvOpHeader : kvOpHeader+8*n]
		body = body[kvOpHeader+8*n:]
		if cap(buf) < n {
			buf = make([]uint64, n, max(n, 256))
		}
		keys := buf[:n]
		decodeHashes(keys, raw)
		fn(op, rank, medium, keys)
	}
	return buf, nil
}

// ParseKVBatch decodes a batch encoded by KVBatch, checked as
// CheckKVBatch does; the ops' keys share one allocation.
func ParseKVBatch(data []byte) (KVHeader, []KVEntry, error) {
	h, body, err := checkKVBatch(data)
	if err != nil {
		return KVHeader{}, nil, err
	}
	h.EngineID = append([]byte(nil), h.EngineID...)
	var ops []KVEntry
	keys := make([]uint64, 0, len(body)/8)
	for len(body) > 0 {
		n := int(binary.LittleEndian.Uint16(body[3:]))
		start := len(keys)
		for i := 0; i < n; i++ {
			keys = append(keys, binary.LittleEndian.Uint64(body[kvOpHeader+8*i:]))
		}
		ops = append(ops, KVEntry{Op: KVOp(body[0]), Rank: int(body[1]), Medium: KVMedium(body[2]), Keys: keys[start:len(keys):len(keys)]})
		body = body[kvOpHeader+8*n:]
	}
	return h, ops, nil
}

// checkKVBatch checks a batch whole and returns its header and its ops'
// bytes.
func checkKVBatch(data []byte) (KVHeader, []byte, error) {
	bad := func(why string) (KVHeader, []byte, error) {
		return KVHeader{}, nil, fmt.Errorf("%w: %s", ErrKVBatch, why)
	}
	if len(data) > KVMaxBatch {
		return bad("larger than 256 KiB")
	}
	if len(data) < len(kvMagic)+1 || string(data[:len(kvMagic)]) != kvMagic {
		return bad("not a KV batch (magic)")
	}
	p := data[len(kvMagic):]
	n := int(p[0])
	if n == 0 || len(p) < 1+n+8+8+2+2 || !utf8.Valid(p[1:1+n]) {
		return bad("engine id empty, not UTF-8, or header cut short")
	}
	h := KVHeader{EngineID: p[1 : 1+n]}
	p = p[1+n:]
	h.Epoch = binary.LittleEndian.Uint64(p)
	h.Seq = binary.LittleEndian.Uint64(p[8:])
	h.BlockSize = int(binary.LittleEndian.Uint16(p[16:]))
	count := int(binary.LittleEndian.Uint16(p[18:]))
	p = p[20:]
	switch {
	case h.Epoch == 0:
		return bad("epoch 0")
	case h.Seq == 0:
		return bad("seq 0")
	case h.BlockSize < 1 || h.BlockSize > 1024:
		return bad("block size not 1…1024 tokens")
	case count == 0:
		return bad("no ops")
	}
	body := p
	for i := 0; i < count; i++ {
		if len(p) < kvOpHeader {
			return bad("op cut short")
		}
		k := int(binary.LittleEndian.Uint16(p[3:]))
		if !validKVOp(KVOp(p[0]), int(p[1]), KVMedium(p[2]), k) {
			return bad(fmt.Sprintf("op %d invalid (op %d, rank %d, medium %d, %d keys)", i, p[0], p[1], p[2], k))
		}
		if len(p) < kvOpHeader+8*k {
			return bad("keys cut short")
		}
		p = p[kvOpHeader+8*k:]
	}
	if len(p) != 0 {
		return bad("bytes after the last op")
	}
	return h, body, nil
}
