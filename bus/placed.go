package bus

import (
	"bytes"
	"encoding/binary"
	"fmt"
)

// Placements in flight, shared between routers (behaviour.md R-PLACE-4):
// when a router places a prompt on an engine by its exact index, it
// publishes the prompt's token-block keys on its load subject,
// narwhal.load.<router_id>, so that the other routers credit that engine
// with the prompt until the engine's KV events report it; when the
// attempt ends it publishes that (AppendPlacedEnd), so that the credit
// lasts as long as the attempt, as the router's own does. They travel on
// the load subject, which every router may already publish and read, in
// a message of their own magic: a router that does not know it counts
// it as an invalid load report and goes on.
const (
	// PlacedMaxKeys bounds the keys of one placement: 256 blocks, 4,096
	// tokens at 16 a block. A longer prompt is shared by its head.
	PlacedMaxKeys = 256
)

// placedMagic starts every placement message: its name and version.
const placedMagic = "NWP1"

// IsPlaced reports whether data, a message of a load subject, is a
// placement in flight (AppendPlaced) rather than a load report.
func IsPlaced(data []byte) bool { return bytes.HasPrefix(data, []byte(placedMagic)) }

// AppendPlaced appends to dst the message of one placement in flight,
// all integers little-endian:
//
//	"NWP1"                  magic and version
//	u8 len, router id       the publishing router (1…255 bytes, UTF-8)
//	u8 len, engine id       the engine placed on (1…255 bytes, UTF-8)
//	u16 count               keys that follow (1…PlacedMaxKeys)
//	count × u64             the prompt's leading token-block keys
//	                        (prefix.TokenBlockKey chain), in chain order
//
// keys past PlacedMaxKeys are left out. It returns dst unchanged, and
// false, for an id of 0 or more than PrefixMaxID bytes or no keys.
func AppendPlaced(dst []byte, routerID, engineID string, keys []uint64) ([]byte, bool) {
	if routerID == "" || len(routerID) > PrefixMaxID || engineID == "" || len(engineID) > PrefixMaxID || len(keys) == 0 {
		return dst, false
	}
	keys = keys[:min(len(keys), PlacedMaxKeys)]
	dst = append(dst, placedMagic...)
	dst = append(dst, byte(len(routerID)))
	dst = append(dst, routerID...)
	dst = append(dst, byte(len(engineID)))
	dst = append(dst, engineID...)
	dst = binary.LittleEndian.AppendUint16(dst, uint16(len(keys)))
	for _, k := range keys {
		dst = binary.LittleEndian.AppendUint64(dst, k)
	}
	return dst, true
}

// ParsePlaced decodes a message of AppendPlaced: the router and engine
// ids (views of data) and the keys, decoded into keys[:0] (grown when
// too small, returned for reuse). It trusts nothing (R-BUS-9): another
// magic, an id that is empty or not UTF-8, no keys or more than
// PlacedMaxKeys, a length that runs past the end or bytes after the
// last key is refused whole with an error wrapping ErrLoadReport. Once
// keys has grown it allocates nothing.
func ParsePlaced(data []byte, keys []uint64) (routerID, engineID []byte, out []uint64, err error) {
	bad := func(why string) ([]byte, []byte, []uint64, error) {
		return nil, nil, keys[:0], fmt.Errorf("%w: placement: %s", ErrLoadReport, why)
	}
	if !IsPlaced(data) {
		return bad("not a placement")
	}
	p := data[len(placedMagic):]
	var ok bool
	if routerID, p, ok = readID(p); !ok {
		return bad("bad router id")
	}
	if engineID, p, ok = readID(p); !ok {
		return bad("bad engine id")
	}
	if len(p) < 2 {
		return bad("truncated")
	}
	n := int(binary.LittleEndian.Uint16(p))
	p = p[2:]
	if n == 0 || n > PlacedMaxKeys {
		return bad("key count out of range")
	}
	if len(p) != 8*n {
		return bad("keys do not match their count")
	}
	out = keys[:0]
	for i := range n {
		out = append(out, binary.LittleEndian.Uint64(p[8*i:]))
	}
	return routerID, engineID, out, nil
}

// placedEndMagic starts every message that a placement in flight ended.
const placedEndMagic = "NWE1"

// PlacedOutcome is how a placement in flight ended (AppendPlacedEnd).
type PlacedOutcome uint8

