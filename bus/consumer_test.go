package bus_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// consumerState is what the admin reads of every consumer of the account:
// by "<stream>/<name>", its configuration, whether it is paused, and how
// far it delivered.
func consumerState(t *testing.T, admin *bus.Bus) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	out := map[string]string{}
	names := admin.JetStream().StreamNames(ctx)
	for stream := range names.Name() {
		st, err := admin.JetStream().Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		list := st.ListConsumers(ctx)
		for info := range list.Info() {
			cfg, _ := json.Marshal(info.Config)
			out[stream+"/"+info.Name] = fmt.Sprintf("%s paused=%v delivered=%+v pending=%d created=%s",
				cfg, info.Paused, info.Delivered, info.NumPending, info.Created)
		}
		if err := list.Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// ownedConsumers starts, with router r's and engine p's connections, a
// consumer of every purpose each has (behaviour.md R-BUS-11): r's
// quarantine follower, prefix read-back, placement and fleet watches, p's
// read of the routers' reports; and returns, by stream, the names the
// admin lists, after checking they are the names each computes. The keys
// r's placement watch and p's reports watch deliver after their first
// read go to placed and reports.
func ownedConsumers(t *testing.T, ctx context.Context, admin, r, p *bus.Bus, placed, reports chan<- string) map[string]string {
	t.Helper()
	stop, err := bus.SubscribeResuming(ctx, r, bus.SubscribeOptions{
		Filter: bus.SubjectPrefix + "quarantine.>", Consumer: r.ConsumerName(bus.PurposeQuarantine),
	}, func(string, []byte) {}, nil)
	if err != nil {
		t.Fatalf("the router follows quarantines: %v (%v)", err, r.PermissionError())
	}
	t.Cleanup(stop)
	if _, err := bus.OwnConsumer(ctx, r.JetStream(), bus.PrefixStream, jetstream.ConsumerConfig{
		Name: r.ConsumerName(bus.PurposePrefix), FilterSubject: bus.PrefixSubjectPrefix + "*",
		AckPolicy: jetstream.AckNonePolicy, MemoryStorage: true, Replicas: 1, InactiveThreshold: 10 * time.Minute, // unread: it must outlive the test
	}); err != nil {
		t.Fatalf("the router reads the prefix batches back: %v (%v)", err, r.PermissionError())
	}
	for _, w := range []struct {
		b               *bus.Bus
		bucket, purpose string
		keys            chan<- string
	}{{r, bus.PlacementBucket, bus.PurposePlacement, placed}, {r, bus.FleetBucket, bus.PurposeFleet, nil}, {p, bus.RoutersBucket, bus.PurposeReports, reports}} {
		loaded := make(chan struct{})
		go func() {
			_ = bus.WatchBucket(ctx, w.b, w.bucket, w.b.ConsumerName(w.purpose), func(map[string]jetstream.KeyValueEntry) { close(loaded) },
				func(e jetstream.KeyValueEntry) {
					if w.keys != nil {
						w.keys <- e.Key()
					}
				})
		}()
		select {
		case <-loaded:
		case <-time.After(waitBound):
			t.Fatalf("the watch of %s loaded nothing (%v)", w.bucket, w.b.PermissionError())
		}
	}
	want := map[string]string{
		bus.StreamName:              r.ConsumerName(bus.PurposeQuarantine),
		bus.PrefixStream:            r.ConsumerName(bus.PurposePrefix),
		"KV_" + bus.PlacementBucket: r.ConsumerName(bus.PurposePlacement),
		"KV_" + bus.FleetBucket:     r.ConsumerName(bus.PurposeFleet),
		"KV_" + bus.RoutersBucket:   p.ConsumerName(bus.PurposeReports),
	}
	got := map[string]string{}
	for key := range consumerState(t, admin) {
		stream, name, _ := strings.Cut(key, "/")
		if _, ok := want[stream]; ok {
			if got[stream] != "" {
				t.Errorf("stream %s has consumers %s and %s, want one", stream, got[stream], name)
			}
			got[stream] = name
		}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("the admin lists consumers %v, want the identities' own names %v", got, want)
	}
	for stream, name := range got {
		if len(name) > 32 || !strings.HasPrefix(name, "nw-") {
			t.Errorf("consumer %s of %s: want nw-<purpose>-…, at most 32 characters", name, stream)
		}
	}
	return got
}

// consumerActs are the JetStream API requests that would delete, read,
// pull from, pause, reset or edit consumer name of stream — an edit
// being a creation under the same name with another configuration (a
// pause, another filter), through every form of the create request —
// each with its subject and body.
func consumerActs(stream, name string) [][2]string {
	api := "$JS.API.CONSUMER."
	cfg := func(extra string) string {
		return `{"stream_name":"` + stream + `","config":{"name":"` + name + `","ack_policy":"none","deliver_policy":"all"` + extra + `}}`
	}
	return [][2]string{
		{api + "DELETE." + stream + "." + name, ``},
		{api + "INFO." + stream + "." + name, ``},
		{api + "MSG.NEXT." + stream + "." + name, `{"batch":1,"expires":100000000}`},
		{api + "PAUSE." + stream + "." + name, `{"pause_until":"2999-01-01T00:00:00Z"}`},
		{api + "RESET." + stream + "." + name, `{}`},
		{api + "CREATE." + stream + "." + name, cfg(`,"pause_until":"2999-01-01T00:00:00Z"`)},
		{api + "CREATE." + stream + "." + name + ".x.y", cfg(`,"filter_subject":"x.y"`)},
		{api + "CREATE." + stream, cfg(`,"filter_subject":"x.y"`)},
		{api + "DURABLE.CREATE." + stream + "." + name, `{"stream_name":"` + stream + `","config":{"durable_name":"` + name + `","ack_policy":"none"}}`},
		{api + "LEADER.STEPDOWN." + stream + "." + name, ``},
	}
}

// TestConsumersOwnedByPermissionRBUS11 proves on a server that enforces
// the credentials (behaviour.md R-BUS-11) that the consumers of router r1
// and engine p1 carry their own fixed names, and that with the admin
// listing those names and handing them over, router r2's and engine p2's
// credentials, and the breaker's, the chaos proxies' and the viewer's
// role credentials, can neither delete, read the info of, pull from,
// pause, reset nor edit (create anew with a pause or another filter, by
// the named, legacy or durable create) any of them — nor can the chaos
// and viewer credentials touch the breaker's durable consumer, nor any
// role credential make a consumer of its own: every act is refused by the
// server, the consumers and every stream and bucket are exactly as they
// were, r1's and p1's readers keep delivering, and the viewer still reads
// the buckets, by direct gets.
func TestConsumersOwnedByPermissionRBUS11(t *testing.T) {
	t.Parallel() // its refused acts wait out their bounds
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	registrationsStream(t, admin)
	r1 := connectID(t, e, dir, bus.RoleRouter, "r1")
	p1 := connectID(t, e, dir, bus.RoleEngine, "p1")
	// r1's and p1's readers deliver what they read, before and after the
	// attempts.
	placed, reports := make(chan string, 16), make(chan string, 16)
	names := ownedConsumers(t, ctx, admin, r1, p1, placed, reports)
	// The breaker's durable consumer, which only the breaker's credential
	// may use.
	if _, err := admin.JetStream().CreateConsumer(ctx, bus.StreamName, jetstream.ConsumerConfig{
		Durable: bus.BreakerConsumer, AckPolicy: jetstream.AckExplicitPolicy,
	}); err != nil {
		t.Fatal(err)
	}
	// The viewer reads the placement bucket without a consumer.
	viewer := connectAs(t, e, dir, bus.RoleViewer)
	viewed := make(chan string, 16)
	viewerLoaded := make(chan struct{})
	go func() {
		_ = bus.WatchBucket(ctx, viewer, bus.PlacementBucket, viewer.ConsumerName(bus.PurposeView),
			func(map[string]jetstream.KeyValueEntry) { close(viewerLoaded) },
			func(e jetstream.KeyValueEntry) { viewed <- e.Key() })
	}()
	select {
	case <-viewerLoaded:
	case <-time.After(waitBound):
		t.Fatalf("the viewer's watch of the placement loaded nothing (%v)", viewer.PermissionError())
	}
	historySettled(t, admin)
	consumersBefore, streamsBefore := consumerState(t, admin), accountState(t, admin)

	attackers := map[string]*bus.Bus{
		"router r2": connectID(t, e, dir, bus.RoleRouter, "r2"),
		"engine p2": connectID(t, e, dir, bus.RoleEngine, "p2"),
		"breaker":   connectAs(t, e, dir, bus.RoleBreaker),
		"chaos":     connectAs(t, e, dir, bus.RoleChaos),
		"viewer":    viewer,
	}
	// Each attacker on its own goroutine: every refused act waits out its
	// bound, and one attacker's acts run one after another (each waits
	// for its own connection's violation).
	var wg sync.WaitGroup
	for who, b := range attackers {
		targets := maps.Clone(names)
		if who != "breaker" {
			targets[bus.StreamName+" "] = bus.BreakerConsumer
		}
		wg.Go(func() {
			for key, name := range targets {
				stream := strings.TrimSpace(key)
				for _, act := range consumerActs(stream, name) {
					jsAPIDenied(t, b, who, act[0], act[1])
				}
				dctx, dcancel := context.WithTimeout(ctx, deniedBound)
				if err := b.JetStream().DeleteConsumer(dctx, stream, name); err == nil {
					t.Errorf("%s deleted %s's consumer %s through nats.go", who, stream, name)
				}
				dcancel()
			}
		})
	}
	wg.Wait()
	// Nor may an identity make a consumer of a name not its own (an
	// ordered consumer's, random).
	octx, ocancel := context.WithTimeout(ctx, deniedBound)
	defer ocancel()
	if stop, err := bus.Subscribe(octx, attackers["router r2"], bus.SubjectPrefix+"quarantine.>", false, func(string, []byte) {}); err == nil {
		stop()
		t.Error("router r2 made an ordered consumer of a random name")
	}
	// Nor may a role's credential make a consumer at all, of any name.
	for _, who := range []string{"breaker", "chaos", "viewer"} {
		for stream := range names {
			cctx, ccancel := context.WithTimeout(ctx, deniedBound)
			if _, err := attackers[who].JetStream().CreateConsumer(cctx, stream, jetstream.ConsumerConfig{
				Name: "nw-mine-" + who, AckPolicy: jetstream.AckNonePolicy, InactiveThreshold: time.Minute,
			}); err == nil {
				t.Errorf("the %s's credential made a consumer on %s", who, stream)
			}
			ccancel()
		}
	}
	if after := consumerState(t, admin); fmt.Sprint(after) != fmt.Sprint(consumersBefore) {
		t.Errorf("the consumers changed:\nbefore %v\nafter  %v", consumersBefore, after)
	}
	sameState(t, "the refused consumer acts", streamsBefore, accountState(t, admin))

	if _, err := admin.Placement().Put(ctx, "d1", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	if _, err := attackers["router r2"].JetStream().Publish(ctx, "$KV."+bus.RoutersBucket+".r2", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	for what, c := range map[string]chan string{"r1's placement watch": placed, "p1's reports watch": reports, "the viewer's direct watch": viewed} {
		select {
		case key := <-c:
			if key != "d1" && key != "r2" {
				t.Errorf("%s delivered key %s", what, key)
			}
		case <-time.After(waitBound):
			t.Errorf("%s delivers nothing after the attempts", what)
		}
	}
}

// TestReaderTakesItsNameBackRBUS11 proves a Reader's recovery
// (behaviour.md R-BUS-11): after the admin deletes its consumer, it makes
// it again under the same name, and delivers every message published
// before, while and after the consumer was gone, once each and in order.
func TestReaderTakesItsNameBackRBUS11(t *testing.T) {
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	r1 := connectID(t, e, dir, bus.RoleRouter, "r1")
	r2 := connectID(t, e, dir, bus.RoleRouter, "r2")
	name := r1.ConsumerName(bus.PurposeQuarantine)
	var mu sync.Mutex
	var got []string
	r, err := bus.StartReader(ctx, r1, bus.ReaderOptions{
		Stream: bus.StreamName, Filter: bus.SubjectPrefix + "quarantine.>", Name: name, Deliver: jetstream.DeliverNewPolicy,
	}, func(m jetstream.Msg) {
		mu.Lock()
		got = append(got, string(m.Data()))
		mu.Unlock()
	})
	if err != nil {
		t.Fatalf("r1's reader: %v (%v)", err, r1.PermissionError())
	}
	defer r.Stop()
	var want []string
	publish := func(n int) {
		for range n {
			body := strconv.Itoa(len(want))
			want = append(want, body)
			if _, err := r2.JetStream().Publish(ctx, bus.SubjectPrefix+"quarantine.d1.r2", []byte(body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	delivered := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
	publish(3)
	testkit.WaitFor(t, waitBound, "the first events", func() bool { return len(delivered()) == 3 })
	for round := range 2 {
		if err := admin.JetStream().DeleteConsumer(ctx, bus.StreamName, name); err != nil {
			t.Fatal(err)
		}
		publish(4) // while the consumer is gone
		testkit.WaitFor(t, waitBound, "the consumer made again under its name", func() bool {
			_, err := admin.JetStream().Consumer(ctx, bus.StreamName, name)
			return err == nil && r.Resets() > round
		})
		publish(4)
		testkit.WaitFor(t, waitBound, "every event", func() bool { return len(delivered()) >= len(want) })
	}
	// One more event after the others: delivery is in order, so a
	// repeat of any earlier one would come before it.
	publish(1)
	last := want[len(want)-1]
	testkit.WaitFor(t, waitBound, "the last event", func() bool { g := delivered(); return len(g) > 0 && g[len(g)-1] == last })
	if g := delivered(); !slices.Equal(g, want) {
		t.Errorf("delivered %v, want %v, once each and in order", g, want)
	}
}

// TestRestartTakesTheNameBackRBUS11 proves that a process started again
// with the same identity (behaviour.md R-BUS-11) makes its consumers
// under the names the previous process left — a consumer of another
// start and filter still there — and reads from its own start.
func TestRestartTakesTheNameBackRBUS11(t *testing.T) {
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	old := connectID(t, e, dir, bus.RoleRouter, "r1")
	name := old.ConsumerName(bus.PurposeFleet)
	for _, key := range []string{"d1", "d2"} {
		if _, err := admin.JetStream().Publish(ctx, "$KV."+bus.FleetBucket+"."+key, []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := old.JetStream().CreateConsumer(ctx, "KV_"+bus.FleetBucket, jetstream.ConsumerConfig{
		Name: name, FilterSubject: "$KV." + bus.FleetBucket + ".d2", DeliverPolicy: jetstream.DeliverNewPolicy,
		AckPolicy: jetstream.AckNonePolicy, MemoryStorage: true, InactiveThreshold: time.Minute,
	}); err != nil {
		t.Fatalf("the previous process's consumer: %v (%v)", err, old.PermissionError())
	}
	old.Close() // gone without deleting it

	restarted := connectID(t, e, dir, bus.RoleRouter, "r1")
	if restarted.ConsumerName(bus.PurposeFleet) != name {
		t.Fatalf("the same credential names its fleet watch %s, then %s", name, restarted.ConsumerName(bus.PurposeFleet))
	}
	keys := make(chan []string, 1)
	go func() {
		_ = bus.WatchBucket(ctx, restarted, bus.FleetBucket, name, func(snap map[string]jetstream.KeyValueEntry) {
			var k []string
			for key := range snap {
				k = append(k, key)
			}
			slices.Sort(k)
			keys <- k
		}, func(jetstream.KeyValueEntry) {})
	}()
	select {
	case k := <-keys:
		if !slices.Equal(k, []string{"d1", "d2"}) {
			t.Errorf("the restarted watch read %v, want d1 and d2", k)
		}
	case <-time.After(waitBound):
		t.Fatalf("the restarted process's watch read nothing (%v)", restarted.PermissionError())
	}
	cons, err := admin.JetStream().Consumer(ctx, "KV_"+bus.FleetBucket, name)
	if err != nil {
		t.Fatal(err)
	}
	if c := cons.CachedInfo().Config; c.FilterSubject != "$KV."+bus.FleetBucket+".>" || c.DeliverPolicy != jetstream.DeliverLastPerSubjectPolicy {
		t.Errorf("consumer %s after the restart: filter %q, deliver %v; want the new process's", name, c.FilterSubject, c.DeliverPolicy)
	}
}

// TestLongestRouterIdentityOnPlainNATSServerRBUS11 proves that the
// longest router id IssueIdentity accepts — its JWT, with the exact names
// of its consumers, at most 3,712 bytes — connects to a nats-server of a
// plain configuration (default max_control_line, 4 KiB, which nats-server
// 2.15's parser applies to the CONNECT line too) and reads through its
// own consumers; one character more is refused when issued.
func TestLongestRouterIdentityOnPlainNATSServerRBUS11(t *testing.T) {
	dir := bustest.Credentials(t)
	longest := 0
	for n := 1; n < 200; n++ {
		probe := t.TempDir()
		if err := bus.WriteCredentials(probe); err != nil {
			t.Fatal(err)
		}
		if _, err := bus.IssueIdentity(probe, bus.RoleRouter, strings.Repeat("r", n)); err != nil {
			if !strings.Contains(err.Error(), "shorter id") {
				t.Fatal(err)
			}
			break
		}
		longest = n
	}
	if longest < 63 {
		t.Errorf("the longest router id is %d characters, want at least a host name label's 63", longest)
	}
	id := strings.Repeat("r", longest)
	path, err := bus.IssueIdentity(dir, bus.RoleRouter, id)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := os.ReadFile(path)
	token, _ := jwt.ParseDecoratedJWT(raw)
	t.Logf("longest router id: %d characters, JWT %d bytes", longest, len(token))

	etc, store := t.TempDir(), t.TempDir()
	auth, err := os.ReadFile(filepath.Join(dir, bus.AuthConfFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(etc, bus.AuthConfFile), auth, 0o644); err != nil {
		t.Fatal(err)
	}
	conf := "include auth.conf\n" +
		"resolver: { type: full, dir: " + strconv.Quote(t.TempDir()) + " }\n" +
		"listen: \"127.0.0.1:-1\"\njetstream: { store_dir: " + strconv.Quote(store) + " }\n"
	main := filepath.Join(etc, "nats.conf")
	if err := os.WriteFile(main, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(main)
	if err != nil {
		t.Fatal(err)
	}
	if opts.MaxControlLine != 0 {
		t.Fatalf("the plain configuration sets max_control_line %d", opts.MaxControlLine)
	}
	opts.NoLog, opts.NoSigs = true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	if !srv.ReadyForConnections(waitBound) {
		t.Fatal("nats-server not ready")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, err := bus.Connect(ctx, bus.ConnectOptions{URL: srv.ClientURL(), CredsFile: bustest.CredsFile(dir, bus.RoleAdmin), Setup: &bus.SetupOptions{}})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	r, err := bus.Connect(ctx, bus.ConnectOptions{URL: srv.ClientURL(), CredsFile: path, Role: bus.RoleRouter, ID: id})
	if err != nil {
		t.Fatalf("router %s (JWT of %d bytes) connects to a plain nats-server: %v", id, len(token), err)
	}
	defer r.Close()
	loaded := make(chan struct{})
	go func() {
		_ = bus.WatchBucket(ctx, r, bus.FleetBucket, r.ConsumerName(bus.PurposeFleet), func(map[string]jetstream.KeyValueEntry) { close(loaded) }, func(jetstream.KeyValueEntry) {})
	}()
	select {
	case <-loaded:
	case <-time.After(waitBound):
		t.Fatalf("router %s's fleet watch loaded nothing (%v)", id, r.PermissionError())
	}
}
