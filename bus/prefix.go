package bus

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"
)

// The routers' shared prefix index on the bus (behaviour.md R-PLACE-2): every
// router publishes the block hashes it placed on each engine, and applies
// the other routers' placements to its own index.
const (
	// PrefixSubjectPrefix starts every subject of prefix placements:
	// narwhal.prefix.<router_id>. Core NATS carries them to the routers
	// at once; stream PrefixStream keeps them for a while, so that a
	// router that starts or reconnects warms its index from the recent
	// past.
	PrefixSubjectPrefix = "narwhal.prefix."
	// PrefixStream is the stream of prefix placements (subjects
	// narwhal.prefix.>) and of the engines' KV batches (narwhal.kv.>,
	// KVSubject).
	PrefixStream = "NARWHAL_PREFIX"
	// PrefixMaxAge is how long PrefixStream keeps a batch: the recent
	// past a router warms its index from.
	PrefixMaxAge = 10 * time.Minute
	// PrefixMaxBytes caps PrefixStream's size (the routers' placements
	// and the engines' KV batches, KVSubject, together); the oldest
	// batches go first.
	PrefixMaxBytes = 256 << 20
	// PrefixMaxBatch is the largest batch, in bytes: a batch encoded
	// with PrefixBatch never exceeds it, and ParsePrefixBatch refuses a
	// larger one. It is also PrefixStream's largest message.
	PrefixMaxBatch = 256 << 10
	// PrefixMaxHashes bounds the hashes of one placement in a batch (the
	// prefix package hashes at most 4096 blocks per prompt).
	PrefixMaxHashes = 4096
	// PrefixMaxID bounds a router or engine id in a batch, in bytes.
	PrefixMaxID = 255
)

// prefixMagic starts every batch: the format's name and version.
const prefixMagic = "NWP1"

// prefixHeader is the size of a batch before its placements: the magic,
// the router id's length and the placement count (the id excluded).
const prefixHeader = len(prefixMagic) + 1 + 2

// PrefixSubject returns the subject routerID publishes its placements on.
func PrefixSubject(routerID string) string { return PrefixSubjectPrefix + routerID }

// PrefixBatch encodes a batch of prefix placements, a compact binary
// message (all integers little-endian):
//
//	"NWP1"                       magic and version
//	u8 len, router id            the publishing router (1…255 bytes, UTF-8)
//	u16 count                    placements that follow (1…65535)
//	count × {
//	  u8 len, engine id          the engine placed on (1…255 bytes, UTF-8)
//	  u16 n                      hashes that follow (1…PrefixMaxHashes)
//	  n × u64                    block hashes, in chain order
//	}
//
// The zero value is unusable; call Reset first. A PrefixBatch is reused
// batch after batch and allocates nothing once its buffer has grown.
type PrefixBatch struct {
	buf   []byte
	count int
}

// Reset starts a new, empty batch from routerID. It panics when routerID
// is empty or longer than PrefixMaxID (a router id is checked at start).
func (b *PrefixBatch) Reset(routerID string) {
	if routerID == "" || len(routerID) > PrefixMaxID {
		panic("bus: prefix batch router id must be 1…255 bytes")
	}
	b.buf = append(b.buf[:0], prefixMagic...)
	b.buf = append(b.buf, byte(len(routerID)))
	b.buf = append(b.buf, routerID...)
	b.buf = append(b.buf, 0, 0)
	b.count = 0
}

// PrefixEntrySize returns the bytes a placement of n hashes on engineID
// takes in a batch.
func PrefixEntrySize(engineID string, n int) int { return 1 + len(engineID) + 2 + 8*n }

