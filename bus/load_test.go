package bus_test

import (
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
	id, err := bus.ParseLoadReport(data, func(e []byte, p, d, k int64) { got = append(got, loadEntry{string(e), p, d, k}) })
	return id, got, err
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
