package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	josejwt "github.com/go-jose/go-jose/v4/jwt"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestBusCredsAuthdRBUS11 proves `narwhal bus creds --authd`: into a new
// DIR it writes the mesh and the callout's files (authd.creds,
// keys/authd-signing.nk) and lists them; auth.conf gets the sentinel and
// the callout account; a second --authd is refused; into a DIR that holds
// a mesh without it, it adds it and nothing else; and --kubernetes-secrets
// then writes the Secret narwhal-authd the chart mounts.
func TestBusCredsAuthdRBUS11(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "mesh")
	var out, errOut bytes.Buffer
	if err := runBus(context.Background(), []string{"creds", "--out", dir, "--authd"}, &out, &errOut); err != nil {
		t.Fatalf("bus creds --authd: %v\n%s", err, errOut.String())
	}
	for _, f := range []string{"admin.creds", "auth.conf", bus.AuthdCredsFile, "keys/" + bus.AuthdSigningKeyFile} {
		st, err := os.Stat(filepath.Join(dir, f))
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if f != "auth.conf" && st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", f, st.Mode().Perm())
		}
	}
	for _, want := range []string{bus.AuthdCredsFile, "keys/" + bus.AuthdSigningKeyFile} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the listing lacks %s:\n%s", want, out.String())
		}
	}
	conf, _ := os.ReadFile(filepath.Join(dir, "auth.conf"))
	if !strings.Contains(string(conf), "default_sentinel: ") || !strings.Contains(string(conf), bus.AuthAccountName) {
		t.Errorf("auth.conf lacks the sentinel or the callout account:\n%s", conf)
	}
	if err := runBus(context.Background(), []string{"creds", "--out", dir, "--authd"}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "already") {
		t.Errorf("a second --authd: %v, want a refusal", err)
	}

	existing := bustest.Credentials(t)
	before, _ := os.ReadFile(filepath.Join(existing, "admin.creds"))
	out.Reset()
	if err := runBus(context.Background(), []string{"creds", "--out", existing, "--authd", "--kubernetes-secrets"}, &out, &errOut); err != nil {
		t.Fatalf("bus creds --authd into a mesh: %v", err)
	}
	if !strings.Contains(out.String(), "auth callout added") || !strings.Contains(out.String(), "narwhal-authd") {
		t.Errorf("listing:\n%s", out.String())
	}
	after, _ := os.ReadFile(filepath.Join(existing, "admin.creds"))
	if !bytes.Equal(before, after) {
		t.Error("--authd changed admin.creds")
	}
	secrets, _ := os.ReadFile(filepath.Join(existing, KubernetesSecretsFile))
	for _, key := range []string{`"authd.creds"`, `"authd-signing.nk"`} {
		if !strings.Contains(string(secrets), key) {
			t.Errorf("%s lacks %s", KubernetesSecretsFile, key)
		}
	}
}

