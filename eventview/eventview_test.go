package eventview

import (
	"bytes"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestSelection checks the consumer filter of a selection (R-BUS-1
// subjects) and what Keep adds to it for request events.
func TestSelection(t *testing.T) {
	for _, c := range []struct {
		sel  Selection
		want string
	}{
		{Selection{}, "narwhal.events.>"},
		{Selection{Kind: "failure"}, "narwhal.events.failure.>"},
		{Selection{Kind: "failure", Engine: "d1"}, "narwhal.events.failure.d1.*"},
		{Selection{Kind: "probe", Engine: "d1"}, "narwhal.events.probe.d1"},
		{Selection{Engine: "d1"}, "narwhal.events.>"},
		{Selection{Kind: "request", Engine: "d1"}, "narwhal.events.request.>"},
	} {
		if got := c.sel.Filter(); got != c.want {
			t.Errorf("%+v.Filter() = %q, want %q", c.sel, got, c.want)
		}
	}
	sel := Selection{Engine: "d1"}
	for _, c := range []struct {
		ev   schemas.Event
		keep bool
	}{
		{bustest.SampleFailure("d1", "f1"), true},
		{bustest.SampleFailure("d10", "f2"), false},
		{bustest.SampleRequest("r1", "rt-1", "p1", "d1"), true},
		{bustest.SampleRequest("r2", "rt-1", "d1", "d2"), true},
		{bustest.SampleRequest("r3", "d1", "p2", "d2"), true},
		{bustest.SampleRequest("r4", "rt-1", "p2", "d2"), false},
		{bustest.SampleEligibility("e1", "rt-1", true), false},
	} {
		payload, _ := json.Marshal(c.ev)
		if got := sel.Keep(c.ev.Subject(), payload); got != c.keep {
			t.Errorf("Keep(%s) = %v, want %v", c.ev.Subject(), got, c.keep)
		}
	}
	if sel.Keep("narwhal.events.request.rt-1", []byte("not json")) {
		t.Error("kept a request event that does not decode")
	}
	for s, want := range map[string]bool{"d1": true, "decode-1_a": true, "": false, "d.1": false, "*": false, ">": false, "d 1": false} {
		if SubjectToken(s) != want {
			t.Errorf("SubjectToken(%q) = %v", s, !want)
		}
	}
}

// failingWriter fails every write, as a closed pipe does.
type failingWriter struct{ n int }

func (w *failingWriter) Write([]byte) (int, error) {
	w.n++
	return 0, errors.New("broken pipe")
}

// TestPrinterJSONAndWriteError checks --json lines (the payload as
// published, a multi-line one compacted) and that a Printer writes nothing
// after its first write error.
func TestPrinterJSONAndWriteError(t *testing.T) {
	var out bytes.Buffer
	p := NewPrinter(&out, true)
	for _, payload := range []string{`{"schema":"x","id":"1"}`, "{\n  \"id\": \"2\"\n}", "not\njson"} {
		if err := p.Print("narwhal.events.failure.d1", []byte(payload)); err != nil {
			t.Fatal(err)
		}
	}
	if want := "{\"schema\":\"x\",\"id\":\"1\"}\n{\"id\":\"2\"}\nnot json\n"; out.String() != want {
		t.Errorf("JSON lines %q, want %q", out.String(), want)
	}
	w := &failingWriter{}
	p = NewPrinter(w, true)
	for range 3 {
		if err := p.Print("narwhal.events.failure.d1", []byte(`{}`)); err == nil || err.Error() != "broken pipe" {
			t.Fatalf("Print: %v, want the write error", err)
		}
	}
	if w.n != 1 {
		t.Errorf("%d writes, want 1: nothing after the first error", w.n)
	}
}

// TestParseSince checks every form --since accepts and refuses.
func TestParseSince(t *testing.T) {
	now := time.Date(2026, 11, 30, 6, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		in   string
		want bus.SubscribeOptions
	}{
		{"", bus.SubscribeOptions{}},
		{"0", bus.SubscribeOptions{DeliverAll: true}},
		{"0s", bus.SubscribeOptions{DeliverAll: true}},
		{"all", bus.SubscribeOptions{DeliverAll: true}},
		{"10m", bus.SubscribeOptions{Since: now.Add(-10 * time.Minute)}},
		{"2026-11-30T05:59:14.5Z", bus.SubscribeOptions{Since: time.Date(2026, 11, 30, 5, 59, 14, 5e8, time.UTC)}},
	} {
		got, desc, err := ParseSince(c.in, now)
		if err != nil || got.DeliverAll != c.want.DeliverAll || !got.Since.Equal(c.want.Since) || desc == "" {
			t.Errorf("ParseSince(%q) = %+v %q %v, want %+v", c.in, got, desc, err, c.want)
		}
	}
	for _, in := range []string{"-5m", "yesterday", "10"} {
		if _, _, err := ParseSince(in, now); err == nil {
			t.Errorf("ParseSince(%q): no error", in)
		}
	}
}

// TestPrinterReadableLines checks the readable output of `narwhal
// events`: one aligned line per event, with each kind's useful fields; an
// event that does not decode is shown raw, on one line.
func TestPrinterReadableLines(t *testing.T) {
	var out bytes.Buffer
	p := NewPrinter(&out, false)

	f := bustest.SampleFailure("d1", "f1")
	f.At, f.RequestID = bustest.SampleAt, "abc"
	retry := bustest.SampleFailure("d2", "f2")
	retry.At, retry.Phase, retry.Kind, retry.Status, retry.UpstreamStatus = bustest.SampleAt, schemas.PhasePrefill, "upstream_status", 502, 503
	retry.Message, retry.Timeout, retry.Counts, retry.ProducerID, retry.ConsumerID, retry.Attempt = "engine returned HTTP 503", false, true, "d2", "d3", 2
	client := bustest.SampleFailure("d1", "f3")
	client.At, client.Counts, client.RequestID = bustest.SampleAt, false, "abc"
	failedReq := bustest.SampleRequest("r2", "rt-1", "p1", "d1")
	failedReq.Status, failedReq.ErrorKind, failedReq.FirstByteSeconds = 504, "first_token_timeout", nil
	events := []schemas.Event{
		f,
		bustest.SampleRequest("r1", "rt-1", "p1", "d1"),
		failedReq,
		bustest.SampleEligibility("e1", "d1", false),
		bustest.SampleEligibility("e2", "d1", true),
		bustest.SampleProbe("pr1", "d1"),
		&schemas.Probe{Envelope: bustest.SampleEnvelope(schemas.SchemaProbe, "pr2", "", "b1", "d1", ""),
			Outcome: "inconclusive", Phase: schemas.PhaseDecode, ProducerID: "p1", ConsumerID: "d1", Message: "producer p1 failed"},
		&schemas.Quarantine{Envelope: bustest.SampleEnvelope(schemas.SchemaQuarantine, "q1", "rt-1", "", "d1", ""),
			DurationSeconds: 5, Until: bustest.SampleAt.Add(5 * time.Second), Reason: "first_token_timeout"},
		&schemas.Handoff{Envelope: bustest.SampleEnvelope(schemas.SchemaHandoff, "h1", "rt-1", "", "p1", "abc"),
			Outcome: schemas.HandoffAbandoned, Reason: "decode_failed", ConsumerID: "d1", Connector: "nixl", AgeSeconds: 0.1, Released: true},
		retry,
		client,
	}
	for _, ev := range events {
		payload, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		if err := bus.ValidateEvent(payload); err != nil { // R-BUS-3
			t.Fatalf("%v\n%s", err, payload)
		}
		if err := p.Print(ev.Subject(), payload); err != nil {
			t.Fatal(err)
		}
	}
	// An event that is not JSON is shown raw.
	if err := p.Print("narwhal.events.custom.x", []byte("not\njson")); err != nil {
		t.Fatal(err)
	}
	want := []string{
		`2026-11-30T05:59:14.123Z failure     d1 decode first_token_timeout 504 counts p1→d1 "engine first token timeout" (router rt-1, req abc)`,
		`2026-11-30T05:59:14.123Z request     rt-1 200 /v1/chat/completions p1→d1 ttft=0.120s first_byte=0.340s attempts=1 (req req-r1, model m, 1.250s)`,
		`2026-11-30T05:59:14.123Z request     rt-1 504 first_token_timeout /v1/chat/completions p1→d1 ttft=0.120s first_byte=- attempts=1 (req req-r2, model m, 1.250s)`,
		`2026-11-30T05:59:14.123Z eligibility d1   ejected streak=3 "ejected after 3 failures" (breaker b1)`,
		`2026-11-30T05:59:14.123Z eligibility d1   eligible streak=0 (breaker b1)`,
		`2026-11-30T05:59:14.123Z probe       d1   success decode p1→d1 (breaker b1)`,
		`2026-11-30T05:59:14.123Z probe       d1   inconclusive decode p1→d1 "producer p1 failed" (breaker b1)`,
		`2026-11-30T05:59:14.123Z quarantine  d1   5.000s first_token_timeout until 2026-11-30T05:59:19.123Z (router rt-1)`,
		`2026-11-30T05:59:14.123Z handoff     p1   abandoned decode_failed released p1→d1 nixl age=0.100s (router rt-1, req abc)`,
		`2026-11-30T05:59:14.123Z failure     d2   prefill upstream_status 502 upstream=503 counts d2→d3 "engine returned HTTP 503" (router rt-1, req req-f2, attempt 2)`,
		`2026-11-30T05:59:14.123Z failure     d1   decode first_token_timeout 504 uncounted p1→d1 "engine first token timeout" (router rt-1, req abc)`,
		`-                        custom      x    not json`,
	}
	got := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			t.Errorf("line %d:\n got %q\nwant %q", i, got[min(i, len(got)-1)], want[i])
		}
	}
}

