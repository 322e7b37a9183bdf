package schemas

import "encoding/binary"

// ChunkKind is what one SSE data payload of a decode stream holds, in the
// terms of behaviour.md §0 (generated output, metadata chunk). The router uses it to
// stop the first-token timer (R-TMO-1), to recognise a valid end of stream
// (R-FAIL-2, R-FAIL-3) and to find error frames inside an HTTP 200 stream
// (R-FAIL-4).
type ChunkKind uint8

const (
	// ChunkMetadata is a valid JSON payload that carries no generated
	// output: the role-only first chat chunk, empty deltas, the usage-only
	// chunk ("choices": []), and any valid JSON that is not an object.
	ChunkMetadata ChunkKind = iota
	// ChunkOutput is generated output (behaviour.md §0): at least one choice has a
	// non-empty string delta.content, delta.reasoning_content,
	// delta.reasoning or text, a non-empty delta.tool_calls array, a
	// logprobs member that is present and not null, or a finish_reason that
	// is present and not null (an immediate stop is output).
	ChunkOutput
	// ChunkDone is the end-of-stream marker: the payload is exactly
	// "[DONE]", optionally surrounded by JSON whitespace.
	ChunkDone
	// ChunkError is an error frame (R-FAIL-4): a JSON object whose
	// top-level "error" member is an object, or the older flat shape whose
	// top-level "object" member is the string "error". It takes precedence
	// over output in the same payload.
	ChunkError
	// ChunkInvalid is a payload that is not valid JSON (RFC 8259, as
	// encoding/json's Valid accepts it, nesting depth at most 10000) and
	// not [DONE]. An empty payload is invalid.
	ChunkInvalid
)

// String returns the lower-case name of k ("metadata", "output", "done",
// "error", "invalid"), or "unknown" for a value outside the enumeration.
func (k ChunkKind) String() string {
	switch k {
	case ChunkMetadata:
		return "metadata"
	case ChunkOutput:
		return "output"
	case ChunkDone:
		return "done"
	case ChunkError:
		return "error"
	case ChunkInvalid:
		return "invalid"
	}
	return "unknown"
}

// Chunk is what one scan of a decode stream's SSE data payload learns
// (ScanChunk): its kind and, for the relay, its usage (R-LEG-5, R-LEG-6).
type Chunk struct {
	// Kind is what the payload holds, as ClassifyChunk reports it.
	Kind ChunkKind
	// Usage reports a top-level "usage" member (the last one, if
	// repeated) that is an object, as ChunkHasUsage does.
	Usage bool
	// UsageOnly reports the include_usage chunk: top-level "choices" is
	// [] and "usage" is an object, as IsUsageOnly does.
	UsageOnly bool
	// PromptTokens and CompletionTokens are usage.prompt_tokens and
	// usage.completion_tokens when Usage is true (0 when absent or not a
	// non-negative integer), as UsageTokens reads them.
	PromptTokens, CompletionTokens int
	// Cached reports that the usage object holds
	// prompt_tokens_details.cached_tokens as a non-negative integer (vLLM
	// with prompt-token details on, SGLang); CachedTokens is its value
	// (R-FAIL-8).
	Cached       bool
	CachedTokens int
}

// ScanChunk reads payload once and reports everything ClassifyChunk,
// ChunkHasUsage, IsUsageOnly and UsageTokens would: a relay needs one pass
// per chunk, not four. The usage fields are zero unless Kind is
// ChunkMetadata or ChunkOutput. It does not allocate, never panics and runs
// in time linear in len(payload).
func ScanChunk(payload []byte) Chunk {
	if chunkIsDone(payload) {
		return Chunk{Kind: ChunkDone}
	}
	f, ok := scanChunk(payload)
	switch {
	case !ok:
		return Chunk{Kind: ChunkInvalid}
	case f.errorObject || f.flatError:
		return Chunk{Kind: ChunkError}
	}
	c := Chunk{Kind: ChunkMetadata, Usage: f.usageObject, UsageOnly: f.choicesEmpty && f.usageObject}
	if f.output {
		c.Kind = ChunkOutput
	}
	if f.usageObject {
		c.PromptTokens, c.CompletionTokens = f.promptTokens, f.completionTokens
		c.Cached, c.CachedTokens = f.cachedKnown, f.cachedTokens
	}
	return c
}

