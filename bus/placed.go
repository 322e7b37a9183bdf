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
// with the prompt until the engine's KV events report it. They travel on
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
