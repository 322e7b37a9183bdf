package main

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// eventsBus starts an embedded bus on a free port, points
// NARWHAL_NATS_URL at it (no credentials, no TLS) and returns a connection
// that publishes.
func eventsBus(t *testing.T) *bus.Bus {
	t.Helper()
	e := bustest.Start(t)
	t.Setenv("NARWHAL_NATS_URL", e.ClientURL())
	for _, v := range []string{"NARWHAL_NATS_CREDS", "NARWHAL_NATS_TLS_CA", "NARWHAL_NATS_TLS_CERT", "NARWHAL_NATS_TLS_KEY"} {
		t.Setenv(v, "")
	}
	return bustest.Connect(t, e, bus.ConnectOptions{})
}

// publishEvent validates ev against its schema (R-BUS-3), publishes it
// with its id as the message id, and returns the published JSON and the
// time the stream stored it.
func publishEvent(t *testing.T, b *bus.Bus, ev schemas.Event) ([]byte, time.Time) {
	t.Helper()
	payload, seq := bustest.Publish(t, b, ev)
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()
	stream, err := b.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	msg, err := stream.GetMsg(ctx, seq)
	if err != nil {
		t.Fatal(err)
	}
	return payload, msg.Time
}

// startEvents runs `narwhal events args…` and waits until it follows the
// stream (its stderr line), so that an event published afterwards is new
// to it.
func startEvents(t *testing.T, args ...string) *runningCmd {
	t.Helper()
	c := startCmd(t, runEvents, args...)
	c.waitStderr(t, "following ")
	return c
}

// waitLines waits until c has written n lines to stdout and returns them.
func waitLines(t *testing.T, c *runningCmd, n int) []string {
	t.Helper()
	testkit.WaitFor(t, cmdTestBound, "output lines", func() bool { return len(c.stdout.Lines()) >= n })
	return c.stdout.Lines()
}

// TestEventsJSONExactlyAsPublished proves R-BUS-5 for `narwhal events
// --json`: every event (stored ones with --since all, then new ones) comes
// out as the JSON object exactly as published, one per line, in stream
// order; and it stops cleanly when its context ends.
func TestEventsJSONExactlyAsPublished(t *testing.T) {
	testkit.CheckLeaks(t)
	b := eventsBus(t)
	f := testFailure("d1", "f1")
	f.At = bustest.SampleAt
	var want []string
	for _, ev := range []schemas.Event{f, bustest.SampleRequest("r1", "rt-1", "p1", "d1"), bustest.SampleEligibility("e1", "d1", false)} {
		payload, _ := publishEvent(t, b, ev)
		want = append(want, string(payload))
	}
	c := startEvents(t, "--json", "--since", "all")
	if !strings.Contains(c.stderr.String(), "following narwhal.events.> on nats://127.0.0.1:") {
		t.Errorf("stderr %q", c.stderr)
	}
	live, _ := publishEvent(t, b, bustest.SampleProbe("pr1", "d1"))
	want = append(want, string(live))

	got := waitLines(t, c, len(want))
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("--json output:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if err := c.stop(t); err != nil {
		t.Errorf("narwhal events returned %v on cancel, want nil", err)
	}
}

