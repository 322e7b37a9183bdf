package bus_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// registrationsStream makes stream NARWHAL_REGISTRATIONS with the admin
// credential when the set-up has not made it, as the engines'
// registrations need it: the last message of each subject, no rollup, no
// purge, no message delete (behaviour.md R-FLEET-5).
func registrationsStream(t *testing.T, admin *bus.Bus) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	if _, err := admin.JetStream().Stream(ctx, bus.RegistrationsStream); err == nil {
		return
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatal(err)
	}
	if _, err := admin.JetStream().CreateStream(ctx, jetstream.StreamConfig{
		Name: bus.RegistrationsStream, Subjects: []string{bus.RegistrationSubjectPrefix + ">"},
		MaxMsgsPerSubject: 1, MaxAge: bus.RegistrationsMaxAge, DenyDelete: true, DenyPurge: true,
	}); err != nil {
		t.Fatal(err)
	}
}

// streamState is what a stream holds: its messages, first and last
// sequences and the messages of each subject.
type streamState struct {
	Msgs, First, Last uint64
	Subjects          map[string]uint64
}

// accountState reads every stream of the account (buckets included) with
// the admin credential.
func accountState(t *testing.T, admin *bus.Bus) map[string]streamState {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	out := map[string]streamState{}
	names := admin.JetStream().StreamNames(ctx)
	for name := range names.Name() {
		st, err := admin.JetStream().Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		info, err := st.Info(ctx, jetstream.WithSubjectFilter(">"))
		if err != nil {
			t.Fatal(err)
		}
		out[name] = streamState{info.State.Msgs, info.State.FirstSeq, info.State.LastSeq, info.State.Subjects}
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// historySettled waits until NARWHAL_HISTORY, which sources
// NARWHAL_EVENTS asynchronously, holds every event of the kinds it keeps
// (every kind but request events), so that a snapshot taken after it
// does not see the sourcing as a change.
func historySettled(t *testing.T, admin *bus.Bus) {
	t.Helper()
	testkit.WaitFor(t, waitBound, "NARWHAL_HISTORY to catch up with NARWHAL_EVENTS", func() bool {
		st := accountState(t, admin)
		var kept uint64
		for subject, n := range st[bus.StreamName].Subjects {
			if !strings.HasPrefix(subject, bus.SubjectPrefix+"request.") {
				kept += n
			}
		}
		return st[bus.HistoryStream].Msgs == kept
	})
}

// sameState reports every stream whose state differs between before and
// after. Of bucket narwhal_routers, whose reports lapse after
// bus.RouterReportTTL (5 s, shorter than a test), only the last sequence
// is compared: nothing was written there.
func sameState(t *testing.T, what string, before, after map[string]streamState) {
	t.Helper()
	if len(before) != len(after) {
		t.Errorf("%s: %d streams before, %d after", what, len(before), len(after))
	}
	for name, b := range before {
		a := after[name]
		if name == "KV_"+bus.RoutersBucket {
			if a.Last != b.Last {
				t.Errorf("%s wrote to stream %s: %+v → %+v", what, name, b, a)
			}
			continue
		}
		if a.Msgs != b.Msgs || a.First != b.First || a.Last != b.Last || fmt.Sprint(a.Subjects) != fmt.Sprint(b.Subjects) {
			t.Errorf("%s changed stream %s: %+v → %+v", what, name, b, a)
		}
	}
}

// rollupHeaders are the headers a publish would wipe a subject or a stream
// with: both rollups, and both as nats.go's KV Purge sends them.
var rollupHeaders = []map[string]string{
	{"Nats-Rollup": "all"},
	{"Nats-Rollup": "sub"},
	{"KV-Operation": "PURGE", "Nats-Rollup": "all"},
	{"KV-Operation": "PURGE", "Nats-Rollup": "sub"},
}

// refusedByStream asserts that a JetStream publish on subject with
// headers h (a subject b may publish) is refused by the stream, not
// stored.
func refusedByStream(t *testing.T, b *bus.Bus, subject string, h map[string]string) {
	t.Helper()
	m := nats.NewMsg(subject)
	for k, v := range h {
		m.Header.Set(k, v)
	}
	m.Data = []byte(`{}`)
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	if _, err := b.JetStream().PublishMsg(ctx, m); err == nil {
		t.Errorf("publish on %s with %v stored, want it refused", subject, h)
	} else if !strings.Contains(strings.ToLower(err.Error()), "rollup") {
		t.Errorf("publish on %s with %v: %v, want the stream's refusal of rollups", subject, h, err)
	}
}

// jsAPIBound bounds a JetStream API request that is to be denied: the
// server answers none, and the permissions violation it reports is what
// proves the refusal (an answer, however slow, fails the test).
const jsAPIBound = 150 * time.Millisecond

// jsAPIDenied asserts that b may not ask the JetStream API for
// subject (purging, deleting a message or a stream, pausing, listing):
// the server reports a permissions violation naming it. It fails with
// t.Errorf only, so it may run on a goroutine of its own — one per
// connection at most: the violation it waits for is b's last one.
func jsAPIDenied(t *testing.T, b *bus.Bus, who, subject, body string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), jsAPIBound)
	defer cancel()
	if _, err := b.Conn().RequestWithContext(ctx, subject, []byte(body)); err == nil {
		t.Errorf("%s asks %s: answered, want it refused", who, subject)
		return
	}
	if !testkit.Poll(waitBound, testkit.PollEvery, func() bool {
		err := b.PermissionError()
		return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), subject)
	}) {
		t.Errorf("%s asks %s: no permissions violation from the server within %v (last: %v)", who, subject, waitBound, b.PermissionError())
	}
}

