package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/chaos"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// The chaos end-to-end tests (behaviour.md R-CHAOS-2): real processes — `narwhal
// bus`, two routers, one breaker, a `narwhal chaos proxy` in front of each
// of the four simulators — with faults armed over NATS by `narwhal chaos
// arm` / `narwhal chaos run`. Each fault of the catalogue is checked for
// what the client sees (behaviour.md §5, §6, docs/failures.md), the events on the
// bus, and the breaker's decisions (behaviour.md §8); a storm of mixed faults
// checks that no request hangs, is cut without an error or repeats a token.

// Settings of the chaos clusters.
const (
	// chaosEjectAfter is recovery.eject_after.
	chaosEjectAfter = 2
	// chaosTimeout is the catalogue's engine.first_token_timeout_s,
	// decode_read_timeout_s and prefill_timeout_s (also the bound of each
	// probe leg, R-BRK-3): each strike of a fault past it costs that long.
	// It leaves a loaded machine (the race detector, the suite's packages
	// in parallel) room for a whole unfaulted leg through the chaos proxy:
	// at 1 s, legs that no fault delayed ran into it.
	chaosTimeout = 2 * time.Second
	// chaosPast is a delay past chaosTimeout; chaosInside one well inside
	// it (the "just inside the bound" cases).
	chaosPast   = chaosTimeout + 500*time.Millisecond
	chaosInside = 250 * time.Millisecond
	// chaosMaxTokens is the output limit of the catalogue's requests.
	chaosMaxTokens = 8
	// chaosPrompt is the prompt of the catalogue's requests.
	chaosPrompt = "the chaos proxy stands between the router and the engine"
)

// Bounds of the chaos tests.
const (
	// eventBound bounds the wait for an event that follows a request the
	// test saw end (its request-completed or its injection event).
	eventBound = 5 * time.Second
	// maxCaseRequests bounds the requests one catalogue case sends.
	maxCaseRequests = 60
	// checkRequests is how many requests show that routers no longer
	// place on an ejected engine.
	checkRequests = 4
)

// chaosEnv are the environment overrides of the catalogue's routers and
// breaker (behaviour.md §11).
var chaosEnv = []string{
	"NARWHAL_RECOVERY_EJECT_AFTER=" + strconv.Itoa(chaosEjectAfter),
	"NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S=" + seconds(chaosTimeout),
	"NARWHAL_ENGINE_DECODE_READ_TIMEOUT_S=" + seconds(chaosTimeout),
	"NARWHAL_ENGINE_PREFILL_TIMEOUT_S=" + seconds(chaosTimeout),
}

// seconds formats d as a *_s setting, e.g. "1" or "0.3".
func seconds(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'g', -1, 64) }

// chaosEngines are the engines of a chaos cluster; each has a chaos proxy
// in front of it.
var chaosEngines = []string{"p1", "p2", "d1", "d2"}

// ms formats a duration as a delay_ms parameter.
func ms(d time.Duration) string { return "delay_ms=" + strconv.FormatInt(d.Milliseconds(), 10) }

