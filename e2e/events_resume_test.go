package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// resumeBound bounds how long `narwhal events` may take, once it runs
// again after a bus restart, to print what was stored meanwhile: the
// reconnect (250 ms between attempts) and one consumer, far below the 14 s
// of silence an ordered consumer's own backoff took.
const resumeBound = 3 * time.Second

// eventsBusRig is one `narwhal bus` process at a fixed address, restarted
// on the store the test chooses, and a connection of the test that
// publishes and purges.
type eventsBusRig struct {
	addr string
	proc *process
	conn *bus.Bus
}

// start starts `narwhal bus --listen addr --data data` and waits for its
// listening line and, once connected, for the test's connection to reach
// the stream again.
func (r *eventsBusRig) start(t *testing.T, data string) {
	t.Helper()
	r.proc = spawn(t, "bus", nil, "bus", "--listen", r.addr, "--data", data)
	testkit.WaitEvery(t, readyBound, pollInterval, "the bus's listening line", func() bool {
		if r.proc.exited() {
			r.proc.dump(t)
			t.Fatalf("narwhal bus exited: %v", r.proc.waitErr)
		}
		return busLine.MatchString(r.proc.stdout.String())
	})
	if r.conn == nil {
		ctx, cancel := context.WithTimeout(context.Background(), readyBound)
		defer cancel()
		b, err := bus.Connect(ctx, bus.ConnectOptions{URL: "nats://" + r.addr, Name: t.Name()})
		if err != nil {
			t.Fatal(err)
		}
		r.conn = b
		return
	}
	testkit.WaitEvery(t, readyBound, pollInterval, "the test's connection back on the stream", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := r.conn.JetStream().Stream(ctx, bus.StreamName)
		return err == nil
	})
}

// publish publishes each event and returns their stream sequences.
func (r *eventsBusRig) publish(t *testing.T, evs ...schemas.Event) []uint64 {
	t.Helper()
	seqs := make([]uint64, len(evs))
	for i, ev := range evs {
		_, seqs[i] = bustest.Publish(t, r.conn, ev)
	}
	return seqs
}

// requests returns n request events with ids prefix-01 … prefix-n.
func requests(prefix string, n int) []schemas.Event {
	evs := make([]schemas.Event, n)
	for i := range evs {
		evs[i] = bustest.SampleRequest(fmt.Sprintf("%s-%02d", prefix, i+1), "rt-1", "p1", "d1")
	}
	return evs
}

// ids returns the event ids of evs.
func ids(evs []schemas.Event) []string {
	out := make([]string, len(evs))
	for i, ev := range evs {
		out[i] = ev.Head().ID
	}
	return out
}

// printedIDs returns the id of every JSON line p printed to stdout.
func printedIDs(t *testing.T, p *process) []string {
	t.Helper()
	var out []string
	for line := range strings.SplitSeq(strings.TrimSpace(p.stdout.String()), "\n") {
		if line == "" {
			continue
		}
		var head schemas.Envelope
		if err := json.Unmarshal([]byte(line), &head); err != nil {
			t.Fatalf("narwhal events printed %q: %v", line, err)
		}
		out = append(out, head.ID)
	}
	return out
}

