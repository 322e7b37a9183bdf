package schemas

import (
	"bytes"
	"math"
	"unicode/utf16"
	"unicode/utf8"
)

// Separators of the rendered prompt: bytes a JSON string can hold only
// escaped, so that the structure is not a question of the contents.
const (
	promptField   = 0x1f // between a message's fields
	promptMessage = 0x1e // after each message, tool list and prompt
)

// AppendPrompt appends to dst the request's prompt as prefix placement
// hashes it (behaviour.md R-PLACE-2) and returns the extended slice: the model,
// then for a completion its prompt (strings unescaped, token ids as
// written), for a chat completion its tools and then every message in
// order — role, name, content (strings and text parts unescaped, other
// parts compacted), tool calls, tool call id and any other member
// compacted. Tools come first because chat templates render them into
// the first (system) turn. The rendering is deterministic: the same
// request renders the same bytes however its JSON is spaced, its string
// escapes written, or the request's and each message's known members
// (role, name, content, tool_calls, tool_call_id) ordered; the members of
// values rendered compacted (tools, tool calls, non-text parts, other
// message members) keep the client's order, so reordering those changes
// the rendering. It is not the engine's chat template: it only has to
// make equal prefixes equal. It
// does not allocate when dst has room.
func (r *Request) AppendPrompt(dst []byte) []byte {
	return r.appendPrompt(dst, math.MaxInt)
}

// AppendPromptPrefix appends to dst the first n bytes (all of them when
// shorter) of what AppendPrompt appends, and returns the extended slice.
// It reads the request no further than those bytes need, so a prompt of
// many MiB costs no more than n (prefix placement hashes only a bounded
// head of the prompt). It does not allocate when dst has room for
// n + 16 bytes (the rendering runs a few bytes past n before the cut).
// n <= 0 appends nothing.
func (r *Request) AppendPromptPrefix(dst []byte, n int) []byte {
	if n <= 0 {
		return dst
	}
	limit := len(dst) + min(n, math.MaxInt-len(dst))
	dst = r.appendPrompt(dst, limit)
	return dst[:min(len(dst), limit)]
}

// appendPrompt is AppendPrompt stopping once dst holds limit bytes or
// more (it may hold a few more; the caller cuts).
func (r *Request) appendPrompt(dst []byte, limit int) []byte {
	dst = append(dst, r.Model...)
	dst = append(dst, promptMessage)
	if !r.Chat() {
		if raw, ok := r.Member("prompt"); ok {
			dst = appendPromptValue(dst, raw, limit)
			dst = append(dst, promptMessage)
		}
		return dst
	}
	if raw, ok := r.Member("tools"); ok && !isNull(raw) {
		dst = appendCompact(dst, raw, limit)
		dst = append(dst, promptMessage)
	}
	if raw, ok := r.Member("messages"); ok {
		for it := (elements{buf: raw}); len(dst) < limit && it.nextStart(); {
			var end int
			dst, end = appendMessageAt(dst, raw, it.start, limit)
			it.setEnd(end)
			dst = append(dst, promptMessage)
		}
	}
	return dst
}

// appendPromptValue appends a completion's prompt: a string unescaped,
// an array element by element (strings unescaped, token ids and the
// rest compacted), anything else compacted.
func appendPromptValue(dst, raw []byte, limit int) []byte {
	if len(raw) == 0 || raw[0] != '[' {
		return appendText(dst, raw, limit)
	}
	for it := (elements{buf: raw}); len(dst) < limit && it.next(); {
		dst = appendText(dst, it.value(), limit)
		dst = append(dst, promptField)
	}
	return dst
}

// messageFields are the members of a chat message AppendPrompt renders
// by name, in its order.
var messageFields = [...]string{"role", "name", "content", "tool_calls", "tool_call_id"}

// appendMessageAt appends the chat message that starts at buf[start] and
// returns the index just after it: the known fields in messageFields'
// order, then any other member as name and compacted value in the
// client's order. A message that is not an object is compacted whole. An
// object's end is where reading its members ended, so its strings are
// not scanned once more only to find it.
func appendMessageAt(dst, buf []byte, start, limit int) ([]byte, int) {
	if buf[start] != '{' {
		end := valueEnd(buf, start)
		return appendCompact(dst, buf[start:end], limit), end
	}
	var known [len(messageFields)][]byte
	others := false
	it := members{buf: buf[start:]}
	for it.next() {
		if i := messageField(it.name()); i >= 0 {
			known[i] = it.value()
		} else {
			others = true
		}
	}
	end := len(buf)
	if it.close > 0 {
		end = start + it.close + 1
	}
	msg := buf[start:end]
	for i, raw := range known {
		switch {
		case raw == nil || isNull(raw):
		case messageFields[i] == "content":
			dst = appendContent(dst, raw, limit)
		default:
			dst = appendText(dst, raw, limit)
		}
		dst = append(dst, promptField)
	}
	if !others {
		return dst, end
	}
	for it := (members{buf: msg}); len(dst) < limit && it.next(); {
		if messageField(it.name()) >= 0 {
			continue
		}
		dst = appendClipped(dst, it.name(), limit)
		dst = append(dst, ':')
		dst = appendCompact(dst, it.value(), limit)
		dst = append(dst, promptField)
	}
	return dst, end
}

