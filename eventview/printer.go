package eventview

import (
	"bytes"
	"encoding/json"
	"io"
	"sort"
	"strconv"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Layout of a readable line.
const (
	// lineTimeLayout is the "at" column: UTC, milliseconds.
	lineTimeLayout = "2006-01-02T15:04:05.000Z07:00"
	// timeWidth is the width of a time in lineTimeLayout.
	timeWidth = len("2006-01-02T15:04:05.000Z")
	// kindWidth is the kind column's width, that of "eligibility"; a
	// longer kind (kv_recomputed) pushes the rest of its line right.
	kindWidth = 11
	// minIDWidth is the narrowest id column.
	minIDWidth = 2
)

// Printer writes one line per event to an io.Writer, reusing one buffer.
// It is not safe for concurrent use.
//
// A readable line is `<at> <kind> <id> <details>`, columns aligned, where
// id is the subject's last token (engine id; router id for request events)
// and the details depend on the kind:
//
//	failure      decode first_token_timeout 504 counts p1→d1 "engine first token timeout" (router rt-1, req abc)
//	request      200 /v1/chat/completions p1→d1 ttft=0.120s first_byte=0.340s attempts=1 (req abc, model m, 1.250s)
//	eligibility  ejected streak=3 "ejected after 3 failures" (breaker b1)
//	probe        success decode p1→d1 (breaker b1)
//	quarantine   5.000s first_token_timeout until 2026-11-30T05:59:19.123Z (router rt-1)
//	handoff      abandoned decode_failed released p1→d1 nixl age=0.100s (router rt-1, req abc)
//	fleet        active previous=joining "inference probe passed" (breaker b1)
//
// (chaos and kv_recomputed events have lines of their own too: every kind
// of schemas.EventKinds has one). An event of a kind the table lacks, or
// that does not decode, is shown with its raw JSON.
type Printer struct {
	w       io.Writer
	json    bool
	buf     []byte
	idWidth int
	err     error // the first write error; nothing is written after it
}

// NewPrinter returns a Printer writing to w: readable lines, or with
// asJSON each event's JSON exactly as published (compacted to one line
// when it spans several).
func NewPrinter(w io.Writer, asJSON bool) *Printer {
	return &Printer{w: w, json: asJSON}
}

// Print writes the line of the event published on subject with payload.
// It returns the write error, if any; after one, it writes nothing and
// returns that error again.
func (p *Printer) Print(subject string, payload []byte) error {
	if p.err != nil {
		return p.err
	}
	b := p.buf[:0]
	if p.json {
		b = appendJSONLine(b, payload)
	} else {
		b = p.appendReadable(b, subject, payload)
	}
	p.buf = b
	if _, err := p.w.Write(b); err != nil {
		p.err = err
		return err
	}
	return nil
}

// appendJSONLine appends payload and a newline. A payload spread over
// several lines is compacted (or, when it is not JSON, its line breaks
// become spaces) so that each event stays one line.
func appendJSONLine(b, payload []byte) []byte {
	if bytes.ContainsAny(payload, "\r\n") {
		var c bytes.Buffer
		if json.Compact(&c, payload) == nil {
			payload = c.Bytes()
		} else {
			payload = bytes.Map(func(r rune) rune {
				if r == '\r' || r == '\n' {
					return ' '
				}
				return r
			}, payload)
		}
	}
	b = append(b, payload...)
	return append(b, '\n')
}

// appendReadable appends the readable line of one event.
func (p *Printer) appendReadable(b []byte, subject string, payload []byte) []byte {
	kind, id := subjectParts(subject)
	var head schemas.Envelope
	detailed := json.Unmarshal(payload, &head) == nil
	if head.At.IsZero() {
		b = append(b, '-')
		b = pad(b, 1, timeWidth)
	} else {
		b = head.At.UTC().AppendFormat(b, lineTimeLayout)
	}
	b = append(b, ' ')
	b = append(b, kind...)
	b = pad(b, len(kind), kindWidth)
	b = append(b, ' ')
	p.idWidth = max(p.idWidth, len(id), minIDWidth)
	b = append(b, id...)
	b = pad(b, len(id), p.idWidth)
	b = append(b, ' ')
	if detailed {
		var withDetails []byte
		if withDetails, detailed = appendDetails(b, kind, payload); detailed {
			b = withDetails
		}
	}
	if !detailed {
		return appendJSONLine(b, payload)
	}
	return append(b, '\n')
}

// appendDetails appends the kind's own fields, decoding payload as the
// payload type of the kind's row of schemas.EventKinds; ok is false for a
// kind the table does not have, a payload that does not decode as its
// type, or a type that has no line here (TestEveryKindHasALine fails for
// one).
func appendDetails(b []byte, kind string, payload []byte) (_ []byte, ok bool) {
	row, known := schemas.LookupEventKind(kind)
	if !known {
		return b, false
	}
	ev := row.New()
	if json.Unmarshal(payload, ev) != nil {
		return b, false
	}
	switch e := ev.(type) {
	case *schemas.Failure:
		b = append(b, e.Phase...)
		b = append(b, ' ')
		b = append(b, e.Kind...)
		b = append(b, ' ')
		b = strconv.AppendInt(b, int64(e.Status), 10)
		if e.UpstreamStatus != 0 {
			b = append(b, " upstream="...)
			b = strconv.AppendInt(b, int64(e.UpstreamStatus), 10)
		}
		if e.Counts {
			b = append(b, " counts"...)
		} else {
			b = append(b, " uncounted"...)
		}
		b = appendEnds(b, e.ProducerID, e.ConsumerID)
		b = append(b, ' ')
		b = strconv.AppendQuote(b, e.Message)
		if e.Detail != "" {
			b = append(b, " detail="...)
			b = strconv.AppendQuote(b, e.Detail)
		}
		b = appendSource(b, e.Envelope, e.Attempt)
	case *schemas.RequestCompleted:
		b = strconv.AppendInt(b, int64(e.Status), 10)
		if e.ErrorKind != "" {
			b = append(b, ' ')
			b = append(b, e.ErrorKind...)
		}
		b = append(b, ' ')
		b = append(b, e.Endpoint...)
		b = appendEnds(b, e.ProducerID, e.ConsumerID)
		b = append(b, " ttft="...)
		b = appendOptSeconds(b, e.TTFTSeconds)
		b = append(b, " first_byte="...)
		b = appendOptSeconds(b, e.FirstByteSeconds)
		b = append(b, " attempts="...)
		b = strconv.AppendInt(b, int64(e.Attempts), 10)
		b = append(b, " (req "...)
		b = append(b, e.RequestID...)
		if e.Model != "" {
			b = append(b, ", model "...)
			b = append(b, e.Model...)
		}
		b = append(b, ", "...)
		b = appendSeconds(b, e.DurationSeconds)
		b = append(b, ')')
	case *schemas.Eligibility:
		state := e.State
		if state == "" {
			state = "ejected"
			if e.Eligible {
				state = "eligible"
			}
		}
		b = append(b, state...)
		b = append(b, " streak="...)
		b = strconv.AppendInt(b, int64(e.Streak), 10)
		if e.Reason != "" {
			b = append(b, ' ')
			b = strconv.AppendQuote(b, e.Reason)
		}
		b = appendSource(b, e.Envelope, 0)
	case *schemas.Probe:
		b = append(b, e.Outcome...)
		b = append(b, ' ')
		b = append(b, e.Phase...)
		b = appendEnds(b, e.ProducerID, e.ConsumerID)
		if e.Message != "" {
			b = append(b, ' ')
			b = strconv.AppendQuote(b, e.Message)
		}
		b = appendSource(b, e.Envelope, 0)
	case *schemas.KVRecomputed:
		b = append(b, e.Connector...)
		b = appendEnds(b, e.ProducerID, e.EngineID)
		b = append(b, " cached="...)
		b = strconv.AppendInt(b, int64(e.CachedTokens), 10)
		b = append(b, '/')
		b = strconv.AppendInt(b, int64(e.PromptTokens), 10)
		if e.Counts {
			b = append(b, " counts"...)
		}
		b = appendSource(b, e.Envelope, 0)
	case *schemas.Chaos:
		b = append(b, e.Action...)
		b = append(b, ' ')
		b = append(b, e.Fault...)
		b = append(b, ' ')
		b = append(b, e.Phase...)
		if len(e.Params) > 0 {
			keys := make([]string, 0, len(e.Params))
			for k := range e.Params {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				b = append(b, ' ')
				b = append(b, k...)
				b = append(b, '=')
				b = append(b, e.Params[k]...)
			}
		}
		if e.Count > 0 {
			b = append(b, " left="...)
			b = strconv.AppendInt(b, int64(e.Left), 10)
		}
		b = appendSource(b, e.Envelope, 0)
	case *schemas.Quarantine:
		b = appendSeconds(b, e.DurationSeconds)
		b = append(b, ' ')
		b = append(b, e.Reason...)
		if !e.Until.IsZero() {
			b = append(b, " until "...)
			b = e.Until.UTC().AppendFormat(b, lineTimeLayout)
		}
		b = appendSource(b, e.Envelope, 0)
	case *schemas.Handoff:
		b = append(b, e.Outcome...)
		b = append(b, ' ')
		b = append(b, e.Reason...)
		if e.Released {
			b = append(b, " released"...)
		} else {
			b = append(b, " not-released"...)
		}
		b = appendEnds(b, e.EngineID, e.ConsumerID)
		if e.Connector != "" {
			b = append(b, ' ')
			b = append(b, e.Connector...)
		}
		b = append(b, " age="...)
		b = appendSeconds(b, e.AgeSeconds)
		b = appendSource(b, e.Envelope, 0)
	case *schemas.Admission:
		b = appendStateChange(b, e.State, e.Previous, e.Reason)
		b = appendSource(b, e.Envelope, 0)
	case *schemas.FleetChange:
		b = appendStateChange(b, e.State, e.Previous, e.Reason)
		b = appendSource(b, e.Envelope, 0)
	default:
		return b, false
	}
	return b, true
}

// appendEnds appends " producer→consumer" when either is known.
func appendEnds(b []byte, producer, consumer string) []byte {
	if producer == "" && consumer == "" {
		return b
	}
	b = append(b, ' ')
	b = append(b, producer...)
	b = append(b, "→"...)
	return append(b, consumer...)
}

// appendSource appends " (router R, req X, attempt N)" or
// " (breaker B)": who published the event and for which request; attempt
// only when it is a retry (N > 1).
func appendSource(b []byte, h schemas.Envelope, attempt int) []byte {
	b = append(b, " ("...)
	n := len(b)
	if h.RouterID != "" {
		b = append(b, "router "...)
		b = append(b, h.RouterID...)
	}
	if h.BreakerID != "" {
		b = appendSep(b, n)
		b = append(b, "breaker "...)
		b = append(b, h.BreakerID...)
	}
	if h.RequestID != "" {
		b = appendSep(b, n)
		b = append(b, "req "...)
		b = append(b, h.RequestID...)
	}
	if attempt > 1 {
		b = appendSep(b, n)
		b = append(b, "attempt "...)
		b = strconv.AppendInt(b, int64(attempt), 10)
	}
	if len(b) == n {
		return b[:n-2] // nothing to say
	}
	return append(b, ')')
}

// appendSep appends ", " unless b has nothing after position start.
func appendSep(b []byte, start int) []byte {
	if len(b) > start {
		b = append(b, ", "...)
	}
	return b
}

// appendSeconds appends s seconds as "1.250s".
func appendSeconds(b []byte, s float64) []byte {
	b = strconv.AppendFloat(b, s, 'f', 3, 64)
	return append(b, 's')
}

// appendOptSeconds appends *s as appendSeconds does, or "-" for nil.
func appendOptSeconds(b []byte, s *float64) []byte {
	if s == nil {
		return append(b, '-')
	}
	return appendSeconds(b, *s)
}

// pad appends spaces to bring a column of n bytes to width.
func pad(b []byte, n, width int) []byte {
	for ; n < width; n++ {
		b = append(b, ' ')
	}
	return b
}

// appendStateChange appends a fleet or admission event's state, its
// previous state (" previous=<state>", when known) and its quoted reason
// (when given).
func appendStateChange(b []byte, state, previous, reason string) []byte {
	b = append(b, state...)
	if previous != "" {
		b = append(b, " previous="...)
		b = append(b, previous...)
	}
	if reason != "" {
		b = append(b, ' ')
		b = strconv.AppendQuote(b, reason)
	}
	return b
}