// ClassifyChunk reports what the SSE data payload of a decode stream holds
// (behaviour.md §0; R-FAIL-2/3/4, R-TMO-1/2). It validates the whole payload as JSON
// and reads the members it needs on the real JSON structure: keys are
// compared after unescaping, in any order, and when a key is repeated in an
// object the last occurrence counts (as encoding/json does). Precedence:
// ChunkDone, ChunkInvalid, ChunkError, ChunkOutput, ChunkMetadata.
//
// It does not allocate, never panics and runs in time linear in
// len(payload).
func ClassifyChunk(payload []byte) ChunkKind { return ScanChunk(payload).Kind }

// ChunkHasUsage reports whether payload is a valid JSON object whose
// top-level "usage" member (the last one, if repeated) is an object, as in
// the decode engine's include_usage chunk or in chunks sent with continuous
// usage statistics (R-LEG-6). It does not allocate.
func ChunkHasUsage(payload []byte) bool {
	f, ok := scanChunk(payload)
	return ok && f.usageObject
}

// IsUsageOnly reports whether payload is the include_usage chunk: a valid
// JSON object whose top-level "choices" member is an empty array and whose
// top-level "usage" member is an object (R-LEG-5, R-LEG-6). The router uses
// it to drop that chunk when the client did not ask for usage. It does not
// allocate.
func IsUsageOnly(payload []byte) bool {
	f, ok := scanChunk(payload)
	return ok && f.choicesEmpty && f.usageObject
}

// SSEData returns the payload of one SSE "data:" line: the bytes after
// "data:" and one optional leading space, without a trailing "\n", "\r\n"
// or "\r". ok is false for every other line: comments (starting with ':'),
// "event:", "id:", "retry:", blank lines, and a bare "data" without colon.
// A line "data:" with nothing after it gives an empty payload and ok=true.
// payload aliases line; SSEData does not allocate.
func SSEData(line []byte) (payload []byte, ok bool) {
	n := len(line)
	if n > 0 && line[n-1] == '\n' {
		n--
	}
	if n > 0 && line[n-1] == '\r' {
		n--
	}
	if n < 5 || string(line[:5]) != "data:" {
		return nil, false
	}
	payload = line[5:n]
	if len(payload) > 0 && payload[0] == ' ' {
		payload = payload[1:]
	}
	return payload, true
}

// chunkIsDone reports whether payload is [DONE] with optional JSON
// whitespace around it.
func chunkIsDone(payload []byte) bool {
	i, j := 0, len(payload)
	for i < j && chunkIsSpace(payload[i]) {
		i++
	}
	for j > i && chunkIsSpace(payload[j-1]) {
		j--
	}
	return string(payload[i:j]) == "[DONE]"
}

// chunkMaxDepth is the deepest nesting of objects and arrays accepted, the
// same limit as encoding/json's scanner.
const chunkMaxDepth = 10000

// chunkFacts is what one walk of a payload learns. Each field follows the
// last occurrence of its key.
type chunkFacts struct {
	errorObject  bool // top-level "error" is an object
	flatError    bool // top-level "object" is the string "error"
	output       bool // top-level "choices" holds a choice with generated output
	choicesEmpty bool // top-level "choices" is []
	usageObject  bool // top-level "usage" is an object
	// promptTokens and completionTokens are the last "usage" object's
	// prompt_tokens and completion_tokens (0 when absent or invalid).
	promptTokens, completionTokens int
	// cachedTokens is its prompt_tokens_details.cached_tokens, when
	// cachedKnown.
	cachedTokens int
	cachedKnown  bool
}

// chunkWalker is an allocation-free validating JSON reader over buf.
type chunkWalker struct {
	buf     []byte
	pos     int
	scratch [24]byte // an unescaped member name
}

// scanChunk validates payload as one JSON value and, when it is an object,
// collects the facts ClassifyChunk, ChunkHasUsage and IsUsageOnly need. ok
// is false when payload is not valid JSON.
func scanChunk(payload []byte) (f chunkFacts, ok bool) {
	w := chunkWalker{buf: payload}
	w.skipSpace()
	if w.peek() == '{' {
		ok = w.walkTop(&f)
	} else {
		ok = w.skipValue(0)
	}
	if !ok {
		return chunkFacts{}, false
	}
	w.skipSpace()
	if w.pos != len(w.buf) {
		return chunkFacts{}, false
	}
	return f, true
}

func chunkIsSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r'
}

func (w *chunkWalker) skipSpace() {
	for w.pos < len(w.buf) {
		if c := w.buf[w.pos]; c > ' ' || !chunkIsSpace(c) {
			return
		}
		w.pos++
	}
}

// peek returns the byte at the read position, or 0 at the end.
func (w *chunkWalker) peek() byte {
	if w.pos < len(w.buf) {
		return w.buf[w.pos]
	}
	return 0
}

// walkTop reads the top-level object at w.pos (depth 1).
func (w *chunkWalker) walkTop(f *chunkFacts) bool {
	empty, ok := w.openObject()
	if !ok || empty {
		return ok
	}
	for {
		name, ok := w.memberName()
		if !ok {
			return false
		}
		start := w.pos
		switch string(name) {
		case "choices":
			if w.peek() == '[' {
				if f.output, f.choicesEmpty, ok = w.walkChoices(); !ok {
					return false
				}
			} else {
				if !w.skipValue(1) {
					return false
				}
				f.output, f.choicesEmpty = false, false
			}
		case "error":
			if !w.skipValue(1) {
				return false
			}
			f.errorObject = w.buf[start] == '{'
		case "object":
			if w.peek() != '"' {
				if !w.skipValue(1) {
					return false
				}
				f.flatError = false
				break
			}
			ok, escaped := w.skipString()
			if !ok {
				return false
			}
			f.flatError = chunkStringIs(w.buf[start:w.pos], escaped, "error")
		case "usage":
			f.promptTokens, f.completionTokens, f.cachedTokens, f.cachedKnown = 0, 0, 0, false
			if w.peek() == '{' {
				if !w.walkUsage(f) {
					return false
				}
				f.usageObject = true
			} else {
				if !w.skipValue(1) {
					return false
				}
				f.usageObject = false
			}
		default:
			if !w.skipValue(1) {
				return false
			}
		}
		more, ok := w.nextMember('}')
		if !ok || !more {
			return ok
		}
	}
}

// walkUsage reads the top-level "usage" object at w.pos (depth 2) into f:
// its prompt_tokens and completion_tokens (the last occurrence of each; 0
// when absent or not a non-negative integer) and
// prompt_tokens_details.cached_tokens.
func (w *chunkWalker) walkUsage(f *chunkFacts) bool {
	empty, ok := w.openObject()
	if !ok || empty {
		return ok
	}
	for {
		name, ok := w.memberName()
		if !ok {
			return false
		}
		start := w.pos
		if !w.skipValue(2) {
			return false
		}
		switch string(name) {
		case "prompt_tokens":
			f.promptTokens, _ = nonNegativeInt(w.buf[start:w.pos])
		case "completion_tokens":
			f.completionTokens, _ = nonNegativeInt(w.buf[start:w.pos])
		case "prompt_tokens_details":
			// Already validated by skipValue: read it again on its own.
			f.cachedTokens, f.cachedKnown = 0, false
			if w.buf[start] == '{' {
				d := chunkWalker{buf: w.buf[start:w.pos]}
				f.cachedTokens, f.cachedKnown = d.walkDetails()
			}
		}
		more, ok := w.nextMember('}')
		if !ok {
			return false
		}
		if !more {
			return true
		}
	}
}

// walkDetails reads a valid usage.prompt_tokens_details object from the
// start of w.buf and returns its cached_tokens (the last occurrence) when
// it is a non-negative integer.
func (w *chunkWalker) walkDetails() (cached int, known bool) {
	empty, ok := w.openObject()
	if !ok || empty {
		return 0, false
	}
	for {
		name, ok := w.memberName()
		if !ok {
			return 0, false
		}
		start := w.pos
		if !w.skipValue(3) {
			return 0, false
		}
		if string(name) == "cached_tokens" {
			cached, known = nonNegativeInt(w.buf[start:w.pos])
		}
		more, ok := w.nextMember('}')
		if !ok || !more {
			return cached, known
		}
	}
}

