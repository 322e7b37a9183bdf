package bus_test

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// revokeBound is how soon a revocation must be enforced (behaviour.md
// R-BUS-11): the revoked client disconnected, every server refusing it.
const revokeBound = 5 * time.Second

// identityConn is a plain NATS connection with an identity's credential,
// and what it has seen of its connection.
type identityConn struct {
	nc   *nats.Conn
	lost chan error // the first disconnect's error
}

// dialIdentity connects to url with the credential IssueIdentity wrote for
// role and id, keeping nats.go's reconnects (which a revoked credential
// must not survive). It is closed when the test ends.
func dialIdentity(t *testing.T, url, path, role, id string) *identityConn {
	t.Helper()
	c := &identityConn{lost: make(chan error, 1)}
	opts := append(bustest.IdentityOptions(path, role, id),
		nats.Timeout(2*time.Second),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}), // the revocation is expected
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			select {
			case c.lost <- err:
			default:
			}
		}))
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatalf("%s %s connects to %s: %v", role, id, url, err)
	}
	c.nc = nc
	t.Cleanup(nc.Close)
	return c
}

// alive reports whether c is connected and answered by JetStream.
func (c *identityConn) alive() bool {
	if !c.nc.IsConnected() {
		return false
	}
	m, err := c.nc.Request("$JS.API.INFO", nil, 2*time.Second)
	return err == nil && strings.Contains(string(m.Data), "io.nats.jetstream.api.v1.account_info_response")
}

// refused asserts that a new connection with the credential fails with
// an authorization error.
func refused(t *testing.T, url, path, role, id string) {
	t.Helper()
	opts := append(bustest.IdentityOptions(path, role, id), nats.Timeout(2*time.Second))
	nc, err := nats.Connect(url, opts...)
	if err == nil {
		nc.Close()
		t.Errorf("a new connection of revoked %s %s to %s succeeded", role, id, url)
		return
	}
	if !strings.Contains(strings.ToLower(err.Error()), "authorization") && !strings.Contains(strings.ToLower(err.Error()), "revoked") {
		t.Errorf("a new connection of revoked %s %s: %v, want an authorization violation", role, id, err)
	}
}

// revoke revokes pub in dir and pushes the new account JWT to url with
// dir's sys.creds (bus.Revoke), as `narwhal bus revoke` does, failing the test on an
// error or a server that did not store it.
func revoke(t *testing.T, dir, url string, pub string) []bus.ClaimUpdate {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	answers, stored, err := bus.Revoke(ctx, dir, []string{pub}, bus.PushOptions{URL: url, CredsFile: filepath.Join(dir, bus.SysCredsFile)})
	if err != nil || !stored {
		t.Fatalf("revoke: stored %v, %v (answers %v)", stored, err, answers)
	}
	for _, a := range answers {
		if !a.OK {
			t.Errorf("server %s refused the revocation: %s", a.Server, a.Message)
		}
	}
	return answers
}

// jetStreamState is what the test keeps of an account's JetStream: each
// stream's message count and last sequence, and the placement bucket's
// values.
func jetStreamState(t *testing.T, b *bus.Bus) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	out := map[string]string{}
	names := b.JetStream().StreamNames(ctx)
	for name := range names.Name() {
		s, err := b.JetStream().Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		st := s.CachedInfo().State
		out["stream "+name] = strconv.FormatUint(st.Msgs, 10) + "/" + strconv.FormatUint(st.LastSeq, 10)
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
	keys, err := b.Placement().ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for k := range keys.Keys() {
		en, err := b.Placement().Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		out["placement "+k] = string(en.Value())
	}
	return out
}

// sameJetStreamState fails the test when got differs from want.
func sameJetStreamState(t *testing.T, when string, want, got map[string]string) {
	t.Helper()
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %s is %q, want %q", when, k, got[k], v)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: %s appeared", when, k)
		}
	}
}

