package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Finish reasons, as vLLM reports them in choices[].finish_reason.
const (
	FinishStop      = "stop"
	FinishLength    = "length"
	FinishToolCalls = "tool_calls"
)

// vocabulary is the fixed word list every generated token is drawn from.
// Each word carries a leading space, as the tokens of running text do, so
// a stream's text is the plain concatenation of its tokens.
var vocabulary = [...]string{
	" the", " narwhal", " swims", " under", " arctic", " ice", " and", " sings",
	" to", " its", " pod", " of", " whales", " in", " cold", " dark",
	" water", " while", " light", " bends", " through", " frozen", " sea", " where",
	" krill", " drift", " slowly", " past", " a", " long", " spiral", " tusk",
	" that", " senses", " salt", " currents", " near", " shore", " every", " winter",
	" season", " brings", " new", " routes", " for", " hunters", " who", " follow",
	" echoes", " across", " open", " leads", " between", " floes", " at", " dawn",
	" when", " seals", " rest", " on", " blue", " shelves", " quiet", " waves",
}

const (
	fnvOffset64 = 14695981039346656037
	fnvPrime64  = 1099511628211
	// eosModulus makes one token hash in 64 an end-of-sequence.
	eosModulus = 64
)

func fnvString(h uint64, s string) uint64 {
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= fnvPrime64
	}
	return h
}

func fnvUint64(h, v uint64) uint64 {
	for k := 0; k < 8; k++ {
		h ^= v & 0xff
		h *= fnvPrime64
		v >>= 8
	}
	return h
}

// finalize is splitmix64's finalizer: it spreads FNV-1a's weak low bits.
func finalize(h uint64) uint64 {
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}

// streamBase is the FNV-1a state after hashing prompt and seed (8 bytes,
// little-endian); every token hash of one choice continues from it.
func streamBase(prompt string, seed int64) uint64 {
	return fnvUint64(fnvString(fnvOffset64, prompt), uint64(seed))
}

// tokenHash is the hash of token i of the choice whose base is base:
// FNV-1a over (prompt, seed, i as 8 little-endian bytes), finalized.
func tokenHash(base uint64, i int) uint64 {
	return finalize(fnvUint64(base, uint64(i)))
}

func wordIndex(h uint64) int { return int((h >> 6) % uint64(len(vocabulary))) }

func isEOS(h uint64) bool { return h%eosModulus == 0 }

// tokenLogprob is the deterministic log probability reported for the
// token whose hash is h: a value in (-5.0, -0.001].
func tokenLogprob(h uint64) float64 {
	return -float64((h>>32)%5000)/1000 - 0.001
}

// Generate returns the simulator's deterministic output for one choice.
//
// Token i (0-based) is drawn from a fixed vocabulary of words, each with a
// leading space (" narwhal"), by the hash FNV-1a(prompt, seed, i) followed
// by a splitmix64 finalizer. Generation ends:
//   - with finishReason "stop" at the first token whose hash%64 == 0 (the
//     end-of-sequence token, not emitted), unless ignoreEOS;
//   - with "stop" when one of stop (empty strings ignored) appears in the
//     concatenated output: as vLLM does, the output is truncated just
//     before the earliest stop string, so the last token may be a prefix
//     of its word and tokens that lay wholly after the cut are dropped;
//   - with "length" after maxTokens tokens.
//
// Choice j of a request with n > 1 uses seed+j. The server's usage
// completion_tokens is len(tokens) (R-LEG-6). Tests use Generate to know
// exactly what a decode leg must stream (R-LEG-3).
func Generate(prompt string, seed int64, maxTokens int, stop []string, ignoreEOS bool) (tokens []string, finishReason string) {
	tokens, _, finishReason = generateInto(nil, nil, streamBase(prompt, seed), maxTokens, stop, ignoreEOS)
	return tokens, finishReason
}

// generateInto is Generate into reused slices: tokens and text (scratch
// for stop-string matching, used only when stop is non-empty) are
// truncated and appended to, and returned for reuse.
func generateInto(tokens []string, text []byte, base uint64, maxTokens int, stop []string, ignoreEOS bool) ([]string, []byte, string) {
	tokens = tokens[:0]
	text = text[:0]
	for i := 0; i < maxTokens; i++ {
		h := tokenHash(base, i)
		if !ignoreEOS && isEOS(h) {
			return tokens, text, FinishStop
		}
		w := vocabulary[wordIndex(h)]
		tokens = append(tokens, w)
		if len(stop) == 0 {
			continue
		}
		prev := len(text)
		text = append(text, w...)
		cut, found := findStop(text, prev, stop)
		if !found {
			continue
		}
		// Drop whole tokens at or after the cut, shorten the one across it.
		total := len(text)
		for len(tokens) > 0 && total-len(tokens[len(tokens)-1]) >= cut {
			total -= len(tokens[len(tokens)-1])
			tokens = tokens[:len(tokens)-1]
		}
		if total > cut {
			last := tokens[len(tokens)-1]
			tokens[len(tokens)-1] = last[:len(last)-(total-cut)]
		}
		return tokens, text[:cut], FinishStop
	}
	return tokens, text, FinishLength
}