// wipeActs are the JetStream API acts that remove messages or streams, on
// stream name.
func wipeActs(name string) [][2]string {
	return [][2]string{
		{"$JS.API.STREAM.PURGE." + name, `{}`},
		{"$JS.API.STREAM.PURGE." + name, `{"filter":">"}`},
		{"$JS.API.STREAM.MSG.DELETE." + name, `{"seq":1}`},
		{"$JS.API.STREAM.DELETE." + name, ``},
	}
}

// TestEngineIdentityRBUS11 proves an engine's own credential (R-BUS-11,
// R-FLEET-5) on a server that enforces it: engine p1 publishes its own
// registration and reads the fleet, the routers' reports and placement;
// it may not publish p2's registration, write any key of narwhal_fleet
// (its own neither: nothing but the breaker makes it active), write any
// other bucket or an event; and none of its rollup or purge attempts —
// rollup headers on the one subject it may publish, the JetStream API's
// purges and deletes on every stream — changes any stream or bucket.
func TestEngineIdentityRBUS11(t *testing.T) {
	t.Parallel() // its refused acts wait out their bounds
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	registrationsStream(t, admin)
	if _, err := admin.JetStream().Publish(ctx, "$KV."+bus.FleetBucket+".p1", []byte(`{"state":"joining"}`)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.JetStream().Publish(ctx, "$KV."+bus.RoutersBucket+".r1", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	p1 := connectID(t, e, dir, bus.RoleEngine, "p1")
	p2 := connectID(t, e, dir, bus.RoleEngine, "p2")

	// Its own acts.
	for _, eng := range []struct {
		b  *bus.Bus
		id string
	}{{p1, "p1"}, {p2, "p2"}} {
		if _, err := eng.b.JetStream().Publish(ctx, bus.RegistrationSubject(eng.id), []byte(`{"engine_id":"`+eng.id+`"}`)); err != nil {
			t.Fatalf("engine %s publishes its registration: %v (%v)", eng.id, err, eng.b.PermissionError())
		}
	}
	if _, err := p1.JetStream().Stream(ctx, bus.RegistrationsStream); err != nil {
		t.Errorf("engine reads the registrations stream's info: %v", err)
	}
	fleet, err := p1.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	if en, err := fleet.Get(ctx, "p1"); err != nil || string(en.Value()) != `{"state":"joining"}` {
		t.Fatalf("engine reads its fleet entry: %v", err)
	}
	if _, err := p1.BindBucket(ctx, bus.RoutersBucket); err != nil {
		t.Fatal(err)
	}
	// The reports through its consumer of its own name (R-BUS-11).
	if all, err := bus.ReadBucket(ctx, p1, bus.RoutersBucket, p1.ConsumerName(bus.PurposeReports)); err != nil {
		t.Fatalf("engine reads the routers' reports: %v (%v)", err, p1.PermissionError())
	} else {
		var got []string
		for _, e := range all {
			got = append(got, e.Key())
		}
		if fmt.Sprint(got) != "[r1]" {
			t.Errorf("engine read the reports %v, want [r1]", got)
		}
	}
	if err := p1.PermissionError(); err != nil {
		t.Fatalf("engine's own acts: %v", err)
	}

	historySettled(t, admin)
	before := accountState(t, admin)
	// Another engine's registration, the fleet, other buckets, events.
	for _, subject := range []string{
		bus.RegistrationSubject("p2"), bus.RegistrationSubject("p1.x"),
		"$KV." + bus.FleetBucket + ".p1", "$KV." + bus.FleetBucket + ".p2",
		"$KV." + bus.PlacementBucket + ".p1", "$KV." + bus.RoutersBucket + ".r1", "$KV." + bus.LeaseBucket + ".leader",
		"$KV." + bus.ChaosBucket + ".p1.x", "narwhal.events.failure.p1", "narwhal.events.fleet.p1", bus.PrefixSubject("p1"),
	} {
		denied(t, p1, "engine p1 publishes on "+subject, subject, func(ctx context.Context) error {
			_, err := p1.JetStream().Publish(ctx, subject, []byte(`{"state":"active","url":"http://forged"}`))
			return err
		})
	}
	denied(t, p1, "engine p1 puts its fleet entry", "$KV.narwhal_fleet.p1", func(ctx context.Context) error {
		_, err := fleet.Put(ctx, "p1", []byte(`{"state":"active"}`))
		return err
	})
	denied(t, p1, "engine p1 purges the fleet", "$KV.narwhal_fleet.p2", func(ctx context.Context) error {
		return fleet.Purge(ctx, "p2")
	})
	// Rollups on the one subject it may publish: refused by the stream.
	for _, h := range rollupHeaders {
		refusedByStream(t, p1, bus.RegistrationSubject("p1"), h)
	}
	// The JetStream API's purges and deletes, of every stream and bucket.
	for name := range before {
		for _, act := range wipeActs(name) {
			jsAPIDenied(t, p1, "engine p1", act[0], act[1])
		}
	}
	sameState(t, "engine p1's forbidden acts", before, accountState(t, admin))
	if en, err := fleet.Get(ctx, "p1"); err != nil || en.Revision() != 1 {
		t.Errorf("fleet p1 after the forbidden acts: %v %v", en, err)
	}
}

// TestRouterIdentityRBUS11 proves a router's own credential (R-BUS-11) on
// a server that enforces it: router r1 publishes its events (the engine's
// id, then its own, as the subject's last tokens; request events under its
// id), its prefix batches and its report under its own id, and may not
// under r2's nor without an id; its rollup and purge attempts on the
// subjects it may write, and the JetStream API's purges and deletes,
// change no stream and no bucket.
func TestRouterIdentityRBUS11(t *testing.T) {
	t.Parallel() // its refused acts wait out their bounds
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	r1 := connectID(t, e, dir, bus.RoleRouter, "r1")
	r2 := connectID(t, e, dir, bus.RoleRouter, "r2")

	// Its own acts.
	for _, subject := range []string{"narwhal.events.failure.d1.r1", "narwhal.events.quarantine.d1.r1",
		"narwhal.events.handoff.d1.r1", "narwhal.events.request.r1", bus.PrefixSubject("r1")} {
		if _, err := r1.JetStream().Publish(ctx, subject, []byte(`{}`)); err != nil {
			t.Errorf("router r1 publishes on %s: %v (%v)", subject, err, r1.PermissionError())
		}
	}
	reports, err := r1.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reports.Put(ctx, "r1", []byte(`{"router_id":"r1"}`)); err != nil {
		t.Fatalf("router r1 writes its report: %v", err)
	}
	r2reports, err := r2.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r2reports.Put(ctx, "r2", []byte(`{"router_id":"r2"}`)); err != nil {
		t.Fatalf("router r2 writes its report: %v", err)
	}
	// Delete writes a marker without a rollup: a router may remove its own
	// report; write it again after.
	if err := reports.Delete(ctx, "r1"); err != nil {
		t.Errorf("router r1 deletes its report: %v", err)
	}
	if _, err := reports.Put(ctx, "r1", []byte(`{"router_id":"r1"}`)); err != nil {
		t.Fatal(err)
	}
	if err := r1.PermissionError(); err != nil {
		t.Fatalf("router r1's own acts: %v", err)
	}

	historySettled(t, admin)
	before := accountState(t, admin)
	for _, subject := range []string{
		"narwhal.events.failure.d1.r2", "narwhal.events.failure.d1", "narwhal.events.failure.d1.r1.x",
		"narwhal.events.request.r2", "narwhal.events.request.r1.x", "narwhal.events.eligibility.d1",
		bus.PrefixSubject("r2"), "$KV." + bus.RoutersBucket + ".r2", "$KV." + bus.FleetBucket + ".d1",
		bus.RegistrationSubject("d1"),
	} {
		denied(t, r1, "router r1 publishes on "+subject, subject, func(ctx context.Context) error {
			_, err := r1.JetStream().Publish(ctx, subject, []byte(`{"router_id":"r2"}`))
			return err
		})
	}
	denied(t, r1, "router r1 purges r2's report", "$KV.narwhal_routers.r2", func(ctx context.Context) error {
		return reports.Purge(ctx, "r2")
	})
	// Rollups on the subjects it may publish: refused by the stream.
	for _, subject := range []string{"narwhal.events.failure.d1.r1", "narwhal.events.request.r1", bus.PrefixSubject("r1"), "$KV." + bus.RoutersBucket + ".r1"} {
		for _, h := range rollupHeaders {
			refusedByStream(t, r1, subject, h)
		}
	}
	if err := reports.Purge(ctx, "r1"); err == nil {
		t.Error("router r1 purged its report through the KV API, want the rollup refused")
	}
	for name := range before {
		for _, act := range wipeActs(name) {
			jsAPIDenied(t, r1, "router r1", act[0], act[1])
		}
	}
	sameState(t, "router r1's forbidden acts", before, accountState(t, admin))
}

// refusedSubscription asserts that b's subscription to subject is refused
// by the server (a permissions violation naming it, reported
// asynchronously) and delivers nothing that is published there.
func refusedSubscription(t *testing.T, b, publisher *bus.Bus, subject string) {
	t.Helper()
	got := make(chan *nats.Msg, 1)
	sub, err := b.Conn().Subscribe(subject, func(m *nats.Msg) { got <- m })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	_ = b.Conn().Flush()
	testkit.WaitFor(t, waitBound, "the refusal of a subscription to "+subject, func() bool {
		err := b.PermissionError()
		return err != nil && strings.Contains(err.Error(), "Subscription") && strings.Contains(err.Error(), subject)
	})
	inbox := strings.ReplaceAll(strings.ReplaceAll(subject, ">", "x"), "*", "x")
	if err := publisher.Conn().Publish(inbox, []byte("secret")); err != nil {
		t.Fatal(err)
	}
	_ = publisher.Conn().Flush()
	select {
	case m := <-got:
		t.Errorf("the refused subscription to %s received %s", subject, m.Subject)
	case <-time.After(deniedBound):
	}
}

// TestConsumersAndInboxesArePrivateRBUS11 proves that consumer ownership
// holds on a server that enforces the credentials (R-BUS-11): no
// credential but the admin's may pause a consumer or list a stream's
// consumers or their names (the viewer's neither), and no
// credential may subscribe to another's inbox (or to every inbox), where
// the replies that name its consumers travel. Each credential's own
// requests come back on its own inbox prefix.
func TestConsumersAndInboxesArePrivateRBUS11(t *testing.T) {
	t.Parallel() // its refused acts wait out their bounds
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	registrationsStream(t, admin)
	conns := map[string]*bus.Bus{
		"router r1": connectID(t, e, dir, bus.RoleRouter, "r1"),
		"engine p1": connectID(t, e, dir, bus.RoleEngine, "p1"),
	}
	for _, role := range []string{bus.RoleBreaker, bus.RoleChaos, bus.RoleViewer} {
		conns[role] = connectAs(t, e, dir, role)
	}
	inboxes := map[string]string{"router r1": "narwhal-router-r1", "engine p1": "narwhal-engine-p1",
		bus.RoleBreaker: "narwhal-breaker", bus.RoleChaos: "narwhal-chaos", bus.RoleViewer: "narwhal-viewer"}

	// A consumer of the breaker's, which it pulls from and acknowledges on
	// (replies to its own inbox), and one of a router's watch.
	brk := conns[bus.RoleBreaker]
	cons, err := brk.JetStream().CreateOrUpdateConsumer(ctx, bus.StreamName, jetstream.ConsumerConfig{
		Durable: bus.BreakerConsumer, AckPolicy: jetstream.AckExplicitPolicy,
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := brk.JetStream().Publish(ctx, "narwhal.events.probe.d1", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	msg, err := cons.Next(jetstream.FetchMaxWait(waitBound))
	if err != nil || msg.Subject() != "narwhal.events.probe.d1" {
		t.Fatalf("the breaker pulls from its consumer: %v %v", msg, err)
	}
	if err := msg.DoubleAck(ctx); err != nil {
		t.Fatalf("the breaker acknowledges: %v", err)
	}
	r1 := conns["router r1"]
	loaded := make(chan int, 1)
	go func() {
		_ = bus.WatchBucket(ctx, r1, bus.PlacementBucket, r1.ConsumerName(bus.PurposePlacement),
			func(snap map[string]jetstream.KeyValueEntry) { loaded <- len(snap) }, func(jetstream.KeyValueEntry) {})
	}()
	select {
	case n := <-loaded:
		if n != 0 {
			t.Fatalf("an empty placement's watch read %d keys", n)
		}
	case <-time.After(waitBound):
		t.Fatalf("router watches placement: nothing loaded (%v)", r1.PermissionError())
	}
	kvStream, err := admin.JetStream().Stream(ctx, "KV_"+bus.PlacementBucket)
	if err != nil {
		t.Fatal(err)
	}
	names := kvStream.ConsumerNames(ctx)
	var watch string
	for n := range names.Name() {
		watch = n
	}
	if watch == "" {
		t.Fatalf("the admin finds no consumer of the router's watch: %v", names.Err())
	}

	for who, b := range conns {
		if got := b.Conn().NewRespInbox(); !strings.HasPrefix(got, "_INBOX."+inboxes[who]+".") {
			t.Errorf("%s's replies come to %s, want its own prefix _INBOX.%s", who, got, inboxes[who])
		}
		for stream, consumer := range map[string]string{bus.StreamName: bus.BreakerConsumer, "KV_" + bus.PlacementBucket: watch} {
			jsAPIDenied(t, b, who, "$JS.API.CONSUMER.PAUSE."+stream+"."+consumer, `{"pause_until":"2999-01-01T00:00:00Z"}`)
			for _, list := range []string{"$JS.API.CONSUMER.NAMES." + stream, "$JS.API.CONSUMER.LIST." + stream} {
				jsAPIDenied(t, b, who, list, `{}`)
			}
		}
		for other, name := range inboxes {
			if other != who {
				refusedSubscription(t, b, admin, "_INBOX."+name+".>")
			}
		}
		refusedSubscription(t, b, admin, "_INBOX.>")
	}
	for _, stream := range []string{bus.StreamName, "KV_" + bus.PlacementBucket} {
		st, err := admin.JetStream().Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		list := st.ListConsumers(ctx)
		n := 0
		for info := range list.Info() {
			n++
			if info.Paused {
				t.Errorf("consumer %s of %s paused", info.Name, stream)
			}
		}
		if n != 1 || list.Err() != nil {
			t.Errorf("stream %s has %d consumers after the attempts (%v), want its one", stream, n, list.Err())
		}
	}
	// The admin may list and pause (and resume).
	if _, err := admin.JetStream().PauseConsumer(ctx, bus.StreamName, bus.BreakerConsumer, time.Now().Add(time.Minute)); err != nil {
		t.Errorf("the admin pauses a consumer: %v", err)
	}
	if _, err := admin.JetStream().ResumeConsumer(ctx, bus.StreamName, bus.BreakerConsumer); err != nil {
		t.Errorf("the admin resumes a consumer: %v", err)
	}
}

// TestIdentityIssuedToARunningServerRBUS11 proves `narwhal bus creds
// --router ID`'s library half (R-BUS-11): identities issued from a mesh's
// keys after its server started are accepted by it at once, without a
// restart, and act as themselves; IssueIdentity refuses an id that is not
// one subject token, a file that exists, and a directory without a mesh.
func TestIdentityIssuedToARunningServerRBUS11(t *testing.T) {
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, c := range []struct{ kind, id, subject string }{
		{bus.RoleRouter, "late-router_9", "$KV." + bus.RoutersBucket + ".late-router_9"},
		{bus.RoleEngine, "late-engine", bus.RegistrationSubject("late-engine")},
	} {
		path, err := bus.IssueIdentity(dir, c.kind, c.id)
		if err != nil {
			t.Fatal(err)
		}
		if path != filepath.Join(dir, c.kind+"-"+c.id+".creds") {
			t.Errorf("IssueIdentity wrote %s", path)
		}
		fi, err := os.Stat(path)
		if err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: %v %v, want mode 0600", path, fi, err)
		}
		raw, _ := os.ReadFile(path)
		token, err := jwt.ParseDecoratedJWT(raw)
		if err != nil {
			t.Fatal(err)
		}
		uc, err := jwt.DecodeUserClaims(token)
		if err != nil || uc.Name != "narwhal-"+c.kind+"-"+c.id {
			t.Errorf("%s's user: %v %v, want narwhal-%s-%s", path, uc, err, c.kind, c.id)
		}
		if len(token) > 3072 {
			t.Errorf("%s holds a JWT of %d bytes: it would crowd NATS's 4 KiB control line", path, len(token))
		}
		t.Logf("%s: JWT of %d bytes", filepath.Base(path), len(token))
		b := bustest.Connect(t, e, bus.ConnectOptions{CredsFile: path})
		if c.kind == bus.RoleEngine {
			registrationsStream(t, connectAs(t, e, dir, bus.RoleAdmin))
		}
		if _, err := b.JetStream().Publish(ctx, c.subject, []byte(`{}`)); err != nil {
			t.Errorf("%s %s issued after the server started: %v (%v)", c.kind, c.id, err, b.PermissionError())
		}
		if _, err := bus.IssueIdentity(dir, c.kind, c.id); err == nil || !strings.Contains(err.Error(), "exists already") {
			t.Errorf("a second IssueIdentity of %s %s: %v, want a refusal", c.kind, c.id, err)
		}
	}
	for _, id := range []string{"", "a.b", "a*", "a>", "a b", "é", "r1\n"} {
		for _, kind := range []string{bus.RoleRouter, bus.RoleEngine} {
			if _, err := bus.IssueIdentity(dir, kind, id); err == nil {
				t.Errorf("IssueIdentity(%s, %q) succeeded", kind, id)
			}
		}
	}
	if _, err := bus.IssueIdentity(dir, bus.RoleViewer, "v1"); err == nil {
		t.Error("IssueIdentity of a viewer succeeded")
	}
	if _, err := bus.IssueIdentity(t.TempDir(), bus.RoleRouter, "r1"); err == nil || !strings.Contains(err.Error(), "narwhal bus creds") {
		t.Errorf("IssueIdentity without a mesh: %v, want the command that makes one", err)
	}
}

// TestLongIdentityFitsTheControlLineRBUS11 proves that a router id as long
// as a host name label (63 characters) still makes a credential a server
// takes, and that an id too long for NATS's 4 KiB control line is refused
// when issued, not when the router connects (R-BUS-11).
func TestLongIdentityFitsTheControlLineRBUS11(t *testing.T) {
	e, dir := authServer(t)
	id := strings.Repeat("r", 63)
	b := connectID(t, e, dir, bus.RoleRouter, id)
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	if _, err := b.JetStream().Publish(ctx, "$KV."+bus.RoutersBucket+"."+id, []byte(`{}`)); err != nil {
		t.Errorf("router %s writes its report: %v", id, err)
	}
	if _, err := bus.IssueIdentity(dir, bus.RoleRouter, strings.Repeat("r", 200)); err == nil || !strings.Contains(err.Error(), "shorter id") {
		t.Errorf("a 200-character router id: %v, want a refusal", err)
	}
}

// TestCredentialWithoutJWTRBUS11 proves that Connect refuses at once a
// NARWHAL_NATS_CREDS file that holds no user JWT — it reads the user name
// there, for its private inbox prefix (R-BUS-11) — naming the setting and
// the file to set.
func TestCredentialWithoutJWTRBUS11(t *testing.T) {
	path := filepath.Join(t.TempDir(), "router-r1.creds")
	if err := os.WriteFile(path, []byte("not a credential\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := bus.Connect(ctx, bus.ConnectOptions{URL: "nats://127.0.0.1:1", CredsFile: path, Role: bus.RoleRouter, ID: "r1"})
	if err == nil || !strings.Contains(err.Error(), "NARWHAL_NATS_CREDS="+path) || !strings.Contains(err.Error(), "no user JWT") ||
		!strings.Contains(err.Error(), "--router r1") {
		t.Errorf("Connect with a file without a JWT: %v", err)
	}
}

// TestRoutersReadEventsThroughConsumersRBUS11 proves on a server that
// enforces the credentials (R-BUS-11) that a router's credential
// subscribes to no event subject with core NATS — neither its kinds'
// wildcard nor the literal subject a forged push delivery would use — and
// reads the quarantine events through a consumer of its own name on
// NARWHAL_EVENTS instead, while the breaker's durable consumer stays out
// of its reach (no edit, no pull, no delete). The viewer subscribes to no
// event subject either.
func TestRoutersReadEventsThroughConsumersRBUS11(t *testing.T) {
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	r1 := connectID(t, e, dir, bus.RoleRouter, "r1")
	r2 := connectID(t, e, dir, bus.RoleRouter, "r2")
	for _, subject := range []string{"narwhal.events.quarantine.>", "narwhal.events.quarantine.d1.r2"} {
		refusedSubscription(t, connectID(t, e, dir, bus.RoleRouter, "r1"), admin, subject)
	}
	refusedSubscription(t, connectAs(t, e, dir, bus.RoleViewer), admin, "narwhal.events.>")

	got := make(chan string, 4)
	stop, err := bus.SubscribeResuming(ctx, r1, bus.SubscribeOptions{Filter: "narwhal.events.quarantine.>", Consumer: r1.ConsumerName(bus.PurposeQuarantine)},
		func(subject string, _ []byte) { got <- subject }, nil)
	if err != nil {
		t.Fatalf("router r1 follows the quarantine events: %v (%v)", err, r1.PermissionError())
	}
	defer stop()
	if _, err := r2.JetStream().Publish(ctx, "narwhal.events.quarantine.d1.r2", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-got:
		if s != "narwhal.events.quarantine.d1.r2" {
			t.Errorf("router r1 read %s", s)
		}
	case <-ctx.Done():
		t.Fatal("router r1's consumer delivered nothing")
	}

	if _, err := admin.JetStream().CreateOrUpdateConsumer(ctx, bus.StreamName, jetstream.ConsumerConfig{
		Durable: bus.BreakerConsumer, AckPolicy: jetstream.AckExplicitPolicy, FilterSubjects: []string{"narwhal.events.failure.>"},
	}); err != nil {
		t.Fatal(err)
	}
	api := "$JS.API.CONSUMER."
	jsAPIDenied(t, r1, "router r1", api+"CREATE."+bus.StreamName+"."+bus.BreakerConsumer+".narwhal.events.quarantine.>",
		`{"stream_name":"NARWHAL_EVENTS","config":{"durable_name":"narwhal-breaker","ack_policy":"explicit","filter_subject":"narwhal.events.quarantine.>"}}`)
	jsAPIDenied(t, r1, "router r1", api+"MSG.NEXT."+bus.StreamName+"."+bus.BreakerConsumer, `{"batch":1}`)
	jsAPIDenied(t, r1, "router r1", api+"DELETE."+bus.StreamName+"."+bus.BreakerConsumer, ``)
	cons, err := admin.JetStream().Consumer(ctx, bus.StreamName, bus.BreakerConsumer)
	if err != nil {
		t.Fatalf("the breaker's consumer after router r1's acts: %v", err)
	}
	if info, err := cons.Info(ctx); err != nil || !slices.Equal(info.Config.FilterSubjects, []string{"narwhal.events.failure.>"}) {
		t.Errorf("the breaker's consumer after router r1's acts: %+v %v", info, err)
	}
}
