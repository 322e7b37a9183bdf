package bus_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
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

// deniedBound bounds each forbidden act: NATS drops a denied publish
// without a reply, so the act ends by its own timeout.
const deniedBound = 500 * time.Millisecond

// authServer writes a credential set into a new directory (a missing
// parent included) and starts an embedded server that enforces it, set up
// in-process with the admin credential.
func authServer(t *testing.T) (e *bus.Embedded, dir string) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "mesh", "creds")
	if err := bus.WriteCredentials(dir); err != nil {
		t.Fatal(err)
	}
	return bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: dir}), dir
}

// connectAs connects to e over TCP with role's credential from dir.
func connectAs(t *testing.T, e *bus.Embedded, dir, role string) *bus.Bus {
	t.Helper()
	return bustest.Connect(t, e, bus.ConnectOptions{Name: role, CredsFile: bustest.CredsFile(dir, role)})
}

// connectID connects to e over TCP with the own credential of engine or
// router id (kind bus.RoleEngine or bus.RoleRouter) from dir, issuing it
// when it is not there yet (R-BUS-11).
func connectID(t *testing.T, e *bus.Embedded, dir, kind, id string) *bus.Bus {
	t.Helper()
	return bustest.Connect(t, e, bus.ConnectOptions{Name: kind + "-" + id, CredsFile: bustest.Identity(t, dir, kind, id), Role: kind, ID: id})
}

// receive subscribes b to subject (a wildcard allowed) until the test
// ends and returns the channel its messages arrive on (8 buffered); the
// subscription is on the server when it returns.
func receive(t *testing.T, b *bus.Bus, subject string) <-chan *nats.Msg {
	t.Helper()
	got := make(chan *nats.Msg, 8)
	sub, err := b.Conn().Subscribe(subject, func(m *nats.Msg) { got <- m })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Unsubscribe() })
	if err := b.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	return got
}

// denied asserts that act failed and that the server reported a
// permissions violation naming subject on b's connection (R-BUS-8).
func denied(t *testing.T, b *bus.Bus, what, subject string, act func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), deniedBound)
	defer cancel()
	if err := act(ctx); err == nil {
		t.Errorf("%s succeeded, want it refused", what)
		return
	}
	testkit.WaitFor(t, waitBound, what+": the server's permissions violation", func() bool {
		err := b.PermissionError()
		return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), subject)
	})
}

// TestCredentialFiles proves `narwhal bus creds`' files (R-BUS-8): one
// .creds per role, private, the server side auth.conf, and no overwrite of
// an existing set.
func TestCredentialFiles(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "new", "dir")
	if err := bus.WriteCredentials(dir); err != nil {
		t.Fatal(err)
	}
	for _, role := range bus.Roles {
		fi, err := os.Stat(filepath.Join(dir, bus.CredsFile(role)))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v, want 0600", fi.Name(), fi.Mode().Perm())
		}
		raw, _ := os.ReadFile(filepath.Join(dir, bus.CredsFile(role)))
		if !strings.Contains(string(raw), "BEGIN NATS USER JWT") || !strings.Contains(string(raw), "BEGIN USER NKEY SEED") {
			t.Errorf("%s is not a NATS credentials file", fi.Name())
		}
		// The JWT travels in the CONNECT line, which a server takes up to
		// 4 KiB long (max_control_line): leave 1 KiB for the rest (the
		// nonce's signature, the client's name, version and options). The
		// seed in the file does not travel.
		userJWT, err := jwt.ParseDecoratedJWT(raw)
		if err != nil {
			t.Fatalf("%s: %v", fi.Name(), err)
		}
		if len(userJWT) > 3072 {
			t.Errorf("%s holds a JWT of %d bytes: it would crowd NATS's 4 KiB control line", fi.Name(), len(userJWT))
		}
		t.Logf("%s: JWT of %d bytes", fi.Name(), len(userJWT))
	}
	conf, err := os.ReadFile(filepath.Join(dir, bus.AuthConfFile))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(conf), "SUA") || !strings.Contains(string(conf), "operator:") || !strings.Contains(string(conf), "resolver_preload") {
		t.Errorf("auth.conf holds a seed or lacks the operator or the accounts:\n%s", conf)
	}
	if err := bus.WriteCredentials(dir); err == nil || !strings.Contains(err.Error(), "exists already") {
		t.Errorf("a second WriteCredentials into the same directory: %v, want a refusal", err)
	}
	if _, err := bus.RolePermissions("root"); err == nil {
		t.Error("RolePermissions of an unknown role succeeded")
	}
	// Engines and routers have no role credential any more (R-BUS-11).
	for _, role := range []string{bus.RoleRouter, bus.RoleEngine} {
		if _, err := bus.RolePermissions(role); err == nil {
			t.Errorf("RolePermissions(%s) succeeded: want an identity per %s", role, role)
		}
		if _, err := os.Stat(filepath.Join(dir, bus.CredsFile(role))); err == nil {
			t.Errorf("WriteCredentials wrote %s", bus.CredsFile(role))
		}
	}
}

