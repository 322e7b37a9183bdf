package bus_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

type loadEntry struct {
	id                      string
	prefill, decode, tokens int64
}

func parseLoad(t *testing.T, data []byte) (string, []loadEntry, error) {
	t.Helper()
	var got []loadEntry
	id, err := bus.ParseLoadReport(data, func(e []byte, l bus.EngineLoad) {
		if l.HeadBusy != 0 || l.HeadEnd != 0 || l.PaceMean != 0 || l.PaceTokens != 0 {
			t.Errorf("entry %s: a head %+v where none was added", e, l)
		}
		got = append(got, loadEntry{string(e), l.Prefill, l.Decode, l.Tokens})
	})
	return id, got, err
}

// TestLoadReportCarriesTheHeadRPLACE3: the head of each engine's queue
// (its busy and end ages and the pace) comes back as it was appended, to
// the microsecond, a known age under a microsecond stays known, and a
// duration past LoadMaxAge is neither appended nor parsed; a version 1
// report of another router is still read, its entries without a head.
func TestLoadReportCarriesTheHeadRPLACE3(t *testing.T) {
	var r bus.LoadReport
	r.Reset("router-a")
	want := []bus.EngineLoad{
		{Prefill: 2, Tokens: 900, HeadBusy: 1500 * time.Microsecond, HeadEnd: 40 * time.Millisecond, PaceMean: 310 * time.Millisecond, PaceTokens: 640},
		{Decode: 3, HeadEnd: 1},
		{Prefill: 1, HeadBusy: bus.LoadMaxAge, PaceMean: bus.LoadMaxAge, PaceTokens: bus.LoadMaxCount},
	}
	for i, l := range want {
		if !r.Append("e"+string(rune('1'+i)), l) {
			t.Fatalf("append %+v refused", l)
		}
	}
	for _, bad := range []bus.EngineLoad{{HeadBusy: bus.LoadMaxAge + time.Microsecond}, {HeadEnd: -1}, {PaceMean: bus.LoadMaxAge + time.Microsecond}, {PaceTokens: bus.LoadMaxCount + 1}} {
		if r.Append("x", bad) {
			t.Fatalf("append %+v accepted", bad)
		}
	}
	want[1].HeadEnd = time.Nanosecond // under a microsecond: known, as the least
	var got []bus.EngineLoad
	if _, err := bus.ParseLoadReport(r.Bytes(), func(_ []byte, l bus.EngineLoad) { got = append(got, l) }); err != nil || len(got) != len(want) {
		t.Fatalf("parsed %v, %v", got, err)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("entry %d: %+v, want %+v", i, got[i], want[i])
		}
	}

	// A version 1 report: "NWL1", the id, two engines of three counts.
	v1 := []byte("NWL1\x02r1\x02\x00\x02p1\x03\x00\x90\x03\x02d1\x00\x05\x00")
	id, entries, err := parseLoad(t, v1)
	if err != nil || id != "r1" || len(entries) != 2 || entries[0] != (loadEntry{"p1", 3, 0, 400}) || entries[1] != (loadEntry{"d1", 0, 5, 0}) {
		t.Fatalf("version 1: %q %v %v", id, entries, err)
	}
	// An age past the bound, written by hand, is refused.
	r.Reset("router-a")
	r.Append("p1", bus.EngineLoad{Prefill: 1})
	huge := r.Bytes()
	huge = append(huge[:len(huge)-4], 0x80, 0xb0, 0xd0, 0xb5, 0x0e, 0, 0, 0) // head busy of about 3.9e9 µs, over an hour
	if _, _, err := parseLoad(t, huge); !errors.Is(err, bus.ErrLoadReport) {
		t.Fatalf("an age over LoadMaxAge: %v, want refused", err)
	}
}