// TestRevokeEngineCredentialRBUS11 proves revocation in the existing
// account (behaviour.md R-BUS-11): once engine d1's credential is revoked
// and the account JWT pushed with sys.creds, d1's connected client is
// disconnected within 5 s and its new connections are refused, while
// engine d2 and the role credentials keep working; every stream and
// bucket is still there with the same messages. The revocation survives
// a restart of the node even from the auth.conf of before it: the full
// resolver stored it under the node's data directory.
func TestRevokeEngineCredentialRBUS11(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "creds")
	if err := bus.WriteCredentials(dir); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(dir, bus.SysCredsFile))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("sys.creds: %v, %v; want mode 0600", fi, err)
	}
	d1, d1Pub := bustest.IssueIdentity(t, dir, bus.RoleEngine, "d1")
	d2, _ := bustest.IssueIdentity(t, dir, bus.RoleEngine, "d2")
	// The auth.conf of before the revocation, for the restart.
	before := t.TempDir()
	for _, f := range []string{bus.AuthConfFile, bus.RouteSecretFile, bus.CredsFile(bus.RoleAdmin)} {
		raw, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(before, f), raw, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	data := t.TempDir()
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: data, Port: -1, AuthDir: dir})
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, subj := range []string{"narwhal.events.failure.d1", "narwhal.events.failure.d2", "narwhal.events.request.r1"} {
		if _, err := admin.JetStream().Publish(ctx, subj, []byte(`{"n":1}`)); err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range []string{"d1", "d2"} {
		if _, err := admin.Placement().Put(ctx, k, []byte(`{"eligible":true,"engine":"`+k+`"}`)); err != nil {
			t.Fatal(err)
		}
	}
	// NARWHAL_HISTORY copies from NARWHAL_EVENTS in the background: the
	// state to keep is the one that stopped changing.
	var want map[string]string
	testkit.WaitFor(t, waitBound, "the history stream caught up", func() bool {
		prev := want
		want = jetStreamState(t, admin)
		return want["stream "+bus.HistoryStream] != "0/0" && maps.Equal(prev, want)
	})
	t.Logf("JetStream before: %v", want)

	c1 := dialIdentity(t, e.ClientURL(), d1, bus.RoleEngine, "d1")
	c2 := dialIdentity(t, e.ClientURL(), d2, bus.RoleEngine, "d2")
	router := connectID(t, e, dir, bus.RoleRouter, "r1")
	if !c1.alive() || !c2.alive() {
		t.Fatal("d1 or d2 not answered before the revocation")
	}

	start := time.Now()
	answers := revoke(t, dir, e.ClientURL(), d1Pub)
	if len(answers) != 1 || answers[0].Server != "narwhal" || answers[0].Message != "jwt updated" {
		t.Errorf("answers %+v, want server narwhal's jwt updated", answers)
	}
	select {
	case err := <-c1.lost:
		t.Logf("d1 disconnected %v after the push: %v", time.Since(start), err)
	case <-time.After(revokeBound):
		t.Fatalf("d1's connection still open %v after its revocation", revokeBound)
	}
	testkit.WaitFor(t, revokeBound, "d1 without a connection", func() bool { return !c1.nc.IsConnected() })
	refused(t, e.ClientURL(), d1, bus.RoleEngine, "d1")
	if !c2.alive() {
		t.Error("d2 lost its connection with d1's revocation")
	}
	select {
	case err := <-c2.lost:
		t.Errorf("d2 was disconnected: %v", err)
	default:
	}
	if !router.Connected() {
		t.Error("the router's role credential lost its connection")
	}
	if _, err := router.Placement().Get(ctx, "d1"); err != nil {
		t.Errorf("the router reads placement after the revocation: %v", err)
	}
	sameJetStreamState(t, "after the revocation", want, jetStreamState(t, admin))

	// auth.conf holds the new JWT: its preload is the newest.
	conf, err := os.ReadFile(filepath.Join(dir, bus.AuthConfFile))
	if err != nil {
		t.Fatal(err)
	}
	old, _ := os.ReadFile(filepath.Join(before, bus.AuthConfFile))
	if string(conf) == string(old) {
		t.Error("auth.conf unchanged by the revocation")
	}

	// A restart from the auth.conf of before: the resolver's stored JWT,
	// newer than that preload, still revokes d1.
	admin.Close()
	router.Close()
	e.Shutdown()
	if _, err := os.Stat(filepath.Join(data, bus.ResolverDir)); err != nil {
		t.Fatalf("no resolver directory under the data directory: %v", err)
	}
	e2 := bustest.StartWith(t, bus.EmbeddedOptions{Dir: data, Port: -1, AuthDir: before})
	refused(t, e2.ClientURL(), d1, bus.RoleEngine, "d1")
	if !dialIdentity(t, e2.ClientURL(), d2, bus.RoleEngine, "d2").alive() {
		t.Error("d2 not answered after the restart")
	}
	sameJetStreamState(t, "after the restart", want, jetStreamState(t, connectAs(t, e2, dir, bus.RoleAdmin)))
}