// TestRolePermissions proves R-BUS-8 on a server that enforces the
// credentials: each role can do its own acts, and each forbidden act
// fails with a permission error and changes nothing — connecting without
// a credential, a router writing placement or arming chaos or taking the
// breaker's consumer, a viewer publishing an event or deleting the
// breaker's consumer, chaos writing placement, and anyone but the admin
// creating or updating a stream or bucket.
func TestRolePermissions(t *testing.T) {
	t.Parallel() // its refused acts wait out their bounds
	e, dir := authServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// No credential: refused at once, not retried for ever.
	start := time.Now()
	_, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), Name: "anonymous"})
	if err == nil || !strings.Contains(err.Error(), "uthorization") {
		t.Errorf("Connect without a credential: %v, want an authorization violation", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Connect without a credential took %v to fail", d)
	}
	// A credential of another operator is refused too.
	other := bustest.Credentials(t)
	if _, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), CredsFile: bustest.CredsFile(other, bus.RoleAdmin)}); err == nil {
		t.Error("Connect with another mesh's admin credential succeeded")
	}

	breaker := connectAs(t, e, dir, bus.RoleBreaker)
	router := connectID(t, e, dir, bus.RoleRouter, "rt-1")
	viewer := connectAs(t, e, dir, bus.RoleViewer)
	chaosB := connectAs(t, e, dir, bus.RoleChaos)

	// The breaker's own acts: its consumer, placement, its lease.
	cons, err := breaker.JetStream().CreateOrUpdateConsumer(ctx, bus.StreamName, jetstream.ConsumerConfig{
		Durable: bus.BreakerConsumer, AckPolicy: jetstream.AckExplicitPolicy, FilterSubjects: []string{"narwhal.events.failure.>"},
	})
	if err != nil {
		t.Fatalf("breaker creates its consumer: %v", err)
	}
	if _, err := breaker.Placement().Put(ctx, "d1", []byte(`{"eligible":true}`)); err != nil {
		t.Fatalf("breaker writes placement: %v", err)
	}
	lease, err := breaker.BindBucket(ctx, bus.LeaseBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lease.Create(ctx, "leader", []byte(`{}`)); err != nil {
		t.Fatalf("breaker takes its lease: %v", err)
	}
	if _, err := breaker.JetStream().Publish(ctx, "narwhal.events.eligibility.d1", []byte(`{}`)); err != nil {
		t.Fatalf("breaker publishes an eligibility event: %v", err)
	}

	// The router's own acts: its events, reading placement and chaos.
	if _, err := router.JetStream().Publish(ctx, "narwhal.events.failure.d1.rt-1", []byte(`{"n":1}`)); err != nil {
		t.Fatalf("router publishes a failure event: %v", err)
	}
	if en, err := router.Placement().Get(ctx, "d1"); err != nil || string(en.Value()) != `{"eligible":true}` {
		t.Fatalf("router reads placement: %v", err)
	}
	// Through its consumer of its own name (R-BUS-11).
	keys := make(chan []string, 1)
	wctx, wcancel := context.WithCancel(ctx)
	go func() {
		_ = bus.WatchBucket(wctx, router, bus.PlacementBucket, router.ConsumerName(bus.PurposePlacement), func(snap map[string]jetstream.KeyValueEntry) {
			var k []string
			for key := range snap {
				k = append(k, key)
			}
			keys <- k
		}, func(jetstream.KeyValueEntry) {})
	}()
	select {
	case k := <-keys:
		if len(k) != 1 || k[0] != "d1" {
			t.Errorf("router's watch read %v, want d1", k)
		}
	case <-time.After(waitBound):
		t.Fatalf("router watches placement: nothing read (%v)", router.PermissionError())
	}
	wcancel()
	if _, err := router.BindBucket(ctx, bus.ChaosBucket); err != nil {
		t.Errorf("router binds the chaos bucket: %v", err)
	}

	// Forbidden: the router writing placement, arming chaos, taking the
	// lease or the breaker's consumer.
	denied(t, router, "router writes placement", "$KV.narwhal_placement.d1", func(ctx context.Context) error {
		_, err := router.Placement().Put(ctx, "d1", []byte(`{"eligible":false}`))
		return err
	})
	denied(t, router, "router arms chaos", "$KV.narwhal_chaos.d1.x", func(ctx context.Context) error {
		_, err := router.JetStream().Publish(ctx, "$KV.narwhal_chaos.d1.x", []byte(`{}`))
		return err
	})
	denied(t, router, "router takes the lease", "$KV.narwhal_breaker.leader", func(ctx context.Context) error {
		_, err := router.JetStream().Publish(ctx, "$KV.narwhal_breaker.leader", []byte(`{}`))
		return err
	})
	denied(t, router, "router pulls from the breaker's consumer", "NARWHAL_EVENTS.narwhal-breaker", func(ctx context.Context) error {
		c, err := router.JetStream().Consumer(ctx, bus.StreamName, bus.BreakerConsumer)
		if err != nil {
			return err
		}
		_, err = c.Next(jetstream.FetchMaxWait(deniedBound / 2))
		return err
	})
	denied(t, router, "router publishes an eligibility event", "narwhal.events.eligibility.d1", func(ctx context.Context) error {
		_, err := router.JetStream().Publish(ctx, "narwhal.events.eligibility.d1", []byte(`{}`))
		return err
	})

	// The fleet (R-FLEET-1, R-FLEET-3, R-BUS-8): the admin and the breaker
	// write it, the router reads it and writes only its in-flight report.
	adminB := connectAs(t, e, dir, bus.RoleAdmin)
	if _, err := adminB.JetStream().Publish(ctx, "$KV."+bus.FleetBucket+".d9", []byte(`{"by":"admin"}`)); err != nil {
		t.Fatalf("admin writes the fleet: %v", err)
	}
	if _, err := breaker.JetStream().Publish(ctx, "$KV."+bus.FleetBucket+".d9", []byte(`{"by":"breaker"}`)); err != nil {
		t.Fatalf("breaker writes a fleet state: %v", err)
	}
	if _, err := breaker.JetStream().Publish(ctx, "narwhal.events.fleet.d9", []byte(`{}`)); err != nil {
		t.Fatalf("breaker publishes a fleet event: %v", err)
	}
	routerFleet, err := router.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatalf("router binds the fleet: %v", err)
	}
	fleetRead, err := bus.ReadBucket(ctx, router, bus.FleetBucket, router.ConsumerName(bus.PurposeFleet))
	if err != nil {
		t.Fatalf("router watches the fleet: %v (%v)", err, router.PermissionError())
	}
	if len(fleetRead) != 1 || fleetRead[0].Key() != "d9" || string(fleetRead[0].Value()) != `{"by":"breaker"}` {
		t.Errorf("router's fleet watch read %v, want d9 as the breaker wrote it", fleetRead)
	}
	routersKV, err := router.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatalf("router binds the routers bucket: %v", err)
	}
	if _, err := routersKV.Put(ctx, "rt-1", []byte(`{}`)); err != nil {
		t.Fatalf("router writes its report: %v", err)
	}
	// The breaker reads the routers' reports without a consumer
	// (R-BUS-11: a role's credential makes none).
	breakerRouters, err := bus.ReadBucket(ctx, breaker, bus.RoutersBucket, breaker.ConsumerName(bus.PurposeView))
	if err != nil {
		t.Fatalf("breaker reads the routers bucket: %v (%v)", err, breaker.PermissionError())
	}
	if len(breakerRouters) != 1 || breakerRouters[0].Key() != "rt-1" {
		t.Errorf("breaker's read of the routers bucket gave %v, want rt-1", breakerRouters)
	}
	denied(t, breaker, "breaker watches the routers bucket through a consumer", "$JS.API.CONSUMER.CREATE.KV_narwhal_routers", func(ctx context.Context) error {
		kv, err := breaker.BindBucket(ctx, bus.RoutersBucket)
		if err != nil {
			return err
		}
		w, err := kv.WatchAll(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = w.Stop() }()
		select {
		case <-w.Updates():
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	denied(t, router, "router writes the fleet", "$KV.narwhal_fleet.d9", func(ctx context.Context) error {
		_, err := routerFleet.Put(ctx, "d9", []byte(`{"state":"active"}`))
		return err
	})
	denied(t, router, "router publishes a fleet event", "narwhal.events.fleet.d9", func(ctx context.Context) error {
		_, err := router.JetStream().Publish(ctx, "narwhal.events.fleet.d9", []byte(`{}`))
		return err
	})
	denied(t, chaosB, "chaos writes the fleet", "$KV.narwhal_fleet.d9", func(ctx context.Context) error {
		_, err := chaosB.JetStream().Publish(ctx, "$KV.narwhal_fleet.d9", []byte(`{}`))
		return err
	})
	denied(t, viewer, "viewer writes the fleet", "$KV.narwhal_fleet.d9", func(ctx context.Context) error {
		_, err := viewer.JetStream().Publish(ctx, "$KV.narwhal_fleet.d9", []byte(`{}`))
		return err
	})

	// The viewer reads everything and follows the events by direct gets,
	// without a consumer, but publishes nothing and cannot touch the
	// breaker's consumer.
	got := make(chan string, 4)
	stop, err := bus.Subscribe(ctx, viewer, "", true, func(subject string, _ []byte) { got <- subject })
	if err != nil {
		t.Fatalf("viewer follows the events: %v", err)
	}
	if s := <-got; s != "narwhal.events.eligibility.d1" {
		t.Errorf("viewer's first event on %s", s)
	}
	stop()
	if _, err := viewer.Placement().Get(ctx, "d1"); err != nil {
		t.Errorf("viewer reads placement: %v", err)
	}
	denied(t, viewer, "viewer publishes a failure event", "narwhal.events.failure.d1", func(ctx context.Context) error {
		_, err := viewer.JetStream().Publish(ctx, "narwhal.events.failure.d1", []byte(`{"forged":true}`))
		return err
	})
	denied(t, viewer, "viewer deletes the breaker's consumer", "CONSUMER.DELETE.NARWHAL_EVENTS.narwhal-breaker", func(ctx context.Context) error {
		return viewer.JetStream().DeleteConsumer(ctx, bus.StreamName, bus.BreakerConsumer)
	})
	// The consumer API's legacy ephemeral create names the consumer in the
	// request body, not the subject: with the name of the breaker's durable
	// it would update that consumer (here: to a filter that matches
	// nothing the breaker needs), so it is denied on NARWHAL_EVENTS.
	denied(t, viewer, "viewer updates the breaker's consumer through the legacy create", "$JS.API.CONSUMER.CREATE.NARWHAL_EVENTS", func(ctx context.Context) error {
		body := `{"stream_name":"NARWHAL_EVENTS","config":{"name":"narwhal-breaker","ack_policy":"explicit","filter_subjects":["narwhal.events.chaos.>"]}}`
		_, err := viewer.Conn().RequestWithContext(ctx, "$JS.API.CONSUMER.CREATE.NARWHAL_EVENTS", []byte(body))
		return err
	})
	denied(t, viewer, "viewer writes placement", "$KV.narwhal_placement.d1", func(ctx context.Context) error {
		_, err := viewer.Placement().Put(ctx, "d1", []byte(`{"eligible":false}`))
		return err
	})

	// Chaos: arms faults, but cannot write placement.
	if _, err := chaosB.JetStream().Publish(ctx, "$KV.narwhal_chaos.d1.x", []byte(`{}`)); err != nil {
		t.Errorf("chaos writes its bucket: %v", err)
	}
	denied(t, chaosB, "chaos writes placement", "$KV.narwhal_placement.d1", func(ctx context.Context) error {
		_, err := chaosB.JetStream().Publish(ctx, "$KV.narwhal_placement.d1", []byte(`{"eligible":false}`))
		return err
	})

	// Only the admin creates or updates streams and buckets.
	st, err := router.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	lowered := st.CachedInfo().Config
	lowered.MaxAge = time.Minute
	for _, b := range []*bus.Bus{router, breaker, viewer, chaosB} {
		denied(t, b, "a stream update by a non-admin", "$JS.API.STREAM.UPDATE.NARWHAL_EVENTS", func(ctx context.Context) error {
			_, err := b.JetStream().UpdateStream(ctx, lowered)
			return err
		})
		denied(t, b, "a bucket created by a non-admin", "$JS.API.STREAM.CREATE.KV_narwhal_other", func(ctx context.Context) error {
			_, err := b.JetStream().CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "narwhal_other"})
			return err
		})
		denied(t, b, "a bucket deleted by a non-admin", "$JS.API.STREAM.DELETE.KV_narwhal_placement", func(ctx context.Context) error {
			return b.JetStream().DeleteKeyValue(ctx, bus.PlacementBucket)
		})
	}
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	if err := bus.Setup(ctx, admin, bus.SetupOptions{}); err != nil {
		t.Errorf("the admin's Setup: %v", err)
	}

	// Nothing the forbidden acts tried changed anything.
	if en, err := admin.Placement().Get(ctx, "d1"); err != nil || string(en.Value()) != `{"eligible":true}` || en.Revision() != 1 {
		t.Errorf("placement d1 after the forbidden writes: %v %v", en, err)
	}
	if _, err := admin.JetStream().Consumer(ctx, bus.StreamName, bus.BreakerConsumer); err != nil {
		t.Errorf("the breaker's consumer after the viewer's delete: %v", err)
	}
	if info, err := cons.Info(ctx); err != nil || info.NumPending != 1 || info.NumAckPending != 0 {
		t.Errorf("the breaker's consumer after the router's pull: %+v %v, want the one failure event pending", info, err)
	}
	if info, err := cons.Info(ctx); err != nil || !slices.Equal(info.Config.FilterSubjects, []string{"narwhal.events.failure.>"}) {
		t.Errorf("the breaker's consumer after the viewer's legacy create: %+v %v, want its own filter", info, err)
	}
	st, err = admin.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	if info := st.CachedInfo(); info.State.Msgs != 3 || info.Config.MaxAge != bus.StreamMaxAge {
		t.Errorf("the stream holds %d events (want 3: the breaker's two and the router's own), max age %v (want %v)",
			info.State.Msgs, info.Config.MaxAge, bus.StreamMaxAge)
	}
	if _, err := admin.JetStream().KeyValue(ctx, "narwhal_other"); !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Errorf("bucket narwhal_other: %v, want none", err)
	}
}

