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
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestBusCredsCommand proves `narwhal bus creds --out DIR` (R-BUS-8,
// R-BUS-11): it creates a missing DIR with one credential per role (no
// router.creds, no engine.creds: those are per identity) and the server
// side, lists them, and refuses to overwrite a set; with --engine and
// --router into the new DIR it writes those identities too, every row's
// text lined up after the longest name.
func TestBusCredsCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b")
	var out, errOut bytes.Buffer
	if err := runBus(context.Background(), []string{"creds", "--out", dir, "--engine", "p1", "--router", "r1", "--router", "r2"}, &out, &errOut); err != nil {
		t.Fatalf("bus creds: %v\n%s", err, errOut.String())
	}
	for _, f := range []string{"breaker.creds", "chaos.creds", "viewer.creds", "admin.creds", "auth.conf", "route.secret", "keys/account.nk",
		"engine-p1.creds", "router-r1.creds", "router-r2.creds"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("%s: %v", f, err)
		}
		if !strings.Contains(out.String(), strings.TrimPrefix(f, "keys/account.nk")) {
			t.Errorf("the listing lacks %s:\n%s", f, out.String())
		}
	}
	for _, f := range []string{"router.creds", "engine.creds"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			t.Errorf("bus creds wrote %s: a credential every router (engine) would share", f)
		}
	}
	checkRowsLineUp(t, out.String())
	if err := runBus(context.Background(), []string{"creds", "--out", dir}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "holds a mesh") {
		t.Errorf("a second bus creds into %s: %v, want a refusal", dir, err)
	}
	if err := runBus(context.Background(), []string{"creds"}, &out, &errOut); err == nil {
		t.Error("bus creds without --out succeeded")
	}
	// A DIR with part of a mesh but no keys: refused, nothing replaced.
	partial := t.TempDir()
	if err := os.WriteFile(filepath.Join(partial, "auth.conf"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := runBus(context.Background(), []string{"creds", "--out", partial, "--router", "r1"}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "exists already") {
		t.Errorf("bus creds into a directory with an auth.conf: %v, want a refusal", err)
	}
}

// checkRowsLineUp fails t unless every indented row of a listing of
// `narwhal bus creds` ("  NAME   text") has its text at the same column.
func checkRowsLineUp(t *testing.T, listing string) {
	t.Helper()
	col := -1
	for line := range strings.SplitSeq(listing, "\n") {
		name, ok := strings.CutPrefix(line, "  ")
		if !ok {
			continue
		}
		name, _, _ = strings.Cut(name, " ")
		at := 2 + len(name) + len(line[2+len(name):]) - len(strings.TrimLeft(line[2+len(name):], " "))
		if col < 0 {
			col = at
		} else if at != col {
			t.Errorf("bus creds: the row of %s has its text at column %d, the first row at %d:\n%s", name, at, col, listing)
		}
	}
}

// TestBusCredsIdentitiesRBUS11 proves `narwhal bus creds --out DIR
// --engine ID --router ID` on a DIR that holds a mesh (R-BUS-11): it adds
// only the identities (the role files untouched), says what it wrote,
// refuses an invalid id, an id given twice and an identity that exists
// (before writing any), and a real `narwhal bus --auth DIR` started before
// them accepts them at once: each acts as itself, and not as another.
func TestBusCredsIdentitiesRBUS11(t *testing.T) {
	testkit.CheckLeaks(t)
	dir := filepath.Join(t.TempDir(), "mesh")
	var out, errOut bytes.Buffer
	if err := runBus(context.Background(), []string{"creds", "--out", dir}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	admin, _ := os.ReadFile(filepath.Join(dir, "admin.creds"))
	c := startCmd(t, runBus, "--listen", "127.0.0.1:0", "--data", t.TempDir(), "--auth", dir)
	defer func() { _ = c.stop(t) }()
	var url string
	testkit.WaitFor(t, cmdTestBound, "the bus listening line", func() bool {
		if lines := c.stdout.Lines(); len(lines) > 0 {
			if m := busLine.FindStringSubmatch(lines[0]); m != nil {
				url = m[1]
				return true
			}
			t.Fatalf("narwhal bus printed %q", lines[0])
		}
		return false
	})

	for _, bad := range [][]string{
		{"--router", "r.1"}, {"--engine", "p*"}, {"--router", ""}, {"--router", "r1", "--router", "r1"},
	} {
		out.Reset()
		if err := runBus(context.Background(), append([]string{"creds", "--out", dir}, bad...), &out, &errOut); err == nil {
			t.Errorf("bus creds %v succeeded", bad)
		}
	}
	out.Reset()
	if err := runBus(context.Background(), []string{"creds", "--out", dir, "--engine", "p1", "--router", "r1", "--router", "r2"}, &out, &errOut); err != nil {
		t.Fatalf("bus creds --engine p1 --router r1 --router r2: %v", err)
	}
	for _, want := range []string{"identities added to the mesh of " + dir, "engine-p1.creds", "router-r1.creds", "router-r2.creds"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("bus creds' output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "admin.creds") {
		t.Errorf("bus creds on a mesh lists the role files again:\n%s", out.String())
	}
	checkRowsLineUp(t, out.String())
	if again, _ := os.ReadFile(filepath.Join(dir, "admin.creds")); !bytes.Equal(again, admin) {
		t.Error("adding identities rewrote admin.creds")
	}
	if err := runBus(context.Background(), []string{"creds", "--out", dir, "--router", "r3", "--router", "r1"}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "exists already") {
		t.Errorf("bus creds --router r1 again: %v, want a refusal", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "router-r3.creds")); err == nil {
		t.Error("a refused bus creds wrote router-r3.creds")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r1, err := bus.Connect(ctx, bus.ConnectOptions{URL: url, CredsFile: filepath.Join(dir, "router-r1.creds"), Role: bus.RoleRouter, ID: "r1"})
	if err != nil {
		t.Fatalf("router r1, issued after the bus started: %v", err)
	}
	defer r1.Close()
	reports, err := r1.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reports.Put(ctx, "r1", []byte(`{}`)); err != nil {
		t.Errorf("router r1 writes its report: %v", err)
	}
	short, cancelShort := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancelShort()
	if _, err := reports.Put(short, "r2", []byte(`{}`)); err == nil {
		t.Error("router r1 wrote r2's report")
	}
	testkit.WaitFor(t, cmdTestBound, "the violation of r1's write as r2", func() bool {
		err := r1.PermissionError()
		return err != nil && strings.Contains(err.Error(), "$KV.narwhal_routers.r2")
	})
	p1, err := bus.Connect(ctx, bus.ConnectOptions{URL: url, CredsFile: filepath.Join(dir, "engine-p1.creds"), Role: bus.RoleEngine, ID: "p1"})
	if err != nil {
		t.Fatalf("engine p1, issued after the bus started: %v", err)
	}
	defer p1.Close()
	if _, err := p1.BindBucket(ctx, bus.FleetBucket); err != nil {
		t.Errorf("engine p1 binds the fleet: %v", err)
	}
}

// TestBusSetupCommand proves `narwhal bus setup` (R-BUS-8): against a NATS
// without Narwhal's streams it creates them all with the admin credential,
// listing each stream's and bucket's replicas, while a router credential
// may not, and the message names the permission; run again (with the
// viewer's credential or the admin's) it says there was nothing to change.
func TestBusSetupCommand(t *testing.T) {
	testkit.CheckLeaks(t)
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir, NoSetup: true})
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())

	t.Setenv("NARWHAL_NATS_CREDS", bustest.Identity(t, dir, bus.RoleRouter, "r1"))
	out, errOut := &testkit.LockedBuffer{}, &testkit.LockedBuffer{}
	err := runBus(context.Background(), []string{"setup", "--connect-timeout", "3s"}, out, errOut)
	if err == nil || !strings.Contains(err.Error(), "ermissions") {
		t.Errorf("bus setup with a router's credential: %v, want a permissions violation", err)
	}

	t.Setenv("NARWHAL_NATS_CREDS", bustest.CredsFile(dir, bus.RoleAdmin))
	out = &testkit.LockedBuffer{}
	if err := runBus(context.Background(), []string{"setup"}, out, errOut); err != nil {
		t.Fatalf("bus setup with the admin's credential: %v\n%s", err, errOut.String())
	}
	if !strings.HasPrefix(out.String(), "bus set up on ") {
		t.Errorf("bus setup that created everything does not say it set the bus up:\n%s", out.String())
	}
	names := bus.SetUpNames()
	if len(names) < 10 {
		t.Errorf("bus.SetUpNames lists %d streams and buckets, want the 10 the set-up creates: %v", len(names), names)
	}
	for _, n := range names {
		if !regexp.MustCompile(`(?m)^  ` + n.What + ` ` + regexp.QuoteMeta(n.Name) + `\s+1 replicas$`).MatchString(out.String()) {
			t.Errorf("bus setup's output lacks %s %s at 1 replica:\n%s", n.What, n.Name, out.String())
		}
	}
	if !strings.Contains(errOut.String(), "stream created") {
		t.Errorf("bus setup's log does not say what it created:\n%s", errOut.String())
	}

	// Run again, with the viewer's credential and the admin's: nothing is
	// to change, and neither says it set the bus up.
	for _, role := range []string{bus.RoleViewer, bus.RoleAdmin} {
		t.Setenv("NARWHAL_NATS_CREDS", bustest.CredsFile(dir, role))
		out = &testkit.LockedBuffer{}
		if err := runBus(context.Background(), []string{"setup", "--connect-timeout", "3s"}, out, errOut); err != nil {
			t.Fatalf("bus setup again with the %s credential: %v\n%s", role, err, errOut.String())
		}
		if !strings.HasPrefix(out.String(), "bus already set up on ") || !strings.Contains(out.String(), ": nothing to change\n") {
			t.Errorf("bus setup again with the %s credential, nothing to change, says:\n%s", role, out.String())
		}
	}
}

// TestMissingCredentialNamesTheRoleRBUS8 proves that a process refused by
// a bus that enforces credentials (R-BUS-8: nats: Authorization
// Violation) says what to set: NARWHAL_NATS_CREDS, and the file of its
// own role (a router: its own router-<id>.creds, R-BUS-11; the least that
// does: viewer.creds for `narwhal fleet list`) among those
// `narwhal bus creds` writes — without a credential
// and with one of another mesh. It runs against a real --auth server.
func TestMissingCredentialNamesTheRoleRBUS8(t *testing.T) {
	testkit.CheckLeaks(t)
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	other := bustest.CredsFile(bustest.Credentials(t), bus.RoleViewer)
	cfg := config.Default()
	cfg.Router.ID = "t"
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
			{"router", "router-t.creds", func() error {
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
			{"fleet list", "viewer.creds", func() error {
				return runFleet(context.Background(), []string{"list"}, io.Discard, io.Discard)
			}},
			{"fleet remove", "admin.creds", func() error {
				return runFleet(context.Background(), []string{"remove", "d1"}, io.Discard, io.Discard)
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
	// The file named is the least that does: the viewer's lists the fleet.
	t.Setenv("NARWHAL_NATS_CREDS", bustest.CredsFile(dir, bus.RoleViewer))
	if err := runFleet(context.Background(), []string{"list"}, io.Discard, io.Discard); err != nil {
		t.Errorf("fleet list with viewer.creds, the file its refusal names: %v", err)
	}
}

// TestIdentityIDsAreConfigIDsRBUS11 proves that `narwhal bus creds` and
// bus.IssueIdentity take the ids the configuration takes for engines and
// routers (config.ValidID: one NATS subject token), no more, no fewer
// (R-BUS-11).
func TestIdentityIDsAreConfigIDsRBUS11(t *testing.T) {
	for _, id := range []string{"", "p1", "r-1_A", "a.b", "a*", "a>", "a b", "é", "x\n", "-", strings.Repeat("z", 63)} {
		for _, kind := range []string{bus.RoleEngine, bus.RoleRouter} {
			if got, want := bus.ValidIdentity(kind, id) == nil, config.ValidID(id); got != want {
				t.Errorf("%s id %q: valid %v, config says %v", kind, id, got, want)
			}
		}
	}
}

// TestBusCredsListsOnlyWhatItWrote proves that `narwhal bus creds` on a
// DIR holding a mesh prints the header of the identities only above one
// it wrote: an id whose credential cannot be issued (its JWT would not
// fit the CONNECT line) leaves stdout empty when it is the only one, and
// after an identity written before it the listing names that one alone.
func TestBusCredsListsOnlyWhatItWrote(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "mesh")
	var out, errOut bytes.Buffer
	if err := runBus(context.Background(), []string{"creds", "--out", dir}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("r", 200)
	out.Reset()
	err := runBus(context.Background(), []string{"creds", "--out", dir, "--router", long}, &out, &errOut)
	if err == nil || !strings.Contains(err.Error(), "use a shorter id") {
		t.Fatalf("bus creds --router <200 characters>: %v, want the refusal of a JWT too long", err)
	}
	if out.Len() != 0 {
		t.Errorf("bus creds printed %q before its error; want nothing", out.String())
	}
	out.Reset()
	err = runBus(context.Background(), []string{"creds", "--out", dir, "--router", "r1", "--router", long}, &out, &errOut)
	if err == nil {
		t.Fatal("bus creds --router r1 --router <200 characters> succeeded")
	}
	want := "identities added to the mesh of " + dir + ":\n"
	if !strings.HasPrefix(out.String(), want) || !strings.Contains(out.String(), "router-r1.creds") || strings.Contains(out.String(), long) {
		t.Errorf("bus creds printed %q; want %q and the row of router-r1.creds alone", out.String(), want)
	}
	if _, err := os.Stat(filepath.Join(dir, bus.IdentityCredsFile(bus.RoleRouter, long))); err == nil {
		t.Error("bus creds wrote the credential it refused")
	}
}

// TestFleetChangeDeniedFailsAtOnceRBUS8 proves that `narwhal fleet drain`
// and `remove` with the viewer's credential (R-BUS-8: read-only) against
// a real --auth server fail as soon as the server reports the
// permissions violation — well before the operation's timeout, which a
// denied write (NATS drops it) would otherwise wait out — with one line
// that names the violation, the credential used and the admin's, without
// a repeated prefix and without a log line of its own; the entry is left
// as it was.
func TestFleetChangeDeniedFailsAtOnceRBUS8(t *testing.T) {
	testkit.CheckLeaks(t)
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	t.Setenv("NARWHAL_NATS_CREDS", bustest.CredsFile(dir, bus.RoleAdmin))
	if out, err := runFleetCmd("add", "--id", "p1", "--url", "http://127.0.0.1:9001", "--role", "prefill"); err != nil {
		t.Fatalf("fleet add with the admin's credential: %v\n%s", err, out)
	}
	viewer := bustest.CredsFile(dir, bus.RoleViewer)
	t.Setenv("NARWHAL_NATS_CREDS", viewer)
	for _, args := range [][]string{{"drain", "p1"}, {"remove", "p1", "--force"}} {
		var stdout, stderr bytes.Buffer
		start := time.Now()
		err := runFleet(context.Background(), args, &stdout, &stderr)
		took := time.Since(start)
		if err == nil {
			t.Fatalf("fleet %v with the viewer's credential succeeded", args)
		}
		msg := err.Error()
		t.Logf("fleet %v: %v after %v", args, err, took)
		if took >= fleetOpTimeout/2 {
			t.Errorf("fleet %v took %v, want it to end at the violation, not near the %v timeout", args, took, fleetOpTimeout)
		}
		for _, want := range []string{args[0] + " p1: ", "ermissions", viewer, "admin.creds"} {
			if !strings.Contains(msg, want) {
				t.Errorf("fleet %v: %q lacks %q", args, msg, want)
			}
		}
		if strings.Count(msg, "p1") > 2 || strings.Contains(msg, "deadline") || strings.Contains(msg, "context canceled") || strings.Contains(msg, "\n") {
			t.Errorf("fleet %v: %q repeats itself or names the timeout", args, msg)
		}
		if stderr.Len() != 0 || stdout.Len() != 0 {
			t.Errorf("fleet %v printed besides its error:\n%s%s", args, stdout.String(), stderr.String())
		}
	}
	t.Setenv("NARWHAL_NATS_CREDS", viewer)
	out, err := runFleetCmd("list", "--json")
	if err != nil || !strings.Contains(out, `"joining"`) {
		t.Errorf("fleet list after the denied changes: %v %q, want p1 still joining", err, out)
	}
}
