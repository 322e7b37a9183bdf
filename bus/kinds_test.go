package bus_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestPermissionsFollowTheEventKinds proves that the credentials take
// the event kinds from schemas.EventKinds (R-BUS-8, R-BUS-11): every role
// a row names is a role of the mesh that can be given events (not the
// viewer, which only reads, nor the admin, which may do anything); a role
// may publish narwhal.events.<kind>.* exactly when the row names it among
// the publishers, and no role but the admin subscribes to an event subject
// with core NATS (R-BUS-11); the viewer publishes no event. A router
// publishes a kind the row gives it only under its own id:
// narwhal.events.<kind>.*.<id> for a kind about an engine,
// narwhal.events.<kind>.<id> for one about the router.
func TestPermissionsFollowTheEventKinds(t *testing.T) {
	perms := map[string][2][]string{}
	for _, role := range bus.Roles {
		p, err := bus.RolePermissions(role)
		if err != nil {
			t.Fatal(err)
		}
		perms[role] = [2][]string{p.Pub.Allow, p.Sub.Allow}
	}
	rp, err := bus.RouterPermissions("r1", []byte("seed"))
	if err != nil {
		t.Fatal(err)
	}
	perms[bus.RoleRouter] = [2][]string{rp.Pub.Allow, rp.Sub.Allow}
	ep, err := bus.EnginePermissions("p1", []byte("seed"))
	if err != nil {
		t.Fatal(err)
	}
	perms[bus.RoleEngine] = [2][]string{ep.Pub.Allow, ep.Sub.Allow}
	roles := slices.Concat(bus.Roles, []string{bus.RoleRouter, bus.RoleEngine})
	for _, k := range schemas.EventKinds() {
		for _, role := range k.Publishers {
			if !slices.Contains(roles, role) || role == bus.RoleViewer || role == bus.RoleAdmin {
				t.Errorf("kind %s names role %q: want one of %v but the viewer and the admin", k.Name, role, roles)
			}
		}
		for _, role := range roles {
			if role == bus.RoleAdmin {
				continue
			}
			pub := role != bus.RoleViewer && slices.Contains(k.Publishers, role)
			subject := k.Filter()
			if role == bus.RoleRouter && k.ID == schemas.IDRouter {
				subject = bus.SubjectPrefix + k.Name + ".r1"
			} else if role == bus.RoleRouter {
				subject = bus.SubjectPrefix + k.Name + ".*.r1"
			}
			if got := slices.Contains(perms[role][0], subject); got != pub {
				t.Errorf("role %s may publish %s: %v, want %v (publishers %v)", role, subject, got, pub, k.Publishers)
			}
			if role == bus.RoleRouter && slices.Contains(perms[role][0], k.Filter()) {
				t.Errorf("router r1 may publish %s: under any id", k.Filter())
			}
		}
	}
	// No credential but the admin's subscribes to an event subject with
	// core NATS: a forged push delivery there would pass for an event
	// (R-BUS-11); events are read through stream consumers.
	for _, role := range roles {
		if role == bus.RoleAdmin {
			continue
		}
		for _, sub := range perms[role][1] {
			if strings.HasPrefix(sub, "narwhal.events.") || sub == ">" || strings.HasPrefix(sub, "narwhal.>") || strings.HasPrefix(sub, "narwhal.*") {
				t.Errorf("role %s may subscribe to %s: event subjects with core NATS", role, sub)
			}
		}
	}
	if p, _ := bus.RolePermissions(bus.RoleAdmin); !slices.Equal(p.Pub.Allow, []string{">"}) {
		t.Errorf("admin publishes %v, want everything", p.Pub.Allow)
	}
}

// TestEveryKindsPublishersPublish proves on a server that enforces the
// credentials (R-BUS-8, R-BUS-11) that each role a row of
// schemas.EventKinds names among its publishers really may publish events
// of that kind into NARWHAL_EVENTS — a router under its own id, as the
// last token of the subject.
func TestEveryKindsPublishersPublish(t *testing.T) {
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conns := map[string]*bus.Bus{}
	for _, k := range schemas.EventKinds() {
		for _, role := range k.Publishers {
			if conns[role] == nil && role == bus.RoleRouter {
				conns[role] = connectID(t, e, dir, bus.RoleRouter, "kinds-router")
			} else if conns[role] == nil {
				conns[role] = connectAs(t, e, dir, role)
			}
			subject := k.Subject("kinds-test", "kinds-test")
			if role == bus.RoleRouter && k.ID == schemas.IDRouter {
				subject = k.Subject("kinds-router", "")
			} else if role == bus.RoleRouter {
				subject = k.Subject("kinds-test", "kinds-router")
			}
			if _, err := conns[role].JetStream().Publish(ctx, subject, []byte(`{}`)); err != nil {
				t.Errorf("%s publishes a %s event on %s: %v (%v)", role, k.Name, subject, err, conns[role].PermissionError())
			}
		}
	}
}

// TestHistoryFollowsTheEventKinds proves that NARWHAL_HISTORY is
// sourced with one filter per kind whose row of schemas.EventKinds sets
// History, in the table's order, and with nothing else (R-BUS-1).
func TestHistoryFollowsTheEventKinds(t *testing.T) {
	var want []string
	for _, k := range schemas.EventKinds() {
		if k.History {
			want = append(want, k.Name)
		}
	}
	if !slices.Equal(bus.HistoryKinds, want) {
		t.Errorf("HistoryKinds %v, want %v", bus.HistoryKinds, want)
	}
	e := bustest.StartWith(t, bus.EmbeddedOptions{Port: 0})
	b := connect(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := b.JetStream().Stream(ctx, bus.HistoryStream)
	if err != nil {
		t.Fatal(err)
	}
	srcs := st.CachedInfo().Config.Sources
	if len(srcs) != 1 || srcs[0].Name != bus.StreamName {
		t.Fatalf("history sources %+v, want %s alone", srcs, bus.StreamName)
	}
	var got []string
	for _, tr := range srcs[0].SubjectTransforms {
		if tr.Source != tr.Destination {
			t.Errorf("transform %s → %s, want the subject kept", tr.Source, tr.Destination)
		}
		got = append(got, tr.Source)
	}
	var wantFilters []string
	for _, k := range want {
		wantFilters = append(wantFilters, bus.SubjectPrefix+k+".>")
	}
	if !slices.Equal(got, wantFilters) {
		t.Errorf("history filters %v, want %v", got, wantFilters)
	}
}

// TestDropCounterHasEveryKind proves narwhal_events_dropped_total starts
// with a zero series for every kind of schemas.EventKinds and every reason
// (R-BUS-10), so a new kind needs no change to the publisher.
func TestDropCounterHasEveryKind(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1})
	b := connect(t, e)
	reg := prometheus.NewRegistry()
	p := bus.NewPublisher(b, 4, reg)
	defer p.Close()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, mf := range mfs {
		if mf.GetName() != "narwhal_events_dropped_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetCounter().GetValue() == 0 {
				seen[label(m, "kind")]++
			}
		}
	}
	for _, k := range schemas.EventKinds() {
		if seen[k.Name] != 4 {
			t.Errorf("kind %s: %d zero series of narwhal_events_dropped_total, want one per reason (4)", k.Name, seen[k.Name])
		}
	}
}