// TestRevokeErrorsRBUS11 proves that revocation's errors name what is
// wrong (behaviour.md R-BUS-11): a key that is no user key, a directory
// without the operator key, and a bus that takes no update (its resolver
// is not a full one).
func TestRevokeErrorsRBUS11(t *testing.T) {
	dir := bustest.Credentials(t)
	if _, err := bus.RevokeUsers(dir, []string{"ABADKEY"}); err == nil || !strings.Contains(err.Error(), "ABADKEY") {
		t.Errorf("revoking a bad key: %v", err)
	}
	_, pub := bustest.IssueIdentity(t, dir, bus.RoleEngine, "d1")
	noKeys := t.TempDir()
	raw, _ := os.ReadFile(filepath.Join(dir, bus.AuthConfFile))
	_ = os.WriteFile(filepath.Join(noKeys, bus.AuthConfFile), raw, 0o644)
	if _, err := bus.RevokeUsers(noKeys, []string{pub}); err == nil || !strings.Contains(err.Error(), "operator.nk") {
		t.Errorf("revoking without keys/: %v, want it to name operator.nk", err)
	}
	// A bus without credentials: the system user is refused.
	plain := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, NoSetup: true})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	token, err := bus.AccountJWT(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.PushAccountJWT(ctx, bus.PushOptions{URL: plain.ClientURL(), CredsFile: filepath.Join(dir, bus.SysCredsFile)}, token); err == nil || !strings.Contains(err.Error(), "full resolver") {
		t.Errorf("a push to a bus that takes no update: %v, want it to say the bus needs a full resolver", err)
	} else {
		t.Logf("push to a bus without credentials: %v", err)
	}
	if _, err := bus.PushAccountJWT(ctx, bus.PushOptions{URL: plain.ClientURL(), CredsFile: filepath.Join(noKeys, bus.SysCredsFile)}, token); err == nil || !strings.Contains(err.Error(), bus.SysCredsFile) {
		t.Errorf("a push without sys.creds: %v, want it to name %s", err, bus.SysCredsFile)
	}
}

// TestAuthConfForNATSServerRBUS11 proves what an official nats-server
// gets from auth.conf (behaviour.md R-BUS-11): a full resolver in
// ./narwhal-jwt of its working directory, preloaded with the accounts,
// which a config that includes auth.conf may point elsewhere with a
// resolver of its own after the include; and that such a server refuses
// a revoked credential and keeps the others, as `narwhal bus --auth` does.
func TestAuthConfForNATSServerRBUS11(t *testing.T) {
	dir := bustest.Credentials(t)
	t.Chdir(t.TempDir())
	opts, err := server.ProcessConfigFile(filepath.Join(dir, bus.AuthConfFile))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := opts.AccountResolver.(*server.DirAccResolver); !ok {
		t.Fatalf("auth.conf's resolver is %T, want nats-server's full resolver", opts.AccountResolver)
	}
	opts.AccountResolver.Close() // no server runs it
	if fi, err := os.Stat("narwhal-jwt"); err != nil || !fi.IsDir() {
		t.Errorf("./narwhal-jwt: %v, want the resolver's directory", err)
	}

	jwtDir, store := t.TempDir(), t.TempDir()
	// nats-server reads an include relative to the including file.
	etc := t.TempDir()
	raw, err := os.ReadFile(filepath.Join(dir, bus.AuthConfFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(etc, bus.AuthConfFile), raw, 0o644); err != nil {
		t.Fatal(err)
	}
	main := filepath.Join(etc, "nats.conf")
	conf := "include auth.conf\n" +
		"resolver: { type: full, dir: " + strconv.Quote(jwtDir) + ", allow_delete: false, interval: \"1m\" }\n" +
		"listen: \"127.0.0.1:-1\"\njetstream: { store_dir: " + strconv.Quote(store) + " }\n"
	if err := os.WriteFile(main, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err = server.ProcessConfigFile(main)
	if err != nil {
		t.Fatal(err)
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
	d1, d1Pub := bustest.IssueIdentity(t, dir, bus.RoleEngine, "d1")
	d2, _ := bustest.IssueIdentity(t, dir, bus.RoleEngine, "d2")
	c1 := dialIdentity(t, srv.ClientURL(), d1, bus.RoleEngine, "d1")
	c2 := dialIdentity(t, srv.ClientURL(), d2, bus.RoleEngine, "d2")
	if !c1.alive() {
		t.Fatal("d1 not answered before its revocation")
	}
	revoke(t, dir, srv.ClientURL(), d1Pub)
	testkit.WaitFor(t, revokeBound, "d1 disconnected", func() bool { return !c1.nc.IsConnected() })
	refused(t, srv.ClientURL(), d1, bus.RoleEngine, "d1")
	if !c2.alive() {
		t.Error("d2 lost its connection")
	}
	if entries, err := os.ReadDir(jwtDir); err != nil || len(entries) == 0 {
		t.Errorf("the resolver directory of the including config holds %v, %v; want the account JWTs", entries, err)
	}
}
