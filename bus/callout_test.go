package bus_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/go-jose/go-jose/v4"
	josejwt "github.com/go-jose/go-jose/v4/jwt"
	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
)

// TestAuthdCredentialsKeepFileIdentitiesRBUS11 proves what
// bus.WriteAuthd adds to an existing mesh: the callout account with the
// service's user as its only auth user and account NARWHAL as the only
// one it may place users in, the signing key in both accounts' JWTs, the
// sentinel — and that the users of account NARWHAL (a role's credential,
// a router's file identity issued before) still connect to a bus started
// from the new auth.conf without going through the callout, and that a
// later revocation keeps the signing key.
func TestAuthdCredentialsKeepFileIdentitiesRBUS11(t *testing.T) {
	dir := bustest.Credentials(t)
	router := bustest.Identity(t, dir, bus.RoleRouter, "r1")
	if bus.HasAuthd(dir) {
		t.Fatal("HasAuthd before WriteAuthd")
	}
	if err := bus.WriteAuthd(dir); err != nil {
		t.Fatal(err)
	}
	if !bus.HasAuthd(dir) {
		t.Fatal("HasAuthd false after WriteAuthd")
	}
	if err := bus.WriteAuthd(dir); err == nil {
		t.Error("a second WriteAuthd succeeded")
	}
	target, own, err := bus.AuthdTarget(filepath.Join(dir, bus.AuthdCredsFile))
	if err != nil {
		t.Fatal(err)
	}
	acctJWT, err := bus.AccountJWT(dir)
	if err != nil {
		t.Fatal(err)
	}
	ac, err := jwt.DecodeAccountClaims(acctJWT)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := os.ReadFile(filepath.Join(dir, "keys", bus.AuthdSigningKeyFile))
	kp, err := nkeys.FromSeed(raw)
	if err != nil {
		t.Fatal(err)
	}
	signingPub, _ := kp.PublicKey()
	if ac.Subject != target || !ac.SigningKeys.Contains(signingPub) {
		t.Errorf("account NARWHAL %s (target %s): signing keys %v lack %s", ac.Subject, target, ac.SigningKeys.Keys(), signingPub)
	}
	conf, _ := os.ReadFile(filepath.Join(dir, bus.AuthConfFile))
	var authJWT string
	for _, line := range strings.Split(string(conf), "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ": "); ok && k == own {
			authJWT = v
		}
	}
	auth, err := jwt.DecodeAccountClaims(authJWT)
	if err != nil {
		t.Fatalf("auth.conf preloads no JWT of the callout account %s: %v", own, err)
	}
	svcPub, _, err := bus.CredentialUser(filepath.Join(dir, bus.AuthdCredsFile))
	if err != nil {
		t.Fatal(err)
	}
	if auth.Name != bus.AuthAccountName || len(auth.Authorization.AuthUsers) != 1 || auth.Authorization.AuthUsers[0] != svcPub ||
		len(auth.Authorization.AllowedAccounts) != 1 || auth.Authorization.AllowedAccounts[0] != target || !auth.SigningKeys.Contains(signingPub) {
		t.Errorf("callout account: %+v, signing keys %v", auth.Authorization, auth.SigningKeys.Keys())
	}
	if !strings.Contains(string(conf), "default_sentinel: ") {
		t.Error("auth.conf sets no default_sentinel")
	}

	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: dir})
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	bustest.Connect(t, e, bus.ConnectOptions{CredsFile: bustest.CredsFile(dir, bus.RoleBreaker), Role: bus.RoleBreaker})
	r1 := bustest.Connect(t, e, bus.ConnectOptions{CredsFile: router, Role: bus.RoleRouter, ID: "r1"})
	if _, err := r1.JetStream().Publish(ctx, "narwhal.events.request.r1", []byte(`{}`)); err != nil {
		t.Errorf("router r1's file identity publishes: %v", err)
	}

	pub, _, _ := bus.CredentialUser(router)
	if _, err := bus.RevokeUsers(dir, []string{pub}); err != nil {
		t.Fatal(err)
	}
	acctJWT, _ = bus.AccountJWT(dir)
	if ac, _ := jwt.DecodeAccountClaims(acctJWT); ac == nil || !ac.SigningKeys.Contains(signingPub) {
		t.Error("a revocation dropped the callout's signing key")
	}
}

// TestTokenFileOptionsRBUS11 proves that a connection with a token file
// refuses, before dialling, what cannot be an authd identity: a token
// together with a credential, a role other than router or engine, an id
// other than the token's pod name, a file that holds no pod's token.
func TestTokenFileOptionsRBUS11(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// An unsigned-looking token is enough: the client does not verify
	// its own token, the callout does.
	pod := write("pod", podTokenForTest(t, "r1"))
	for _, c := range []struct {
		opts bus.ConnectOptions
		want string
	}{
		{bus.ConnectOptions{TokenFile: pod, CredsFile: pod, Role: bus.RoleRouter}, "not both"},
		{bus.ConnectOptions{TokenFile: pod, Role: bus.RoleViewer}, "viewer"},
		{bus.ConnectOptions{TokenFile: pod, Role: bus.RoleRouter, ID: "r2"}, "pod r1"},
		{bus.ConnectOptions{TokenFile: write("garbage", "not a token"), Role: bus.RoleRouter}, "no service-account token"},
		{bus.ConnectOptions{TokenFile: filepath.Join(dir, "missing"), Role: bus.RoleRouter}, "missing"},
	} {
		c.opts.URL = "nats://127.0.0.1:1"
		b, err := bus.Connect(context.Background(), c.opts)
		if err == nil {
			b.Close()
			t.Errorf("%+v connected", c.opts)
			continue
		}
		if !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "NARWHAL_NATS_TOKEN_FILE") {
			t.Errorf("%+v: %v, want it to name NARWHAL_NATS_TOKEN_FILE and %q", c.opts, err, c.want)
		}
	}
}

// podTokenForTest is a projected token of pod in namespace llm, service
// account narwhal-router, signed by a throwaway key.
func podTokenForTest(t *testing.T, pod string) string {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	js, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: key}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := josejwt.Signed(js).Claims(map[string]any{"sub": "system:serviceaccount:llm:narwhal-router", "aud": []string{"narwhal"},
		"kubernetes.io": map[string]any{"namespace": "llm", "serviceaccount": map[string]string{"name": "narwhal-router"},
			"pod": map[string]string{"name": pod, "uid": "u-" + pod}}}).Serialize()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}
