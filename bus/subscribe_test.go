package bus_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestSubscribeWithSince proves the start choices of SubscribeWith for
// R-BUS-5 tools such as `narwhal events --since`: Since starts at the first
// event stored at or after the time (older ones are not delivered), the
// filter still applies, DeliverAll starts at the oldest event, and
// DeliverAll with Since is refused.
func TestSubscribeWithSince(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Port: 0})
	b := connect(t, e)
	ctx := context.Background()
	js := b.JetStream()
	var seqs []uint64
	for _, p := range []struct{ subject, payload string }{
		{"narwhal.events.failure.d1", `{"n":"old"}`},
		{"narwhal.events.failure.d1", `{"n":"cut"}`},
		{"narwhal.events.eligibility.d1", `{"n":"other-kind"}`},
		{"narwhal.events.failure.d2", `{"n":"later"}`},
	} {
		ack, err := js.Publish(ctx, p.subject, []byte(p.payload))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
	}
	st, err := js.Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	old, err := st.GetMsg(ctx, seqs[0])
	if err != nil {
		t.Fatal(err)
	}
	cut, err := st.GetMsg(ctx, seqs[1])
	if err != nil {
		t.Fatal(err)
	}
	if !old.Time.Before(cut.Time) {
		t.Fatalf("stored times %v and %v are not increasing", old.Time, cut.Time)
	}

	since := &bustest.Events{}
	stop, err := bus.SubscribeWith(ctx, b, bus.SubscribeOptions{Filter: "narwhal.events.failure.*", Since: cut.Time}, since.Add)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	testkit.WaitFor(t, waitBound, "the events since the cut", func() bool { return since.Len() >= 2 })
	for i, want := range []string{`{"n":"cut"}`, `{"n":"later"}`} {
		if payload := since.At(i).Payload; string(payload) != want {
			t.Errorf("since: event %d = %s, want %s", i, payload, want)
		}
	}

	all := &bustest.Events{}
	stopAll, err := bus.SubscribeWith(ctx, b, bus.SubscribeOptions{DeliverAll: true}, all.Add)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopAll)
	testkit.WaitFor(t, waitBound, "every stored event", func() bool { return all.Len() >= 4 })
	if payload := all.At(0).Payload; string(payload) != `{"n":"old"}` {
		t.Errorf("deliver all: first event %s, want the oldest", payload)
	}

	// A sentinel after both consumers exist: the since-consumer sees it
	// next, so it saw nothing else in between (no "other-kind", no "old").
	if _, err := js.Publish(ctx, "narwhal.events.failure.d3", []byte(`{"n":"sentinel"}`)); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, waitBound, "the sentinel", func() bool { return since.Len() >= 3 })
	if payload := since.At(2).Payload; string(payload) != `{"n":"sentinel"}` || since.Len() != 3 {
		t.Errorf("since: third event %s of %d, want the sentinel of 3", payload, since.Len())
	}

	_, err = bus.SubscribeWith(ctx, b, bus.SubscribeOptions{DeliverAll: true, Since: time.Now()}, all.Add)
	if err == nil || !strings.Contains(err.Error(), "exclude") {
		t.Errorf("DeliverAll with Since: err %v, want refused", err)
	}
	_, err = bus.SubscribeWith(ctx, b, bus.SubscribeOptions{Filter: "other.>"}, all.Add)
	if err == nil {
		t.Error("filter outside narwhal.events.> accepted")
	}
}