// TestViewerSetupNeedsAdmin proves that a viewer binding to a bus that has
// not been set up gets the message naming the command, and that a
// read-only Connect with any role changes nothing (R-BUS-8).
func TestViewerSetupNeedsAdmin(t *testing.T) {
	dir := bustest.Credentials(t)
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: dir, NoSetup: true})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), CredsFile: bustest.CredsFile(dir, bus.RoleViewer)})
	if !errors.Is(err, bus.ErrNotSetUp) || !strings.Contains(err.Error(), "narwhal bus setup") {
		t.Fatalf("viewer on a bus not set up: %v", err)
	}
	b, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), CredsFile: bustest.CredsFile(dir, bus.RoleAdmin), Setup: &bus.SetupOptions{}})
	if err != nil {
		t.Fatalf("admin set-up: %v", err)
	}
	b.Close()
	connectAs(t, e, dir, bus.RoleViewer)
}

// TestClusterRoutesNeedTheSecret proves that with a credential set the
// cluster port is closed to strangers too (R-BUS-8): a server of the same
// set joins the cluster, one of another set (another route secret) does
// not.
func TestClusterRoutesNeedTheSecret(t *testing.T) {
	dir, other := bustest.Credentials(t), bustest.Credentials(t)
	ports := bustest.FreePorts(t, 3)
	route := func(i int) string { return "nats://127.0.0.1:" + strconv.Itoa(ports[i]) }
	node := func(name, auth string, i int, routes ...string) *bus.Embedded {
		return bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: auth, NoSetup: true,
			ServerName: name, Cluster: "127.0.0.1:" + strconv.Itoa(ports[i]), Routes: routes})
	}
	a := node("a", dir, 0)
	stranger := node("stranger", other, 1, route(0))
	node("b", dir, 2, route(0))
	peers := func(e *bus.Embedded) []string {
		rz, err := e.Server().Routez(nil)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, r := range rz.Routes {
			names = append(names, r.RemoteName)
		}
		return names
	}
	testkit.WaitFor(t, waitBound, "b routed to a", func() bool { return slices.Contains(peers(a), "b") })
	if got := peers(a); slices.Contains(got, "stranger") {
		t.Errorf("a routes to %v: the stranger joined", got)
	}
	// The stranger's own attempts to route to a show for a moment in its
	// Routez (from a's INFO until a refuses its CONNECT, longer on a busy
	// machine) and come back each time it retries: it must find itself
	// without any route, which a route a accepted would never let it.
	testkit.WaitFor(t, waitBound, "the stranger without routes", func() bool { return len(peers(stranger)) == 0 })
	raw, err := os.ReadFile(filepath.Join(dir, bus.RouteSecretFile))
	if err != nil || len(strings.TrimSpace(string(raw))) < 32 {
		t.Errorf("route secret %q, %v", raw, err)
	}
}