// TestBusAuthdFlagsRBUS11 proves `narwhal bus authd`'s flags: the chart's
// set passes --check-args without connecting, and a missing or bad flag
// exits 2 with a message naming it.
func TestBusAuthdFlagsRBUS11(t *testing.T) {
	dir := t.TempDir()
	creds, key, jwksFile := filepath.Join(dir, "authd.creds"), filepath.Join(dir, "authd-signing.nk"), filepath.Join(dir, "jwks.json")
	for _, f := range []string{creds, key, jwksFile} {
		if err := os.WriteFile(f, []byte("placeholder\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	good := []string{"bus", "authd", "--nats", "nats://127.0.0.1:1", "--creds", creds, "--signing-key", key,
		"--jwks", "https://kubernetes.default.svc/openid/v1/jwks", "--audience", "narwhal", "--ttl", "10m",
		"--roles", "llm/narwhal-router=router,llm/narwhal-engine=engine", "--metrics-addr", "0.0.0.0:9106"}
	var stderr bytes.Buffer
	if code := run(append([]string{good[0], good[1], "--check-args"}, good[2:]...), &stderr); code != 0 {
		t.Fatalf("--check-args of the chart's flags: exit %d: %s", code, stderr.String())
	}
	with := func(flag, value string) []string {
		out := []string{"bus", "authd", "--check-args"}
		for i := 2; i < len(good); i += 2 {
			if good[i] != flag {
				out = append(out, good[i], good[i+1])
			}
		}
		if value != "" {
			out = append(out, flag, value)
		}
		return out
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{with("--creds", ""), "--creds"},
		{with("--signing-key", filepath.Join(dir, "missing.nk")), "--signing-key"},
		{with("--roles", "narwhal-router=router"), "NAMESPACE/SERVICEACCOUNT=ROLE"},
		{with("--roles", "llm/narwhal-router=admin"), "admin"},
		{with("--ttl", "0s"), "--ttl"},
		{with("--ttl", "48h"), "--ttl"},
		{with("--jwks", "http://kubernetes.default.svc/openid/v1/jwks"), "--jwks"},
		{with("--jwks", filepath.Join(dir, "none.json")), "--jwks"},
		{append(with("--jwks", jwksFile), "--jwks-ca", creds), "--jwks-ca"},
		{with("--metrics-addr", "nine"), "--metrics-addr"},
		{append(with("", ""), "--no-such-flag"), "no-such-flag"},
	} {
		stderr, restore := captureStderr(t)
		var buf bytes.Buffer
		code := run(c.args, &buf)
		msg := buf.String() + restore()
		_ = stderr
		if code != 2 || !strings.Contains(msg, c.want) {
			t.Errorf("%q: exit %d, message %q; want 2 naming %q", c.args, code, msg, c.want)
		}
	}
	// Without --check-args too: a bad flag exits 2 before connecting.
	stderr.Reset()
	args := with("--ttl", "-1s")
	_, restore := captureStderr(t)
	code := run(append(args[:2:2], args[3:]...), &stderr)
	if msg := stderr.String() + restore(); code != 2 || !strings.Contains(msg, "--ttl") {
		t.Errorf("bus authd --ttl -1s: exit %d: %s", code, msg)
	}
}

// authdMesh is a real `narwhal bus --auth DIR` with `--authd`, and a
// key whose tokens a JWKS file lists.
type authdMesh struct {
	dir, jwksFile string
	emb           *bus.Embedded
	key           *rsa.PrivateKey
}

func newAuthdMesh(t *testing.T) *authdMesh {
	t.Helper()
	m := &authdMesh{dir: bustest.Credentials(t)}
	if err := bus.WriteAuthd(m.dir); err != nil {
		t.Fatal(err)
	}
	m.emb = bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: m.dir})
	var err error
	if m.key, err = rsa.GenerateKey(rand.Reader, 2048); err != nil {
		t.Fatal(err)
	}
	set, _ := json.Marshal(jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &m.key.PublicKey, KeyID: "k1", Algorithm: "RS256", Use: "sig"}}})
	m.jwksFile = filepath.Join(t.TempDir(), "jwks.json")
	if err := os.WriteFile(m.jwksFile, set, 0o600); err != nil {
		t.Fatal(err)
	}
	return m
}

// tokenFile writes a projected token of pod in namespace llm, service
// account sa, and returns its path.
func (m *authdMesh) tokenFile(t *testing.T, sa, pod string) string {
	t.Helper()
	js, _ := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: m.key}, (&jose.SignerOptions{}).WithType("JWT").WithHeader("kid", "k1"))
	now := time.Now()
	tok, err := josejwt.Signed(js).Claims(josejwt.Claims{Subject: "system:serviceaccount:llm:" + sa, Audience: josejwt.Audience{"narwhal"},
		Expiry: josejwt.NewNumericDate(now.Add(time.Hour)), IssuedAt: josejwt.NewNumericDate(now)}).
		Claims(map[string]any{"kubernetes.io": map[string]any{"namespace": "llm", "serviceaccount": map[string]string{"name": sa},
			"pod": map[string]string{"name": pod, "uid": "uid-" + pod}}}).Serialize()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(path, []byte(tok), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// serve runs `narwhal bus authd` for m until the test ends, its metrics
// on addr.
func (m *authdMesh) serve(t *testing.T, addr string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var logs testkit.LockedBuffer
	go func() {
		done <- runBusAuthd(ctx, []string{"--nats", m.emb.ClientURL(), "--creds", filepath.Join(m.dir, bus.AuthdCredsFile),
			"--signing-key", filepath.Join(m.dir, "keys", bus.AuthdSigningKeyFile), "--jwks", m.jwksFile,
			"--roles", "llm/narwhal-router=router,llm/narwhal-engine=engine", "--ttl", "1m", "--metrics-addr", addr}, &logs)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("bus authd: %v\n%s", err, logs.String())
		}
	})
}