// Add appends the placement of hashes on engineID and reports whether it
// did: it does not when the batch would then exceed PrefixMaxBatch or hold
// 65535 placements, or when the placement is not valid (an engine id of
// 0 or more than 255 bytes, no hashes or more than PrefixMaxHashes).
func (b *PrefixBatch) Add(engineID string, hashes []uint64) bool {
	if engineID == "" || len(engineID) > PrefixMaxID || len(hashes) == 0 || len(hashes) > PrefixMaxHashes ||
		b.count == 0xffff || len(b.buf)+PrefixEntrySize(engineID, len(hashes)) > PrefixMaxBatch {
		return false
	}
	b.buf = append(b.buf, byte(len(engineID)))
	b.buf = append(b.buf, engineID...)
	b.buf = binary.LittleEndian.AppendUint16(b.buf, uint16(len(hashes)))
	for _, h := range hashes {
		b.buf = binary.LittleEndian.AppendUint64(b.buf, h)
	}
	b.count++
	return true
}

// Len returns how many placements the batch holds.
func (b *PrefixBatch) Len() int { return b.count }

// Size returns the batch's encoded size so far, in bytes (at most
// PrefixMaxBatch).
func (b *PrefixBatch) Size() int { return len(b.buf) }

// Bytes returns the encoded batch; it stays valid until the next Reset or
// Add.
func (b *PrefixBatch) Bytes() []byte {
	off := len(prefixMagic) + 1 + int(b.buf[len(prefixMagic)])
	binary.LittleEndian.PutUint16(b.buf[off:], uint16(b.count))
	return b.buf
}

// PrefixPlacement is one placement of a batch: the engine and the block
// hashes placed there, in chain order.
type PrefixPlacement struct {
	EngineID string
	Hashes   []uint64
}

// ErrPrefixBatch is wrapped by every error of ParsePrefixBatch.
var ErrPrefixBatch = errors.New("bus: invalid prefix batch")

// ParsePrefixBatch decodes a batch encoded by PrefixBatch. It trusts
// nothing (the bus is hostile, R-BUS-9): a batch larger than
// PrefixMaxBatch, with another magic, an id that is empty or not UTF-8, no
// placements, a placement without hashes or with more than
// PrefixMaxHashes, a length that runs past the end, or bytes after the
// last placement is refused whole, with an error wrapping ErrPrefixBatch.
// The placements' hashes share one allocation. CheckPrefixBatch and
// EachPrefixPlacement read the same batches without allocating.
func ParsePrefixBatch(data []byte) (routerID string, placements []PrefixPlacement, err error) {
	id, count, total, body, err := checkPrefixBatch(data)
	if err != nil {
		return "", nil, err
	}
	hashes := make([]uint64, total)
	placements = make([]PrefixPlacement, 0, count)
	eachPlacement(body, func(eid []byte, raw []byte) {
		hs := hashes[: len(raw)/8 : len(raw)/8]
		hashes = hashes[len(raw)/8:]
		decodeHashes(hs, raw)
		placements = append(placements, PrefixPlacement{EngineID: string(eid), Hashes: hs})
	})
	return string(id), placements, nil
}

// CheckPrefixBatch checks data whole, as ParsePrefixBatch does (R-BUS-9),
// without decoding it or allocating: it returns the router id the batch
// names (a view of data) or an error wrapping ErrPrefixBatch.
// EachPrefixPlacement then reads the placements of a batch it accepted.
func CheckPrefixBatch(data []byte) (routerID []byte, err error) {
	id, _, _, _, err := checkPrefixBatch(data)
	return id, err
}

// EachPrefixPlacement calls fn, in order, with every placement of data, a
// batch CheckPrefixBatch accepted: the engine id (a view of data) and its
// hashes, decoded into buf, which it grows when a placement needs more
// room and returns for the next batch. fn must keep neither. Once buf
// has grown it allocates nothing. A batch CheckPrefixBatch refuses gets
// no call.
func EachPrefixPlacement(data []byte, buf []uint64, fn func(engineID []byte, hashes []uint64)) []uint64 {
	_, _, _, body, err := checkPrefixBatch(data)
	if err != nil {
		return buf
	}
	eachPlacement(body, func(eid []byte, raw []byte) {
		n := len(raw) / 8
		if cap(buf) < n {
			buf = make([]uint64, n, max(n, PrefixMaxHashes))
		}
		hs := buf[:n]
		decodeHashes(hs, raw)
		fn(eid, hs)
	})
	return buf
}