// TestMissingCredentialFileNamesTheRoleRBUS8: a NARWHAL_NATS_CREDS that
// names no file is refused before any server is asked, and the error says
// which setting is wrong, the path it names and the file of the
// process's role that `narwhal bus creds` writes (R-BUS-8), not only
// nats's "open …: no such file or directory".
func TestMissingCredentialFileNamesTheRoleRBUS8(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "creds", "router.creds")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.ConnectOptions{URL: "nats://127.0.0.1:1", CredsFile: missing, Role: bus.RoleBreaker})
	if err == nil {
		b.Close()
		t.Fatal("Connect with a credential file that does not exist: no error")
	}
	msg := err.Error()
	for _, want := range []string{"NARWHAL_NATS_CREDS=" + missing, "breaker.creds", "narwhal bus creds", "no such file"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not say %q", msg, want)
		}
	}
	// A router's or an engine's: its own file and the flag that writes it
	// (R-BUS-11).
	for _, kind := range []string{bus.RoleRouter, bus.RoleEngine} {
		_, err := bus.Connect(ctx, bus.ConnectOptions{URL: "nats://127.0.0.1:1", CredsFile: missing, Role: kind, ID: "x7"})
		if err == nil {
			t.Fatalf("%s: Connect with a credential file that does not exist: no error", kind)
		}
		for _, want := range []string{"NARWHAL_NATS_CREDS=" + missing, kind + "-x7.creds", "narwhal bus creds --out DIR --" + kind + " x7"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: error %q does not say %q", kind, err, want)
			}
		}
	}
}