// chaosCommand runs `narwhal chaos args…` on the cluster's bus, bounded by
// readyBound, and returns its stdout; the test fails unless it exits 0.
func (c *cluster) chaosCommand(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), readyBound)
	defer cancel()
	cmd := exec.CommandContext(ctx, narwhalBin, append([]string{"chaos"}, args...)...)
	cmd.Env = childEnv(append([]string{"NARWHAL_NATS_URL=" + c.natsURL}, c.credsEnv(bus.RoleChaos)...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("narwhal chaos %s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String()
}

// ---- the client

// streamReply is what a streaming client got for one request.
type streamReply struct {
	id      string // the X-Request-Id sent
	router  string
	status  int
	body    []byte
	elapsed time.Duration
	err     error  // the transport's error: the request did not end normally
	decoder string // the decode engine the router committed to (X-Narwhal-Decode-Engine)
}

// sendStream posts one streaming completion of prompt to r and reads the
// response to its end, bounded by ctx.
func (c *cluster) sendStream(ctx context.Context, r *routerProc, prompt string, seed int64, maxTokens int) streamReply {
	rep := streamReply{id: "e2e-chaos-" + strconv.FormatInt(c.sent.Add(1), 10), router: r.id}
	body, _ := json.Marshal(map[string]any{
		"model": clusterModel, "prompt": prompt, "seed": seed, "max_tokens": maxTokens, "stream": true,
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.url+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		rep.err = err
		return rep
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", rep.id)
	start := time.Now()
	resp, err := c.client.Do(req)
	if err != nil {
		rep.err, rep.elapsed = err, time.Since(start)
		return rep
	}
	defer resp.Body.Close()
	rep.status = resp.StatusCode
	rep.decoder = resp.Header.Get("X-Narwhal-Decode-Engine")
	rep.body, rep.err = io.ReadAll(resp.Body)
	rep.elapsed = time.Since(start)
	if rep.err == nil && resp.StatusCode == http.StatusOK && !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		rep.err = fmt.Errorf("HTTP 200 with Content-Type %q, want text/event-stream", resp.Header.Get("Content-Type"))
	}
	return rep
}

// Outcome classes of one client request. A request ends in exactly one of
// ok, httpError and terminalError (R-FAIL-1, R-FAIL-2, R-FAIL-5); the
// others are defects.
const (
	// outcomeOK: HTTP 200, the whole output sim.Generate predicts, then
	// data: [DONE].
	outcomeOK = "ok"
	// outcomeHTTPError: before commit, an OpenAI-shaped error body with
	// the same status (R-API-3).
	outcomeHTTPError = "http_error"
	// outcomeTerminal: after commit, a prefix of the predicted output and
	// one terminal data: {"error":…} event, nothing after it (R-FAIL-5).
	outcomeTerminal = "terminal_error"
	// outcomeHung: the client's bound ran out.
	outcomeHung = "hung"
	// outcomeBroken: the connection failed (no status, or a body cut by
	// the transport).
	outcomeBroken = "broken"
	// outcomeTruncated: a 200 stream that ended with neither [DONE] nor an
	// error event.
	outcomeTruncated = "truncated"
	// outcomeWrongText: output that is not (a prefix of) the predicted
	// one: duplicated, spliced or missing tokens (R-RETRY-4).
	outcomeWrongText = "wrong_text"
	// outcomeMalformed: anything else: a bad error body, data after the
	// end, two ends, a chunk that is no JSON.
	outcomeMalformed = "malformed"
)

// outcome is one classified client request.
type outcome struct {
	class   string
	text    string // the generated text the client got
	code    int    // the error's code (HTTP status or terminal event code)
	message string
	errType string
	detail  string // what is wrong, for the defect classes
}

// parseError checks that raw is an OpenAI/vLLM error body or terminal
// event (R-API-3): {"error":{"message":<non-empty string>,"type":
// <non-empty string>,"param":null,"code":<integer>}}, and returns its
// parts.
func parseError(raw []byte) (code int, message, errType string, err error) {
	var env struct {
		Error map[string]json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(raw, &env); err != nil {
		return 0, "", "", fmt.Errorf("not JSON: %v", err)
	}
	e := env.Error
	if e == nil {
		return 0, "", "", errors.New(`no "error" object`)
	}
	if json.Unmarshal(e["message"], &message) != nil || message == "" {
		return 0, "", "", errors.New("no message string")
	}
	if json.Unmarshal(e["type"], &errType) != nil || errType == "" {
		return 0, "", "", errors.New("no type string")
	}
	if p, ok := e["param"]; !ok || string(p) != "null" {
		return 0, "", "", errors.New(`"param" is not null`)
	}
	if json.Unmarshal(e["code"], &code) != nil {
		return 0, "", "", fmt.Errorf("code %s is not an integer", e["code"])
	}
	return code, message, errType, nil
}

// classifyStream classifies a reply to a streaming request whose complete
// output is want.
func classifyStream(rep streamReply, want []string) outcome {
	full := strings.Join(want, "")
	switch {
	case errors.Is(rep.err, context.DeadlineExceeded):
		return outcome{class: outcomeHung, detail: rep.err.Error()}
	case rep.err != nil:
		return outcome{class: outcomeBroken, detail: rep.err.Error()}
	case rep.status != http.StatusOK:
		code, msg, typ, err := parseError(rep.body)
		if err != nil {
			return outcome{class: outcomeMalformed, detail: fmt.Sprintf("HTTP %d error body %q: %v", rep.status, rep.body, err)}
		}
		if code != rep.status {
			return outcome{class: outcomeMalformed, detail: fmt.Sprintf("HTTP %d with an error of code %d: %s", rep.status, code, rep.body)}
		}
		return outcome{class: outcomeHTTPError, code: code, message: msg, errType: typ}
	}
	var out outcome
	var text strings.Builder
	ended := "" // "[DONE]" or "error" once the stream's end was seen
	for _, p := range sseData(rep.body) {
		if ended != "" {
			return outcome{class: outcomeMalformed, detail: fmt.Sprintf("data after %s: %q in\n%s", ended, p, rep.body)}
		}
		if p == "[DONE]" {
			ended = p
			continue
		}
		if strings.HasPrefix(p, `{"error"`) {
			code, msg, typ, err := parseError([]byte(p))
			if err != nil {
				return outcome{class: outcomeMalformed, detail: fmt.Sprintf("terminal event %q: %v", p, err)}
			}
			ended = "error"
			out.code, out.message, out.errType = code, msg, typ
			continue
		}
		var chunk struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(p), &chunk); err != nil {
			return outcome{class: outcomeMalformed, detail: fmt.Sprintf("chunk %q: %v", p, err)}
		}
		for _, ch := range chunk.Choices {
			text.WriteString(ch.Text)
		}
	}
	out.text = text.String()
	switch ended {
	case "[DONE]":
		if out.text != full {
			return outcome{class: outcomeWrongText, text: out.text, detail: fmt.Sprintf("text %q, want %q", out.text, full)}
		}
		out.class = outcomeOK
	case "error":
		if !strings.HasPrefix(full, out.text) {
			return outcome{class: outcomeWrongText, text: out.text, detail: fmt.Sprintf("text %q before the error is no prefix of %q", out.text, full)}
		}
		out.class = outcomeTerminal
	default:
		return outcome{class: outcomeTruncated, text: out.text, detail: fmt.Sprintf("no [DONE] and no error event:\n%s", rep.body)}
	}
	return out
}

// fullSeed returns the first seed from 1 whose output for prompt runs the
// whole maxTokens (no end-of-sequence token), with that output.
func fullSeed(t *testing.T, prompt string, maxTokens int) (int64, []string) {
	t.Helper()
	for s := int64(1); s < 500; s++ {
		toks, finish := sim.Generate(prompt, s, maxTokens, nil, false)
		if finish == sim.FinishLength && len(toks) == maxTokens {
			return s, toks
		}
	}
	t.Fatalf("no seed runs %q for %d tokens", prompt, maxTokens)
	return 0, nil
}

// ---- events

// chaosEvent is the part of a narwhal.chaos.v1 event the tests read.
type chaosEvent struct {
	Action  string `json:"action"`
	Fault   string `json:"fault"`
	FaultID string `json:"fault_id"`
	Phase   string `json:"phase"`
}

// asChaos decodes e as a chaos event; ok is false for other kinds.
func asChaos(t *testing.T, e event) (chaosEvent, bool) {
	t.Helper()
	var ce chaosEvent
	if e.kind != schemas.KindChaos {
		return ce, false
	}
	if err := json.Unmarshal(e.raw, &ce); err != nil {
		t.Fatalf("chaos event %s: %v", e.raw, err)
	}
	return ce, true
}

// backendID returns a failure event's backend_request_id.
func backendID(t *testing.T, e event) string {
	t.Helper()
	var f struct {
		BackendRequestID string `json:"backend_request_id"`
	}
	if err := json.Unmarshal(e.raw, &f); err != nil {
		t.Fatalf("failure event %s: %v", e.raw, err)
	}
	return f.BackendRequestID
}

// since restricts match to the events from index mark of the log on.
func since(mark int, match func(event) bool) func(event) bool {
	return func(e event) bool { return e.seq >= mark && match(e) }
}

// isInjection matches engine's chaos inject events of fault id faultID
// (any when "") for backend requests that start with prefix.
func isInjection(t *testing.T, engine, faultID, prefix string) func(event) bool {
	return func(e event) bool {
		ce, ok := asChaos(t, e)
		return ok && ce.Action == schemas.ChaosInject && e.EngineID == engine &&
			(faultID == "" || ce.FaultID == faultID) && strings.HasPrefix(e.RequestID, prefix)
	}
}

// requestEvent waits for the request-completed event of client request id
// (R-BUS-1).
func (c *cluster) requestEvent(t *testing.T, id string) event {
	t.Helper()
	return c.waitEvents(t, eventBound, 1, "the request event of "+id, func(e event) bool {
		return e.kind == schemas.KindRequest && e.RequestID == id
	})[0]
}

// waitEveryEngineAvailable waits until every router may place on every
// engine.
func (c *cluster) waitEveryEngineAvailable(t *testing.T) {
	t.Helper()
	for _, s := range c.simOrder {
		c.waitAvailable(t, s.id, true, decisionBound)
	}
}

// breakerCaughtUp waits until the breaker's durable consumer has applied
// every failure and request event on the stream (R-BRK-1).
func (c *cluster) breakerCaughtUp(t *testing.T) {
	t.Helper()
	testkit.WaitEvery(t, decisionBound, pollInterval, "the breaker to apply every event", func() bool {
		ci := c.consumerInfo(t, breaker.ConsumerName)
		return ci.NumPending == 0 && ci.NumAckPending == 0
	})
}

// ---- the catalogue

// chaosCase is one fault of the catalogue (R-CHAOS-1) armed on one engine
// for one phase, and what behaviour.md §5–§8 and docs/failures.md say follows when
// it strikes a request.
type chaosCase struct {
	name   string   // the subtest, and the fault's --id
	engine string   // the engine it is armed on
	fault  string   // the catalogue's name
	phase  string   // prefill or decode
	params []string // --param k=v

	// What the client sees of a struck request.
	status     int           // the HTTP status: the error's before commit; 200 after commit or on success
	code       int           // after commit: the terminal event's code; 0 for none
	message    string        // the error message's start; "" on success
	tokens     int           // after commit: the generated tokens before the terminal event
	minLatency time.Duration // on success: the least the request takes

	// What the bus and the breaker see.
	kind   string // the failure event's kind; "" when none is published
	counts bool   // the failure counts: eject_after strikes eject the engine
}

// chaosMeshOf says which of the catalogue's two clusters runs a case
// (they run at the same time, each its cases one after the other): the
// prefill faults and the decode faults that end a stream on the first,
// the other decode faults on the second, so both take about as long.
func chaosMeshOf(tc chaosCase) int {
	if tc.phase == schemas.PhasePrefill {
		return 0
	}
	switch tc.fault {
	case "mid-stream-silence", "close-before-done", "done-before-token":
		return 0
	}
	return 1
}

// fails reports whether a struck request fails.
func (tc *chaosCase) fails() bool { return tc.status != http.StatusOK || tc.code != 0 }

// chaosCatalogue is every fault of the catalogue on the leg it acts on:
// the prefill leg's armed on p1, the decode leg's on d1. Faults past a
// bound have a twin just inside it where that is telling.
var chaosCatalogue = []chaosCase{
	{name: "prefill-connect-refused", engine: "p1", fault: "connect-refused", phase: schemas.PhasePrefill,
		status: 502, message: "prefill engine p1 unreachable: ", kind: "connect_error", counts: true},
	{name: "prefill-connect-delay", engine: "p1", fault: "connect-delay", phase: schemas.PhasePrefill, params: []string{ms(chaosPast)},
		status: 504, message: "engine prefill timeout", kind: "prefill_timeout", counts: true},
	{name: "prefill-header-delay", engine: "p1", fault: "header-delay", phase: schemas.PhasePrefill, params: []string{ms(chaosPast)},
		status: 504, message: "engine prefill timeout", kind: "prefill_timeout", counts: true},
	{name: "prefill-header-delay-inside", engine: "p1", fault: "header-delay", phase: schemas.PhasePrefill, params: []string{ms(chaosInside)},
		status: 200, minLatency: chaosInside},
	{name: "prefill-http-status-500", engine: "p1", fault: "http-status", phase: schemas.PhasePrefill, params: []string{"code=500"},
		status: 502, message: "prefill engine p1 answered HTTP 500: chaos: injected HTTP 500", kind: "prefill_status", counts: true},
	{name: "prefill-http-status-400", engine: "p1", fault: "http-status", phase: schemas.PhasePrefill, params: []string{"code=400"},
		status: 400, message: "chaos: injected HTTP 400"},
	{name: "prefill-drop-engine-id", engine: "p1", fault: "drop-engine-id", phase: schemas.PhasePrefill,
		status: 502, message: "handoff descriptor rejected: missing engine identity", kind: "descriptor_rejected", counts: true},
	{name: "prefill-garble-block-ids", engine: "p1", fault: "garble-block-ids", phase: schemas.PhasePrefill,
		status: 502, message: "handoff descriptor rejected: malformed block ids", kind: "descriptor_rejected", counts: true},
	{name: "prefill-change-connector-shape", engine: "p1", fault: "change-connector-shape", phase: schemas.PhasePrefill,
		status: 502, message: "handoff descriptor rejected: connector mismatch", kind: "descriptor_rejected", counts: true},
	{name: "decode-connect-refused", engine: "d1", fault: "connect-refused", phase: schemas.PhaseDecode,
		status: 502, message: "decode engine d1 unreachable: ", kind: "connect_error", counts: true},
	{name: "decode-connect-delay", engine: "d1", fault: "connect-delay", phase: schemas.PhaseDecode, params: []string{ms(chaosPast)},
		status: 504, message: "engine first token timeout", kind: "first_token_timeout", counts: true},
	{name: "decode-connect-delay-inside", engine: "d1", fault: "connect-delay", phase: schemas.PhaseDecode, params: []string{ms(chaosInside)},
		status: 200, minLatency: chaosInside},
	{name: "decode-header-delay", engine: "d1", fault: "header-delay", phase: schemas.PhaseDecode, params: []string{ms(chaosPast)},
		status: 504, message: "engine first token timeout", kind: "first_token_timeout", counts: true},
	{name: "decode-first-token-delay", engine: "d1", fault: "first-token-delay", phase: schemas.PhaseDecode, params: []string{ms(chaosPast)},
		status: 504, message: "engine first token timeout", kind: "first_token_timeout", counts: true},
	{name: "decode-first-token-delay-inside", engine: "d1", fault: "first-token-delay", phase: schemas.PhaseDecode, params: []string{ms(chaosInside)},
		status: 200, minLatency: chaosInside},
	{name: "decode-mid-stream-silence", engine: "d1", fault: "mid-stream-silence", phase: schemas.PhaseDecode, params: []string{"after_tokens=2"},
		status: 200, code: 504, tokens: 2, message: "engine went silent between tokens", kind: "mid_stream_silence", counts: true},
	{name: "decode-close-before-done", engine: "d1", fault: "close-before-done", phase: schemas.PhaseDecode,
		status: 502, message: "engine stream closed before [DONE]", kind: "closed_before_done", counts: true},
	{name: "decode-close-before-done-after-output", engine: "d1", fault: "close-before-done", phase: schemas.PhaseDecode, params: []string{"after_tokens=3"},
		status: 200, code: 502, tokens: 3, message: "engine stream closed before [DONE]", kind: "closed_before_done", counts: true},
	{name: "decode-done-before-token", engine: "d1", fault: "done-before-token", phase: schemas.PhaseDecode,
		status: 502, message: "stream ended with [DONE] before any token arrived", kind: "done_before_token", counts: true},
	{name: "decode-error-object", engine: "d1", fault: "error-object", phase: schemas.PhaseDecode, params: []string{"code=503", "message=chaos: the engine is draining"},
		status: 503, message: "chaos: the engine is draining", kind: "error_object", counts: true},
	{name: "decode-error-object-after-output", engine: "d1", fault: "error-object", phase: schemas.PhaseDecode, params: []string{"after_tokens=2", "code=500"},
		status: 200, code: 500, tokens: 2, message: "chaos: injected error object", kind: "error_object", counts: true},
	{name: "decode-http-status-503", engine: "d1", fault: "http-status", phase: schemas.PhaseDecode, params: []string{"code=503"},
		status: 502, message: "decode engine d1 answered HTTP 503: chaos: injected HTTP 503", kind: "upstream_status", counts: true},
	{name: "decode-http-status-429", engine: "d1", fault: "http-status", phase: schemas.PhaseDecode, params: []string{"code=429"},
		status: 429, message: "chaos: injected HTTP 429", kind: "overload"},
	{name: "decode-http-status-422", engine: "d1", fault: "http-status", phase: schemas.PhaseDecode, params: []string{"code=422"},
		status: 422, message: "chaos: injected HTTP 422"},
	{name: "decode-trickle", engine: "d1", fault: "trickle", phase: schemas.PhaseDecode, params: []string{"delay_ms=40"},
		status: 200, minLatency: chaosMaxTokens * 40 * time.Millisecond},
}

// startChaosCluster starts the catalogue's cluster: the bus, two routers,
// one breaker, and a chaos proxy in front of each of p1, p2, d1 and d2,
// with short engine timeouts (chaosTimeout) and eject_after
// chaosEjectAfter.
func startChaosCluster(t *testing.T) *cluster {
	t.Helper()
	return startCluster(t, clusterOptions{
		routers:    2,
		breakers:   1,
		chaos:      chaosEngines,
		routerEnv:  chaosEnv,
		breakerEnv: chaosEnv,
	})
}

// TestChaosCatalogue proves every fault of the chaos catalogue end to end
// (R-CHAOS-1, R-CHAOS-2) with real processes: armed over NATS with
// `narwhal chaos arm` on one engine's proxy, each fault strikes requests
// sent through two routers, and the test checks
//
//   - what the client sees: the HTTP status and message before commit
//     (R-FAIL-1, R-FAIL-3, R-FAIL-4, R-FAIL-6, R-TMO-1, R-DESC-1…3,
//     R-DESC-6), or after commit the generated tokens then one terminal
//     error event and no [DONE] (R-FAIL-5, R-TMO-3); delays inside the
//     bounds just succeed, later;
//   - the bus: one chaos inject event per struck request (its backend
//     request id), one failure event per struck request with the kind,
//     phase, engine, status and counts of docs/failures.md, none for the
//     client faults, none for any other engine (R-BUS-1);
//   - the breaker: eject_after counted strikes eject the engine, every
//     router stops placing on it, its probe is struck too and fails, and
//     after the disarm a successful probe readmits it (R-BRK-1…3, R-BRK-8);
//     429 and client faults never eject (R-BRK-2).
//
// A request with nothing armed passes every proxy unharmed. The cases run
// on two clusters at the same time (see chaosMeshOf).
func TestChaosCatalogue(t *testing.T) {
	// Every fault of the catalogue has its case; http-status has a 5xx, a
	// 429 and a client fault.
	for _, name := range chaos.Names() {
		if !slices.ContainsFunc(chaosCatalogue, func(tc chaosCase) bool { return tc.fault == name }) {
			t.Fatalf("fault %s of the chaos catalogue has no case (R-CHAOS-2)", name)
		}
	}
	for _, code := range []string{"code=5", "code=429", "code=4"} {
		if !slices.ContainsFunc(chaosCatalogue, func(tc chaosCase) bool {
			return tc.fault == chaos.FaultHTTPStatus && slices.ContainsFunc(tc.params, func(p string) bool {
				return strings.HasPrefix(p, code) && (code != "code=4" || p != "code=429")
			})
		}) {
			t.Fatalf("no http-status case with %s…", code)
		}
	}

	var meshes [2][]chaosCase
	for _, tc := range chaosCatalogue {
		meshes[chaosMeshOf(tc)] = append(meshes[chaosMeshOf(tc)], tc)
	}
	for i, cases := range meshes {
		name := fmt.Sprintf("mesh-%d", i+1)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			c := startChaosCluster(t)
			seed, want := fullSeed(t, chaosPrompt, chaosMaxTokens)
			t.Run("no-fault", func(t *testing.T) { checkTransparent(t, c, seed, want) })
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					caseStart := time.Now()
					runChaosCase(t, c, tc, seed, want)
					t.Logf("%s on %s: %v", tc.name, tc.engine, time.Since(caseStart).Round(time.Millisecond))
				})
			}
			t.Logf("%s: %d faults in %v", name, len(cases), time.Since(start).Round(time.Millisecond))
		})
	}
}