// checkPrefixBatch checks a batch whole and returns its router id, its
// placement count, the hashes of all its placements and its placements'
// bytes.
func checkPrefixBatch(data []byte) (id []byte, count, total int, body []byte, err error) {
	bad := func(why string) ([]byte, int, int, []byte, error) {
		return nil, 0, 0, nil, fmt.Errorf("%w: %s", ErrPrefixBatch, why)
	}
	if len(data) > PrefixMaxBatch {
		return bad("larger than 256 KiB")
	}
	if len(data) < prefixHeader || string(data[:len(prefixMagic)]) != prefixMagic {
		return bad("not a prefix batch (magic)")
	}
	p := data[len(prefixMagic):]
	id, p, ok := readID(p)
	if !ok {
		return bad("router id")
	}
	if len(p) < 2 {
		return bad("truncated")
	}
	count = int(binary.LittleEndian.Uint16(p))
	p = p[2:]
	if count == 0 {
		return bad("no placements")
	}
	for i, q := 0, p; i < count; i++ {
		if _, q, ok = readID(q); !ok || len(q) < 2 {
			return bad("engine id of placement " + strconv.Itoa(i))
		}
		n := int(binary.LittleEndian.Uint16(q))
		q = q[2:]
		if n == 0 || n > PrefixMaxHashes || len(q) < 8*n {
			return bad("hashes of placement " + strconv.Itoa(i))
		}
		q = q[8*n:]
		total += n
		if i == count-1 && len(q) != 0 {
			return bad("bytes after the last placement")
		}
	}
	return id, count, total, p, nil
}

// eachPlacement calls fn with the engine id and the raw hashes (8 bytes
// each) of every placement of body, placements checkPrefixBatch accepted.
func eachPlacement(body []byte, fn func(eid, raw []byte)) {
	for len(body) > 0 {
		eid, p, _ := readID(body)
		n := int(binary.LittleEndian.Uint16(p))
		fn(eid, p[2:2+8*n])
		body = p[2+8*n:]
	}
}

// decodeHashes decodes len(hs) little-endian hashes of raw into hs.
func decodeHashes(hs []uint64, raw []byte) {
	for k := range hs {
		hs[k] = binary.LittleEndian.Uint64(raw[8*k:])
	}
}

// readID reads a u8-length-prefixed id of 1…255 bytes of UTF-8, a view
// of p.
func readID(p []byte) ([]byte, []byte, bool) {
	if len(p) < 1 {
		return nil, nil, false
	}
	n := int(p[0])
	if n == 0 || len(p) < 1+n || !utf8.Valid(p[1:1+n]) {
		return nil, nil, false
	}
	return p[1 : 1+n], p[1+n:], true
}

// prefixStreamConfig is stream NARWHAL_PREFIX as Setup creates it: the
// placements of the last PrefixMaxAge, at most PrefixMaxBytes.
func prefixStreamConfig(replicas int) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        PrefixStream,
		Description: "Narwhal prefix placements (the block hashes each router placed on each engine) and the engines' KV events, for the prefix indexes",
		Subjects:    []string{PrefixSubjectPrefix + ">", KVSubjectPrefix + ">"},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		Storage:     jetstream.FileStorage,
		MaxAge:      PrefixMaxAge,
		MaxBytes:    PrefixMaxBytes,
		MaxMsgSize:  PrefixMaxBatch,
		Replicas:    replicas,
		// No rollup and no purge (behaviour.md R-BUS-11): a router's
		// batch with a Nats-Rollup header would wipe the others'.
		AllowRollup: false,
		AllowDirect: true, // read without a consumer (R-BUS-11)
		DenyPurge:   true,
	}
}
