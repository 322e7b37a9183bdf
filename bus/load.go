package bus

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unicode/utf8"
)

// The routers' load exchange on the bus (behaviour.md R-PLACE-3): every
// router publishes, per engine, the work it has in flight there, and
// every router's placement weighs the sum.
const (
	// LoadSubjectPrefix starts every subject of load reports:
	// narwhal.load.<router_id>, on core NATS only (no stream keeps
	// them: a report is worth its last second).
	LoadSubjectPrefix = "narwhal.load."
	// LoadMaxReport is the largest report, in bytes: LoadReport never
	// encodes a larger one and ParseLoadReport refuses it.
	LoadMaxReport = 64 << 10
	// LoadMaxEngines bounds the engines of one report.
	LoadMaxEngines = 1024
	// LoadMaxCount bounds each count of a report (attempts, tokens); a
	// larger one is refused.
	LoadMaxCount = 1 << 40
)

// loadMagic starts every report: the format's name and version.
const loadMagic = "NWL1"

// LoadSubject returns the subject routerID publishes its load reports on.
func LoadSubject(routerID string) string { return LoadSubjectPrefix + routerID }

// LoadReport encodes one router's load report, a compact binary message:
//
//	"NWL1"                      magic and version
//	u8 len, router id           the publishing router (1…255 bytes, UTF-8)
//	u16 count                   engines that follow (0…LoadMaxEngines)
//	count × {
//	  u8 len, engine id         (1…255 bytes, UTF-8)
//	  uvarint prefill           prefill legs in flight there
//	  uvarint decode            decode legs in flight there
//	  uvarint tokens            estimated uncached prefill tokens in flight
//	}
//
// A report with no engine says the router has nothing in flight any
// more. The zero value is unusable; call Reset first. A LoadReport is
// reused report after report and allocates nothing once its buffer has
// grown.
type LoadReport struct {
	buf   []byte
	count int
}

// Reset starts a new, empty report from routerID. It panics when
// routerID is empty or longer than PrefixMaxID (a router id is checked
// at start).
func (r *LoadReport) Reset(routerID string) {
	if routerID == "" || len(routerID) > PrefixMaxID {
		panic("bus: load report router id must be 1…255 bytes")
	}
	r.buf = append(r.buf[:0], loadMagic...)
	r.buf = append(r.buf, byte(len(routerID)))
	r.buf = append(r.buf, routerID...)
	r.buf = append(r.buf, 0, 0)
	r.count = 0
}

// Add appends engineID's counts and reports whether it did: it does not
// when the report would then exceed LoadMaxReport or LoadMaxEngines, or
// the entry is not valid (an engine id of 0 or more than 255 bytes, a
// count below 0 or above LoadMaxCount).
func (r *LoadReport) Add(engineID string, prefill, decode, tokens int64) bool {
	if engineID == "" || len(engineID) > PrefixMaxID || r.count >= LoadMaxEngines ||
		len(r.buf)+1+len(engineID)+3*binary.MaxVarintLen64 > LoadMaxReport {
		return false
	}
	for _, n := range [3]int64{prefill, decode, tokens} {
		if n < 0 || n > LoadMaxCount {
			return false
		}
	}
	r.buf = append(r.buf, byte(len(engineID)))
	r.buf = append(r.buf, engineID...)
	r.buf = binary.AppendUvarint(r.buf, uint64(prefill))
	r.buf = binary.AppendUvarint(r.buf, uint64(decode))
	r.buf = binary.AppendUvarint(r.buf, uint64(tokens))
	r.count++
	return true
}

// Len returns how many engines the report holds.
func (r *LoadReport) Len() int { return r.count }

// Bytes returns the encoded report; it stays valid until the next Reset
// or Add.
func (r *LoadReport) Bytes() []byte {
	off := len(loadMagic) + 1 + int(r.buf[len(loadMagic)])
	binary.LittleEndian.PutUint16(r.buf[off:], uint16(r.count))
	return r.buf
}

// ErrLoadReport is wrapped by every error of ParseLoadReport.
var ErrLoadReport = errors.New("bus: invalid load report")

// ParseLoadReport decodes a report encoded by LoadReport, calling fn for
// each engine (engineID is a slice of data, valid during the call). It
// trusts nothing (the bus is hostile, behaviour.md R-BUS-9): a report
// larger than LoadMaxReport, with another magic, an id that is empty or
// not UTF-8, more than LoadMaxEngines engines, a count above
// LoadMaxCount, a length that runs past the end, or bytes after the last
// engine is refused with an error wrapping ErrLoadReport — fn may then
// have been called for the engines before the fault, so a caller applies
// what fn collected only when the error is nil. It allocates only the
// router id.
func ParseLoadReport(data []byte, fn func(engineID []byte, prefill, decode, tokens int64)) (routerID string, err error) {
	bad := func(why string) (string, error) { return "", fmt.Errorf("%w: %s", ErrLoadReport, why) }
	if len(data) > LoadMaxReport {
		return bad("too large")
	}
	if len(data) < len(loadMagic)+1 || string(data[:len(loadMagic)]) != loadMagic {
		return bad("not a load report")
	}
	p := data[len(loadMagic):]
	idLen := int(p[0])
	p = p[1:]
	if idLen == 0 || len(p) < idLen+2 || !utf8.Valid(p[:idLen]) {
		return bad("bad router id")
	}
	id := p[:idLen]
	p = p[idLen:]
	count := int(binary.LittleEndian.Uint16(p))
	p = p[2:]
	if count > LoadMaxEngines {
		return bad("too many engines")
	}
	for range count {
		if len(p) < 1 {
			return bad("truncated")
		}
		n := int(p[0])
		p = p[1:]
		if n == 0 || len(p) < n || !utf8.Valid(p[:n]) {
			return bad("bad engine id")
		}
		eid := p[:n]
		p = p[n:]
		var vals [3]int64
		for i := range vals {
			v, k := binary.Uvarint(p)
			if k <= 0 || v > LoadMaxCount {
				return bad("bad count")
			}
			vals[i] = int64(v)
			p = p[k:]
		}
		fn(eid, vals[0], vals[1], vals[2])
	}
	if len(p) != 0 {
		return bad("trailing bytes")
	}
	return string(id), nil
}
