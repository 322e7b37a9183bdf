package bus_test

import (
	"context"
	"encoding/binary"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestPrefixBatchRoundTrip: what PrefixBatch encodes, ParsePrefixBatch
// decodes, placement by placement, and a batch never grows past
// PrefixMaxBatch (R-PLACE-2's shared index).
func TestPrefixBatchRoundTrip(t *testing.T) {
	var b bus.PrefixBatch
	b.Reset("router-a")
	want := []bus.PrefixPlacement{
		{EngineID: "p1", Hashes: []uint64{1, 2, 3}},
		{EngineID: "p2", Hashes: []uint64{^uint64(0)}},
		{EngineID: "p1", Hashes: []uint64{7}},
	}
	for _, p := range want {
		if !b.Add(p.EngineID, p.Hashes) {
			t.Fatalf("Add %v refused", p)
		}
	}
	id, got, err := bus.ParsePrefixBatch(b.Bytes())
	if err != nil || id != "router-a" || len(got) != len(want) {
		t.Fatalf("parse: %q %v %v", id, got, err)
	}
	for i := range want {
		if got[i].EngineID != want[i].EngineID || !slices.Equal(got[i].Hashes, want[i].Hashes) {
			t.Fatalf("placement %d: %v, want %v", i, got[i], want[i])
		}
	}

	// Invalid placements are refused; a full batch refuses more.
	b.Reset("r")
	if b.Add("", []uint64{1}) || b.Add("p1", nil) || b.Add(strings.Repeat("x", 256), []uint64{1}) || b.Add("p1", make([]uint64, bus.PrefixMaxHashes+1)) {
		t.Fatal("an invalid placement was added")
	}
	full := make([]uint64, bus.PrefixMaxHashes)
	n := 0
	for b.Add("p1", full) {
		n++
	}
	if n == 0 || len(b.Bytes()) > bus.PrefixMaxBatch || b.Len() != n {
		t.Fatalf("%d placements in %d bytes", n, len(b.Bytes()))
	}
	if _, got, err := bus.ParsePrefixBatch(b.Bytes()); err != nil || len(got) != n {
		t.Fatalf("a full batch: %d placements, %v", len(got), err)
	}

	// Reuse allocates nothing once grown.
	hs := []uint64{1, 2, 3, 4}
	if a := testkit.LeastAllocs(100, func() { b.Reset("router-a"); b.Add("p1", hs); _ = b.Bytes() }); a != 0 {
		t.Fatalf("a reused batch allocates %v times", a)
	}
}

// TestParsePrefixBatchRefusesHostileInput: every malformed batch from
// the bus is refused whole (R-BUS-9).
func TestParsePrefixBatchRefusesHostileInput(t *testing.T) {
	var b bus.PrefixBatch
	b.Reset("r1")
	b.Add("p1", []uint64{1, 2})
	good := slices.Clone(b.Bytes())
	cases := map[string][]byte{
		"empty":         nil,
		"other magic":   append([]byte("NWP2"), good[4:]...),
		"truncated":     good[:len(good)-1],
		"trailing byte": append(slices.Clone(good), 0),
		"no router id":  append([]byte("NWP1\x00"), good[7:]...),
		"bad utf-8 id":  append([]byte("NWP1\x02\xff\xfe"), good[7:]...),
		"too large":     make([]byte, bus.PrefixMaxBatch+1),
	}
	zeroCount := slices.Clone(good)
	binary.LittleEndian.PutUint16(zeroCount[7:], 0)
	cases["no placements"] = zeroCount[:9]
	moreCount := slices.Clone(good)
	binary.LittleEndian.PutUint16(moreCount[7:], 2)
	cases["count past the end"] = moreCount
	zeroHashes := slices.Clone(good)
	binary.LittleEndian.PutUint16(zeroHashes[12:], 0)
	cases["placement without hashes"] = zeroHashes[:14]
	manyHashes := slices.Clone(good)
	binary.LittleEndian.PutUint16(manyHashes[12:], 60000)
	cases["hashes past the end"] = manyHashes
	for name, data := range cases {
		if _, p, err := bus.ParsePrefixBatch(data); !errors.Is(err, bus.ErrPrefixBatch) || p != nil {
			t.Errorf("%s: %v %v, want a refusal", name, p, err)
		}
		if id, err := bus.CheckPrefixBatch(data); !errors.Is(err, bus.ErrPrefixBatch) || id != nil {
			t.Errorf("%s: CheckPrefixBatch %q %v, want a refusal", name, id, err)
		}
		bus.EachPrefixPlacement(data, nil, func(eid []byte, _ []uint64) {
			t.Errorf("%s: EachPrefixPlacement visited placement on %q", name, eid)
		})
	}
}

// TestEachPrefixPlacementReadsWhatParseDecodesRBUS9: CheckPrefixBatch and
// EachPrefixPlacement give the router id and the placements
// ParsePrefixBatch gives, and allocate nothing once the buffer of hashes
// has grown.
func TestEachPrefixPlacementReadsWhatParseDecodesRBUS9(t *testing.T) {
	var b bus.PrefixBatch
	b.Reset("router-a")
	b.Add("p1", []uint64{1, 2, 3})
	b.Add("p2", []uint64{^uint64(0)})
	b.Add("p1", make([]uint64, bus.PrefixMaxHashes))
	data := b.Bytes()
	id, want, err := bus.ParsePrefixBatch(data)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := bus.CheckPrefixBatch(data); err != nil || string(got) != id {
		t.Fatalf("CheckPrefixBatch: %q %v, want %q", got, err, id)
	}
	var buf []uint64
	i := 0
	buf = bus.EachPrefixPlacement(data, buf, func(eid []byte, hs []uint64) {
		if i >= len(want) || string(eid) != want[i].EngineID || !slices.Equal(hs, want[i].Hashes) {
			t.Fatalf("placement %d: %s %d hashes, want %v", i, eid, len(hs), want[min(i, len(want)-1)].EngineID)
		}
		i++
	})
	if i != len(want) {
		t.Fatalf("visited %d placements, want %d", i, len(want))
	}
	visit := func([]byte, []uint64) {}
	if a := testkit.LeastAllocs(100, func() {
		_, _ = bus.CheckPrefixBatch(data)
		buf = bus.EachPrefixPlacement(data, buf, visit)
	}); a != 0 {
		t.Fatalf("reading a batch allocates %v times", a)
	}
}

// FuzzParsePrefixBatch: no input panics, and whatever is accepted encodes
// back to the same bytes.
func FuzzParsePrefixBatch(f *testing.F) {
	var b bus.PrefixBatch
	b.Reset("r1")
	b.Add("p1", []uint64{1, 2})
	f.Add(slices.Clone(b.Bytes()))
	f.Fuzz(func(t *testing.T, data []byte) {
		id, ps, err := bus.ParsePrefixBatch(data)
		checked, cerr := bus.CheckPrefixBatch(data)
		if (err == nil) != (cerr == nil) || string(checked) != id {
			t.Fatalf("ParsePrefixBatch %q %v, CheckPrefixBatch %q %v", id, err, checked, cerr)
		}
		visited := 0
		bus.EachPrefixPlacement(data, nil, func(eid []byte, hs []uint64) {
			if visited >= len(ps) || string(eid) != ps[visited].EngineID || !slices.Equal(hs, ps[visited].Hashes) {
				t.Fatalf("EachPrefixPlacement's placement %d differs", visited)
			}
			visited++
		})
		if visited != len(ps) {
			t.Fatalf("EachPrefixPlacement visited %d placements, ParsePrefixBatch decoded %d", visited, len(ps))
		}
		if err != nil {
			return
		}
		var again bus.PrefixBatch
		again.Reset(id)
		for _, p := range ps {
			if !again.Add(p.EngineID, p.Hashes) {
				t.Fatalf("accepted placement %v does not encode", p)
			}
		}
		if string(again.Bytes()) != string(data) {
			t.Fatal("accepted batch does not encode back to itself")
		}
	})
}

// TestPrefixPlacementPermissions (R-BUS-8, R-PLACE-2): a router publishes
// prefix placements, other routers receive them at once and find them in
// stream NARWHAL_PREFIX through a consumer of their own; no other role,
// and no other router (R-BUS-11), may publish a router's placements.
func TestPrefixPlacementPermissions(t *testing.T) {
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	routerA := connectID(t, e, dir, bus.RoleRouter, "router-a")
	routerB := connectID(t, e, dir, bus.RoleRouter, "router-b")

	got := make(chan []byte, 1)
	sub, err := routerB.Conn().Subscribe(bus.PrefixSubjectPrefix+"*", func(m *nats.Msg) { got <- m.Data })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := routerB.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	var b bus.PrefixBatch
	b.Reset("router-a")
	b.Add("p1", []uint64{42})
	if err := routerA.Conn().Publish(bus.PrefixSubject("router-a"), b.Bytes()); err != nil {
		t.Fatal(err)
	}
	if err := routerA.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	select {
	case data := <-got:
		if _, ps, err := bus.ParsePrefixBatch(data); err != nil || ps[0].Hashes[0] != 42 {
			t.Fatalf("router B received %v %v", ps, err)
		}
	case <-time.After(waitBound):
		t.Fatal("router B received nothing")
	}
	if err := routerA.PermissionError(); err != nil {
		t.Fatalf("router A publishing placements: %v", err)
	}

	// As a router warms its index: the stream's info, then a consumer of
	// its own name (R-BUS-11) from a start time, fetched from.
	if _, err := routerB.JetStream().Stream(ctx, bus.PrefixStream); err != nil {
		t.Fatalf("router reads the prefix stream's info: %v", err)
	}
	since := time.Now().Add(-bus.PrefixMaxAge)
	oc, err := bus.OwnConsumer(ctx, routerB.JetStream(), bus.PrefixStream, jetstream.ConsumerConfig{
		Name:          routerB.ConsumerName(bus.PurposePrefix),
		FilterSubject: bus.PrefixSubjectPrefix + "*", DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: &since,
		AckPolicy: jetstream.AckNonePolicy, MemoryStorage: true, InactiveThreshold: 5 * time.Second,
	})
	if err != nil {
		t.Fatalf("router reads the prefix stream: %v", err)
	}
	batch, err := oc.Fetch(1, jetstream.FetchMaxWait(waitBound))
	if err != nil {
		t.Fatalf("router reads the prefix stream: %v", err)
	}
	msg := <-batch.Messages()
	if msg == nil || msg.Subject() != bus.PrefixSubject("router-a") {
		t.Fatalf("router reads the prefix stream: %v %v", msg, batch.Error())
	}
	if err := routerB.PermissionError(); err != nil {
		t.Fatalf("router B reading the stream: %v", err)
	}

	others := map[string]*bus.Bus{"router-b": routerB, "engine p1": connectID(t, e, dir, bus.RoleEngine, "p1")}
	for _, role := range []string{bus.RoleBreaker, bus.RoleChaos, bus.RoleViewer} {
		others[role] = connectAs(t, e, dir, role)
	}
	for role, other := range others {
		denied(t, other, role+" publishes a prefix placement", "narwhal.prefix.router-a", func(ctx context.Context) error {
			_, err := other.JetStream().Publish(ctx, bus.PrefixSubject("router-a"), b.Bytes())
			return err
		})
	}
}
