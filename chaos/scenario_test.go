package chaos

import (
	"bytes"
	"context"
	"errors"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

const testScenario = `
steps:
  - at: 0s
    arm: {engine: d1, fault: http-status, params: {code: 503, message: "try later"}, for: 1m}
  - at: 100ms
    arm: {engine: d1, fault: trickle, id: slow, phase: decode, prob: 0.5, count: 2, params: {delay_ms: 10}}
  - at: 200ms
    disarm: {engine: d1, id: http-status}
  - at: 250ms
    disarm: {all: true}
`

// stepLine is one line Run prints: "+<seconds>s <action> …".
var stepLine = regexp.MustCompile(`^\+([0-9]+\.[0-9]{3})s (arm|disarm) (.*)$`)

// TestScenarioPlaysStepsInOrder proves `narwhal chaos run` (R-CHAOS-1):
// the steps run in order, none before its offset, each printed as it
// runs, each an arm or disarm in the bucket with its event on the bus.
func TestScenarioPlaysStepsInOrder(t *testing.T) {
	tb := startBus(t)
	sc, err := ParseScenario([]byte(testScenario))
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	start := time.Now()
	if err := sc.Run(testContext(t), tb.store, &out, 0); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 250*time.Millisecond {
		t.Errorf("ran in %v, want ≥ 250ms (the last step's offset)", d)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	want := []struct {
		at     time.Duration
		action string
		rest   string
	}{
		{0, "arm", "d1/http-status phase=any prob=1 count=unlimited code=503 message=try later expires="},
		{100 * time.Millisecond, "arm", "d1/trickle (id slow) phase=decode prob=0.5 count=2 left=2 delay_ms=10 expires="},
		{200 * time.Millisecond, "disarm", "d1/http-status: d1/http-status"},
		{250 * time.Millisecond, "disarm", "all: d1/slow"},
	}
	if len(lines) != len(want) {
		t.Fatalf("output %q, want %d lines", out.String(), len(want))
	}
	for i, w := range want {
		m := stepLine.FindStringSubmatch(lines[i])
		if m == nil {
			t.Fatalf("line %q", lines[i])
		}
		secs, _ := strconv.ParseFloat(m[1], 64)
		if at := time.Duration(secs * float64(time.Second)); at < w.at {
			t.Errorf("step %d ran at %v, before its offset %v", i+1, at, w.at)
		}
		if m[2] != w.action || !strings.HasPrefix(m[3], w.rest) {
			t.Errorf("line %q, want %s %s…", lines[i], w.action, w.rest)
		}
	}
	evs := tb.events.wait(t, schemas.ChaosDisarm, 2)
	var got []string
	for _, ev := range tb.events.snapshot() {
		got = append(got, ev.Action+" "+ev.FaultID)
	}
	if strings.Join(got, ", ") != "arm http-status, arm slow, disarm http-status, disarm slow" {
		t.Errorf("events %v", got)
	}
	if evs[0].Params["message"] != "try later" {
		t.Errorf("disarm event params %v", evs[0].Params)
	}
	if faults, err := tb.store.List(testContext(t), ""); err != nil || len(faults) != 0 {
		t.Errorf("after the scenario: %v %v", faults, err)
	}
}

// TestScenarioUntil proves --until: steps after it are skipped, and the
// run lasts until it when the steps end sooner.
func TestScenarioUntil(t *testing.T) {
	tb := startBus(t)
	sc, err := ParseScenario([]byte(testScenario))
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := sc.Run(testContext(t), tb.store, &out, 150*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(out.String(), "\n"); n != 2 {
		t.Errorf("output %q, want the first 2 steps only", out.String())
	}
	if faults, _ := tb.store.List(testContext(t), "d1"); len(faults) != 2 {
		t.Errorf("armed %v, want the 2 faults the skipped steps would have disarmed", faults)
	}

	short, err := ParseScenario([]byte("steps:\n  - at: 0s\n    disarm: {all: true}\n"))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := short.Run(testContext(t), tb.store, &out, 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Errorf("returned after %v, want ≥ --until 200ms", d)
	}

	// A cancelled run returns the context's error.
	ctx, cancel := context.WithCancel(testContext(t))
	cancel()
	if err := sc.Run(ctx, tb.store, &out, 0); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled run: %v", err)
	}
}

// TestParseScenarioRejects proves scenario files are checked before any
// step runs, with the step named.
func TestParseScenarioRejects(t *testing.T) {
	for _, tc := range []struct{ name, yaml, want string }{
		{"no steps", "steps: []\n", "no steps"},
		{"unknown field", "steps:\n  - at: 0s\n    arm: {engine: d1, fault: trickle, params: {delay_ms: 5}, colour: red}\n", "colour"},
		{"out of order", "steps:\n  - at: 2s\n    disarm: {all: true}\n  - at: 1s\n    disarm: {all: true}\n", "step 2"},
		{"negative at", "steps:\n  - at: -1s\n    disarm: {all: true}\n", "negative"},
		{"both", "steps:\n  - at: 0s\n    disarm: {all: true}\n    arm: {engine: d1, fault: connect-refused}\n", "exactly one"},
		{"neither", "steps:\n  - at: 0s\n", "exactly one"},
		{"unknown fault", "steps:\n  - at: 0s\n    arm: {engine: d1, fault: meteor}\n", "unknown fault"},
		{"missing delay", "steps:\n  - at: 0s\n    arm: {engine: d1, fault: trickle}\n", "delay_ms is required"},
		{"bad param", "steps:\n  - at: 0s\n    arm: {engine: d1, fault: trickle, params: {delay_ms: fast}}\n", "not an integer"},
		{"probability", "steps:\n  - at: 0s\n    arm: {engine: d1, fault: connect-refused, prob: 2}\n", "probability"},
		{"too long", "steps:\n  - at: 0s\n    arm: {engine: d1, fault: connect-refused, for: 48h}\n", "for 48h"},
		{"disarm nothing", "steps:\n  - at: 0s\n    disarm: {}\n", "one of engine and all"},
		{"bad engine", "steps:\n  - at: 0s\n    disarm: {engine: d.1}\n", "engine and id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseScenario([]byte(tc.yaml))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}