// checkTransparent sends requests through both routers until every engine
// served one, each through its chaos proxy with nothing armed: every one
// succeeds with the predicted output, and no proxy injects anything.
func checkTransparent(t *testing.T, c *cluster, seed int64, want []string) {
	mark := c.events.Len()
	used := map[string]bool{}
	for i := 0; len(used) < len(chaosEngines); i++ {
		if i == maxCaseRequests {
			t.Fatalf("after %d requests only engines %v served one", i, used)
		}
		rep := c.sendStream(testContext(t, requestBound), c.routers[i%len(c.routers)], chaosPrompt, seed, chaosMaxTokens)
		if out := classifyStream(rep, want); out.class != outcomeOK {
			t.Fatalf("request %s through %s with nothing armed: %s %s", rep.id, rep.router, out.class, out.detail)
		}
		ev := c.requestEvent(t, rep.id)
		used[ev.ProducerID], used[ev.ConsumerID] = true, true
	}
	if inj := c.list(t, since(mark, func(e event) bool { return e.kind == schemas.KindChaos })); len(inj) != 0 {
		t.Fatalf("chaos events with nothing armed: %s", inj[0].raw)
	}
	if f := c.list(t, since(mark, func(e event) bool { return e.kind == schemas.KindFailure })); len(f) != 0 {
		t.Fatalf("failure events with nothing armed: %s", f[0].raw)
	}
}

