package bus

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
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
	// LoadMaxAge bounds each duration of a report (EngineLoad's HeadBusy,
	// HeadEnd and PaceMean); a longer one is refused.
	LoadMaxAge = time.Hour
)

// The formats' names and versions, each report's first bytes: loadMagic
// is written, loadMagicV1 (the counts alone, without the head of the
// queue: routers before it) is still read.
const (
	loadMagic   = "NWL2"
	loadMagicV1 = "NWL1"
)

// EngineLoad is one router's work in flight on one engine, one entry of
// a load report (behaviour.md R-PLACE-3). The durations are ages at the
// moment the report was encoded, so that a receiver places them on its
// own clock (its receipt time less the age) and no two routers' clocks
// need agree; each is 0 when unknown, and is carried to the microsecond.
type EngineLoad struct {
	// Prefill and Decode are the legs in flight there, Tokens their
	// estimated uncached prefill tokens.
	Prefill, Decode, Tokens int64
	// HeadBusy is how long the router has had prefill attempts in flight
	// there without a break (since its first was reserved while none
	// was); 0 when it has none.
	HeadBusy time.Duration
	// HeadEnd is how long ago the router's last prefill attempt there
	// ended; 0 when none did, or when the router has had nothing in
	// flight there since the last ended a while ago (meshview keeps 1 s).
	HeadEnd time.Duration
	// PaceMean is the router's mean time of a prefill there, from the
	// head's start to its end, over the prefills that answered;
	// PaceTokens the mean of their reserved uncached tokens (the pace of
	// meshview.Member.Head). Both 0 when none answered.
	PaceMean   time.Duration
	PaceTokens int64
}

// LoadSubject returns the subject routerID publishes its load reports on.
func LoadSubject(routerID string) string { return LoadSubjectPrefix + routerID }

// LoadReport encodes one router's load report, a compact binary message:
//
//	"NWL2"                      magic and version
//	u8 len, router id           the publishing router (1…255 bytes, UTF-8)
//	u16 count                   engines that follow (0…LoadMaxEngines)
//	count × {
//	  u8 len, engine id         (1…255 bytes, UTF-8)
//	  uvarint prefill           prefill legs in flight there
//	  uvarint decode            decode legs in flight there
//	  uvarint tokens            estimated uncached prefill tokens in flight
//	  uvarint head busy         EngineLoad.HeadBusy in µs, plus 1; 0 none
//	  uvarint head end          EngineLoad.HeadEnd in µs, plus 1; 0 none
//	  uvarint pace mean         EngineLoad.PaceMean in µs
//	  uvarint pace tokens       EngineLoad.PaceTokens
//	}
//
// Version 1 ("NWL1") had the first three counts only.
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

// Add appends engineID's counts with no head of the queue known: Append
// of EngineLoad{Prefill: prefill, Decode: decode, Tokens: tokens}.
func (r *LoadReport) Add(engineID string, prefill, decode, tokens int64) bool {
	return r.Append(engineID, EngineLoad{Prefill: prefill, Decode: decode, Tokens: tokens})
}

// Append appends engineID's load and reports whether it did: it does not
// when the report would then exceed LoadMaxReport or LoadMaxEngines, or
// the entry is not valid (an engine id of 0 or more than 255 bytes, a
// count below 0 or above LoadMaxCount, a duration below 0 or above
// LoadMaxAge).
func (r *LoadReport) Append(engineID string, l EngineLoad) bool {
	if engineID == "" || len(engineID) > PrefixMaxID || r.count >= LoadMaxEngines {
		return false
	}
	for _, n := range [...]int64{l.Prefill, l.Decode, l.Tokens, l.PaceTokens} {
		if n < 0 || n > LoadMaxCount {
			return false
		}
	}
	for _, d := range [...]time.Duration{l.HeadBusy, l.HeadEnd, l.PaceMean} {
		if d < 0 || d > LoadMaxAge {
			return false
		}
	}
	start := len(r.buf)
	r.buf = append(r.buf, byte(len(engineID)))
	r.buf = append(r.buf, engineID...)
	r.buf = binary.AppendUvarint(r.buf, uint64(l.Prefill))
	r.buf = binary.AppendUvarint(r.buf, uint64(l.Decode))
	r.buf = binary.AppendUvarint(r.buf, uint64(l.Tokens))
	r.buf = binary.AppendUvarint(r.buf, ageField(l.HeadBusy))
	r.buf = binary.AppendUvarint(r.buf, ageField(l.HeadEnd))
	r.buf = binary.AppendUvarint(r.buf, uint64(l.PaceMean/time.Microsecond))
	r.buf = binary.AppendUvarint(r.buf, uint64(l.PaceTokens))
	if len(r.buf) > LoadMaxReport {
		r.buf = r.buf[:start]
		return false
	}
	r.count++
	return true
}

// loadFields is the uvarints of one engine's entry (loadFieldsV1 in
// version 1).
const (
	loadFields   = 7
	loadFieldsV1 = 3
)

// ageField encodes an age of an entry: 0 for none, else its microseconds
// plus 1 (a known age of under a microsecond is not "none").
func ageField(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return uint64(d/time.Microsecond) + 1
}

// fieldAge decodes ageField.
func fieldAge(v uint64) time.Duration {
	if v == 0 {
		return 0
	}
	return max(time.Duration(v-1)*time.Microsecond, 1)
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

// ParseLoadReport decodes a report encoded by LoadReport, of this
// version or version 1 (whose entries have no head: their durations are
// 0), calling fn for each engine (engineID is a slice of data, valid
// during the call). It trusts nothing (the bus is hostile, behaviour.md
// R-BUS-9): a report larger than LoadMaxReport, with another magic, an
// id that is empty or not UTF-8, more than LoadMaxEngines engines, a
// count above LoadMaxCount or a duration above LoadMaxAge, a length that
// runs past the end, or bytes after the last engine is refused with an
// error wrapping ErrLoadReport — fn may then have been called for the
// engines before the fault, so a caller applies what fn collected only
// when the error is nil. It allocates only the router id.
func ParseLoadReport(data []byte, fn func(engineID []byte, l EngineLoad)) (routerID string, err error) {
	bad := func(why string) (string, error) { return "", fmt.Errorf("%w: %s", ErrLoadReport, why) }
	if len(data) > LoadMaxReport {
		return bad("too large")
	}
	fields := loadFields
	switch {
	case len(data) < len(loadMagic)+1:
		return bad("not a load report")
	case string(data[:len(loadMagic)]) == loadMagic:
	case string(data[:len(loadMagicV1)]) == loadMagicV1:
		fields = loadFieldsV1
	default:
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
		var vals [loadFields]uint64
		for i := range fields {
			v, k := binary.Uvarint(p)
			if k <= 0 || v > LoadMaxCount {
				return bad("bad count")
			}
			vals[i] = v
			p = p[k:]
		}
		l := EngineLoad{Prefill: int64(vals[0]), Decode: int64(vals[1]), Tokens: int64(vals[2]),
			HeadBusy: fieldAge(vals[3]), HeadEnd: fieldAge(vals[4]),
			PaceMean: time.Duration(vals[5]) * time.Microsecond, PaceTokens: int64(vals[6])}
		if l.HeadBusy > LoadMaxAge || l.HeadEnd > LoadMaxAge || l.PaceMean > LoadMaxAge {
			return bad("bad duration")
		}
		fn(eid, l)
	}
	if len(p) != 0 {
		return bad("trailing bytes")
	}
	return string(id), nil
}
