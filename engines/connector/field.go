package connector

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"unicode/utf8"
)

// ValueExcerptBytes bounds the excerpt of a descriptor value a rejection
// reports (RejectError.Excerpt): at most this many bytes of the value,
// before escaping (behaviour.md R-FAIL-10).
const ValueExcerptBytes = 64

// Members is implemented by a connector whose handoff fields have members
// of their own that travel with them (nixl: the members of
// kv_transfer_params, written by the router on the prefill leg and
// forwarded from the producer's descriptor on the decode leg).
type Members interface {
	// HandoffMembers returns the JSON paths of those members below the
	// connector's Fields, e.g. "kv_transfer_params.remote_block_ids".
	HandoffMembers() []string
}

// HandoffPaths returns the JSON paths of every body member c writes for a
// handoff: its Fields and, when it implements Members, their members. A
// consumer's error naming one of them refuses the handoff itself
// (behaviour.md R-FAIL-10, NamedField).
func HandoffPaths(c Connector) []string {
	paths := append([]string(nil), c.Fields()...)
	if m, ok := c.(Members); ok {
		paths = append(paths, m.HandoffMembers()...)
	}
	return paths
}

// NamedField reports which handoff field an engine's error names
// (behaviour.md R-FAIL-10): the deepest of paths (JSON paths such as
// "kv_transfer_params" or "kv_transfer_params.remote_block_ids") whose
// last element occurs in message as a whole word — not preceded or
// followed by a letter, digit or underscore, so that "remote_port"
// matches in ".kv_transfer_params.remote_port" or "'remote_port'" but
// not in "my_remote_port" — and nowhere in request, not even inside a
// longer word. request is what the client itself sent (the body without
// the handoff fields, raw JSON), searched as it came and with its keys and
// strings decoded as the engine reads them (a "\u0072emote_host" is
// remote_host): a name the client wrote too (a field of its own, a
// logit_bias key, a stop string, its prompt) may be the client's, so it
// never blames the pair. A name as the key of an object
// — followed by a closing quote and a colon, as in "'remote_host': " or
// `"bootstrap_room":` — does not count: that is the engine echoing the
// body it got (vLLM's and SGLang's validation errors repeat the whole
// request as pydantic's input when a check of the request as a whole
// fails, e.g. top_logprobs without logprobs), the router's fields
// among the client's, not naming what it refused. message is the
// engine's error as text (not JSON-escaped: a "\n" before a name would
// hide it). It returns "" when message names none of paths.
func NamedField(paths []string, message, request []byte) string {
	best, depth := "", 0
	var decoded []byte
	for _, p := range paths {
		word := p[strings.LastIndexByte(p, '.')+1:]
		if word == "" || !namesWord(message, word) || clientWrote(request, word, &decoded) {
			continue
		}
		if d := strings.Count(p, ".") + 1; d > depth {
			best, depth = p, d
		}
	}
	return best
}

// HasWord reports whether word occurs in s as a whole word: neither
// preceded nor followed by an ASCII letter, digit or underscore.
func HasWord(s []byte, word string) bool {
	return word != "" && wordAt(s, word, nil)
}

// wordAt reports whether word occurs in s as a whole word (see HasWord)
// at a place where key, if not nil, is false of what follows it.
func wordAt(s []byte, word string, key func(rest []byte) bool) bool {
	for i := 0; i+len(word) <= len(s); {
		j := bytes.Index(s[i:], []byte(word))
		if j < 0 {
			return false
		}
		at := i + j
		end := at + len(word)
		if (at == 0 || !wordByte(s[at-1])) && (end == len(s) || !wordByte(s[end])) && (key == nil || !key(s[end:])) {
			return true
		}
		i = at + 1
	}
	return false
}