// struckRequest is a client request a fault struck.
type struckRequest struct {
	rep     streamReply
	out     outcome
	backend string // the backend request id the proxy saw
}

// runChaosCase arms tc, drives requests until enough were struck, checks
// each and the bus, then checks the breaker's decision, disarms, and (for
// a counted fault) checks the readmission.
func runChaosCase(t *testing.T, c *cluster, tc chaosCase, seed int64, want []string) {
	c.waitEveryEngineAvailable(t)
	mark := c.events.Len()
	args := []string{"arm", "--engine", tc.engine, "--fault", tc.fault, "--phase", tc.phase, "--id", tc.name, "--for", "2m"}
	for _, p := range tc.params {
		args = append(args, "--param", p)
	}
	armed := c.chaosCommand(t, args...)
	if !strings.HasPrefix(armed, "armed "+tc.engine+"/"+tc.fault) {
		t.Fatalf("narwhal chaos arm printed %q", armed)
	}
	disarmed := false
	disarm := func() {
		if !disarmed {
			disarmed = true
			out := c.chaosCommand(t, "disarm", "--engine", tc.engine, "--id", tc.name)
			if !strings.HasPrefix(out, "disarmed "+tc.engine+"/"+tc.fault) {
				t.Errorf("narwhal chaos disarm printed %q", out)
			}
		}
	}
	defer disarm()

	strikes := chaosEjectAfter
	switch {
	case !tc.fails():
		strikes = 2
	case !tc.counts:
		strikes = chaosEjectAfter + 1 // more than eject_after: still no ejection
	}
	struck := driveStrikes(t, c, tc, strikes, seed, want)
	checkFailureEvents(t, c, tc, mark, struck)

	switch {
	case tc.counts:
		checkEjectAndReadmit(t, c, tc, mark, seed, want, disarm)
	case tc.fails():
		// R-BRK-2: overload and client faults do not count.
		c.breakerCaughtUp(t)
		if ej := c.list(t, since(mark, isEjection(tc.engine))); len(ej) != 0 {
			t.Fatalf("%d strikes of %s ejected %s (R-BRK-2): %s", strikes, tc.name, tc.engine, ej[0].raw)
		}
		if e, ok := c.placement(t, tc.engine); !ok || !e.Eligible {
			t.Fatalf("%s's placement entry after %d strikes of %s: %+v, want eligible", tc.engine, strikes, tc.name, e)
		}
		for _, r := range c.routers {
			if ok, err := available(r, tc.engine); err != nil || !ok {
				t.Fatalf("router %s: %s available=%v (%v) after strikes that do not count", r.id, tc.engine, ok, err)
			}
		}
		t.Logf("R-BRK-2: %d strikes of %s left %s eligible", strikes, tc.name, tc.engine)
		disarm()
	default:
		disarm()
	}
}

