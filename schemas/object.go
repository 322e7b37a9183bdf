package schemas

import (
	"bytes"
	"encoding/json"
)

// objectIter walks the members of one JSON object with the
// allocation-free validating walker of ClassifyChunk.
type objectIter struct {
	w       chunkWalker
	started bool
	end     bool // the closing brace was read
	bad     bool
}

// next returns the next member's name (unescaped when it holds escapes:
// that rare case allocates), its name as written (quoted) and its raw
// value. ok is false at the end of the object or on invalid JSON (then
// it.bad is set).
func (it *objectIter) next() (name, nameRaw, raw []byte, ok bool) {
	w := &it.w
	if it.bad || it.end {
		return nil, nil, nil, false
	}
	if !it.started {
		it.started = true
		w.skipSpace()
		if w.peek() != '{' {
			it.bad = true
			return nil, nil, nil, false
		}
		empty, ok := w.openObject()
		if !ok {
			it.bad = true
			return nil, nil, nil, false
		}
		if empty {
			it.end = true
			return nil, nil, nil, false
		}
	}
	keyStart := w.pos
	ok, escaped := w.skipString()
	if !ok {
		it.bad = true
		return nil, nil, nil, false
	}
	nameRaw = w.buf[keyStart:w.pos]
	name = nameRaw[1 : len(nameRaw)-1]
	if escaped {
		var k string
		if json.Unmarshal(nameRaw, &k) != nil {
			it.bad = true
			return nil, nil, nil, false
		}
		name = []byte(k)
	}
	w.skipSpace()
	if w.peek() != ':' {
		it.bad = true
		return nil, nil, nil, false
	}
	w.pos++
	w.skipSpace()
	valStart := w.pos
	if !w.skipValue(1) {
		it.bad = true
		return nil, nil, nil, false
	}
	raw = w.buf[valStart:w.pos]
	more, ok := w.nextMember('}')
	if !ok {
		it.bad = true
		return nil, nil, nil, false
	}
	if !more {
		it.end = true
	}
	return name, nameRaw, raw, true
}

// valid drains the iterator and reports whether the whole input was one
// valid JSON object.
func (it *objectIter) valid() bool {
	for {
		if _, _, _, ok := it.next(); !ok {
			break
		}
	}
	if it.bad {
		return false
	}
	it.w.skipSpace()
	return it.w.pos == len(it.w.buf)
}

// Members calls fn with the name and raw value of each member of the JSON
// object obj, in order, until fn returns false. Names are unescaped when
// they hold escapes (that rare case allocates); values are sub-slices of
// obj. It reports false when obj is not exactly one valid JSON object (fn
// may have been called for the members before the fault).
func Members(obj []byte, fn func(name, raw []byte) bool) bool {
	it := objectIter{w: chunkWalker{buf: obj}}
	for {
		name, _, raw, ok := it.next()
		if !ok {
			break
		}
		if !fn(name, raw) {
			break
		}
	}
	return it.valid()
}

// Elements calls fn with the raw value of each element of the JSON array
// arr, in order, until fn returns false. It reports false when arr is not
// exactly one valid JSON array. It does not allocate.
func Elements(arr []byte, fn func(raw []byte) bool) bool {
	w := chunkWalker{buf: arr}
	w.skipSpace()
	if w.peek() != '[' {
		return false
	}
	w.pos++
	w.skipSpace()
	stopped := false
	if w.peek() == ']' {
		w.pos++
	} else {
		for {
			w.skipSpace()
			start := w.pos
			if !w.skipValue(1) {
				return false
			}
			if !stopped && !fn(arr[start:w.pos]) {
				stopped = true
			}
			more, ok := w.nextMember(']')
			if !ok {
				return false
			}
			if !more {
				break
			}
		}
	}
	w.skipSpace()
	return w.pos == len(arr)
}

// Member returns the raw value of the last member of obj named name (as
// encoding/json would decode it), whether it was found, and whether obj is
// a valid JSON object at all. It does not allocate.
func Member(obj []byte, name string) (raw []byte, found, ok bool) {
	it := objectIter{w: chunkWalker{buf: obj}}
	for {
		n, _, r, more := it.next()
		if !more {
			break
		}
		if string(n) == name {
			raw, found = r, true
		}
	}
	if !it.valid() {
		return nil, false, false
	}
	return raw, found, true
}

// UsageTokens reads "usage":{"prompt_tokens","completion_tokens"} of a
// completion or chunk without allocating; ok is false when there is no
// usage object.
func UsageTokens(payload []byte) (prompt, completion int, ok bool) {
	usage, found, valid := Member(payload, "usage")
	if !valid || !found || len(usage) == 0 || usage[0] != '{' {
		return 0, 0, false
	}
	it := objectIter{w: chunkWalker{buf: usage}}
	for {
		n, _, r, more := it.next()
		if !more {
			break
		}
		switch string(n) {
		case "prompt_tokens":
			prompt, _ = nonNegativeInt(r)
		case "completion_tokens":
			completion, _ = nonNegativeInt(r)
		}
	}
	return prompt, completion, true
}

// nonNegativeInt parses a JSON integer literal ≥ 0.
func nonNegativeInt(raw []byte) (int, bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || len(raw) > 18 {
		return 0, false
	}
	n := 0
	for _, c := range raw {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}
