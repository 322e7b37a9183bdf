package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestBusCredsCommand proves `narwhal bus creds --out DIR` (R-BUS-8): it
// creates a missing DIR with one credential per role and the server side,
// lists them, and refuses to overwrite a set.
func TestBusCredsCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b")
	var out, errOut bytes.Buffer
	if err := runBus(context.Background(), []string{"creds", "--out", dir}, &out, &errOut); err != nil {
		t.Fatalf("bus creds: %v\n%s", err, errOut.String())
	}
	for _, f := range []string{"router.creds", "breaker.creds", "chaos.creds", "viewer.creds", "admin.creds", "engine.creds", "auth.conf", "route.secret", "keys/account.nk"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("%s: %v", f, err)
		}
		if !strings.Contains(out.String(), strings.TrimPrefix(f, "keys/account.nk")) {
			t.Errorf("the listing lacks %s:\n%s", f, out.String())
		}
	}
	if err := runBus(context.Background(), []string{"creds", "--out", dir}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "exists already") {
		t.Errorf("a second bus creds into %s: %v, want a refusal", dir, err)
	}
	if err := runBus(context.Background(), []string{"creds"}, &out, &errOut); err == nil {
		t.Error("bus creds without --out succeeded")
	}
}

// TestBusSetupCommand proves `narwhal bus setup` (R-BUS-8): against a NATS
// without Narwhal's streams it creates them all with the admin credential,
// listing each one's replicas, while a router credential may not, and the
// message names the permission.
func TestBusSetupCommand(t *testing.T) {
	testkit.CheckLeaks(t)
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir, NoSetup: true})
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())

	t.Setenv("NARWHAL_NATS_CREDS", bustest.CredsFile(dir, bus.RoleRouter))
	out, errOut := &testkit.LockedBuffer{}, &testkit.LockedBuffer{}
	err := runBus(context.Background(), []string{"setup", "--connect-timeout", "3s"}, out, errOut)
	if err == nil || !strings.Contains(err.Error(), "ermissions") {
		t.Errorf("bus setup with the router's credential: %v, want a permissions violation", err)
	}

	t.Setenv("NARWHAL_NATS_CREDS", bustest.CredsFile(dir, bus.RoleAdmin))
	out = &testkit.LockedBuffer{}
	if err := runBus(context.Background(), []string{"setup"}, out, errOut); err != nil {
		t.Fatalf("bus setup with the admin's credential: %v\n%s", err, errOut.String())
	}
	for _, name := range []string{bus.StreamName, bus.HistoryStream, bus.PlacementBucket, bus.LeaseBucket, bus.ChaosBucket} {
		if !regexp.MustCompile(regexp.QuoteMeta(name) + `\s+1 replicas`).MatchString(out.String()) {
			t.Errorf("bus setup's output lacks %s at 1 replica:\n%s", name, out.String())
		}
	}
	if !strings.Contains(errOut.String(), "stream created") {
		t.Errorf("bus setup's log does not say what it created:\n%s", errOut.String())
	}
}