// walkChoices reads the top-level "choices" array at w.pos (depth 2).
// output reports a choice with generated output; empty reports [].
func (w *chunkWalker) walkChoices() (output, empty, ok bool) {
	w.pos++ // '['
	w.skipSpace()
	if w.peek() == ']' {
		w.pos++
		return false, true, true
	}
	for {
		if w.peek() == '{' {
			out, ok := w.walkChoice()
			if !ok {
				return false, false, false
			}
			output = output || out
		} else if !w.skipValue(2) {
			return false, false, false
		}
		more, ok := w.nextMember(']')
		if !ok {
			return false, false, false
		}
		if !more {
			return output, false, true
		}
	}
}

// walkChoice reads one choice object at w.pos (depth 3) and reports whether
// it carries generated output.
func (w *chunkWalker) walkChoice() (output, ok bool) {
	empty, ok := w.openObject()
	if !ok || empty {
		return false, ok
	}
	var delta, text, logprobs, finish bool
	for {
		name, ok := w.memberName()
		if !ok {
			return false, false
		}
		start := w.pos
		switch string(name) {
		case "delta":
			if w.peek() == '{' {
				if delta, ok = w.walkDelta(); !ok {
					return false, false
				}
			} else {
				if !w.skipValue(3) {
					return false, false
				}
				delta = false
			}
		case "text":
			if !w.skipValue(3) {
				return false, false
			}
			text = chunkNonEmptyString(w.buf[start:w.pos])
		case "logprobs":
			if !w.skipValue(3) {
				return false, false
			}
			logprobs = w.buf[start] != 'n'
		case "finish_reason":
			if !w.skipValue(3) {
				return false, false
			}
			finish = w.buf[start] != 'n'
		default:
			if !w.skipValue(3) {
				return false, false
			}
		}
		more, ok := w.nextMember('}')
		if !ok {
			return false, false
		}
		if !more {
			return delta || text || logprobs || finish, true
		}
	}
}

// walkDelta reads a chat delta object at w.pos (depth 4) and reports
// whether it carries generated output.
func (w *chunkWalker) walkDelta() (output, ok bool) {
	empty, ok := w.openObject()
	if !ok || empty {
		return false, ok
	}
	var content, reasoningContent, reasoning, toolCalls bool
	for {
		name, ok := w.memberName()
		if !ok {
			return false, false
		}
		start := w.pos
		if !w.skipValue(4) {
			return false, false
		}
		raw := w.buf[start:w.pos]
		switch string(name) {
		case "content":
			content = chunkNonEmptyString(raw)
		case "reasoning_content":
			reasoningContent = chunkNonEmptyString(raw)
		case "reasoning":
			reasoning = chunkNonEmptyString(raw)
		case "tool_calls":
			toolCalls = chunkNonEmptyArray(raw)
		}
		more, ok := w.nextMember('}')
		if !ok {
			return false, false
		}
		if !more {
			return content || reasoningContent || reasoning || toolCalls, true
		}
	}
}

// openObject consumes '{' at w.pos and, when the object is empty, its '}'.
func (w *chunkWalker) openObject() (empty, ok bool) {
	w.pos++ // '{'
	w.skipSpace()
	switch w.peek() {
	case '}':
		w.pos++
		return true, true
	case '"':
		return false, true
	}
	return false, false
}

// memberName reads `"name" :` at w.pos and leaves w.pos at the value.
// name is the member name, unescaped when it holds escapes; an escaped name
// that does not decode to short ASCII, and so is none of the names the
// walker looks for, comes back empty. name is valid until the next call.
func (w *chunkWalker) memberName() (name []byte, ok bool) {
	start := w.pos
	if w.peek() != '"' {
		return nil, false
	}
	ok, escaped := w.skipString()
	if !ok {
		return nil, false
	}
	name = w.buf[start+1 : w.pos-1]
	if escaped {
		if name, ok = chunkUnescapeASCII(w.scratch[:0], name); !ok {
			name = nil
		}
	}
	w.skipSpace()
	if w.peek() != ':' {
		return nil, false
	}
	w.pos++
	w.skipSpace()
	return name, true
}