// FuzzParseLoadReport: any input either is refused with ErrLoadReport
// or parses into entries within the bounds that, appended again, make a
// report parsed into the same entries.
func FuzzParseLoadReport(f *testing.F) {
	var r bus.LoadReport
	r.Reset("r1")
	r.Append("p1", bus.EngineLoad{Prefill: 2, Tokens: 77, HeadBusy: time.Millisecond, PaceMean: time.Second, PaceTokens: 9})
	f.Add(append([]byte(nil), r.Bytes()...))
	f.Add([]byte("NWL1\x02r1\x01\x00\x02p1\x03\x00\x90\x03"))
	// A valid version 1 report of 1,024 long ids (62,472 bytes), which
	// does not fit whole in version 2.
	big := []byte("NWL1\x01r\x00\x04")
	for range bus.LoadMaxEngines {
		big = append(big, 57)
		big = append(big, strings.Repeat("e", 57)...)
		big = append(big, 1, 0, 1)
	}
	f.Add(big)
	f.Fuzz(func(t *testing.T, data []byte) {
		var ids []string
		var got []bus.EngineLoad
		id, err := bus.ParseLoadReport(data, func(e []byte, l bus.EngineLoad) {
			ids, got = append(ids, string(e)), append(got, l)
		})
		if err != nil {
			if !errors.Is(err, bus.ErrLoadReport) {
				t.Fatalf("error %v does not wrap ErrLoadReport", err)
			}
			return
		}
		var back bus.LoadReport
		back.Reset(id)
		for i, l := range got {
			if !back.Append(ids[i], l) {
				// Only a version 1 report near the bound may not fit:
				// each of its entries grows by the head's four fields.
				if !bytes.HasPrefix(data, []byte("NWL1")) || len(back.Bytes())+1+len(ids[i])+7*binary.MaxVarintLen64 <= bus.LoadMaxReport {
					t.Fatalf("parsed entry %s %+v not appendable", ids[i], l)
				}
				got, ids = got[:i], ids[:i]
				break
			}
		}
		k := 0
		if _, err := bus.ParseLoadReport(back.Bytes(), func(e []byte, l bus.EngineLoad) {
			if k >= len(got) || string(e) != ids[k] || l != got[k] {
				t.Fatalf("re-encoded entry %d: %s %+v", k, e, l)
			}
			k++
		}); err != nil || k != len(got) {
			t.Fatalf("re-encoded report: %d entries, %v", k, err)
		}
	})
}

// TestLoadReportRoundTripRPLACE3: what LoadReport encodes,
// ParseLoadReport decodes; an empty report is valid (the router has
// nothing in flight any more); invalid entries are not added, and a
// report never grows past its bounds.
func TestLoadReportRoundTripRPLACE3(t *testing.T) {
	var r bus.LoadReport
	r.Reset("router-a")
	want := []loadEntry{{"p1", 3, 0, 6000}, {"both-2", 1, 7, 1 << 40}, {"d1", 0, 12, 0}}
	for _, e := range want {
		if !r.Add(e.id, e.prefill, e.decode, e.tokens) {
			t.Fatalf("add %v refused", e)
		}
	}
	for _, bad := range []loadEntry{{"", 1, 1, 1}, {strings.Repeat("x", 256), 1, 1, 1}, {"p", -1, 0, 0}, {"p", 0, 0, 1<<40 + 1}} {
		if r.Add(bad.id, bad.prefill, bad.decode, bad.tokens) {
			t.Fatalf("add %v accepted", bad)
		}
	}
	id, got, err := parseLoad(t, r.Bytes())
	if err != nil || id != "router-a" || len(got) != len(want) {
		t.Fatalf("parsed %q %v %v", id, got, err)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("entry %d: %v, want %v", i, got[i], want[i])
		}
	}
	r.Reset("router-a")
	if id, got, err := parseLoad(t, r.Bytes()); err != nil || id != "router-a" || len(got) != 0 {
		t.Fatalf("empty report: %q %v %v", id, got, err)
	}
	for i := 0; ; i++ {
		if !r.Add(strings.Repeat("e", 200)+string(rune('a'+i%26))+strings.Repeat("z", i/26%10), 1, 1, 1) {
			break
		}
	}
	if r.Len() > bus.LoadMaxEngines || len(r.Bytes()) > bus.LoadMaxReport {
		t.Fatalf("report of %d engines, %d bytes", r.Len(), len(r.Bytes()))
	}
	if _, _, err := parseLoad(t, r.Bytes()); err != nil {
		t.Fatalf("full report refused: %v", err)
	}
}

