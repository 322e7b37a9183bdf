package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nkeys"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestRevokedSimExitsRBUS11 proves what follows `narwhal bus revoke` for an
// engine (behaviour.md R-BUS-11), with a real --auth bus: `narwhal sim
// --register` with engine d1's own credential exits non-zero within 5 s of
// the revocation, naming the revoked file and how to get a new one; `bus
// revoke` says "1 server answered"; `narwhal bus creds --engine d1` then
// replaces the revoked file, while a valid one (d2) is refused with the
// hint that revoking it first allows a new one; a revocation stored by a
// push that failed (a wrong NARWHAL_NATS_URL) is named as "also pushed,
// revoked earlier" by the next run.
func TestRevokedSimExitsRBUS11(t *testing.T) {
	dir := t.TempDir()
	out, errOut := &testkit.LockedBuffer{}, &testkit.LockedBuffer{}
	if err := runBus(context.Background(), []string{"creds", "--out", dir, "--engine", "d1", "--engine", "d2"}, out, errOut); err != nil {
		t.Fatalf("bus creds: %v\n%s", err, errOut.String())
	}
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	d1 := dir + "/" + bus.IdentityCredsFile(bus.RoleEngine, "d1")
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	t.Setenv("NARWHAL_NATS_CREDS", d1)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- runSim(ctx, []string{"--engine-id", "d1", "--model", "m", "--role", "decode", "--listen", "127.0.0.1:0", "--register"})
	}()
	// Registered: its registration is in stream NARWHAL_REGISTRATIONS.
	admin := bustest.Connect(t, emb, bus.ConnectOptions{CredsFile: bustest.CredsFile(dir, bus.RoleAdmin)})
	testkit.WaitFor(t, 10*time.Second, "d1's registration on the bus", func() bool {
		s, err := admin.JetStream().Stream(ctx, bus.RegistrationsStream)
		return err == nil && s.CachedInfo().State.Msgs > 0
	})

	out = &testkit.LockedBuffer{}
	start := time.Now()
	if err := runBus(context.Background(), []string{"revoke", "--creds", dir, "--engine", "d1"}, out, errOut); err != nil {
		t.Fatalf("bus revoke: %v\n%s%s", err, out.String(), errOut.String())
	}
	if !strings.Contains(out.String(), ": 1 server answered\n") || strings.Contains(out.String(), "also pushed") {
		t.Errorf("bus revoke's output:\n%s\nwant \"1 server answered\" and nothing revoked earlier", out.String())
	}
	select {
	case err := <-done:
		t.Logf("sim exited %v after the revocation began: %v", time.Since(start), err)
		if err == nil || !strings.Contains(err.Error(), "engine-d1.creds was revoked") || !strings.Contains(err.Error(), "narwhal bus creds --out DIR --engine d1") {
			t.Errorf("sim's exit: %v, want an error naming the revoked engine-d1.creds and how to get a new one", err)
		}
	case <-time.After(5*time.Second + time.Until(start.Add(2*time.Second))):
		// bus revoke itself takes up to 2 s (two pushes a second apart).
		t.Fatalf("sim still running %v after the revocation began", time.Since(start))
	}

	// A new credential for revoked d1; none over valid d2.
	out = &testkit.LockedBuffer{}
	if err := runBus(context.Background(), []string{"creds", "--out", dir, "--engine", "d1"}, out, errOut); err != nil {
		t.Fatalf("bus creds --engine d1 after its revocation: %v", err)
	}
	if !strings.Contains(out.String(), "engine-d1.creds") || !strings.Contains(out.String(), "replaces the revoked one") {
		t.Errorf("bus creds output:\n%s\nwant engine-d1.creds replacing the revoked one", out.String())
	}
	err := runBus(context.Background(), []string{"creds", "--out", dir, "--engine", "d2"}, out, errOut)
	if err == nil || !strings.Contains(err.Error(), "exists already") || !strings.Contains(err.Error(), "revoking it first") {
		t.Errorf("bus creds --engine d2 (valid): %v, want refused, saying that revoking it first allows a new one", err)
	}
	nb := bustest.Connect(t, emb, bus.ConnectOptions{CredsFile: d1, Role: bus.RoleEngine, ID: "d1"})
	if !nb.Connected() {
		t.Error("d1's new credential does not connect")
	}

	// A push that fails stores the revocation; the next run says it
	// pushes it too.
	d2Pub, _, err := bus.CredentialUser(dir + "/" + bus.IdentityCredsFile(bus.RoleEngine, "d2"))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("NARWHAL_NATS_URL", "nats://127.0.0.1:1")
	if err := runBus(context.Background(), []string{"revoke", "--creds", dir, "--engine", "d2", "--timeout", "2s"}, out, errOut); err == nil {
		t.Fatal("bus revoke with a wrong NARWHAL_NATS_URL succeeded")
	}
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	kp, _ := nkeys.CreateUser()
	other, _ := kp.PublicKey()
	out = &testkit.LockedBuffer{}
	if err := runBus(context.Background(), []string{"revoke", "--creds", dir, "--user", other}, out, errOut); err != nil {
		t.Fatalf("bus revoke --user: %v\n%s", err, out.String())
	}
	t.Logf("narwhal bus revoke --user:\n%s", out.String())
	if !strings.Contains(out.String(), "also pushed, revoked earlier: ") || !strings.Contains(out.String(), d2Pub+" (narwhal-engine-d2)") {
		t.Errorf("bus revoke's output:\n%s\nwant d2 (narwhal-engine-d2) among the users also pushed", out.String())
	}
}

// TestRevokedEventsExitsRBUS11 proves that `narwhal events` does not go
// silent when its viewer credential is revoked (behaviour.md R-BUS-11):
// it exits non-zero within 5 s naming the revoked file.
func TestRevokedEventsExitsRBUS11(t *testing.T) {
	dir := t.TempDir()
	out, errOut := &testkit.LockedBuffer{}, &testkit.LockedBuffer{}
	if err := runBus(context.Background(), []string{"creds", "--out", dir}, out, errOut); err != nil {
		t.Fatal(err)
	}
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	viewer := bustest.CredsFile(dir, bus.RoleViewer)
	pub, _, err := bus.CredentialUser(viewer)
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	t.Setenv("NARWHAL_NATS_CREDS", viewer)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	evOut, evErr := &testkit.LockedBuffer{}, &testkit.LockedBuffer{}
	done := make(chan error, 1)
	go func() { done <- runEvents(ctx, nil, evOut, evErr) }()
	testkit.WaitFor(t, 10*time.Second, "events following", func() bool { return strings.Contains(evErr.String(), "following ") })
	start := time.Now()
	if err := runBus(context.Background(), []string{"revoke", "--creds", dir, "--user", pub}, out, errOut); err != nil {
		t.Fatalf("bus revoke: %v\n%s", err, out.String())
	}
	select {
	case err := <-done:
		t.Logf("events exited %v after the revocation began: %v", time.Since(start), err)
		if err == nil || !strings.Contains(err.Error(), bus.CredsFile(bus.RoleViewer)+" was revoked") {
			t.Errorf("events' exit: %v, want an error naming the revoked viewer.creds", err)
		}
	case <-time.After(5*time.Second + time.Until(start.Add(2*time.Second))):
		t.Fatalf("events still running %v after the revocation began", time.Since(start))
	}
}
