package authd

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	josejwt "github.com/go-jose/go-jose/v4/jwt"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// Bounds of the tests: generous next to what an embedded bus takes.
const (
	waitBound   = 10 * time.Second
	deniedBound = 500 * time.Millisecond
	// refusedBound is how fast a refused connect must fail: two refused
	// attempts (nats.go gives up on the second) with the bus's reconnect
	// wait between them, far below the bus's auth timeout of 2 s.
	refusedBound = 1500 * time.Millisecond
	testIssuer   = "https://kubernetes.default.svc.cluster.local"
	testNS       = "llm"
)

// signer is a test cluster's signing key with its key id.
type signer struct {
	kid string
	key *rsa.PrivateKey
}

func newSigner(t testing.TB, kid string) signer {
	t.Helper()
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	return signer{kid: kid, key: k}
}

// jwks returns the public JWKS of signers.
func jwks(t testing.TB, signers ...signer) []byte {
	t.Helper()
	var set jose.JSONWebKeySet
	for _, s := range signers {
		set.Keys = append(set.Keys, jose.JSONWebKey{Key: &s.key.PublicKey, KeyID: s.kid, Algorithm: string(jose.RS256), Use: "sig"})
	}
	b, err := json.Marshal(set)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// podToken are the claims of a projected service-account token.
type podToken struct {
	Issuer, Namespace, ServiceAccount, Pod, UID string
	Audience                                    []string
	Expiry, IssuedAt                            time.Time
	NoPod                                       bool
}

// validToken is a token of pod pod of service account sa in testNS,
// valid for an hour.
func validToken(sa, pod string) podToken {
	now := time.Now()
	return podToken{Issuer: testIssuer, Namespace: testNS, ServiceAccount: sa, Pod: pod, UID: "uid-" + pod,
		Audience: []string{"narwhal"}, Expiry: now.Add(time.Hour), IssuedAt: now.Add(-time.Minute)}
}

// sign serializes p signed by s, as a Kubernetes API server does.
func (s signer) sign(t testing.TB, p podToken) string {
	t.Helper()
	js, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: s.key}, (&jose.SignerOptions{}).WithType("JWT").WithHeader("kid", s.kid))
	if err != nil {
		t.Fatal(err)
	}
	std := josejwt.Claims{Issuer: p.Issuer, Subject: "system:serviceaccount:" + p.Namespace + ":" + p.ServiceAccount,
		Audience: p.Audience, Expiry: josejwt.NewNumericDate(p.Expiry), IssuedAt: josejwt.NewNumericDate(p.IssuedAt),
		NotBefore: josejwt.NewNumericDate(p.IssuedAt)}
	k8s := map[string]any{"namespace": p.Namespace, "serviceaccount": map[string]string{"name": p.ServiceAccount, "uid": "sa-uid"}}
	if !p.NoPod {
		k8s["pod"] = map[string]string{"name": p.Pod, "uid": p.UID}
	}
	tok, err := josejwt.Signed(js).Claims(std).Claims(map[string]any{"kubernetes.io": k8s}).Serialize()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// writeToken writes token into a new file of the test and returns its path.
func writeToken(t testing.TB, token string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// cluster is a real `narwhal bus --auth DIR` (embedded, DIR with
// `narwhal bus creds --authd`) and its authd, whose tokens key signs.
type cluster struct {
	dir  string
	emb  *bus.Embedded
	key  signer
	svc  *Service
	reg  *prometheus.Registry
	keys *KeySource
}

// newCluster starts a bus whose callout is an authd with issued JWTs of
// ttl, trusting the tokens of c.key for audience narwhal, issuer
// testIssuer, and roles testNS/narwhal-router=router,
// testNS/narwhal-engine=engine.
func newCluster(t *testing.T, ttl time.Duration) *cluster {
	t.Helper()
	c := &cluster{dir: bustest.Credentials(t), key: newSigner(t, "k1"), reg: prometheus.NewRegistry()}
	if err := bus.WriteAuthd(c.dir); err != nil {
		t.Fatal(err)
	}
	c.emb = bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: c.dir})
	jwksPath := filepath.Join(t.TempDir(), "jwks.json")
	if err := os.WriteFile(jwksPath, jwks(t, c.key), 0o600); err != nil {
		t.Fatal(err)
	}
	var err error
	if c.keys, err = NewKeySource(KeySourceOptions{Location: jwksPath}); err != nil {
		t.Fatal(err)
	}
	if err := c.keys.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	roles, err := ParseRoles(testNS + "/narwhal-router=router," + testNS + "/narwhal-engine=engine")
	if err != nil {
		t.Fatal(err)
	}
	c.svc, err = Start(Options{URL: c.emb.ClientURL(), CredsFile: filepath.Join(c.dir, bus.AuthdCredsFile),
		SigningKeyFile: filepath.Join(c.dir, "keys", bus.AuthdSigningKeyFile), TTL: ttl, Registry: c.reg,
		Verifier: &Verifier{Keys: c.keys, Audience: "narwhal", Issuer: testIssuer, Roles: roles}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.svc.Close)
	testkit.WaitFor(t, waitBound, "authd ready", c.svc.Ready)
	return c
}

// connect connects as role's identity with the token file path (the
// router's or engine's id empty: the pod name).
func (c *cluster) connect(t *testing.T, role, path string) *bus.Bus {
	t.Helper()
	opts := bus.ConnectOptions{Name: "test-" + role, TokenFile: path, Role: role}
	if role == bus.RoleEngine {
		opts.Streams = []string{bus.RegistrationsStream}
	}
	return bustest.Connect(t, c.emb, opts)
}

// refused and issued are the service's counters.
func (c *cluster) refused(t *testing.T, reason string) float64 {
	return testkit.GatheredSum(t, c.reg, "narwhal_authd_refused_total", "reason", reason)
}

func (c *cluster) issued(t *testing.T, role string) float64 {
	return testkit.GatheredSum(t, c.reg, "narwhal_authd_issued_total", "role", role)
}

// readFile returns the content of path.
func readFile(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