// nextMember reads the ',' or closing byte after a member or element. more
// is true after ',' (and w.pos is then at the next key or element).
func (w *chunkWalker) nextMember(closing byte) (more, ok bool) {
	w.skipSpace()
	switch w.peek() {
	case ',':
		w.pos++
		w.skipSpace()
		return true, closing == ']' || w.peek() == '"'
	case closing:
		w.pos++
		return false, true
	}
	return false, false
}

// skipValue validates and skips one JSON value after optional whitespace;
// depth counts the objects and arrays that enclose it.
func (w *chunkWalker) skipValue(depth int) bool {
	w.skipSpace()
	switch c := w.peek(); c {
	case '{', '[':
		return w.skipContainer(depth)
	default:
		return w.skipScalar()
	}
}

// skipContainer validates and skips the object or array at w.pos; depth
// counts the containers that enclose it. Up to 64 nested levels are tracked
// in one word; deeper levels recurse, once per 64 levels.
func (w *chunkWalker) skipContainer(depth int) bool {
	var (
		arrays  uint64 // bit i: open level i is an array
		level   int    // open levels in this call
		isArray bool
		c       byte
	)
open:
	// w.buf[w.pos] is '{' or '['; opening it makes depth+level+1 levels.
	if depth+level >= chunkMaxDepth {
		return false
	}
	isArray = w.buf[w.pos] == '['
	if isArray {
		arrays |= 1 << level
	} else {
		arrays &^= 1 << level
	}
	level++
	w.pos++
	w.skipSpace()
	c = w.peek()
	if (isArray && c == ']') || (!isArray && c == '}') {
		w.pos++
		level--
		goto after
	}
	if !isArray && !w.containerKey() {
		return false
	}
value:
	// w.pos is at the first byte of a value.
	c = w.peek()
	if c == '{' || c == '[' {
		if level < 64 {
			goto open
		}
		if !w.skipContainer(depth + level) {
			return false
		}
	} else if !w.skipScalar() {
		return false
	}
after:
	if level == 0 {
		return true
	}
	w.skipSpace()
	c = w.peek()
	isArray = arrays&(1<<(level-1)) != 0
	switch {
	case c == ',':
		w.pos++
		w.skipSpace()
		if !isArray && !w.containerKey() {
			return false
		}
		goto value
	case (isArray && c == ']') || (!isArray && c == '}'):
		w.pos++
		level--
		goto after
	}
	return false
}

// containerKey skips `"name" :` and the whitespace after it.
func (w *chunkWalker) containerKey() bool {
	if w.peek() != '"' {
		return false
	}
	if ok, _ := w.skipString(); !ok {
		return false
	}
	w.skipSpace()
	if w.peek() != ':' {
		return false
	}
	w.pos++
	w.skipSpace()
	return true
}

// skipScalar validates and skips a string, number, true, false or null.
func (w *chunkWalker) skipScalar() bool {
	switch c := w.peek(); {
	case c == '"':
		ok, _ := w.skipString()
		return ok
	case c == '-' || (c >= '0' && c <= '9'):
		return w.skipNumber()
	case c == 't':
		return w.skipLiteral("true")
	case c == 'f':
		return w.skipLiteral("false")
	case c == 'n':
		return w.skipLiteral("null")
	}
	return false
}

func (w *chunkWalker) skipLiteral(lit string) bool {
	end := w.pos + len(lit)
	if end > len(w.buf) || string(w.buf[w.pos:end]) != lit {
		return false
	}
	w.pos = end
	return true
}

// chunkPlain marks the bytes a string holds without ending or escaping:
// everything but '"', '\\' and control bytes.
var chunkPlain = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// chunkSpecial8 reports whether any of the 8 bytes in x is '"', '\\' or
// a control byte (below 0x20). It may report true for a word whose special
// byte is only a borrow artefact above a real one, never false for a word
// that holds one.
func chunkSpecial8(x uint64) bool {
	const (
		ones  = 0x0101010101010101
		highs = 0x8080808080808080
	)
	q := x ^ (ones * '"')
	b := x ^ (ones * '\\')
	return ((x-ones*0x20)|(q-ones)|(b-ones))&^x&highs != 0
}