// freeAddr is a 127.0.0.1 address nothing listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// TestBusAuthdServesRBUS11 proves the command itself: started against a
// real `narwhal bus --auth DIR` (DIR with --authd), it serves /healthz and
// /readyz (200 once connected and subscribed) and /metrics, and a router
// presenting a pod's token connects as its identity, counted in
// narwhal_authd_issued_total.
func TestBusAuthdServesRBUS11(t *testing.T) {
	m := newAuthdMesh(t)
	addr := freeAddr(t)
	m.serve(t, addr)
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	testkit.WaitFor(t, 10*time.Second, "authd's /readyz 200", func() bool { code, _ := get("/readyz"); return code == http.StatusOK })
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d", code)
	}
	pod := "prod-narwhal-router-7d9f8b6c5d-x2k4q"
	bustest.Connect(t, m.emb, bus.ConnectOptions{TokenFile: m.tokenFile(t, "narwhal-router", pod), Role: bus.RoleRouter, ID: pod})
	if _, body := get("/metrics"); !strings.Contains(body, `narwhal_authd_issued_total{role="router"} 1`) {
		t.Errorf("/metrics lacks one router issued:\n%s", body)
	}
}

// TestAgentRegistersWithATokenRBUS11 proves that `narwhal agent` with
// NARWHAL_NATS_TOKEN_FILE and no credential registers its engine, its
// id the token's pod name, through the identity authd issues: the
// breaker (its role file) applies the registration to the live fleet.
func TestAgentRegistersWithATokenRBUS11(t *testing.T) {
	m := newAuthdMesh(t)
	m.serve(t, freeAddr(t))
	t.Setenv("NARWHAL_NATS_URL", m.emb.ClientURL())
	t.Setenv("NARWHAL_NATS_TOKEN_FILE", m.tokenFile(t, "narwhal-engine", "d-0"))
	cfg := config.Default()
	brk := bustest.Connect(t, m.emb, bus.ConnectOptions{Name: "breaker-test", CredsFile: bustest.CredsFile(m.dir, bus.RoleBreaker),
		Role: bus.RoleBreaker, Buckets: roleBuckets(bus.RoleBreaker), Streams: []string{bus.RegistrationsStream}})
	svc, err := breaker.New(breaker.Options{Config: &cfg, Bus: brk, ID: "breaker-test", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	bctx, bcancel := context.WithCancel(context.Background())
	bdone := make(chan error, 1)
	go func() { bdone <- svc.Run(bctx) }()
	defer func() {
		bcancel()
		<-bdone
	}()
	engine, err := sim.New(sim.Config{Role: sim.RoleDecode, EngineID: "d-0", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	ln := simtestListener(t)
	if _, err := engine.Start(ln); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = engine.Close() })
	agentCtx, stopAgent := context.WithCancel(context.Background())
	var out, errOut testkit.LockedBuffer
	done := make(chan error, 1)
	go func() {
		done <- runAgent(agentCtx, []string{"--engine-url", "http://" + ln, "--id", "d-0", "--role", "decode", "--drain-timeout", "5s",
			"--drained-file", filepath.Join(t.TempDir(), "drained")}, &out, &errOut)
	}()
	defer func() {
		stopAgent()
		<-done
	}()
	testkit.WaitFor(t, 15*time.Second, "d-0 registered through its token's identity", func() bool {
		return strings.Contains(out.String(), "registered d-0 (decode")
	})
	admin := bustest.Connect(t, m.emb, bus.ConnectOptions{CredsFile: bustest.CredsFile(m.dir, bus.RoleAdmin), Role: bus.RoleAdmin})
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	fleetKV, err := admin.BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 15*time.Second, "the breaker's fleet entry of d-0", func() bool {
		_, err := fleetKV.Get(ctx, "d-0")
		return err == nil
	})
}

// TestBusAuthdExitsWhenRefusedRBUS11 proves that `narwhal bus authd`
// with the callout credential of another mesh does not sit unready for
// ever: the bus refuses it, and the command ends with an error naming
// --creds.
func TestBusAuthdExitsWhenRefusedRBUS11(t *testing.T) {
	m := newAuthdMesh(t)
	other := bustest.Credentials(t)
	if err := bus.WriteAuthd(other); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var logs testkit.LockedBuffer
	err := runBusAuthd(ctx, []string{"--nats", m.emb.ClientURL(), "--creds", filepath.Join(other, bus.AuthdCredsFile),
		"--signing-key", filepath.Join(other, "keys", bus.AuthdSigningKeyFile), "--jwks", m.jwksFile,
		"--roles", "llm/narwhal-router=router"}, &logs)
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "--creds") {
		t.Errorf("bus authd with another mesh's credential: %v (ctx %v), want it to end naming --creds", err, ctx.Err())
	}
}