// driveStrikes sends requests through the routers in turn until the fault
// struck n of them, checks what the client got for every request, and
// returns the struck ones. A request placed elsewhere must succeed; so
// must one placed on the engine before its proxy saw the fault armed.
func driveStrikes(t *testing.T, c *cluster, tc chaosCase, n int, seed int64, want []string) []struckRequest {
	t.Helper()
	var struck []struckRequest
	for i := 0; len(struck) < n; i++ {
		if i == maxCaseRequests {
			t.Fatalf("%d requests, %d struck by %s, want %d", i, len(struck), tc.name, n)
		}
		rep := c.sendStream(testContext(t, requestBound), c.routers[i%len(c.routers)], chaosPrompt, seed, chaosMaxTokens)
		out := classifyStream(rep, want)
		ev := c.requestEvent(t, rep.id)
		placed := ev.ConsumerID
		if tc.phase == schemas.PhasePrefill {
			placed = ev.ProducerID
		}
		if placed != tc.engine {
			if out.class != outcomeOK {
				t.Fatalf("request %s placed on %s→%s, away from %s: %s %s (HTTP %d %s)", rep.id, ev.ProducerID, ev.ConsumerID, tc.engine, out.class, out.detail, rep.status, rep.body)
			}
			continue
		}
		prefix := rep.id + "-"
		if tc.fails() && out.class == outcomeOK {
			// The proxy had not seen the fault yet.
			if inj := c.list(t, isInjection(t, tc.engine, "", prefix)); len(inj) != 0 {
				t.Fatalf("request %s succeeded although %s was injected: %s", rep.id, tc.name, inj[0].raw)
			}
			continue
		}
		// A struck request has its injection event; a success of a fault
		// that does not fail may also be a request the proxy did not strike
		// yet (quick, or no injection at all).
		var inj []event
		testkit.Poll(eventBound, pollInterval, func() bool {
			inj = c.list(t, isInjection(t, tc.engine, "", prefix))
			quick := !tc.fails() && out.class == outcomeOK && rep.elapsed < tc.minLatency
			return len(inj) > 0 || quick
		})
		if len(inj) == 0 {
			if tc.fails() || out.class != outcomeOK {
				t.Fatalf("request %s placed on %s failed without an injection of %s: %s %s (HTTP %d %s)", rep.id, tc.engine, tc.name, out.class, out.detail, rep.status, rep.body)
			}
			continue
		}
		if len(inj) != 1 {
			t.Fatalf("request %s: %d injections, want one", rep.id, len(inj))
		}
		ce, _ := asChaos(t, inj[0])
		if ce.Fault != tc.fault || ce.FaultID != tc.name || ce.Phase != tc.phase {
			t.Fatalf("request %s: injection %s, want fault %s id %s phase %s", rep.id, inj[0].raw, tc.fault, tc.name, tc.phase)
		}
		checkStruck(t, tc, rep, out, ev, want)
		struck = append(struck, struckRequest{rep: rep, out: out, backend: inj[0].RequestID})
	}
	return struck
}