// TestEveryKindHasALine proves that `narwhal events` knows every kind of
// schemas.EventKinds: --kind accepts it, in the table's order, and the
// printer gives an event of it a readable line of its own, not the raw
// JSON it shows for a kind it does not know.
func TestEveryKindHasALine(t *testing.T) {
	if want := schemas.EventKindNames(); !slices.Equal(Kinds, want) {
		t.Errorf("Kinds %v, want the table's %v", Kinds, want)
	}
	for _, k := range schemas.EventKinds() {
		ev := k.New()
		*ev.Head() = bustest.SampleEnvelope(k.Schema, "k-"+k.Name, "rt-1", "", "d1", "")
		payload, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		if err := NewPrinter(&out, false).Print(ev.Subject(), payload); err != nil {
			t.Fatal(err)
		}
		line := out.String()
		if !strings.HasPrefix(line, "2026-11-30T05:59:14.123Z "+k.Name+" ") || strings.Contains(line, `"schema"`) {
			t.Errorf("kind %s has no line of its own in printer.go's appendDetails: %q", k.Name, line)
		}
	}
}

// TestSelectionByRouter checks that --engine on a kind whose subject ends
// in a router id (request events) reads every id and keeps the events
// whose producer or consumer is the engine, and that on a kind whose
// subject ends in an engine id it filters on the subject alone.
func TestSelectionByRouter(t *testing.T) {
	for _, k := range schemas.EventKinds() {
		sel := Selection{Kind: k.Name, Engine: "d1"}
		want := k.Subject("d1", "*")
		if k.ID == schemas.IDRouter {
			want = k.Filter()
		}
		if got := sel.Filter(); got != want {
			t.Errorf("%+v.Filter() = %q, want %q", sel, got, want)
		}
	}
}

// TestPrinterFleetLine checks the readable line of a fleet event: the new
// state, the one before and why.
func TestPrinterFleetLine(t *testing.T) {
	var out bytes.Buffer
	p := NewPrinter(&out, false)
	for _, ev := range []*schemas.FleetChange{
		{Envelope: bustest.SampleEnvelope(schemas.SchemaFleet, "fl1", "", "b1", "d1", ""),
			State: schemas.FleetActive, Previous: schemas.FleetJoining, Reason: "inference probe passed"},
		{Envelope: bustest.SampleEnvelope(schemas.SchemaFleet, "fl2", "", "b1", "d1", ""), State: schemas.FleetJoining},
	} {
		payload, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		if err := bus.ValidateEvent(payload); err != nil {
			t.Fatalf("%v\n%s", err, payload)
		}
		if err := p.Print(ev.Subject(), payload); err != nil {
			t.Fatal(err)
		}
	}
	want := "2026-11-30T05:59:14.123Z fleet       d1 active previous=joining \"inference probe passed\" (breaker b1)\n" +
		"2026-11-30T05:59:14.123Z fleet       d1 joining (breaker b1)\n"
	if out.String() != want {
		t.Errorf("fleet lines:\n%s\nwant:\n%s", out.String(), want)
	}
}