// clientWrote reports whether request, the client's JSON, holds word
// (inside a longer word too): as the client wrote it, or in one of its
// keys or strings once decoded (JSON escapes are the engine's to undo,
// not a way to hide a name). *decoded caches the decoded strings.
func clientWrote(request []byte, word string, decoded *[]byte) bool {
	if bytes.Contains(request, []byte(word)) {
		return true
	}
	if bytes.IndexByte(request, '\\') < 0 {
		return false
	}
	if *decoded == nil {
		*decoded = decodedStrings(request)
	}
	return bytes.Contains(*decoded, []byte(word))
}

// decodedStrings returns every key and string of the JSON text raw,
// unescaped, each after a newline (so that two never join into one
// word); up to where raw stops being JSON.
func decodedStrings(raw []byte) []byte {
	out := []byte{'\n'}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	for {
		tok, err := dec.Token()
		if err != nil {
			return out
		}
		if s, ok := tok.(string); ok {
			out = append(append(out, s...), '\n')
		}
	}
}

// namesWord reports whether word occurs in s as a whole word (HasWord)
// somewhere other than as the key of an echoed object: not followed by a
// closing quote (' or ", escaped or not) and, after spaces, a colon.
func namesWord(s []byte, word string) bool {
	return wordAt(s, word, keyAt)
}

// keyAt reports whether rest, what follows a name, closes it as an
// object's key with its value: a quote (' or ", or \" inside a JSON
// string), spaces, a colon, spaces, then the start of a JSON or Python
// value of the kind the router writes (a string, a number, an array or
// object, true/false/null, True/False/None) — so that "'remote_host':
// required", a message about the name, still counts.
func keyAt(rest []byte) bool {
	if len(rest) > 0 && rest[0] == '\\' {
		rest = rest[1:]
	}
	if len(rest) == 0 || rest[0] != '\'' && rest[0] != '"' {
		return false
	}
	rest = bytes.TrimLeft(rest[1:], " \t\r\n")
	if len(rest) == 0 || rest[0] != ':' {
		return false
	}
	rest = bytes.TrimLeft(rest[1:], " \t\r\n")
	if len(rest) == 0 {
		return false
	}
	switch c := rest[0]; {
	case c == '\'' || c == '"' || c == '\\' || c == '[' || c == '{' || c == '-' || c >= '0' && c <= '9':
		return true
	}
	for _, v := range []string{"true", "false", "null", "True", "False", "None"} {
		if bytes.HasPrefix(rest, []byte(v)) {
			return true
		}
	}
	return false
}

func wordByte(c byte) bool {
	return c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

// Excerpt returns at most limit bytes of raw (cut back to a rune
// boundary where raw is UTF-8 there), quoted as a Go string literal
// (strconv.Quote): quotes, backslashes, newlines, control and
// non-printable characters and invalid UTF-8 are escapes, so the result is
// one printable, valid UTF-8 line whatever raw holds. A cut value is
// followed by "…(+N bytes)". An empty raw gives `""`.
func Excerpt(raw []byte, limit int) string {
	if limit < 0 {
		limit = 0
	}
	cut := raw
	if len(raw) > limit {
		n := limit
		for n > limit-utf8.UTFMax && n > 0 && !utf8.RuneStart(raw[n]) {
			n--
		}
		if !utf8.RuneStart(raw[n]) {
			n = limit // not UTF-8 here: cut at the byte limit
		}
		cut = raw[:n]
	}
	s := strconv.Quote(string(cut))
	if len(cut) < len(raw) {
		s += "…(+" + strconv.Itoa(len(raw)-len(cut)) + " bytes)"
	}
	return s
}

// JSONType names the JSON type of raw, a JSON value (white space
// around it allowed): "absent" for none, then "null", "boolean",
// "number", "string", "array", "object", or "not JSON" for anything
// else. Only the first byte is looked at (the value's validity is the
// caller's).
func JSONType(raw []byte) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "absent"
	}
	switch c := raw[0]; {
	case c == 'n':
		return "null"
	case c == 't', c == 'f':
		return "boolean"
	case c == '-', c >= '0' && c <= '9':
		return "number"
	case c == '"':
		return "string"
	case c == '[':
		return "array"
	case c == '{':
		return "object"
	}
	return "not JSON"
}