// findStop returns the earliest position in text where a stop string
// occurs, searching only matches that end after prev (the text before
// prev was already searched).
func findStop(text []byte, prev int, stop []string) (int, bool) {
	best, found := 0, false
	for _, s := range stop {
		if s == "" || len(s) > len(text) {
			continue
		}
		from := max(prev-len(s)+1, 0)
		for i := from; i+len(s) <= len(text); i++ {
			if found && i >= best {
				break
			}
			if string(text[i:i+len(s)]) == s {
				best, found = i, true
				break
			}
		}
	}
	return best, found
}

// PromptTokens is the simulator's prompt token count: the number of
// whitespace-separated words of prompt, at least 1. It is usage.prompt_tokens
// (R-LEG-6) and sizes the KV blocks a producer holds
// (ceil(PromptTokens/BlockSize)).
func PromptTokens(prompt string) int {
	n, inWord := 0, false
	for _, r := range prompt {
		if unicode.IsSpace(r) {
			inWord = false
			continue
		}
		if !inWord {
			n++
			inWord = true
		}
	}
	return max(n, 1)
}

// chatMessage is the part of an OpenAI chat message that shapes the prompt.
type chatMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	Name       string          `json:"name"`
	ToolCallID string          `json:"tool_call_id"`
	ToolCalls  json.RawMessage `json:"tool_calls"`
}

type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// RenderChat returns the canonical prompt text of OpenAI chat messages, the
// simulator's stand-in for a chat template: one line "role: content\n" per
// message, where content is a string, null, or a list of
// {"type":"text","text":…} parts joined without separator. A message's
// name is rendered as "role(name)", a tool_call_id as "role[id]", and
// non-null tool_calls are appended to the line as " tool_calls=<compact
// JSON>". The rendered text, with the endpoint kind, is what producer and
// consumer compare in a handoff (R-DESC-4). It fails when messages is not a non-empty JSON array of objects
// with a role, or a content part is not text.
func RenderChat(messages json.RawMessage) (string, error) {
	prompt, _, err := renderChat(messages, nil)
	return prompt, err
}

// renderChat is RenderChat that also appends to headers the byte span
// [start, end) of each message's role header in the rendered text (the
// role with its name and tool call id, and the colon), the words the
// tokeniser makes role markers (tokens.go), and returns it.
func renderChat(messages json.RawMessage, headers []int) (string, []int, error) {
	var msgs []chatMessage
	if err := json.Unmarshal(messages, &msgs); err != nil {
		return "", headers, fmt.Errorf("messages must be a list of message objects: %v", err)
	}
	if len(msgs) == 0 {
		return "", headers, errors.New("messages must not be empty")
	}
	var b strings.Builder
	for i, m := range msgs {
		if m.Role == "" {
			return "", headers, fmt.Errorf("messages[%d]: role is required", i)
		}
		headers = append(headers, b.Len())
		b.WriteString(m.Role)
		if m.Name != "" {
			b.WriteString("(" + m.Name + ")")
		}
		if m.ToolCallID != "" {
			b.WriteString("[" + m.ToolCallID + "]")
		}
		b.WriteString(":")
		headers = append(headers, b.Len())
		b.WriteString(" ")
		c := bytes.TrimSpace(m.Content)
		switch {
		case len(c) == 0 || string(c) == "null":
		case c[0] == '"':
			var s string
			if err := json.Unmarshal(c, &s); err != nil {
				return "", headers, fmt.Errorf("messages[%d].content: %v", i, err)
			}
			b.WriteString(s)
		case c[0] == '[':
			var parts []contentPart
			if err := json.Unmarshal(c, &parts); err != nil {
				return "", headers, fmt.Errorf("messages[%d].content: %v", i, err)
			}
			for k, p := range parts {
				if p.Type != "text" {
					return "", headers, fmt.Errorf("messages[%d].content[%d]: unsupported content part type %q", i, k, p.Type)
				}
				b.WriteString(p.Text)
			}
		default:
			return "", headers, fmt.Errorf("messages[%d].content must be a string or a list of parts", i)
		}
		if tc := bytes.TrimSpace(m.ToolCalls); len(tc) > 0 && string(tc) != "null" {
			var compact bytes.Buffer
			if err := json.Compact(&compact, tc); err != nil {
				return "", headers, fmt.Errorf("messages[%d].tool_calls: %v", i, err)
			}
			b.WriteString(" tool_calls=")
			b.Write(compact.Bytes())
		}
		b.WriteByte('\n')
	}
	return b.String(), headers, nil
}

// appendJSONString appends s as a JSON string literal to dst.
func appendJSONString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	dst = appendJSONStringContent(dst, s)
	return append(dst, '"')
}

const hexDigits = "0123456789abcdef"

// appendJSONStringContent appends s escaped for the inside of a JSON
// string literal (no quotes), replacing invalid UTF-8 with U+FFFD as
// encoding/json does. It does not allocate beyond growing dst.
func appendJSONStringContent(dst []byte, s string) []byte {
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	return append(dst, s[start:]...)
}