// checkStruck checks what the client got for one struck request, and the
// router's request-completed event of it.
func checkStruck(t *testing.T, tc chaosCase, rep streamReply, out outcome, ev event, want []string) {
	t.Helper()
	fail := func(what string) {
		t.Fatalf("%s struck request %s via %s: %s\nclient got HTTP %d (%v) %s: %s\n%s", tc.name, rep.id, rep.router, what, rep.status, rep.elapsed.Round(time.Millisecond), out.class, out.detail, rep.body)
	}
	switch {
	case !tc.fails():
		if out.class != outcomeOK {
			fail("want a complete stream ending with [DONE]")
		}
		if rep.elapsed < tc.minLatency {
			fail(fmt.Sprintf("want it to take at least %v", tc.minLatency))
		}
	case tc.code != 0: // after commit
		if out.class != outcomeTerminal || rep.status != http.StatusOK || out.code != tc.code || !strings.HasPrefix(out.message, tc.message) {
			fail(fmt.Sprintf("want HTTP 200, then a terminal error event code %d %q…, no [DONE] (R-FAIL-5)", tc.code, tc.message))
		}
		if wantText := strings.Join(want[:tc.tokens], ""); out.text != wantText {
			fail(fmt.Sprintf("text before the terminal event %q, want the first %d tokens %q", out.text, tc.tokens, wantText))
		}
		if out.errType != schemas.ErrorType(tc.code) {
			fail(fmt.Sprintf("error type %q, want %q", out.errType, schemas.ErrorType(tc.code)))
		}
	default: // before commit
		if out.class != outcomeHTTPError || rep.status != tc.status || !strings.HasPrefix(out.message, tc.message) {
			fail(fmt.Sprintf("want HTTP %d %q… (R-FAIL-1)", tc.status, tc.message))
		}
	}
	wantKind := tc.kind
	if tc.fails() && tc.kind == "" {
		wantKind = "client_fault"
	}
	if ev.Status != rep.status || ev.ErrorKind != wantKind {
		t.Fatalf("request event %s: want status %d, error_kind %q", ev.raw, rep.status, wantKind)
	}
}