// TestEventsResumesAcrossBusRestartsRBUS5 proves that `narwhal events`
// (R-BUS-5) never skips: a real `narwhal events --json` follows a real
// `narwhal bus` that is restarted four times while events are stored (and
// whose stream is deleted and made again once), and
// prints every event exactly once, in stream order:
//
//  1. restarted on the same store before it printed anything (it was
//     stopped with SIGSTOP through the restart, so that the events are
//     stored while it cannot read): the 16 requests and the failure stored
//     meanwhile come out, from the sequence after where it started, within
//     resumeBound of it running again;
//  2. restarted on the same store while it runs, events published as soon
//     as the bus is back: all of them, none twice;
//  3. restarted on a fresh store (a stream made anew, numbered from 1
//     again): the new stream's events from its start, and a line saying so;
//  4. restarted on that store, with the first five of ten events purged
//     before it could read them: the line `5 events lost: removed by the
//     stream's retention before they could be read (sequences …)`, then
//     the five left;
//  5. the stream deleted under it and made again: the new stream's
//     events, within resumeBound of being stored.
func TestEventsResumesAcrossBusRestartsRBUS5(t *testing.T) {
	rig := &eventsBusRig{addr: hostPort(freePorts(t, 1)[0])}
	store, fresh := filepath.Join(t.TempDir(), "bus"), filepath.Join(t.TempDir(), "fresh")
	rig.start(t, store)
	t.Cleanup(func() {
		if rig.conn != nil {
			rig.conn.Close()
		}
		rig.proc.halt(t)
	})

	before := requests("before", 2) // stored before it starts: not shown
	rig.publish(t, before...)
	events := startProcess(t, "events", []string{"NARWHAL_NATS_URL=nats://" + rig.addr}, "events", "--json")
	t.Cleanup(func() { _ = events.cmd.Process.Signal(syscall.SIGCONT) }) // before its halt
	testkit.WaitEvery(t, readyBound, pollInterval, "narwhal events following the bus", func() bool {
		if events.exited() {
			events.dump(t)
			t.Fatalf("narwhal events exited: %v", events.waitErr)
		}
		return strings.Contains(events.stderr.String(), "following ")
	})
	var want []string
	// waitPrinted waits until events printed want, and fails the test when
	// what it printed differs (a duplicate, a gap, another order).
	waitPrinted := func(what string, bound time.Duration) time.Duration {
		t.Helper()
		start := time.Now()
		var got []string
		ok := testkit.Poll(bound, pollInterval, func() bool {
			got = printedIDs(t, events)
			return len(got) >= len(want)
		})
		took := time.Since(start)
		if !ok || !slices.Equal(got, want) {
			t.Fatalf("%s: narwhal events printed (after %v)\n%s\nwant\n%s\nstderr:\n%s", what, took.Round(time.Millisecond),
				strings.Join(got, "\n"), strings.Join(want, "\n"), events.stderr.String())
		}
		return took
	}
	// restart stops narwhal events (SIGSTOP) unless running, restarts the
	// bus on data, stores evs, lets narwhal events run again and returns
	// the stream sequences of evs.
	restart := func(data string, running bool, evs []schemas.Event, meanwhile func(seqs []uint64)) []uint64 {
		t.Helper()
		if !running {
			if err := events.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
		}
		rig.proc.halt(t)
		rig.start(t, data)
		seqs := rig.publish(t, evs...)
		if meanwhile != nil {
			meanwhile(seqs)
		}
		if !running {
			if err := events.cmd.Process.Signal(syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
		}
		return seqs
	}

	// 1. Same store, nothing printed yet.
	first := append(requests("meanwhile", 16), bustest.SampleFailure("d1", "first-failure"))
	restart(store, false, first, nil)
	want = append(want, ids(first)...)
	took := waitPrinted("same store, nothing printed before", resumeBound)
	t.Logf("R-BUS-5: after a restart on the same store, the %d events stored meanwhile printed %v after it ran again", len(first), took.Round(time.Millisecond))

	// 2. Same store, running.
	second := requests("running", 8)
	restart(store, true, second, nil)
	want = append(want, ids(second)...)
	waitPrinted("same store, running", readyBound)

	// 3. A fresh store: a new stream, numbered from 1 again.
	third := requests("fresh", 5)
	seqs := restart(fresh, false, third, nil)
	if seqs[0] != 1 {
		t.Fatalf("the fresh store's stream starts at sequence %d, want 1", seqs[0])
	}
	want = append(want, ids(third)...)
	took = waitPrinted("fresh store", resumeBound)
	if !strings.Contains(events.stderr.String(), "stream NARWHAL_EVENTS was made anew; following it from its start") {
		t.Errorf("stderr does not say the stream was made anew:\n%s", events.stderr.String())
	}
	t.Logf("R-BUS-5: a stream made anew followed from its start, %d events %v after it ran again", len(third), took.Round(time.Millisecond))

	// 4. Retention removed five events before they could be read.
	fourth := requests("retention", 10)
	seqs = restart(fresh, false, fourth, func(seqs []uint64) {
		ctx, cancel := context.WithTimeout(context.Background(), readyBound)
		defer cancel()
		stream, err := rig.conn.JetStream().Stream(ctx, bus.StreamName)
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Purge(ctx, jetstream.WithPurgeSequence(seqs[5])); err != nil {
			t.Fatal(err)
		}
	})
	want = append(want, ids(fourth[5:])...)
	waitPrinted("after a purge", resumeBound)
	lost := fmt.Sprintf("5 events lost: removed by the stream's retention before they could be read (sequences %d–%d); resumed at stream sequence %d",
		seqs[0], seqs[4], seqs[5])
	if n := strings.Count(events.stderr.String(), lost); n != 1 {
		t.Errorf("stderr has %q %d times, want once:\n%s", lost, n, events.stderr.String())
	}

	// 5. The stream deleted under it and made again 1.5 s later (as an
	// operator's `nats stream rm` and `narwhal bus setup` would): its
	// consumer is gone; the new stream's events come out at once.
	ctx, cancel := context.WithTimeout(context.Background(), readyBound)
	defer cancel()
	if err := rig.conn.JetStream().DeleteStream(ctx, bus.StreamName); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // an outage longer than an ordered consumer's first backoff (1 s)
	if err := bus.Setup(ctx, rig.conn, bus.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	fifth := requests("recreated", 3)
	rig.publish(t, fifth...)
	want = append(want, ids(fifth)...)
	took = waitPrinted("stream deleted and made again", resumeBound)
	if n := strings.Count(events.stderr.String(), "was made anew"); n != 2 {
		t.Errorf("stderr says %d times that the stream was made anew, want 2:\n%s", n, events.stderr.String())
	}
	t.Logf("R-BUS-5: a stream deleted and made again: its events printed %v after they were stored", took.Round(time.Millisecond))

	if err := events.stop(syscall.SIGINT); err != nil {
		t.Errorf("narwhal events after SIGINT: %v", err)
	}
	// A late duplicate would be after the lines waited for: all of them once.
	if got := printedIDs(t, events); !slices.Equal(got, want) {
		t.Errorf("narwhal events printed in all\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
