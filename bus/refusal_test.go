package bus_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
)

// TestRevokedCredentialIsSaidRBUS11 proves that a revoked credential is
// said, not retried for ever (behaviour.md R-BUS-11): within 5 s of the
// revocation a connected Bus reports a *bus.CredentialRefusedError that
// says revoked and names the file and the command that issues a new one,
// and its Refused channel is closed; a Connect with the revoked file fails
// at once saying revoked (its user is in the account JWT of the file's
// directory); `bus.IssueIdentity` replaces the revoked file, the new
// credential connects, and a valid one is still not replaced.
func TestRevokedCredentialIsSaidRBUS11(t *testing.T) {
	dir := bustest.Credentials(t)
	e := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	d1, d1Pub := bustest.IssueIdentity(t, dir, bus.RoleEngine, "d1")
	bustest.IssueIdentity(t, dir, bus.RoleEngine, "d2")
	b := bustest.Connect(t, e, bus.ConnectOptions{Name: "engine-d1", CredsFile: d1, Role: bus.RoleEngine, ID: "d1"})
	if err := b.CredentialRefused(); err != nil {
		t.Fatalf("before the revocation: %v", err)
	}

	start := time.Now()
	revoke(t, dir, e.ClientURL(), d1Pub)
	select {
	case <-b.Refused():
		t.Logf("refusal reported %v after the push: %v", time.Since(start), b.CredentialRefused())
	case <-time.After(revokeBound):
		t.Fatalf("no refusal reported %v after the revocation (connected %v)", revokeBound, b.Connected())
	}
	var refused *bus.CredentialRefusedError
	if err := b.CredentialRefused(); !errors.As(err, &refused) || !refused.Revoked {
		t.Fatalf("CredentialRefused() = %v, want a revoked *CredentialRefusedError", err)
	}
	msg := b.CredentialRefused().Error()
	for _, want := range []string{"revoked", d1, "narwhal bus creds --out DIR --engine d1", "restart"} {
		if !strings.Contains(msg, want) {
			t.Errorf("refusal %q lacks %q", msg, want)
		}
	}
	if !bus.RevokedLocally(d1) {
		t.Error("RevokedLocally(engine-d1.creds) = false after the revocation")
	}

	// A new process with the revoked file: refused at once, saying revoked.
	ctx, cancel := context.WithTimeout(context.Background(), revokeBound)
	defer cancel()
	_, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), CredsFile: d1, Role: bus.RoleEngine, ID: "d1"})
	if err == nil || !errors.Is(err, nats.ErrAuthorization) || !strings.Contains(err.Error(), "it was revoked") ||
		!strings.Contains(err.Error(), "narwhal bus creds --out DIR --engine d1") {
		t.Errorf("Connect with the revoked credential: %v, want an authorization violation saying revoked and how to get a new one", err)
	}

	// A new credential replaces the revoked one and connects; a valid one
	// is not replaced.
	if _, err := bus.IssueIdentity(dir, bus.RoleEngine, "d1"); err != nil {
		t.Fatalf("a new credential for revoked d1: %v", err)
	}
	if pub, _, err := bus.CredentialUser(d1); err != nil || pub == d1Pub {
		t.Fatalf("engine-d1.creds after the new issue: user %s, %v; want a new user", pub, err)
	}
	if _, err := os.Stat(d1 + ".new"); err == nil {
		t.Error("engine-d1.creds.new left behind")
	}
	nb := bustest.Connect(t, e, bus.ConnectOptions{Name: "engine-d1-new", CredsFile: d1, Role: bus.RoleEngine, ID: "d1"})
	if !nb.Connected() || nb.CredentialRefused() != nil {
		t.Errorf("the new credential of d1: connected %v, refused %v", nb.Connected(), nb.CredentialRefused())
	}
	_, err = bus.IssueIdentity(dir, bus.RoleEngine, "d2")
	if err == nil || !strings.Contains(err.Error(), "exists already") || !strings.Contains(err.Error(), "revoking it first") {
		t.Errorf("IssueIdentity over valid d2: %v, want a refusal saying that revoking it first allows a new one", err)
	}
	if err := bus.IdentityReplaceable(dir, bus.RoleEngine, "d3"); err != nil {
		t.Errorf("IdentityReplaceable of a missing file: %v", err)
	}
}

// TestRefusedCredentialOtherMeshRBUS11 proves that a credential of another
// mesh is refused without a false "revoked" (behaviour.md R-BUS-8,
// R-BUS-11): the error names the file to use and says that a revoked one
// needs a new credential.
func TestRefusedCredentialOtherMeshRBUS11(t *testing.T) {
	dir := bustest.Credentials(t)
	other := bustest.Credentials(t)
	e := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	path := bustest.Identity(t, other, bus.RoleEngine, "d1")
	ctx, cancel := context.WithTimeout(context.Background(), revokeBound)
	defer cancel()
	_, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), CredsFile: path, Role: bus.RoleEngine, ID: "d1"})
	if err == nil || strings.Contains(err.Error(), "it was revoked") || !strings.Contains(err.Error(), filepath.Base(path)+" of this mesh") {
		t.Errorf("Connect with another mesh's credential: %v, want a refusal naming engine-d1.creds of this mesh, not revoked", err)
	}
}