// checkFailureEvents checks the failure events since mark: one per struck
// request of a fault that is published, with the kind, phase, engine,
// status and counts of docs/failures.md and the backend id the proxy saw;
// none for client faults and successes; none for any other engine.
func checkFailureEvents(t *testing.T, c *cluster, tc chaosCase, mark int, struck []struckRequest) {
	t.Helper()
	all := c.list(t, since(mark, func(e event) bool { return e.kind == schemas.KindFailure }))
	if tc.kind == "" {
		if len(all) != 0 {
			t.Fatalf("%s published a failure event, want none (R-FAIL-6): %s", tc.name, all[0].raw)
		}
		return
	}
	if len(all) != len(struck) {
		var raws []string
		for _, e := range all {
			raws = append(raws, string(e.raw))
		}
		t.Fatalf("%d failure events for %d struck requests:\n%s", len(all), len(struck), strings.Join(raws, "\n"))
	}
	for i, e := range all {
		s := struck[i]
		wantStatus := tc.status
		if tc.code != 0 {
			wantStatus = tc.code
		}
		if e.EngineID != tc.engine || e.Kind != tc.kind || e.Phase != tc.phase || e.Counts != tc.counts ||
			e.Status != wantStatus || e.RequestID != s.rep.id || backendID(t, e) != s.backend || !strings.HasPrefix(e.Message, tc.message) {
			t.Fatalf("failure event %s: want engine %s, kind %s, phase %s, counts %v, status %d, request %s (backend %s), message %q…",
				e.raw, tc.engine, tc.kind, tc.phase, tc.counts, wantStatus, s.rep.id, s.backend, tc.message)
		}
	}
}

