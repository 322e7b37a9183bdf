package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Range is an inclusive range of integers drawn uniformly per request
// (prompt words, output tokens). Min == Max is a fixed value.
type Range struct {
	// Min is the smallest value, ≥ 1.
	Min int `json:"min"`
	// Max is the largest value, ≥ Min.
	Max int `json:"max"`
}

// ParseRange parses "N" (Min = Max = N) or "N:M" (N ≤ M). Both must be
// integers ≥ 1; anything else is an error naming the text.
func ParseRange(s string) (Range, error) {
	lo, hi, isRange := strings.Cut(strings.TrimSpace(s), ":")
	a, err := strconv.Atoi(lo)
	if err != nil || a < 1 {
		return Range{}, fmt.Errorf("range %q: want N or N:M with integers ≥ 1", s)
	}
	b := a
	if isRange {
		if b, err = strconv.Atoi(hi); err != nil || b < a {
			return Range{}, fmt.Errorf("range %q: want N or N:M with integers 1 ≤ N ≤ M", s)
		}
	}
	return Range{Min: a, Max: b}, nil
}

// String returns "N" or "N:M", the form ParseRange reads.
func (r Range) String() string {
	if r.Min == r.Max {
		return strconv.Itoa(r.Min)
	}
	return strconv.Itoa(r.Min) + ":" + strconv.Itoa(r.Max)
}

func (r Range) draw(rng *rand.Rand) int {
	if r.Max <= r.Min {
		return r.Min
	}
	return r.Min + rng.IntN(r.Max-r.Min+1)
}

// Workload is what to send and how hard. Exactly one of Concurrency
// (closed loop) and Rate (open loop) is set, and at least one of Duration
// and Requests.
type Workload struct {
	// Endpoint is schemas.EndpointChat or schemas.EndpointCompletions.
	Endpoint string
	// Model is the model name sent in every request. Required.
	Model string
	// Stream asks for an SSE stream (with stream_options.include_usage);
	// false asks for one JSON completion (R-LEG-5).
	Stream bool
	// PromptWords is the prompt length in words, drawn per request.
	PromptWords Range
	// MaxTokens is max_tokens, drawn per request.
	MaxTokens Range
	// IgnoreEOS sends "ignore_eos": true (a vLLM sampling extension the
	// router passes to decode unchanged, R-LEG-3) so every request
	// generates exactly its max_tokens.
	IgnoreEOS bool
	// Concurrency is the number of closed-loop clients, each sending its
	// next request when the previous one ended.
	Concurrency int
	// Rate is the open-loop arrival rate in requests per second, with
	// exponential inter-arrival times (Poisson arrivals). Latencies are
	// measured from each request's scheduled arrival.
	Rate float64
	// MaxInFlight bounds the open loop's requests in flight; an arrival
	// beyond it is not sent and counts as error class "inflight_cap". 0
	// means 4096.
	MaxInFlight int
	// Duration is how long the measured run lasts; arrivals stop then and
	// the requests in flight finish.
	Duration time.Duration
	// Requests, when > 0, ends the measured run after that many requests
	// (whichever of Duration and Requests comes first).
	Requests int
	// Warmup is run before the measurement with the same workload; its
	// results are discarded.
	Warmup time.Duration
	// Timeout bounds each request; 0 means 60 s. Expiry counts as error
	// class "timeout".
	Timeout time.Duration
	// Seed seeds the prompt and length choices (and the arrival times).
	Seed uint64
}

// Validate reports the first problem with w, naming the field.
func (w *Workload) Validate() error {
	switch {
	case w.Endpoint != schemas.EndpointChat && w.Endpoint != schemas.EndpointCompletions:
		return fmt.Errorf("endpoint %q: want %s or %s", w.Endpoint, schemas.EndpointChat, schemas.EndpointCompletions)
	case w.Model == "":
		return errors.New("model: required")
	case w.PromptWords.Min < 1 || w.PromptWords.Max < w.PromptWords.Min:
		return fmt.Errorf("prompt words %s: want 1 ≤ N ≤ M", w.PromptWords)
	case w.MaxTokens.Min < 1 || w.MaxTokens.Max < w.MaxTokens.Min:
		return fmt.Errorf("max tokens %s: want 1 ≤ N ≤ M", w.MaxTokens)
	case (w.Concurrency > 0) == (w.Rate > 0):
		return errors.New("workload: set exactly one of concurrency (closed loop) and rate (open loop)")
	case w.Concurrency < 0 || w.Rate < 0 || w.MaxInFlight < 0:
		return errors.New("workload: concurrency, rate and max in-flight must not be negative")
	case w.Duration <= 0 && w.Requests <= 0:
		return errors.New("workload: set a duration or a number of requests")
	case w.Duration < 0 || w.Requests < 0 || w.Warmup < 0 || w.Timeout < 0:
		return errors.New("workload: duration, requests, warmup and timeout must not be negative")
	}
	return nil
}

func (w *Workload) timeout() time.Duration {
	if w.Timeout > 0 {
		return w.Timeout
	}
	return 60 * time.Second
}

func (w *Workload) maxInFlight() int {
	if w.MaxInFlight > 0 {
		return w.MaxInFlight
	}
	return 4096
}

// promptWords is the vocabulary prompts are drawn from: plain ASCII words,
// so a prompt needs no JSON escaping.
var promptWords = [...]string{
	"ocean", "tusk", "pod", "arctic", "whale", "current", "ice", "floe",
	"echo", "krill", "shelf", "dawn", "winter", "salt", "spiral", "deep",
	"cold", "light", "route", "shore", "drift", "song", "blue", "quiet",
	"wave", "hunter", "season", "lead", "seal", "north", "tide", "swim",
}

// bodyShape is a Workload compiled into the constant parts of its
// request bodies.
type bodyShape struct {
	endpoint       string
	prompt, tokens Range
	head           []byte // {"model":…,"messages":[{"role":"user","content":"
	mid            []byte // "}],"max_tokens":
	tail           []byte // ,"stream":…}
}

func (w *Workload) shape() *bodyShape {
	model, _ := json.Marshal(w.Model)
	s := &bodyShape{endpoint: w.Endpoint, prompt: w.PromptWords, tokens: w.MaxTokens}
	s.head = append(append([]byte(`{"model":`), model...), `,"prompt":"`...)
	s.mid = []byte(`","max_tokens":`)
	if w.Endpoint == schemas.EndpointChat {
		s.head = append(append([]byte(`{"model":`), model...), `,"messages":[{"role":"user","content":"`...)
		s.mid = []byte(`"}],"max_tokens":`)
	}
	if w.Stream {
		s.tail = []byte(`,"stream":true,"stream_options":{"include_usage":true}`)
	} else {
		s.tail = []byte(`,"stream":false`)
	}
	if w.IgnoreEOS {
		s.tail = append(s.tail, `,"ignore_eos":true`...)
	}
	s.tail = append(s.tail, '}')
	return s
}

// appendBody appends one request body to dst: a prompt of PromptWords
// words and a max_tokens, both drawn from rng. It allocates nothing once
// dst has grown.
func (s *bodyShape) appendBody(dst []byte, rng *rand.Rand) []byte {
	dst = append(dst, s.head...)
	n := s.prompt.draw(rng)
	for i := 0; i < n; i++ {
		if i > 0 {
			dst = append(dst, ' ')
		}
		dst = append(dst, promptWords[rng.IntN(len(promptWords))]...)
	}
	dst = append(dst, s.mid...)
	dst = strconv.AppendInt(dst, int64(s.tokens.draw(rng)), 10)
	return append(dst, s.tail...)
}
