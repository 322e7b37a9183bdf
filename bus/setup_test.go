package bus_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// streamNames lists the streams on e's JetStream.
func streamNames(t *testing.T, js jetstream.JetStream) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var names []string
	l := js.StreamNames(ctx)
	for n := range l.Name() {
		names = append(names, n)
	}
	if err := l.Err(); err != nil {
		t.Fatal(err)
	}
	return names
}

// TestConnectOnlyBinds proves R-BUS-8: a process that is not the admin
// binds to what exists and creates nothing — on a bare server its Connect
// fails at once with a message naming the missing stream and the command
// that creates it, and leaves the server without streams; the admin's
// Setup creates the stream and every bucket; after that a plain Connect
// changes nothing, not even settings that differ from Narwhal's.
func TestConnectOnlyBinds(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, NoSetup: true})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	start := time.Now()
	_, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), Name: "router"})
	var nse *bus.NotSetUpError
	if !errors.As(err, &nse) || nse.What != "stream" || nse.Name != bus.StreamName || !errors.Is(err, bus.ErrNotSetUp) {
		t.Fatalf("Connect on a bare server: %v, want a NotSetUpError for stream %s", err, bus.StreamName)
	}
	if msg := err.Error(); !strings.Contains(msg, bus.StreamName) || !strings.Contains(msg, "narwhal bus setup") {
		t.Errorf("message %q names neither the stream nor the command", msg)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Connect took %v to say the stream is missing", d)
	}

	admin := &testkit.LockedBuffer{}
	b, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), Name: "admin",
		Setup: &bus.SetupOptions{LeaseTTL: 2 * time.Second, Log: slog.New(slog.NewTextHandler(admin, nil))}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	got := strings.Join(streamNames(t, b.JetStream()), " ")
	for _, want := range []string{bus.StreamName, "KV_" + bus.PlacementBucket, "KV_" + bus.LeaseBucket, "KV_" + bus.ChaosBucket} {
		if !strings.Contains(got, want) {
			t.Errorf("after Setup the streams are %q, want %s among them", got, want)
		}
	}
	lease, err := b.BindBucket(ctx, bus.LeaseBucket)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := lease.Status(ctx); err != nil || st.TTL() != 2*time.Second {
		t.Errorf("lease bucket status %v, %v: want TTL 2s", st, err)
	}
	for _, want := range []string{"stream created", "bucket created"} {
		if !strings.Contains(admin.String(), want) {
			t.Errorf("the admin's log lacks %q:\n%s", want, admin.String())
		}
	}

	// Someone edits the stream; a plain Connect leaves it so.
	st, err := b.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	edited := st.CachedInfo().Config
	edited.MaxAge = time.Hour
	if _, err := b.JetStream().UpdateStream(ctx, edited); err != nil {
		t.Fatal(err)
	}
	b2, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), Name: "viewer"})
	if err != nil {
		t.Fatal(err)
	}
	b2.Close()
	st, err = b.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	if got := st.CachedInfo().Config.MaxAge; got != time.Hour {
		t.Errorf("a plain Connect changed the stream's max age to %v", got)
	}

	// A missing bucket is named too.
	if err := b.JetStream().DeleteKeyValue(ctx, bus.ChaosBucket); err != nil {
		t.Fatal(err)
	}
	_, err = b.BindBucket(ctx, bus.ChaosBucket)
	if !errors.As(err, &nse) || nse.What != "bucket" || nse.Name != bus.ChaosBucket || !strings.Contains(err.Error(), "narwhal bus setup") {
		t.Errorf("BindBucket of a deleted bucket: %v", err)
	}
}

