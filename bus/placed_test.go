package bus

import (
	"errors"
	"slices"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestPlacedRoundTripRPLACE4: a placement in flight encodes and decodes
// to the same ids and keys (a prompt past PlacedMaxKeys by its head), is
// told from a load report, and decodes without allocating once its
// buffer has grown.
func TestPlacedRoundTripRPLACE4(t *testing.T) {
	keys := make([]uint64, PlacedMaxKeys+40)
	for i := range keys {
		keys[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
	}
	msg, ok := AppendPlaced(nil, "r1", "p1", keys)
	if !ok || !IsPlaced(msg) {
		t.Fatalf("encoded %v, placed %v", ok, IsPlaced(msg))
	}
	var r LoadReport
	r.Reset("r1")
	if IsPlaced(r.Bytes()) {
		t.Fatal("a load report taken for a placement")
	}
	router, engine, got, err := ParsePlaced(msg, nil)
	if err != nil || string(router) != "r1" || string(engine) != "p1" || !slices.Equal(got, keys[:PlacedMaxKeys]) {
		t.Fatalf("decoded %q %q %d keys, %v", router, engine, len(got), err)
	}
	if allocs := testkit.LeastAllocs(100, func() { _, _, got, _ = ParsePlaced(msg, got) }); allocs != 0 {
		t.Fatalf("%v allocations per decode", allocs)
	}
	for _, bad := range []struct{ router, engine string }{{"", "p1"}, {"r1", ""}, {string(make([]byte, 256)), "p1"}} {
		if _, ok := AppendPlaced(nil, bad.router, bad.engine, keys); ok {
			t.Fatalf("encoded ids %q %q", bad.router, bad.engine)
		}
	}
	if _, ok := AppendPlaced(nil, "r1", "p1", nil); ok {
		t.Fatal("encoded a placement without keys")
	}
}

// TestPlacedRefusesHostileMessagesRPLACE4: truncated, padded, miscounted,
// keyless or over-long placements and bad ids are refused whole (R-BUS-9).
func TestPlacedRefusesHostileMessagesRPLACE4(t *testing.T) {
	good, _ := AppendPlaced(nil, "r1", "p1", []uint64{1, 2, 3})
	over := append([]byte(placedMagic+"\x02r1\x02p1"), 0x01, 0x01) // 257 keys claimed
	over = append(over, make([]byte, 8*257)...)
	cases := map[string][]byte{
		"load report magic": append([]byte("NWL1"), good[4:]...),
		"truncated":         good[:len(good)-1],
		"padded":            append(slices.Clone(good), 0),
		"no keys":           []byte(placedMagic + "\x02r1\x02p1\x00\x00"),
		"257 keys":          over,
		"empty router id":   []byte(placedMagic + "\x00\x02p1\x01\x00\x01\x00\x00\x00\x00\x00\x00\x00"),
		"router id not UTF-8": []byte(placedMagic + "\x01\xff\x02p1\x01\x00" +
			"\x01\x00\x00\x00\x00\x00\x00\x00"),
		"engine id past the end": []byte(placedMagic + "\x02r1\x09p1"),
		"nothing after magic":    []byte(placedMagic),
	}
	for name, data := range cases {
		if _, _, _, err := ParsePlaced(data, nil); !errors.Is(err, ErrLoadReport) {
			t.Errorf("%s: %v, want ErrLoadReport", name, err)
		}
	}
}

// FuzzParsePlaced: any input either is refused with ErrLoadReport or
// decodes to a placement that encodes back to the same bytes.
func FuzzParsePlaced(f *testing.F) {
	good, _ := AppendPlaced(nil, "r1", "p1", []uint64{1, 2, 3})
	f.Add(good)
	f.Add([]byte(placedMagic))
	f.Fuzz(func(t *testing.T, data []byte) {
		router, engine, keys, err := ParsePlaced(data, nil)
		if err != nil {
			if !errors.Is(err, ErrLoadReport) {
				t.Fatalf("error %v does not wrap ErrLoadReport", err)
			}
			return
		}
		again, ok := AppendPlaced(nil, string(router), string(engine), keys)
		if !ok || !slices.Equal(again, data) {
			t.Fatalf("decoded %q %q %d keys, encodes back to other bytes", router, engine, len(keys))
		}
	})
}

// TestPlacedEndRoundTripRPLACE4: the end of a placement's attempt names
// the prompt by the count and last key of the keys the placement
// carried (cut to PlacedMaxKeys like them), encodes and decodes to the
// same fields without allocating, is told from a placement and a load
// report, and refuses bad ids, counts and outcomes.
func TestPlacedEndRoundTripRPLACE4(t *testing.T) {
	keys := make([]uint64, PlacedMaxKeys+40)
	for i := range keys {
		keys[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
	}
	count, last := PlacedChain(keys)
	placed, _ := AppendPlaced(nil, "r1", "p1", keys)
	_, _, carried, _ := ParsePlaced(placed, nil)
	if count != len(carried) || last != carried[len(carried)-1] {
		t.Fatalf("PlacedChain %d, %x; the placement carries %d keys ending %x", count, last, len(carried), carried[len(carried)-1])
	}
	if n, l := PlacedChain(nil); n != 0 || l != 0 {
		t.Fatalf("PlacedChain of no keys %d, %x", n, l)
	}
	msg, ok := AppendPlacedEnd(nil, "r1", "p1", count, last, PlacedCompleted)
	if !ok || !IsPlacedEnd(msg) || IsPlaced(msg) || IsPlacedEnd(placed) {
		t.Fatalf("encoded %v; end %v, placement %v; a placement taken for an end %v", ok, IsPlacedEnd(msg), IsPlaced(msg), IsPlacedEnd(placed))
	}
	e, err := ParsePlacedEnd(msg)
	if err != nil || string(e.RouterID) != "r1" || string(e.EngineID) != "p1" || e.Outcome != PlacedCompleted || e.Count != count || e.Last != last {
		t.Fatalf("decoded %+v, %v", e, err)
	}
	if allocs := testkit.LeastAllocs(100, func() { e, _ = ParsePlacedEnd(msg) }); allocs != 0 {
		t.Fatalf("%v allocations per decode", allocs)
	}
	var stack [64]byte
	if allocs := testkit.LeastAllocs(100, func() { _, _ = AppendPlacedEnd(stack[:0], "r1", "p1", count, last, PlacedFailed) }); allocs != 0 {
		t.Fatalf("%v allocations per encode", allocs)
	}
	for _, bad := range []struct {
		router, engine string
		count          int
		outcome        PlacedOutcome
	}{{"", "p1", 1, PlacedFailed}, {"r1", "", 1, PlacedFailed}, {string(make([]byte, 256)), "p1", 1, PlacedFailed},
		{"r1", "p1", 0, PlacedFailed}, {"r1", "p1", PlacedMaxKeys + 1, PlacedFailed}, {"r1", "p1", 1, 2}} {
		if _, ok := AppendPlacedEnd(nil, bad.router, bad.engine, bad.count, 9, bad.outcome); ok {
			t.Fatalf("encoded %+v", bad)
		}
	}
}

// TestPlacedEndRefusesHostileMessagesRPLACE4: truncated, padded,
// miscounted ends, unknown outcomes and bad ids are refused whole
// (R-BUS-9).
func TestPlacedEndRefusesHostileMessagesRPLACE4(t *testing.T) {
	good, _ := AppendPlacedEnd(nil, "r1", "p1", 3, 7, PlacedFailed)
	tail := func(outcome byte, count uint16) []byte {
		return append([]byte(placedEndMagic+"\x02r1\x02p1"), outcome, byte(count), byte(count>>8), 7, 0, 0, 0, 0, 0, 0, 0)
	}
	cases := map[string][]byte{
		"placement magic":        append([]byte(placedMagic), good[4:]...),
		"truncated":              good[:len(good)-1],
		"padded":                 append(slices.Clone(good), 0),
		"no keys":                tail(0, 0),
		"257 keys":               tail(0, PlacedMaxKeys+1),
		"unknown outcome":        tail(2, 3),
		"empty router id":        append([]byte(placedEndMagic+"\x00\x02p1"), tail(0, 3)[10:]...),
		"router id not UTF-8":    append([]byte(placedEndMagic+"\x01\xff\x02p1"), tail(0, 3)[10:]...),
		"engine id past the end": []byte(placedEndMagic + "\x02r1\x09p1"),
		"nothing after magic":    []byte(placedEndMagic),
	}
	if _, err := ParsePlacedEnd(tail(1, 3)); err != nil {
		t.Fatalf("the cases' own well-formed end refused: %v", err)
	}
	for name, data := range cases {
		if _, err := ParsePlacedEnd(data); !errors.Is(err, ErrLoadReport) {
			t.Errorf("%s: %v, want ErrLoadReport", name, err)
		}
	}
}

// FuzzParsePlacedEnd: any input either is refused with ErrLoadReport or
// decodes to an end that encodes back to the same bytes.
func FuzzParsePlacedEnd(f *testing.F) {
	good, _ := AppendPlacedEnd(nil, "r1", "p1", 3, 7, PlacedCompleted)
	f.Add(good)
	f.Add([]byte(placedEndMagic))
	f.Fuzz(func(t *testing.T, data []byte) {
		e, err := ParsePlacedEnd(data)
		if err != nil {
			if !errors.Is(err, ErrLoadReport) {
				t.Fatalf("error %v does not wrap ErrLoadReport", err)
			}
			return
		}
		again, ok := AppendPlacedEnd(nil, string(e.RouterID), string(e.EngineID), e.Count, e.Last, e.Outcome)
		if !ok || !slices.Equal(again, data) {
			t.Fatalf("decoded %+v, encodes back to other bytes", e)
		}
	})
}