const (
	// PlacedFailed: the prefill attempt ended before its prefill
	// completed, so the engine may hold none of the prompt; the other
	// routers drop the credit at once.
	PlacedFailed PlacedOutcome = 0
	// PlacedCompleted: the prefill completed; the engine's KV events for
	// its blocks are due within a grace, and the credit ends then.
	PlacedCompleted PlacedOutcome = 1
)

// IsPlacedEnd reports whether data, a message of a load subject, says a
// placement in flight ended (AppendPlacedEnd).
func IsPlacedEnd(data []byte) bool { return bytes.HasPrefix(data, []byte(placedEndMagic)) }

// AppendPlacedEnd appends to dst the message that a placement published
// with AppendPlaced ended, all integers little-endian:
//
//	"NWE1"                  magic and version
//	u8 len, router id       the publishing router (1…255 bytes, UTF-8)
//	u8 len, engine id       the engine placed on (1…255 bytes, UTF-8)
//	u8 outcome              PlacedFailed or PlacedCompleted
//	u16 count               keys the placement carried (1…PlacedMaxKeys)
//	u64 last                the last of them: a chain key, so it names
//	                        the whole prompt the placement carried
//
// count and last are PlacedChain of the keys given to AppendPlaced. It
// returns dst unchanged, and false, for an id of 0 or more than
// PrefixMaxID bytes, a count of 0 or past PlacedMaxKeys or an outcome of
// neither value. It is about 30 bytes against a placement's 2 KiB.
func AppendPlacedEnd(dst []byte, routerID, engineID string, count int, last uint64, outcome PlacedOutcome) ([]byte, bool) {
	if routerID == "" || len(routerID) > PrefixMaxID || engineID == "" || len(engineID) > PrefixMaxID ||
		count <= 0 || count > PlacedMaxKeys || outcome > PlacedCompleted {
		return dst, false
	}
	dst = append(dst, placedEndMagic...)
	dst = append(dst, byte(len(routerID)))
	dst = append(dst, routerID...)
	dst = append(dst, byte(len(engineID)))
	dst = append(dst, engineID...)
	dst = append(dst, byte(outcome))
	dst = binary.LittleEndian.AppendUint16(dst, uint16(count))
	dst = binary.LittleEndian.AppendUint64(dst, last)
	return dst, true
}

// PlacedChain returns what names, in AppendPlacedEnd, the prompt that
// AppendPlaced(…, keys) carries: how many keys it carries (at most
// PlacedMaxKeys) and the last of them; 0, 0 for no keys.
func PlacedChain(keys []uint64) (count int, last uint64) {
	if len(keys) == 0 {
		return 0, 0
	}
	count = min(len(keys), PlacedMaxKeys)
	return count, keys[count-1]
}

// PlacedEnd is a decoded AppendPlacedEnd message. RouterID and EngineID
// are views of the message's bytes.
type PlacedEnd struct {
	RouterID, EngineID []byte
	Outcome            PlacedOutcome
	// Count is how many keys the placement carried (1…PlacedMaxKeys),
	// Last the last of them.
	Count int
	Last  uint64
}

// ParsePlacedEnd decodes a message of AppendPlacedEnd. It trusts nothing
// (R-BUS-9): another magic, an id that is empty or not UTF-8, an unknown
// outcome, a count of 0 or past PlacedMaxKeys, or a length other than
// the fields' is refused whole with an error wrapping ErrLoadReport. It
// does not allocate.
func ParsePlacedEnd(data []byte) (PlacedEnd, error) {
	bad := func(why string) (PlacedEnd, error) {
		return PlacedEnd{}, fmt.Errorf("%w: placement end: %s", ErrLoadReport, why)
	}
	if !IsPlacedEnd(data) {
		return bad("not a placement end")
	}
	p := data[len(placedEndMagic):]
	var e PlacedEnd
	var ok bool
	if e.RouterID, p, ok = readID(p); !ok {
		return bad("bad router id")
	}
	if e.EngineID, p, ok = readID(p); !ok {
		return bad("bad engine id")
	}
	if len(p) != 1+2+8 {
		return bad("wrong length")
	}
	if e.Outcome = PlacedOutcome(p[0]); e.Outcome > PlacedCompleted {
		return bad("unknown outcome")
	}
	if e.Count = int(binary.LittleEndian.Uint16(p[1:])); e.Count == 0 || e.Count > PlacedMaxKeys {
		return bad("key count out of range")
	}
	e.Last = binary.LittleEndian.Uint64(p[3:])
	return e, nil
}
