package schemas

import (
	"bytes"
	"encoding/json"
	"slices"
)

// Aggregator builds the one non-streaming completion a client gets from the
// decode stream (behaviour.md R-LEG-5): the decode leg is always streamed, and a
// client that asked for "stream": false receives the chunks folded into the
// shape vLLM returns for a non-streaming request.
//
// Chat (/v1/chat/completions) output:
//
//	{"id","object":"chat.completion","created","model",
//	 "choices":[{"index","message":{"role","content","tool_calls"?,"reasoning_content"?,"reasoning"?},
//	             "logprobs":{"content":[…]}|null,"finish_reason","stop_reason"?}],
//	 "usage":{…}|null}
//
// Completions (/v1/completions) output:
//
//	{"id","object":"text_completion","created","model",
//	 "choices":[{"index","text",
//	             "logprobs":{"tokens","token_logprobs","top_logprobs","text_offset"}|null,
//	             "finish_reason","stop_reason"?}],
//	 "usage":{…}|null}
//
// An Aggregator is used by one goroutine; it copies what it keeps, so the
// caller may reuse payload buffers after Add returns.
type Aggregator struct {
	chat    bool
	id      string
	created json.Number
	model   string
	choices []*aggChoice

	usage            json.RawMessage
	promptTokens     int
	completionTokens int
	usageOK          bool

	size int // bytes of output kept, see Bytes
}

// aggChoice accumulates one choice, keyed by its index.
type aggChoice struct {
	index        int
	role         string
	content      []byte
	reasoning    []byte
	reasoningKey bool // the stream used "reasoning" rather than "reasoning_content"
	toolCalls    []*aggToolCall
	finishReason json.RawMessage
	stopReason   json.RawMessage

	logprobs      bool              // a non-null logprobs member was seen
	lpContent     []json.RawMessage // chat: logprobs.content
	lpTokens      []json.RawMessage // completions
	lpTokenLogp   []json.RawMessage
	lpTopLogprobs []json.RawMessage
	lpTextOffset  []json.RawMessage
}

// aggToolCall accumulates one tool call of a chat choice, keyed by index.
type aggToolCall struct {
	index     int
	id        string
	typ       string
	name      string
	arguments []byte
}

// aggWireChunk is the part of a stream chunk the Aggregator reads.
type aggWireChunk struct {
	ID      string          `json:"id"`
	Created json.Number     `json:"created"`
	Model   string          `json:"model"`
	Choices []aggWireChoice `json:"choices"`
	Usage   json.RawMessage `json:"usage"`
}

type aggWireChoice struct {
	Index        int             `json:"index"`
	Delta        *aggWireDelta   `json:"delta"`
	Text         *string         `json:"text"`
	Logprobs     json.RawMessage `json:"logprobs"`
	FinishReason json.RawMessage `json:"finish_reason"`
	StopReason   json.RawMessage `json:"stop_reason"`
}

type aggWireDelta struct {
	Role             string             `json:"role"`
	Content          *string            `json:"content"`
	ReasoningContent *string            `json:"reasoning_content"`
	Reasoning        *string            `json:"reasoning"`
	ToolCalls        []aggWireToolDelta `json:"tool_calls"`
}