// checkEjectAndReadmit checks the breaker's decisions on a counted fault
// that struck eject_after requests (R-BRK-1…3, R-BRK-8): the engine is
// ejected after the last failure, every router stops placing on it, its
// probe is struck and fails; after the disarm a successful probe readmits
// it and every router places on it again.
func checkEjectAndReadmit(t *testing.T, c *cluster, tc chaosCase, mark int, seed int64, want []string, disarm func()) {
	t.Helper()
	ej := c.waitEvents(t, decisionBound, 1, tc.engine+"'s ejection", since(mark, isEjection(tc.engine)))[0]
	fails := c.list(t, since(mark, isFailure(tc.engine)))
	if ej.Eligible || ej.Streak != chaosEjectAfter || ej.seq < fails[len(fails)-1].seq {
		t.Fatalf("ejection %s: want eligible false, streak %d, after the last failure", ej.raw, chaosEjectAfter)
	}
	watchStart := time.Now()
	c.waitAvailable(t, tc.engine, false, decisionBound)
	t.Logf("R-BRK-1: %s ejected after %d strikes of %s (%s); every router stopped placing on it %v after the event (seen %v after it was observed)",
		tc.engine, chaosEjectAfter, tc.name, ej.Reason, time.Since(ej.At).Round(time.Millisecond), time.Since(watchStart).Round(time.Millisecond))

	// No router places on the ejected engine.
	for i := range checkRequests {
		rep := c.sendStream(testContext(t, requestBound), c.routers[i%len(c.routers)], chaosPrompt, seed, chaosMaxTokens)
		if out := classifyStream(rep, want); out.class != outcomeOK {
			t.Fatalf("request %s with %s ejected: %s %s (HTTP %d %s)", rep.id, tc.engine, out.class, out.detail, rep.status, rep.body)
		}
		if ev := c.requestEvent(t, rep.id); ev.ProducerID == tc.engine || ev.ConsumerID == tc.engine {
			t.Fatalf("router %s placed %s on %s→%s while %s is ejected (R-BRK-1)", rep.router, rep.id, ev.ProducerID, ev.ConsumerID, tc.engine)
		}
	}

	// The probe goes through the proxy too: struck, it fails (R-BRK-3).
	// Probes of one engine run one at a time, so the first after the
	// ejection is the one struck (disarmed only once it was).
	c.waitEvents(t, decisionBound, 1, "the injection into "+tc.engine+"'s probe", since(mark, isInjection(t, tc.engine, tc.name, kvprobe.RequestIDPrefix)))
	disarm()
	disarmedAt := time.Now()
	probe := c.waitEvents(t, decisionBound, 1, tc.engine+"'s first probe", after(ej, isProbe(tc.engine, "")))[0]
	if probe.Outcome != schemas.ProbeFailure {
		t.Fatalf("probe %s struck by %s: want a failure", probe.raw, tc.name)
	}
	rd := c.waitEvents(t, decisionBound, 1, tc.engine+"'s readmission", after(ej, isReadmission(tc.engine)))[0]
	c.checkReadmittedByProbe(t, ej, rd)
	c.waitAvailable(t, tc.engine, true, decisionBound)
	t.Logf("R-BRK-3: %s readmitted %v after the disarm, after a successful probe", tc.engine, rd.At.Sub(disarmedAt).Round(time.Millisecond))
}
