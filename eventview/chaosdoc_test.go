package eventview

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// chaosDocEvents are the events of docs/chaos.md's worked scenario, as the
// router, the breaker and the chaos proxy publish them, in order: each
// failed request's failure event, then its request event (502).
func chaosDocEvents(t *testing.T) (subjects []string, payloads [][]byte) {
	t.Helper()
	at := func(clock string) time.Time {
		ts, err := time.Parse(time.RFC3339Nano, "2026-11-30T"+clock+"Z")
		if err != nil {
			t.Fatal(err)
		}
		return ts
	}
	expires := at("06:31:48.273972225")
	params := map[string]string{"code": "503"}
	chaos := func(clock, action, req string) schemas.Event {
		return &schemas.Chaos{Envelope: schemas.Envelope{Schema: schemas.SchemaChaos, At: at(clock), EngineID: "decode-1", RequestID: req},
			Action: action, Fault: "http-status", FaultID: "http-status", Phase: "decode", Probability: 1, Expires: expires, Params: params}
	}
	const router, breaker = "vm-15744", "breaker-vm-15744"
	const msg = "decode engine decode-1 answered HTTP 503: chaos: injected HTTP 503"
	failure := func(clock, producer, req string) schemas.Event {
		return &schemas.Failure{Envelope: schemas.Envelope{Schema: schemas.SchemaFailure, At: at(clock), RouterID: router, EngineID: "decode-1", RequestID: req},
			Phase: "decode", Kind: "upstream_status", Status: 502, UpstreamStatus: 503, Counts: true, ProducerID: producer, ConsumerID: "decode-1", Message: msg, Attempt: 1}
	}
	ttft, firstByte := 0.001, 0.001
	// The router's request event of each 502 follows its failure event.
	failedTTFT := 0.002
	failed := func(clock, producer, req string) schemas.Event {
		return &schemas.RequestCompleted{Envelope: schemas.Envelope{Schema: schemas.SchemaRequest, At: at(clock), RouterID: router, RequestID: req},
			Endpoint: "/v1/chat/completions", Model: "narwhal-sim", Stream: true, Status: 502, ErrorKind: "upstream_status", Attempts: 1,
			DurationSeconds: 0.004, ProducerID: producer, ConsumerID: "decode-1", TTFTSeconds: &failedTTFT}
	}
	events := []schemas.Event{
		chaos("06:29:48.274", "arm", ""),
		chaos("06:29:48.281", "inject", "a338412aeb8d23baf99ce738bb46c0f7-1-73b5ffaf"),
		failure("06:29:48.285", "prefill-2", "a338412aeb8d23baf99ce738bb46c0f7"),
		failed("06:29:48.285", "prefill-2", "a338412aeb8d23baf99ce738bb46c0f7"),
		chaos("06:29:48.707", "inject", "504265caa4697a93eff08e18dc500825-1-0c1d2e3f"),
		failure("06:29:48.707", "prefill-1", "504265caa4697a93eff08e18dc500825"),
		failed("06:29:48.708", "prefill-1", "504265caa4697a93eff08e18dc500825"),
		chaos("06:29:49.125", "inject", "a6fddbb6e2b3e204f10e2fd26859cddc-1-9a8b7c6d"),
		failure("06:29:49.126", "prefill-1", "a6fddbb6e2b3e204f10e2fd26859cddc"),
		failed("06:29:49.126", "prefill-1", "a6fddbb6e2b3e204f10e2fd26859cddc"),
		&schemas.Eligibility{Envelope: schemas.Envelope{Schema: schemas.SchemaEligibility, At: at("06:29:49.128"), BreakerID: breaker, EngineID: "decode-1"},
			Eligible: false, State: "ejected", Streak: 3, Reason: "ejected after 3 consecutive failures (last: decode upstream_status)"},
		chaos("06:29:51.682", "inject", "narwhal-probe-SWSDj6LN4HQTmyJfWKk5I9"),
		&schemas.Probe{Envelope: schemas.Envelope{Schema: schemas.SchemaProbe, At: at("06:29:51.683"), BreakerID: breaker, EngineID: "decode-1"},
			Outcome: "failure", Phase: "decode", ProducerID: "prefill-1", ConsumerID: "decode-1",
			Message: "decode upstream_status on decode-1 (upstream 503): " + msg},
		chaos("06:30:00.277", "disarm", ""),
		&schemas.Probe{Envelope: schemas.Envelope{Schema: schemas.SchemaProbe, At: at("06:30:01.685"), BreakerID: breaker, EngineID: "decode-1"},
			Outcome: "success", Phase: "decode", ProducerID: "prefill-1", ConsumerID: "decode-1"},
		&schemas.Eligibility{Envelope: schemas.Envelope{Schema: schemas.SchemaEligibility, At: at("06:30:01.685"), BreakerID: breaker, EngineID: "decode-1"},
			Eligible: true, State: "eligible", Streak: 0, Reason: "readmitted after a successful inference probe (prefill on prefill-1, decode on decode-1)"},
		&schemas.RequestCompleted{Envelope: schemas.Envelope{Schema: schemas.SchemaRequest, At: at("06:30:02.589"), RouterID: router, RequestID: "e39b298fba4f35ea60d17243bc636fe1"},
			Endpoint: "/v1/chat/completions", Model: "narwhal-sim", Stream: true, Status: 200, Attempts: 1, DurationSeconds: 0.001,
			ProducerID: "prefill-1", ConsumerID: "decode-1", TTFTSeconds: &ttft, FirstByteSeconds: &firstByte},
	}
	for _, ev := range events {
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		subjects = append(subjects, ev.Subject())
		payloads = append(payloads, b)
	}
	return subjects, payloads
}

// docBlock returns the lines of the first fenced block after the line of
// doc that starts with intro.
func docBlock(t *testing.T, doc, intro string) []string {
	t.Helper()
	_, after, ok := strings.Cut(doc, "\n"+intro)
	if !ok {
		t.Fatalf("no line starts with %q", intro)
	}
	_, block, ok := strings.Cut(after, "\n```\n")
	if !ok {
		t.Fatalf("no block after %q", intro)
	}
	block, _, _ = strings.Cut(block, "\n```")
	return strings.Split(block, "\n")
}

// TestChaosDocEventsAsPrinted proves that docs/chaos.md shows the events
// of its worked scenario as `narwhal events --engine decode-1` prints them
// (behaviour.md R-BUS-5, R-CHAOS-1): each documented line is what the
// real Printer writes for the event the scenario publishes, every one of
// them selected by --engine decode-1.
func TestChaosDocEventsAsPrinted(t *testing.T) {
	doc, err := os.ReadFile("../docs/chaos.md")
	if err != nil {
		t.Fatal(err)
	}
	want := docBlock(t, string(doc), "`narwhal events --engine decode-1`")
	subjects, payloads := chaosDocEvents(t)
	var out bytes.Buffer
	p := NewPrinter(&out, false)
	sel := Selection{Engine: "decode-1"}
	for i := range subjects {
		if !sel.Keep(subjects[i], payloads[i]) {
			t.Errorf("--engine decode-1 does not select %s", payloads[i])
		}
		if err := p.Print(subjects[i], payloads[i]); err != nil {
			t.Fatal(err)
		}
	}
	got := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("docs/chaos.md's events differ from what narwhal events prints; it prints:\n%s", out.String())
	}
}
