package authd

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	josejwt "github.com/go-jose/go-jose/v4/jwt"

	"github.com/narwhalmesh/narwhal/bus"
)

// jwksServer is an https JWKS endpoint, as the Kubernetes API's
// /openid/v1/jwks, that wants bearer token want and counts its fetches.
type jwksServer struct {
	srv     *httptest.Server
	caFile  string
	fetches atomic.Int64
	mu      sync.Mutex
	body    []byte
}

func newJWKSServer(t *testing.T, want string, body []byte) *jwksServer {
	t.Helper()
	j := &jwksServer{body: body}
	j.srv = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		j.fetches.Add(1)
		if r.Header.Get("Authorization") != "Bearer "+want {
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		j.mu.Lock()
		defer j.mu.Unlock()
		_, _ = w.Write(j.body)
	}))
	t.Cleanup(j.srv.Close)
	j.caFile = filepath.Join(t.TempDir(), "ca.crt")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: j.srv.Certificate().Raw})
	if err := os.WriteFile(j.caFile, pemBytes, 0o600); err != nil {
		t.Fatal(err)
	}
	return j
}

func (j *jwksServer) set(body []byte) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.body = body
}

// fakeClock is a clock the test moves.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// TestAuthdUnknownKidRefreshIsBoundedRBUS11 proves that the cluster's
// keys come from an https JWKS URL with the pod's bearer token and the
// cluster CA, that a token of a key id not held fetches them again —
// at most once per 10 s however many such tokens come — and that a key
// rotated in is then trusted.
func TestAuthdUnknownKidRefreshIsBoundedRBUS11(t *testing.T) {
	k1, k2 := newSigner(t, "k1"), newSigner(t, "k2")
	srv := newJWKSServer(t, "sa-token", jwks(t, k1))
	tokenFile := writeToken(t, "sa-token")
	clock := &fakeClock{now: time.Now()}
	keys, err := NewKeySource(KeySourceOptions{Location: srv.srv.URL + "/openid/v1/jwks", CAFile: srv.caFile, TokenFile: tokenFile, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	if err := keys.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	v := &Verifier{Keys: keys, Issuer: testIssuer, Roles: Roles{testNS + "/narwhal-router": bus.RoleRouter}, Now: clock.Now}
	ctx := context.Background()
	if id, err := v.Verify(ctx, k1.sign(t, validToken("narwhal-router", "r1"))); err != nil || id.ID != "r1" || id.Role != bus.RoleRouter || id.PodUID != "uid-r1" {
		t.Fatalf("a token of k1: %+v, %v", id, err)
	}
	// A flood of tokens naming key ids the cluster does not have, and of
	// k2, rotated in only now.
	srv.set(jwks(t, k1, k2))
	clock.add(DefaultRefreshEvery)
	for i := range 200 {
		rogue := newSignerOnce(t, i)
		_, err := v.Verify(ctx, rogue.sign(t, validToken("narwhal-router", "r1")))
		var r *Refusal
		if !errors.As(err, &r) || r.Reason != ReasonUnknownKey {
			t.Fatalf("token of unknown kid %s: %v, want refused as %s", rogue.kid, err, ReasonUnknownKey)
		}
	}
	if n := srv.fetches.Load(); n != 2 {
		t.Fatalf("%d fetches for 200 unknown key ids in one interval, want 2 (the start, one refresh)", n)
	}
	// k2 came with that one refresh.
	if _, err := v.Verify(ctx, k2.sign(t, validToken("narwhal-router", "r2"))); err != nil {
		t.Errorf("a token of k2 after the refresh: %v", err)
	}
	// The next refresh only once the interval passed.
	k3 := newSigner(t, "k3")
	srv.set(jwks(t, k1, k2, k3))
	tok3 := k3.sign(t, validToken("narwhal-router", "r3"))
	if _, err := v.Verify(ctx, tok3); err == nil {
		t.Error("k3 trusted before the interval passed")
	}
	clock.add(DefaultRefreshEvery)
	if _, err := v.Verify(ctx, tok3); err != nil {
		t.Errorf("a token of k3 after the interval: %v", err)
	}
	if n := srv.fetches.Load(); n != 3 {
		t.Errorf("%d fetches, want 3", n)
	}
	// Without the pod's bearer token the API refuses: the fetch fails and
	// the keys held stay.
	bad, err := NewKeySource(KeySourceOptions{Location: srv.srv.URL, CAFile: srv.caFile})
	if err != nil {
		t.Fatal(err)
	}
	if err := bad.Load(ctx); err == nil {
		t.Error("fetched the JWKS without the bearer token")
	}
	// Without the cluster's CA the server is not trusted.
	untrusted, err := NewKeySource(KeySourceOptions{Location: srv.srv.URL, TokenFile: tokenFile})
	if err != nil {
		t.Fatal(err)
	}
	if err := untrusted.Load(ctx); err == nil {
		t.Error("fetched the JWKS from a server whose certificate no CA given vouches for")
	}
	if _, err := NewKeySource(KeySourceOptions{Location: "http://kubernetes.default.svc/openid/v1/jwks"}); err == nil {
		t.Error("accepted a plain http JWKS URL")
	}
}

// newSignerOnce is a signer of a key id no JWKS holds (i-th).
func newSignerOnce(t *testing.T, i int) signer {
	t.Helper()
	if roguePool == nil {
		s := newSigner(t, "")
		roguePool = &s
	}
	return signer{kid: fmt.Sprintf("rogue-%d", i), key: roguePool.key}
}

// roguePool is one key behind every rogue key id (RSA key generation is
// slow, and the key does not matter: its id is not known).
var roguePool *signer

// TestAuthdVerifiesOnlyRS256AndES256RBUS11 proves that an ES256 token of
// a JWKS key is accepted, and a token signed with HS256 using the public
// key's bytes as secret (the classic algorithm confusion) is refused.
func TestAuthdVerifiesOnlyRS256AndES256RBUS11(t *testing.T) {
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	k1 := newSigner(t, "k1")
	set := jose.JSONWebKeySet{Keys: []jose.JSONWebKey{
		{Key: &k1.key.PublicKey, KeyID: "k1", Algorithm: string(jose.RS256), Use: "sig"},
		{Key: &ec.PublicKey, KeyID: "e1", Algorithm: string(jose.ES256), Use: "sig"},
	}}
	path := filepath.Join(t.TempDir(), "jwks.json")
	raw, _ := set.Keys[0].MarshalJSON()
	raw2, _ := set.Keys[1].MarshalJSON()
	if err := os.WriteFile(path, []byte(`{"keys":[`+string(raw)+`,`+string(raw2)+`]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	keys, err := NewKeySource(KeySourceOptions{Location: path})
	if err != nil {
		t.Fatal(err)
	}
	if err := keys.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	v := &Verifier{Keys: keys, Roles: Roles{testNS + "/narwhal-engine": bus.RoleEngine}}
	sign := func(alg jose.SignatureAlgorithm, key any, kid string) string {
		js, err := jose.NewSigner(jose.SigningKey{Algorithm: alg, Key: key}, (&jose.SignerOptions{}).WithType("JWT").WithHeader("kid", kid))
		if err != nil {
			t.Fatal(err)
		}
		p := validToken("narwhal-engine", "d-0")
		tok, err := josejwt.Signed(js).Claims(josejwt.Claims{Subject: "system:serviceaccount:llm:narwhal-engine", Audience: p.Audience,
			Expiry: josejwt.NewNumericDate(p.Expiry), IssuedAt: josejwt.NewNumericDate(p.IssuedAt)}).
			Claims(map[string]any{"kubernetes.io": map[string]any{"namespace": testNS,
				"serviceaccount": map[string]string{"name": "narwhal-engine"}, "pod": map[string]string{"name": "d-0", "uid": "u"}}}).Serialize()
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	if id, err := v.Verify(context.Background(), sign(jose.ES256, ec, "e1")); err != nil || id.Role != bus.RoleEngine || id.ID != "d-0" {
		t.Errorf("an ES256 token: %+v, %v", id, err)
	}
	var r *Refusal
	if _, err := v.Verify(context.Background(), sign(jose.HS256, raw, "k1")); !errors.As(err, &r) || r.Reason != ReasonMalformed {
		t.Errorf("an HS256 token: %v, want refused as %s", err, ReasonMalformed)
	}
	if _, err := v.Verify(context.Background(), sign(jose.ES256, ec, "k1")); !errors.As(err, &r) || r.Reason != ReasonSignature {
		t.Errorf("an ES256 token naming the RSA key: %v, want refused as %s", err, ReasonSignature)
	}
}

// TestAuthdParseRolesRBUS11 proves --roles' form: NAMESPACE/NAME=ROLE,
// ROLE router or engine, no entry twice, none without a namespace.
func TestAuthdParseRolesRBUS11(t *testing.T) {
	r, err := ParseRoles("llm/narwhal-router=router, llm/narwhal-engine=engine")
	if err != nil || r["llm/narwhal-router"] != bus.RoleRouter || r["llm/narwhal-engine"] != bus.RoleEngine || len(r) != 2 {
		t.Fatalf("%v %v", r, err)
	}
	for _, bad := range []string{"", "narwhal-router=router", "llm/narwhal-router=admin", "llm/a=router,llm/a=engine", "/x=router", "llm/=router", "llm/a/b=router"} {
		if _, err := ParseRoles(bad); err == nil {
			t.Errorf("ParseRoles(%q) accepted", bad)
		}
	}
}