// skipString validates and skips the string at w.pos: no raw control
// bytes, only the escapes JSON defines. Bytes ≥ 0x80 are not checked for
// UTF-8 validity, as in encoding/json. escaped reports a backslash.
func (w *chunkWalker) skipString() (ok, escaped bool) {
	buf := w.buf
	i := w.pos + 1
	for {
		for i+8 <= len(buf) && !chunkSpecial8(binary.LittleEndian.Uint64(buf[i:])) {
			i += 8
		}
		for i < len(buf) && chunkPlain[buf[i]] {
			i++
		}
		if i >= len(buf) {
			return false, false
		}
		switch buf[i] {
		case '"':
			w.pos = i + 1
			return true, escaped
		case '\\':
			escaped = true
			if i+1 >= len(buf) {
				return false, false
			}
			switch buf[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(buf) {
					return false, false
				}
				for _, h := range buf[i+2 : i+6] {
					if chunkHex(h) < 0 {
						return false, false
					}
				}
				i += 6
			default:
				return false, false
			}
		default: // a control byte
			return false, false
		}
	}
}

// skipNumber validates and skips -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
// of any length.
func (w *chunkWalker) skipNumber() bool {
	buf := w.buf
	i := w.pos
	if i < len(buf) && buf[i] == '-' {
		i++
	}
	switch {
	case i < len(buf) && buf[i] == '0':
		i++
	case i < len(buf) && buf[i] >= '1' && buf[i] <= '9':
		i = chunkDigits(buf, i+1)
	default:
		return false
	}
	if i < len(buf) && buf[i] == '.' {
		j := chunkDigits(buf, i+1)
		if j == i+1 {
			return false
		}
		i = j
	}
	if i < len(buf) && (buf[i] == 'e' || buf[i] == 'E') {
		i++
		if i < len(buf) && (buf[i] == '+' || buf[i] == '-') {
			i++
		}
		j := chunkDigits(buf, i)
		if j == i {
			return false
		}
		i = j
	}
	w.pos = i
	return true
}

// chunkDigits returns the index of the first non-digit at or after i.
func chunkDigits(buf []byte, i int) int {
	for i < len(buf) && buf[i] >= '0' && buf[i] <= '9' {
		i++
	}
	return i
}

// chunkHex returns the value of a hex digit, or -1.
func chunkHex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// chunkNonEmptyString reports whether raw (a validated JSON value) is a
// string of length > 0. Every escape decodes to at least one character, so
// any token longer than `""` is non-empty.
func chunkNonEmptyString(raw []byte) bool {
	return len(raw) > 2 && raw[0] == '"'
}

// chunkNonEmptyArray reports whether raw (a validated JSON value) is an
// array with at least one element.
func chunkNonEmptyArray(raw []byte) bool {
	if len(raw) == 0 || raw[0] != '[' {
		return false
	}
	for _, c := range raw[1:] {
		if !chunkIsSpace(c) {
			return c != ']'
		}
	}
	return false
}

// chunkStringIs reports whether the validated string token raw (with
// quotes; escaped when it holds a backslash) decodes to the ASCII lit.
func chunkStringIs(raw []byte, escaped bool, lit string) bool {
	s := raw[1 : len(raw)-1]
	if escaped {
		var scratch [24]byte
		var ok bool
		if s, ok = chunkUnescapeASCII(scratch[:0], s); !ok {
			return false
		}
	}
	return string(s) == lit
}

// chunkUnescapeASCII decodes s, the inside of a validated string token,
// into dst, appending within dst's capacity only. It reports false when the
// text holds a non-ASCII character or does not fit: every name it is
// compared with is short ASCII.
func chunkUnescapeASCII(dst, s []byte) ([]byte, bool) {
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x80 {
			return nil, false
		}
		if c == '\\' {
			switch s[i+1] {
			case 'b':
				c = '\b'
			case 'f':
				c = '\f'
			case 'n':
				c = '\n'
			case 'r':
				c = '\r'
			case 't':
				c = '\t'
			case 'u':
				r := chunkHex(s[i+2])<<12 | chunkHex(s[i+3])<<8 | chunkHex(s[i+4])<<4 | chunkHex(s[i+5])
				if r >= 0x80 { // includes surrogates
					return nil, false
				}
				c = byte(r)
				i += 4
			default: // '"', '\\', '/'
				c = s[i+1]
			}
			i += 2
		} else {
			i++
		}
		if len(dst) == cap(dst) {
			return nil, false
		}
		dst = append(dst, c)
	}
	return dst, true
}