// messageField returns the index in messageFields of the member name
// (as written, unescaped names only), -1 for any other.
func messageField(name []byte) int {
	for i, f := range messageFields {
		if string(name) == f {
			return i
		}
	}
	return -1
}

// appendContent appends a message's content: a string unescaped; an
// array of parts with each text part's text unescaped and every other
// part compacted.
func appendContent(dst, raw []byte, limit int) []byte {
	if raw[0] != '[' {
		return appendText(dst, raw, limit)
	}
	for it := (elements{buf: raw}); len(dst) < limit && it.next(); {
		part := it.value()
		if text, ok := textPart(part); ok {
			dst = appendText(dst, text, limit)
		} else {
			dst = appendCompact(dst, part, limit)
		}
		dst = append(dst, promptField)
	}
	return dst
}

// textPart returns the raw "text" of a {"type":"text","text":…} part.
func textPart(part []byte) ([]byte, bool) {
	if len(part) == 0 || part[0] != '{' {
		return nil, false
	}
	var typ, text []byte
	for it := (members{buf: part}); it.next(); {
		switch string(it.name()) {
		case "type":
			typ = it.value()
		case "text":
			text = it.value()
		}
	}
	return text, string(typ) == `"text"` && len(text) > 0 && text[0] == '"'
}

// appendText appends a JSON string's text unescaped, or any other value
// compacted.
func appendText(dst, raw []byte, limit int) []byte {
	if len(raw) < 2 || raw[0] != '"' {
		return appendCompact(dst, raw, limit)
	}
	return appendUnescaped(dst, raw[1:len(raw)-1], limit)
}

// appendClipped appends b, or as much of it as keeps dst within limit.
func appendClipped(dst, b []byte, limit int) []byte {
	if room := limit - len(dst); len(b) > room {
		b = b[:max(room, 0)]
	}
	return append(dst, b...)
}

// appendUnescaped appends the text of a valid JSON string's inside s:
// escapes decoded, \u escapes to UTF-8 (surrogate pairs joined, a lone
// surrogate as U+FFFD), stopping once dst holds limit bytes.
func appendUnescaped(dst, s []byte, limit int) []byte {
	for {
		if len(dst) >= limit {
			return dst
		}
		i := bytes.IndexByte(s, '\\')
		if i < 0 {
			return appendClipped(dst, s, limit)
		}
		dst = appendClipped(dst, s[:i], limit)
		if len(dst) >= limit {
			return dst
		}
		s = s[i:]
		if len(s) < 2 {
			return append(dst, s...)
		}
		switch c := s[1]; c {
		case 'b':
			dst, s = append(dst, '\b'), s[2:]
		case 'f':
			dst, s = append(dst, '\f'), s[2:]
		case 'n':
			dst, s = append(dst, '\n'), s[2:]
		case 'r':
			dst, s = append(dst, '\r'), s[2:]
		case 't':
			dst, s = append(dst, '\t'), s[2:]
		case 'u':
			r, ok := hex4(s[2:])
			if !ok {
				return append(dst, s...)
			}
			s = s[6:]
			if utf16.IsSurrogate(r) {
				r2, ok2 := rune(0), false
				if len(s) >= 6 && s[0] == '\\' && s[1] == 'u' {
					r2, ok2 = hex4(s[2:])
				}
				if d := utf16.DecodeRune(r, r2); ok2 && d != utf8.RuneError {
					r, s = d, s[6:]
				} else {
					r = utf8.RuneError
				}
			}
			dst = utf8.AppendRune(dst, r)
		default: // '"', '\\', '/'
			dst, s = append(dst, c), s[2:]
		}
	}
}

// hex4 reads four hex digits.
func hex4(s []byte) (rune, bool) {
	if len(s) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range s[:4] {
		h := chunkHex(c)
		if h < 0 {
			return 0, false
		}
		r = r<<4 | rune(h)
	}
	return r, true
}

// appendCompact appends the JSON value raw without the whitespace
// between its tokens (strings kept as written, skipped at memchr speed),
// stopping once dst holds limit bytes.
func appendCompact(dst, raw []byte, limit int) []byte {
	start := 0
	for i := 0; i < len(raw) && len(dst)+i-start < limit; i++ {
		switch c := raw[i]; {
		case c == '"':
			i = stringEnd(raw, i) - 1
		case chunkIsSpace(c):
			dst = appendClipped(dst, raw[start:i], limit)
			start = i + 1
		}
	}
	return appendClipped(dst, raw[start:], limit)
}