// TestSetupKeepsReplicas proves R-BUS-8: an admin that wants other
// replicas than an existing stream or bucket has does not change them; it
// logs what it found against what it wanted, and still restores the other
// settings.
func TestSetupKeepsReplicas(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1})
	b := connect(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := b.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	edited := st.CachedInfo().Config
	edited.MaxAge = time.Hour
	if _, err := b.JetStream().UpdateStream(ctx, edited); err != nil {
		t.Fatal(err)
	}
	log := &testkit.LockedBuffer{}
	if err := bus.Setup(ctx, b, bus.SetupOptions{Replicas: 3, Log: slog.New(slog.NewTextHandler(log, nil))}); err != nil {
		t.Fatalf("Setup wanting 3 replicas of R1 streams on one server: %v", err)
	}
	out := log.String()
	for _, name := range []string{bus.StreamName, bus.PlacementBucket, bus.LeaseBucket, bus.ChaosBucket} {
		if !strings.Contains(out, name+" found=1 wanted=3") {
			t.Errorf("the log does not say %s was found at 1 replica against 3 wanted:\n%s", name, out)
		}
	}
	st, err = b.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	if cfg := st.CachedInfo().Config; cfg.Replicas != 1 || cfg.MaxAge != bus.StreamMaxAge {
		t.Errorf("after Setup: replicas %d (want 1 kept), max age %v (want %v restored)", cfg.Replicas, cfg.MaxAge, bus.StreamMaxAge)
	}
}

// TestSetupAllowsNoRollupRBUS11 proves the set-up's part of "no wipe"
// (R-BUS-11): streams NARWHAL_EVENTS, NARWHAL_HISTORY and NARWHAL_PREFIX
// and bucket narwhal_routers allow no rollup (the history, the prefix
// stream and the bucket no purge either), also a bucket nats.go made with
// rollups before the set-up ran; a second set-up keeps them so and
// updates nothing; nats.go's Put and Delete on the bucket still work, its
// Purge (a rollup) is refused.
func TestSetupAllowsNoRollupRBUS11(t *testing.T) {
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, NoSetup: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	nc, err := nats.Connect(e.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	// As an older set-up made it: nats.go's defaults, rollups allowed.
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket: bus.RoutersBucket, Description: "Narwhal routers: legs in flight by router id", History: 1,
		TTL: bus.RouterReportTTL, Storage: jetstream.FileStorage,
	}); err != nil {
		t.Fatal(err)
	}
	b := bustest.Connect(t, e, bus.ConnectOptions{Setup: &bus.SetupOptions{}})
	check := func(when string) {
		t.Helper()
		for _, c := range []struct {
			stream string
			purge  bool
		}{{bus.StreamName, false}, {bus.HistoryStream, true}, {bus.PrefixStream, true}, {"KV_" + bus.RoutersBucket, true}} {
			st, err := b.JetStream().Stream(ctx, c.stream)
			if err != nil {
				t.Fatal(err)
			}
			cfg := st.CachedInfo().Config
			if cfg.AllowRollup || c.purge && !cfg.DenyPurge {
				t.Errorf("%s: stream %s allows rollups %v, denies purges %v; want no rollup (and no purge: %v)", when, c.stream, cfg.AllowRollup, cfg.DenyPurge, c.purge)
			}
		}
	}
	check("after the set-up")
	log := &testkit.LockedBuffer{}
	if err := bus.Setup(ctx, b, bus.SetupOptions{Log: slog.New(slog.NewTextHandler(log, nil))}); err != nil {
		t.Fatal(err)
	}
	check("after a second set-up")
	if strings.Contains(log.String(), "updated") {
		t.Errorf("a second set-up updated:\n%s", log.String())
	}
	kv, err := b.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := kv.Status(ctx); err != nil || st.TTL() != bus.RouterReportTTL || st.History() != 1 {
		t.Errorf("bucket %s after the set-up: %v %v", bus.RoutersBucket, st, err)
	}
	if _, err := kv.Put(ctx, "r1", []byte(`{}`)); err != nil {
		t.Errorf("put: %v", err)
	}
	if _, err := kv.Put(ctx, "r2", []byte(`{}`)); err != nil {
		t.Errorf("put: %v", err)
	}
	if err := kv.Delete(ctx, "r1"); err != nil {
		t.Errorf("delete: %v", err)
	}
	if err := kv.Purge(ctx, "r2"); err == nil {
		t.Error("purge of r2 succeeded, want the rollup refused")
	}
	if en, err := kv.Get(ctx, "r2"); err != nil || en.Operation() != jetstream.KeyValuePut {
		t.Errorf("r2 after the refused purge: %v %v", en, err)
	}
}