type aggWireToolDelta struct {
	Index    int    `json:"index"`
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

type aggWireChatLogprobs struct {
	Content []json.RawMessage `json:"content"`
}

type aggWireTextLogprobs struct {
	Tokens        []json.RawMessage `json:"tokens"`
	TokenLogprobs []json.RawMessage `json:"token_logprobs"`
	TopLogprobs   []json.RawMessage `json:"top_logprobs"`
	TextOffset    []json.RawMessage `json:"text_offset"`
}

type aggWireUsage struct {
	PromptTokens     *int `json:"prompt_tokens"`
	CompletionTokens *int `json:"completion_tokens"`
}

// NewAggregator returns an empty Aggregator for /v1/chat/completions when
// chat is true, else for /v1/completions (R-LEG-5).
func NewAggregator(chat bool) *Aggregator {
	return &Aggregator{chat: chat}
}

// Add folds one data payload of the decode stream into the completion
// (R-LEG-5). Callers pass output and metadata chunks (ClassifyChunk
// ChunkOutput or ChunkMetadata), never [DONE] or error frames. The first
// non-empty id, created and model are kept; per choice (by "index"),
// content, text and reasoning are concatenated, tool calls are assembled by
// their "index" (id, type and name from the first delta that has them,
// arguments concatenated), logprobs lists are concatenated, and the last
// non-null finish_reason and stop_reason are kept. A non-null usage object
// replaces any earlier one (R-LEG-6). A choice or tool-call delta without
// "index" counts as index 0. Member names are matched as encoding/json
// matches struct fields (case-insensitively).
//
// Add returns an error, and leaves the Aggregator unchanged, when payload
// is not valid JSON or a member it reads has the wrong JSON type (for
// example a string "index", or logprobs that are not an object).
func (a *Aggregator) Add(payload []byte) error {
	var c aggWireChunk
	if err := json.Unmarshal(payload, &c); err != nil {
		return err
	}
	// Decode logprobs and usage before changing any state.
	var (
		chatLP []aggWireChatLogprobs
		textLP []aggWireTextLogprobs
	)
	for i := range c.Choices {
		raw := c.Choices[i].Logprobs
		if aggIsNull(raw) {
			continue
		}
		var err error
		if a.chat {
			if chatLP == nil {
				chatLP = make([]aggWireChatLogprobs, len(c.Choices))
			}
			err = json.Unmarshal(raw, &chatLP[i])
		} else {
			if textLP == nil {
				textLP = make([]aggWireTextLogprobs, len(c.Choices))
			}
			err = json.Unmarshal(raw, &textLP[i])
		}
		if err != nil {
			return err
		}
	}
	var usage aggWireUsage
	usageOK := false
	hasUsage := len(c.Usage) > 0 && c.Usage[0] == '{'
	if hasUsage {
		usageOK = json.Unmarshal(c.Usage, &usage) == nil &&
			usage.PromptTokens != nil && usage.CompletionTokens != nil
	}

	if a.id == "" {
		a.id = c.ID
	}
	if a.created == "" {
		a.created = c.Created
	}
	if a.model == "" {
		a.model = c.Model
	}
	if hasUsage {
		a.usage = c.Usage
		a.usageOK = usageOK
		if usageOK {
			a.promptTokens, a.completionTokens = *usage.PromptTokens, *usage.CompletionTokens
		} else {
			a.promptTokens, a.completionTokens = 0, 0
		}
	}
	for i := range c.Choices {
		wc := &c.Choices[i]
		ch := a.choice(wc.Index)
		if wc.Text != nil {
			ch.content = append(ch.content, *wc.Text...)
			a.size += len(*wc.Text)
		}
		if d := wc.Delta; d != nil {
			if d.Role != "" && ch.role == "" {
				ch.role = d.Role
			}
			if d.Content != nil {
				ch.content = append(ch.content, *d.Content...)
				a.size += len(*d.Content)
			}
			// Some vLLM versions send the same text under both names.
			switch {
			case d.ReasoningContent != nil && *d.ReasoningContent != "":
				ch.reasoning = append(ch.reasoning, *d.ReasoningContent...)
				a.size += len(*d.ReasoningContent)
			case d.Reasoning != nil && *d.Reasoning != "":
				ch.reasoning = append(ch.reasoning, *d.Reasoning...)
				a.size += len(*d.Reasoning)
				ch.reasoningKey = true
			}
			for j := range d.ToolCalls {
				td := &d.ToolCalls[j]
				tc := ch.toolCall(td.Index)
				if tc.id == "" {
					tc.id = td.ID
				}
				if tc.typ == "" {
					tc.typ = td.Type
				}
				if tc.name == "" {
					tc.name = td.Function.Name
				}
				tc.arguments = append(tc.arguments, td.Function.Arguments...)
				a.size += len(td.Function.Arguments)
			}
		}
		if !aggIsNull(wc.Logprobs) {
			ch.logprobs = true
			if a.chat {
				ch.lpContent = append(ch.lpContent, chatLP[i].Content...)
				a.size += rawBytes(chatLP[i].Content)
			} else {
				lp := &textLP[i]
				ch.lpTokens = append(ch.lpTokens, lp.Tokens...)
				ch.lpTokenLogp = append(ch.lpTokenLogp, lp.TokenLogprobs...)
				ch.lpTopLogprobs = append(ch.lpTopLogprobs, lp.TopLogprobs...)
				ch.lpTextOffset = append(ch.lpTextOffset, lp.TextOffset...)
				a.size += rawBytes(lp.Tokens) + rawBytes(lp.TokenLogprobs) + rawBytes(lp.TopLogprobs) + rawBytes(lp.TextOffset)
			}
		}
		if !aggIsNull(wc.FinishReason) {
			ch.finishReason = wc.FinishReason
		}
		if !aggIsNull(wc.StopReason) {
			ch.stopReason = wc.StopReason
		}
	}
	return nil
}

// Bytes returns how many bytes of output the Aggregator holds: the texts,
// reasoning and tool-call arguments of every choice and their logprobs
// entries as sent, about the size of the completion AppendJSON would
// write, without its fixed envelope. The router bounds it (R-LEG-5,
// request.max_response_bytes) so that a non-streamed request cannot make
// it hold an arbitrarily large output.
func (a *Aggregator) Bytes() int { return a.size }

// rawBytes is the total length of raws.
func rawBytes(raws []json.RawMessage) int {
	n := 0
	for _, r := range raws {
		n += len(r)
	}
	return n
}

// choice returns the accumulator for a choice index, creating it.
func (a *Aggregator) choice(index int) *aggChoice {
	for _, ch := range a.choices {
		if ch.index == index {
			return ch
		}
	}
	ch := &aggChoice{index: index}
	a.choices = append(a.choices, ch)
	return ch
}

// toolCall returns the accumulator for a tool-call index, creating it.
func (ch *aggChoice) toolCall(index int) *aggToolCall {
	for _, tc := range ch.toolCalls {
		if tc.index == index {
			return tc
		}
	}
	tc := &aggToolCall{index: index}
	ch.toolCalls = append(ch.toolCalls, tc)
	return tc
}

// Usage returns the decode engine's usage.prompt_tokens and
// usage.completion_tokens from the last usage object added (R-LEG-6). ok is
// false when no usage object came or it lacked either integer count.
func (a *Aggregator) Usage() (prompt, completion int, ok bool) {
	return a.promptTokens, a.completionTokens, a.usageOK
}

// aggCompletion and the types below are the output shapes; C is the
// choice's: aggChatChoice or aggTextChoice.
type aggCompletion[C any] struct {
	ID      string          `json:"id"`
	Object  string          `json:"object"`
	Created json.Number     `json:"created"`
	Model   string          `json:"model"`
	Choices []C             `json:"choices"`
	Usage   json.RawMessage `json:"usage"`
}

// aggBuild is a's completion of kind object ("chat.completion",
// "text_completion") with choices, each shaped by shape.
func aggBuild[C any](a *Aggregator, object string, choices []*aggChoice, shape func(*aggChoice) C) *aggCompletion[C] {
	out := &aggCompletion[C]{
		ID: a.id, Object: object, Created: a.created, Model: a.model,
		Choices: make([]C, 0, len(choices)), Usage: a.usage,
	}
	for _, ch := range choices {
		out.Choices = append(out.Choices, shape(ch))
	}
	return out
}

type aggChatChoice struct {
	Index        int             `json:"index"`
	Message      aggChatMessage  `json:"message"`
	Logprobs     any             `json:"logprobs"` // nil or *aggWireChatLogprobs
	FinishReason json.RawMessage `json:"finish_reason"`
	StopReason   json.RawMessage `json:"stop_reason,omitempty"`
}

type aggChatMessage struct {
	Role             string        `json:"role"`
	Content          *string       `json:"content"`
	ToolCalls        []aggToolJSON `json:"tool_calls,omitempty"`
	ReasoningContent *string       `json:"reasoning_content,omitempty"`
	Reasoning        *string       `json:"reasoning,omitempty"`
}

type aggToolJSON struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

type aggTextChoice struct {
	Index        int             `json:"index"`
	Text         string          `json:"text"`
	Logprobs     any             `json:"logprobs"` // nil or *aggWireTextLogprobs
	FinishReason json.RawMessage `json:"finish_reason"`
	StopReason   json.RawMessage `json:"stop_reason,omitempty"`
}

// AppendJSON appends the aggregated completion (the shapes in the
// Aggregator doc) to dst and returns the extended slice (R-LEG-5). Choices
// are ordered by index and tool calls by their index. A chat message's
// content is null when the choice has tool calls and no content, else a
// string (possibly empty); its role defaults to "assistant" and a tool
// call's type to "function". logprobs is null for a choice whose chunks all
// had null logprobs; finish_reason is null when no chunk gave one; usage is
// the last usage object verbatim, or null when none came (R-LEG-6). HTML
// characters are not escaped. Every value comes from validated JSON, so
// encoding cannot fail; should it, dst is returned unchanged.
func (a *Aggregator) AppendJSON(dst []byte) []byte {
	choices := slices.Clone(a.choices)
	slices.SortStableFunc(choices, func(x, y *aggChoice) int { return x.index - y.index })
	var v any
	if a.chat {
		v = aggBuild(a, "chat.completion", choices, (*aggChoice).chatJSON)
	} else {
		v = aggBuild(a, "text_completion", choices, (*aggChoice).textJSON)
	}
	n := len(dst)
	buf := bytes.NewBuffer(dst)
	enc := json.NewEncoder(buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return dst[:n]
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

func (ch *aggChoice) chatJSON() aggChatChoice {
	out := aggChatChoice{
		Index:        ch.index,
		FinishReason: ch.finishReason,
		StopReason:   ch.stopReason,
	}
	out.Message.Role = ch.role
	if out.Message.Role == "" {
		out.Message.Role = "assistant"
	}
	if len(ch.content) > 0 || len(ch.toolCalls) == 0 {
		s := string(ch.content)
		out.Message.Content = &s
	}
	tcs := slices.Clone(ch.toolCalls)
	slices.SortStableFunc(tcs, func(x, y *aggToolCall) int { return x.index - y.index })
	for _, tc := range tcs {
		var t aggToolJSON
		t.ID, t.Type = tc.id, tc.typ
		if t.Type == "" {
			t.Type = "function"
		}
		t.Function.Name, t.Function.Arguments = tc.name, string(tc.arguments)
		out.Message.ToolCalls = append(out.Message.ToolCalls, t)
	}
	if len(ch.reasoning) > 0 {
		s := string(ch.reasoning)
		out.Message.ReasoningContent = &s
		if ch.reasoningKey {
			out.Message.Reasoning = &s
		}
	}
	if ch.logprobs {
		out.Logprobs = &aggWireChatLogprobs{Content: aggNonNil(ch.lpContent)}
	}
	return out
}

func (ch *aggChoice) textJSON() aggTextChoice {
	out := aggTextChoice{
		Index:        ch.index,
		Text:         string(ch.content),
		FinishReason: ch.finishReason,
		StopReason:   ch.stopReason,
	}
	if ch.logprobs {
		out.Logprobs = &aggWireTextLogprobs{
			Tokens:        aggNonNil(ch.lpTokens),
			TokenLogprobs: aggNonNil(ch.lpTokenLogp),
			TopLogprobs:   aggNonNil(ch.lpTopLogprobs),
			TextOffset:    aggNonNil(ch.lpTextOffset),
		}
	}
	return out
}

// aggNonNil returns s, or an empty list so that it encodes as [].
func aggNonNil(s []json.RawMessage) []json.RawMessage {
	if s == nil {
		return []json.RawMessage{}
	}
	return s
}

// aggIsNull reports whether raw is absent or the JSON null.
func aggIsNull(raw json.RawMessage) bool {
	return len(raw) == 0 || string(raw) == "null"
}
