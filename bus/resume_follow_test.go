package bus_test

import (
	"context"
	"encoding/json"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// bothReaders runs test with a reader through consumers of the
// connection's own names and with a direct reader, which makes no
// consumer (a role credential's, behaviour.md R-BUS-11).
func bothReaders(t *testing.T, test func(t *testing.T, direct bool)) {
	for _, direct := range []bool{false, true} {
		name := "consumer"
		if direct {
			name = "direct"
		}
		t.Run(name, func(t *testing.T) { test(t, direct) })
	}
}

// resumeLog records what a SubscribeResuming delivered and decided.
type resumeLog struct {
	mu      sync.Mutex
	ids     []string
	resumed []bus.Resumption
}

func (l *resumeLog) event(_ string, payload []byte) {
	var head struct{ ID string }
	_ = json.Unmarshal(payload, &head)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ids = append(l.ids, head.ID)
}

func (l *resumeLog) resume(r bus.Resumption) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.resumed = append(l.resumed, r)
}

func (l *resumeLog) snapshot() ([]string, []bus.Resumption) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.ids), slices.Clone(l.resumed)
}

// TestSubscribeResumingRBUS5 proves bus.SubscribeResuming (R-BUS-5, what
// `narwhal events` follows with) through restarts of an embedded server:
// on the same store it resumes after the last event it delivered (the
// events stored meanwhile, once each), on a fresh store it follows the new
// stream from its start, and it reports each decision.
func TestSubscribeResumingRBUS5(t *testing.T) {
	testkit.CheckLeaks(t)
	bothReaders(t, testSubscribeResuming)
}

func testSubscribeResuming(t *testing.T, direct bool) {
	dir := t.TempDir()
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: dir, Port: -1})
	_, portStr, _ := net.SplitHostPort(strings.TrimPrefix(e.ClientURL(), "nats://"))
	port, _ := strconv.Atoi(portStr)
	pub, follower := connect(t, e), bustest.Connect(t, e, bus.ConnectOptions{ReadDirect: direct})
	publish := func(ids ...string) {
		t.Helper()
		testkit.WaitFor(t, waitBound, "the publisher on the stream", func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_, err := pub.JetStream().Stream(ctx, bus.StreamName)
			return err == nil
		})
		for _, id := range ids {
			ev := failure("d1")
			ev.ID = id
			bustest.Publish(t, pub, ev)
		}
	}
	publish("before") // not new: not delivered

	var log resumeLog
	stop, err := bus.SubscribeResuming(context.Background(), follower, bus.SubscribeOptions{Filter: "narwhal.events.failure.>"}, log.event, log.resume)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	var want []string
	var wantResumed []bus.Resumption
	check := func(what string) {
		t.Helper()
		var ids []string
		var resumed []bus.Resumption
		ok := testkit.Poll(waitBound, 10*time.Millisecond, func() bool {
			ids, resumed = log.snapshot()
			return len(ids) >= len(want) && len(resumed) >= len(wantResumed)
		})
		if !ok || !slices.Equal(ids, want) || !slices.Equal(resumed, wantResumed) {
			t.Fatalf("%s: delivered %q, resumed %+v; want %q, %+v", what, ids, resumed, want, wantResumed)
		}
	}
	publish("a1", "a2")
	want = append(want, "a1", "a2")
	check("before the restart")

	restart := func(dir string) {
		t.Helper()
		e.Shutdown()
		testkit.WaitFor(t, waitBound, "the follower's disconnect", func() bool { return !follower.Connected() })
		e = bustest.StartWith(t, bus.EmbeddedOptions{Dir: dir, Port: port})
	}
	restart(dir)
	publish("b1", "b2", "b3", "b4", "b5")
	want = append(want, "b1", "b2", "b3", "b4", "b5")
	wantResumed = append(wantResumed, bus.Resumption{Start: 4}) // "before", a1, a2
	check("after a restart on the same store")

	restart(t.TempDir())
	publish("c1", "c2", "c3")
	want = append(want, "c1", "c2", "c3")
	wantResumed = append(wantResumed, bus.Resumption{Start: 1, NewStream: true})
	check("after a restart on a fresh store")
	stop()
	stop() // twice is fine
}

// TestSubscribeResumingCountsGapsRBUS5 proves that a follower of every
// event reports events removed before it reached them while it follows
// (R-BUS-5: a loss is said, never silent): two stored events deleted from
// the middle of the stream come out as one loss of 2 between the events
// around them.
func TestSubscribeResumingCountsGapsRBUS5(t *testing.T) {
	testkit.CheckLeaks(t)
	bothReaders(t, testSubscribeResumingCountsGaps)
}

func testSubscribeResumingCountsGaps(t *testing.T, direct bool) {
	e := bustest.Start(t)
	b := bustest.Connect(t, e, bus.ConnectOptions{ReadDirect: direct})
	var seqs []uint64
	for _, id := range []string{"g1", "g2", "g3", "g4"} {
		ev := failure("d1")
		ev.ID = id
		_, seq := bustest.Publish(t, b, ev)
		seqs = append(seqs, seq)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	stream, err := b.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	for _, seq := range seqs[1:3] {
		if err := stream.DeleteMsg(ctx, seq); err != nil {
			t.Fatal(err)
		}
	}
	var log resumeLog
	stop, err := bus.SubscribeResuming(context.Background(), b, bus.SubscribeOptions{DeliverAll: true}, func(subject string, payload []byte) {
		log.event(subject, payload)
	}, func(r bus.Resumption) {
		log.mu.Lock()
		log.ids = append(log.ids, "lost "+strconv.FormatUint(r.Lost, 10)+" from "+strconv.FormatUint(r.Start, 10))
		log.resumed = append(log.resumed, r)
		log.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	want := []string{"g1", "lost 2 from " + strconv.FormatUint(seqs[1], 10), "g4"}
	var got []string
	ok := testkit.Poll(waitBound, 10*time.Millisecond, func() bool {
		got, _ = log.snapshot()
		return len(got) >= len(want)
	})
	if !ok || !slices.Equal(got, want) {
		t.Fatalf("delivered %q, want %q", got, want)
	}
}