// TestLoadReportRefusesHostileRBUS9: a report that is not one, too
// large, cut anywhere, with trailing bytes, a bad id or a count past the
// bound is refused, never panics.
func TestLoadReportRefusesHostileRBUS9(t *testing.T) {
	var r bus.LoadReport
	r.Reset("router-a")
	r.Add("p1", 3, 1, 500)
	good := append([]byte(nil), r.Bytes()...)
	for cut := 0; cut < len(good); cut++ {
		if _, _, err := parseLoad(t, good[:cut]); err == nil && cut != len("NWL1")+1+len("router-a")+2 {
			t.Fatalf("cut at %d accepted", cut)
		}
	}
	huge := append([]byte(nil), good[:len(good)-1]...)
	huge = append(huge, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01) // tokens far past LoadMaxCount
	for name, data := range map[string][]byte{
		"trailing":  append(append([]byte(nil), good...), 0),
		"magic":     append([]byte("NWP1"), good[4:]...),
		"oversized": append(append([]byte(nil), good...), make([]byte, bus.LoadMaxReport)...),
		"count":     huge,
		"bad utf8":  []byte("NWL1\x01\xff\x00\x00"),
		"no id":     []byte("NWL1\x00\x00\x00"),
	} {
		if _, _, err := parseLoad(t, data); !errors.Is(err, bus.ErrLoadReport) {
			t.Errorf("%s: %v, want refused", name, err)
		}
	}
}

// TestLoadReportPermissionsRPLACE3 (R-BUS-11, R-PLACE-3): against a real
// server with auth, a router publishes its load reports on its own
// subject and the other routers receive them; it cannot publish under
// another router's subject (the server refuses it and nothing is
// delivered).
func TestLoadReportPermissionsRPLACE3(t *testing.T) {
	e, dir := authServer(t)
	r1 := connectID(t, e, dir, bus.RoleRouter, "r1")
	r2 := connectID(t, e, dir, bus.RoleRouter, "r2")
	got := receive(t, r2, bus.LoadSubjectPrefix+"*")
	var r bus.LoadReport
	r.Reset("r2")
	r.Add("p1", 50, 0, 100000)
	_ = r1.Conn().Publish(bus.LoadSubject("r2"), r.Bytes()) // forged: r1 as r2
	testkit.WaitFor(t, waitBound, "the server's permissions violation", func() bool {
		err := r1.PermissionError()
		return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), bus.LoadSubject("r2"))
	})
	r.Reset("r1")
	r.Add("p1", 1, 0, 10)
	if err := r1.Conn().Publish(bus.LoadSubject("r1"), r.Bytes()); err != nil {
		t.Fatal(err)
	}
	_ = r1.Conn().Flush()
	select {
	case m := <-got:
		// The forged report, had it passed, would have come first.
		if m.Subject != bus.LoadSubject("r1") {
			t.Fatalf("r2 received a report on %s", m.Subject)
		}
	case <-time.After(waitBound):
		t.Fatal("r2 received nothing of r1's own report")
	}
	if err := r2.PermissionError(); err != nil {
		t.Fatalf("r2 subscribing to the load reports: %v", err)
	}
}

// TestPlacedPermissionsRPLACE4 (R-BUS-11, R-PLACE-4): against a real
// server with auth and each identity's own credential, router r1 cannot
// publish a placement in flight under router r2's subject, nor engine
// p1 under r1's (the server refuses both and nothing is delivered); r1's
// own, on its own subject, reaches r2 first.
func TestPlacedPermissionsRPLACE4(t *testing.T) {
	e, dir := authServer(t)
	r1 := connectID(t, e, dir, bus.RoleRouter, "r1")
	r2 := connectID(t, e, dir, bus.RoleRouter, "r2")
	p1 := connectID(t, e, dir, bus.RoleEngine, "p1")
	got := receive(t, r2, bus.LoadSubjectPrefix+"*")
	keys := []uint64{1, 2, 3, 4}
	for _, f := range []struct {
		by      *bus.Bus
		as      string
		subject string
	}{{r1, "r2", bus.LoadSubject("r2")}, {p1, "r1", bus.LoadSubject("r1")}} {
		msg, _ := bus.AppendPlaced(nil, f.as, "p1", keys)
		_ = f.by.Conn().Publish(f.subject, msg)
		testkit.WaitFor(t, waitBound, "the server's refusal of a forged placement on "+f.subject, func() bool {
			err := f.by.PermissionError()
			return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), f.subject)
		})
	}
	own, _ := bus.AppendPlaced(nil, "r1", "p1", keys)
	if err := r1.Conn().Publish(bus.LoadSubject("r1"), own); err != nil {
		t.Fatal(err)
	}
	_ = r1.Conn().Flush()
	select {
	case m := <-got:
		router, _, _, err := bus.ParsePlaced(m.Data, nil)
		if m.Subject != bus.LoadSubject("r1") || err != nil || string(router) != "r1" {
			t.Fatalf("r2 received %q on %s (%v): a forged placement passed", router, m.Subject, err)
		}
	case <-time.After(waitBound):
		t.Fatal("r2 received nothing of r1's own placement")
	}
}