// TestEventsKindAndEngineFilters proves the selection of `narwhal events`
// (R-BUS-1 subjects): --kind keeps one kind; --engine keeps the events
// whose subject ends in the id (router id for request events) and the
// request events whose producer or consumer is the engine. Each follower
// ends with a sentinel only it must show: any stored event it should not
// show would have come out before the sentinel (the stream is ordered).
func TestEventsKindAndEngineFilters(t *testing.T) {
	testkit.CheckLeaks(t)
	b := eventsBus(t)
	stored := []schemas.Event{
		testFailure("d1", "f-d1"),                             // 0
		testFailure("d2", "f-d2"),                             // 1
		bustest.SampleRequest("r-1", "rt-1", "p1", "d1"),      // 2: d1 decoded
		bustest.SampleRequest("r-2", "rt-2", "p2", "d2"),      // 3
		bustest.SampleEligibility("e-d1", "d1", false),        // 4
		bustest.SampleProbe("pr-d2", "d2"),                    // 5
		bustest.SampleRequest("r-3", "rt-3", "d1", "d1"),      // 6: d1 as both
		bustest.SampleEligibility("e-rt", "rt-1", true),       // 7: an engine named like a router
		bustest.SampleRequest("r-4", "rt-1", "p2", "d2"),      // 8: router rt-1, not d1's
		bustest.SampleRequest("r-5", "d1", "p2", "d2"),        // 9: a router whose id is d1
		testFailure("d10", "f-d10"),                           // 10: d1 is only a prefix
		bustest.SampleEligibility("e-d2", "d2", true),         // 11
		bustest.SampleRequest("r-6", "rt-2", "p1", "d10"),     // 12
		bustest.SampleProbe("pr-d1", "d1"),                    // 13
		testFailure("d1", "f-d1-2"),                           // 14
		bustest.SampleEligibility("e-d1-2", "d1", true),       // 15
		bustest.SampleRequest("r-7", "rt-1", "d2", "d1"),      // 16: d1 as consumer
		bustest.SampleRequest("r-8", "rt-9", "d1", "d2"),      // 17: d1 as producer
		bustest.SampleEligibility("e-d10", "d10", false),      // 18
		testFailure("d2", "f-d2-2"),                           // 19
		bustest.SampleRequest("r-9", "rt-2", "", ""),          // 20: rejected before placement
		bustest.SampleProbe("pr-d10", "d10"),                  // 21
		bustest.SampleEligibility("e-d1-3", "d1", false),      // 22
		bustest.SampleRequest("r-10", "rt-10", "p10", "d100"), // 23
	}
	payloads := make([]string, len(stored))
	for i, ev := range stored {
		p, _ := publishEvent(t, b, ev)
		payloads[i] = string(p)
	}
	// Each case's sentinel matches that case and no other.
	cases := []struct {
		args     []string
		want     []int
		sentinel schemas.Event
	}{
		{[]string{"--kind", "failure"}, []int{0, 1, 10, 14, 19}, testFailure("d7", "s-failure")},
		{[]string{"--engine", "d1"}, []int{0, 2, 4, 6, 9, 13, 14, 15, 16, 17, 22},
			&schemas.Quarantine{Envelope: bustest.SampleEnvelope(schemas.SchemaQuarantine, "s-d1", "rt-1", "", "d1", ""),
				DurationSeconds: 1, Until: bustest.SampleAt.Add(time.Second), Reason: "first_token_timeout"}},
		{[]string{"--kind", "request", "--engine", "d2"}, []int{3, 8, 9, 16, 17}, bustest.SampleRequest("s-req-d2", "rt-5", "p5", "d2")},
		{[]string{"--kind", "eligibility", "--engine", "d2"}, []int{11}, bustest.SampleEligibility("s-el-d2", "d2", true)},
		{[]string{"--engine", "rt-1"}, []int{2, 7, 8, 16}, bustest.SampleRequest("s-rt-1", "rt-1", "p9", "d9")},
		{[]string{"--kind", "probe"}, []int{5, 13, 21}, bustest.SampleProbe("s-probe", "d9")},
	}
	followers := make([]*runningCmd, len(cases))
	for i, c := range cases {
		followers[i] = startEvents(t, append([]string{"--json", "--since", "0"}, c.args...)...)
	}
	for _, c := range cases {
		publishEvent(t, b, c.sentinel)
	}
	for i, c := range cases {
		var want []string
		for _, j := range c.want {
			want = append(want, payloads[j])
		}
		sentinel, err := json.Marshal(c.sentinel)
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, string(sentinel))
		got := waitLines(t, followers[i], len(want))
		testkit.WaitFor(t, cmdTestBound, "the sentinel", func() bool {
			got = followers[i].stdout.Lines()
			return strings.Contains(strings.Join(got, "\n"), string(sentinel))
		})
		if strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Errorf("%q:\n%s\nwant:\n%s", c.args, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
}

// TestEventsSince proves the start of `narwhal events`: without --since
// only events published after it started; --since DUR from that far back;
// --since at an RFC 3339 time from the first event stored then.
func TestEventsSince(t *testing.T) {
	testkit.CheckLeaks(t)
	b := eventsBus(t)
	past, _ := publishEvent(t, b, testFailure("d1", "past"))
	cut, cutAt := publishEvent(t, b, testFailure("d1", "cut"))

	newOnly := startEvents(t, "--json")
	ago := startEvents(t, "--json", "--since", "1h")
	at := startEvents(t, "--json", "--since", cutAt.Format(time.RFC3339Nano))
	if s := newOnly.stderr.String(); !strings.Contains(s, "new events only") {
		t.Errorf("stderr %q", s)
	}
	live, _ := publishEvent(t, b, testFailure("d1", "live"))

	for _, c := range []struct {
		name string
		cmd  *runningCmd
		want []string
	}{
		{"no --since", newOnly, []string{string(live)}},
		{"--since 1h", ago, []string{string(past), string(cut), string(live)}},
		{"--since " + cutAt.String(), at, []string{string(cut), string(live)}},
	} {
		var got []string
		testkit.WaitFor(t, cmdTestBound, c.name+": the live event", func() bool {
			got = c.cmd.stdout.Lines()
			return len(got) > 0 && got[len(got)-1] == string(live)
		})
		if strings.Join(got, "\n") != strings.Join(c.want, "\n") {
			t.Errorf("%s:\n%s\nwant:\n%s", c.name, strings.Join(got, "\n"), strings.Join(c.want, "\n"))
		}
	}
}

// TestEventsUnreachableBus proves that `narwhal events` gives up with a
// clear error within --connect-timeout when nothing listens at
// NARWHAL_NATS_URL.
func TestEventsUnreachableBus(t *testing.T) {
	testkit.CheckLeaks(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "nats://" + ln.Addr().String()
	ln.Close() // nothing listens there now
	t.Setenv("NARWHAL_NATS_URL", url)

	start := time.Now()
	err = runEvents(context.Background(), []string{"--connect-timeout", "300ms"}, &testkit.LockedBuffer{}, &testkit.LockedBuffer{})
	elapsed := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "bus "+url+" not reachable within 300ms") {
		t.Errorf("err = %v, want not reachable", err)
	}
	if elapsed > 5*time.Second {
		t.Errorf("gave up after %v, want about 300ms", elapsed)
	}
}

// failingWriter fails every write, as a closed pipe does.
type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("broken pipe") }