// The walkers below read JSON that ParseRequest has already validated
// (AppendPrompt's input): they do not validate again, they only find
// boundaries, strings at memchr speed; on malformed input they stop
// early and never read out of bounds.

// stringEnd returns the index just after the string that starts with the
// quote at buf[i] (len(buf) when it does not end).
func stringEnd(buf []byte, i int) int {
	j := i + 1
	for {
		k := bytes.IndexByte(buf[j:], '"')
		if k < 0 {
			return len(buf)
		}
		q := j + k
		n := 0
		for q-1-n >= j && buf[q-1-n] == '\\' {
			n++
		}
		if n%2 == 0 {
			return q + 1
		}
		j = q + 1
	}
}

// valueEnd returns the index just after the JSON value that starts at
// buf[i] (no leading space).
func valueEnd(buf []byte, i int) int {
	if i >= len(buf) {
		return len(buf)
	}
	switch buf[i] {
	case '"':
		return stringEnd(buf, i)
	case '{', '[':
		depth := 0
		for ; i < len(buf); i++ {
			switch buf[i] {
			case '"':
				i = stringEnd(buf, i) - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
		}
		return len(buf)
	}
	for ; i < len(buf); i++ {
		switch c := buf[i]; {
		case c == ',' || c == '}' || c == ']' || chunkIsSpace(c):
			return i
		}
	}
	return len(buf)
}

func skipSpaceAt(buf []byte, i int) int {
	for i < len(buf) && chunkIsSpace(buf[i]) {
		i++
	}
	return i
}

// elements iterates the elements of a validated JSON array.
type elements struct {
	buf        []byte
	pos        int
	start, end int
	started    bool
}

// next moves to the next element; false at the end.
func (it *elements) next() bool {
	if !it.nextStart() {
		return false
	}
	it.setEnd(valueEnd(it.buf, it.start))
	return true
}

// nextStart moves to the next element like next, but leaves finding
// its end to the caller, who reads the element from it.start and must
// call setEnd before moving on; false at the end.
func (it *elements) nextStart() bool {
	i := it.pos
	if !it.started {
		it.started = true
		i = skipSpaceAt(it.buf, 0)
		if i >= len(it.buf) || it.buf[i] != '[' {
			it.pos = len(it.buf)
			return false
		}
		i++
	} else {
		i = skipSpaceAt(it.buf, i)
		if i >= len(it.buf) || it.buf[i] != ',' {
			it.pos = len(it.buf)
			return false
		}
		i++
	}
	i = skipSpaceAt(it.buf, i)
	if i >= len(it.buf) || it.buf[i] == ']' {
		it.pos = len(it.buf)
		return false
	}
	it.start = i
	return true
}

// setEnd sets the end of the element nextStart moved to (the index just
// after it; at least its start).
func (it *elements) setEnd(end int) {
	it.end = max(end, it.start)
	it.pos = it.end
}

// value returns the current element's raw JSON.
func (it *elements) value() []byte { return it.buf[it.start:it.end] }

// members iterates the members of a validated JSON object.
type members struct {
	buf                  []byte
	pos                  int
	nameStart, nameEnd   int
	valueStart, valueEnd int
	started              bool
	// close is the index of the object's closing brace once next has
	// returned false there; 0 until then (and for an empty object).
	close int
}

// next moves to the next member; false at the end.
func (it *members) next() bool {
	buf := it.buf
	i := skipSpaceAt(buf, it.pos)
	if !it.started {
		it.started = true
		if i >= len(buf) || buf[i] != '{' {
			it.pos = len(buf)
			return false
		}
	} else if i >= len(buf) || buf[i] != ',' {
		if i < len(buf) && buf[i] == '}' {
			it.close = i
		}
		it.pos = len(buf)
		return false
	}
	i = skipSpaceAt(buf, i+1)
	if i >= len(buf) || buf[i] != '"' {
		if i < len(buf) && buf[i] == '}' {
			it.close = i
		}
		it.pos = len(buf)
		return false
	}
	end := stringEnd(buf, i)
	it.nameStart, it.nameEnd = i+1, max(i+1, end-1)
	i = skipSpaceAt(buf, end)
	if i >= len(buf) || buf[i] != ':' {
		it.pos = len(buf)
		return false
	}
	i = skipSpaceAt(buf, i+1)
	it.valueStart, it.valueEnd = i, valueEnd(buf, i)
	it.pos = it.valueEnd
	return true
}

// name returns the current member's name as written, without quotes.
func (it *members) name() []byte { return it.buf[it.nameStart:it.nameEnd] }

// value returns the current member's raw value.
func (it *members) value() []byte { return it.buf[it.valueStart:it.valueEnd] }
