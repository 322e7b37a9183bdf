package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
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

// TestMissingCredentialNamesTheRoleRBUS8 proves that a process refused by
// a bus that enforces credentials (R-BUS-8: nats: Authorization
// Violation) says what to set: NARWHAL_NATS_CREDS, and the file of its
// own role among those `narwhal bus creds` writes — without a credential
// and with one of another mesh. It runs against a real --auth server.
func TestMissingCredentialNamesTheRoleRBUS8(t *testing.T) {
	testkit.CheckLeaks(t)
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	other := bustest.CredsFile(bustest.Credentials(t), bus.RoleRouter)
	cfg := config.Default()
	cfg.Bus.URL = emb.ClientURL()
	cfg.Bus.ConnectTimeoutS = 5
	log := slog.New(slog.DiscardHandler)
	for _, creds := range []string{"", other} {
		t.Setenv("NARWHAL_NATS_CREDS", creds)
		cfg.Bus.Creds = creds
		checks := []struct {
			who, file string
			run       func() error
		}{
			{"router", "router.creds", func() error {
				_, _, err := joinBus(context.Background(), &cfg, "narwhal-router-t", bus.RoleRouter, log)
				return err
			}},
			{"breaker", "breaker.creds", func() error {
				_, _, err := joinBus(context.Background(), &cfg, "narwhal-breaker-t", bus.RoleBreaker, log)
				return err
			}},
			{"events", "viewer.creds", func() error {
				return runEvents(context.Background(), []string{"--connect-timeout", "5s"}, io.Discard, io.Discard)
			}},
			{"chaos list", "chaos.creds", func() error {
				return runChaos(context.Background(), []string{"list", "--connect-timeout", "5s"}, io.Discard, io.Discard)
			}},
			{"fleet list", "admin.creds", func() error {
				return runFleet(context.Background(), []string{"list"}, io.Discard, io.Discard)
			}},
		}
		for _, c := range checks {
			err := c.run()
			if err == nil {
				t.Errorf("%s with credential %q: no error against a bus that requires one", c.who, creds)
				continue
			}
			msg := err.Error()
			if !strings.Contains(strings.ToLower(msg), "authorization violation") || !strings.Contains(msg, "NARWHAL_NATS_CREDS") ||
				!strings.Contains(msg, c.file) || !strings.Contains(msg, "narwhal bus creds") {
				t.Errorf("%s with credential %q: %v\nwant the violation, NARWHAL_NATS_CREDS, %s and `narwhal bus creds`", c.who, creds, err, c.file)
			}
			if creds != "" && !strings.Contains(msg, creds) {
				t.Errorf("%s: the error does not name the refused file %s: %v", c.who, creds, err)
			}
		}
	}
}