// TestEventsStopsWhenOutputFails checks that `narwhal events` ends with an
// error, instead of following on, when stdout cannot be written.
func TestEventsStopsWhenOutputFails(t *testing.T) {
	testkit.CheckLeaks(t)
	b := eventsBus(t)
	publishEvent(t, b, testFailure("d1", "f1"))
	errc := make(chan error, 1)
	go func() {
		errc <- runEvents(context.Background(), []string{"--since", "all"}, failingWriter{}, &testkit.LockedBuffer{})
	}()
	select {
	case err := <-errc:
		if err == nil || !strings.Contains(err.Error(), "broken pipe") {
			t.Errorf("err = %v, want the write error", err)
		}
	case <-time.After(cmdTestBound):
		t.Fatal("narwhal events kept running after its output failed")
	}
}

// TestEventsFlags checks `narwhal events`'s flag errors.
func TestEventsFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--kind", "failures"},
		{"--engine", "d1.x"},
		{"--engine", "*"},
		{"--since", "-1m"},
		{"--connect-timeout", "0s"},
		{"extra"},
	} {
		if err := runEvents(context.Background(), args, &testkit.LockedBuffer{}, &testkit.LockedBuffer{}); err == nil {
			t.Errorf("runEvents %q: no error", args)
		}
	}
}
