package authd

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// denied asserts that act failed and that the bus reported a permissions
// violation naming subject on b's connection.
func denied(t *testing.T, b *bus.Bus, what, subject string, act func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), deniedBound)
	defer cancel()
	if err := act(ctx); err == nil {
		t.Errorf("%s succeeded, want it refused", what)
		return
	}
	testkit.WaitFor(t, waitBound, what+": the bus's permissions violation", func() bool {
		err := b.PermissionError()
		return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), subject)
	})
}

// TestAuthdRouterTokenGetsExactlyItsIdentityRBUS11 proves that a valid
// router token connects, with no credential file, as router r1's
// identity and no more: its own event, prefix and report subjects are
// published, its consumer names (from the pod's UID) are its own to make,
// and another router's subjects, fleet writes and a purge of another's
// report are refused by the bus.
func TestAuthdRouterTokenGetsExactlyItsIdentityRBUS11(t *testing.T) {
	c := newCluster(t, time.Minute)
	r1 := c.connect(t, bus.RoleRouter, writeToken(t, c.key.sign(t, validToken("narwhal-router", "r1"))))
	if r1.ReadsDirect() {
		t.Fatal("a token's identity reads through consumers of its own names, want ReadsDirect false")
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	for _, subject := range []string{"narwhal.events.failure.d1.r1", "narwhal.events.quarantine.d1.r1", "narwhal.events.request.r1", bus.PrefixSubject("r1")} {
		if _, err := r1.JetStream().Publish(ctx, subject, []byte(`{}`)); err != nil {
			t.Errorf("router r1 publishes on %s: %v (%v)", subject, err, r1.PermissionError())
		}
	}
	reports, err := r1.BindBucket(ctx, bus.RoutersBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reports.Put(ctx, "r1", []byte(`{"router_id":"r1"}`)); err != nil {
		t.Fatalf("router r1 writes its report: %v", err)
	}
	// Its consumer of PurposeQuarantine: the name authd allowed.
	got := make(chan string, 4)
	rd, err := bus.StartReader(ctx, r1, bus.ReaderOptions{Stream: bus.StreamName, Filter: "narwhal.events.quarantine.>",
		Name: r1.ConsumerName(bus.PurposeQuarantine), Deliver: jetstream.DeliverAllPolicy}, func(m jetstream.Msg) { got <- m.Subject() })
	if err != nil {
		t.Fatalf("router r1 makes its own consumer: %v", err)
	}
	defer rd.Stop()
	select {
	case s := <-got:
		if s != "narwhal.events.quarantine.d1.r1" {
			t.Errorf("read %s", s)
		}
	case <-time.After(waitBound):
		t.Fatal("router r1's reader read nothing")
	}
	if err := r1.PermissionError(); err != nil {
		t.Fatalf("router r1's own acts: %v", err)
	}
	for _, subject := range []string{"narwhal.events.failure.d1.r2", "narwhal.events.request.r2", "narwhal.events.eligibility.d1",
		bus.PrefixSubject("r2"), "$KV." + bus.RoutersBucket + ".r2", "$KV." + bus.FleetBucket + ".d1", bus.RegistrationSubject("d1")} {
		denied(t, r1, "router r1 publishes on "+subject, subject, func(ctx context.Context) error {
			_, err := r1.JetStream().Publish(ctx, subject, []byte(`{}`))
			return err
		})
	}
	denied(t, r1, "router r1 purges r2's report", "$KV.narwhal_routers.r2", func(ctx context.Context) error {
		return reports.Purge(ctx, "r2")
	})
	other := bus.ConsumerName(bus.PodConsumerKey("uid-r2"), bus.PurposeQuarantine)
	denied(t, r1, "router r1 makes router r2's consumer", other, func(ctx context.Context) error {
		_, err := r1.JetStream().CreateConsumer(ctx, bus.StreamName, jetstream.ConsumerConfig{Name: other})
		return err
	})
	if n := c.issued(t, bus.RoleRouter); n < 1 {
		t.Errorf("narwhal_authd_issued_total{role=router} = %v, want ≥ 1", n)
	}
}

// TestAuthdEngineTokenGetsExactlyItsIdentityRBUS11 proves the same for an
// engine token: its own registration is published, another engine's, a
// fleet write and an event are refused.
func TestAuthdEngineTokenGetsExactlyItsIdentityRBUS11(t *testing.T) {
	c := newCluster(t, time.Minute)
	e1 := c.connect(t, bus.RoleEngine, writeToken(t, c.key.sign(t, validToken("narwhal-engine", "p-0"))))
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	if _, err := e1.JetStream().Publish(ctx, bus.RegistrationSubject("p-0"), []byte(`{}`)); err != nil {
		t.Errorf("engine p-0 registers: %v (%v)", err, e1.PermissionError())
	}
	for _, subject := range []string{bus.RegistrationSubject("p-1"), "$KV." + bus.FleetBucket + ".p-0", "narwhal.events.failure.p-0"} {
		denied(t, e1, "engine p-0 publishes on "+subject, subject, func(ctx context.Context) error {
			_, err := e1.JetStream().Publish(ctx, subject, []byte(`{}`))
			return err
		})
	}
	if n := c.issued(t, bus.RoleEngine); n != 1 {
		t.Errorf("narwhal_authd_issued_total{role=engine} = %v, want 1", n)
	}
}

// TestAuthdIssuesTheFileIdentitysPermissionsRBUS11 proves that the user
// authd issues for a token holds exactly the permissions `narwhal bus
// creds --router ID` / `--engine ID` writes into the identity's file
// (bus.IssueIdentity), its consumer names keyed by the pod's UID instead
// of the file's seed; named narwhal-<role>-<id> in account NARWHAL; and
// expiring after the TTL, or at the token's exp when that comes first.
func TestAuthdIssuesTheFileIdentitysPermissionsRBUS11(t *testing.T) {
	c := newCluster(t, time.Minute)
	acctPub, _, err := bus.AuthdTarget(filepath.Join(c.dir, bus.AuthdCredsFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, role := range []string{bus.RoleRouter, bus.RoleEngine} {
		path := bustest.Identity(t, c.dir, role, "x1")
		seed := credsSeed(t, path)
		fileJWT := credsClaims(t, path)
		user, _ := nkeys.CreateUser()
		userPub, _ := user.PublicKey()
		exp := time.Now().Add(20 * time.Second)
		token, err := c.svc.issue(userPub, Identity{Role: role, ID: "x1", PodUID: "u-1", Expires: exp})
		if err != nil {
			t.Fatal(err)
		}
		uc, err := jwt.DecodeUserClaims(token)
		if err != nil {
			t.Fatal(err)
		}
		// The file's names under the pod's key.
		want := fileJWT.Permissions
		rename := map[string]string{}
		for _, p := range []string{bus.PurposeQuarantine, bus.PurposePrefix, bus.PurposePlacement, bus.PurposeFleet, bus.PurposeReports} {
			rename[bus.ConsumerName(seed, p)] = bus.ConsumerName(bus.PodConsumerKey("u-1"), p)
		}
		var allow []string
		for _, s := range want.Pub.Allow {
			for from, to := range rename {
				s = strings.ReplaceAll(s, from, to)
			}
			allow = append(allow, s)
		}
		want.Pub.Allow = allow
		if !reflect.DeepEqual(uc.Permissions, want) {
			t.Errorf("%s: issued permissions\n %+v\nwant the file's\n %+v", role, uc.Permissions, want)
		}
		if uc.Name != bus.UserName(role, "x1") || uc.IssuerAccount != acctPub || uc.Subject != userPub {
			t.Errorf("%s: name %q issuer account %s subject %s", role, uc.Name, uc.IssuerAccount, uc.Subject)
		}
		if uc.Expires != exp.Unix() {
			t.Errorf("%s: expires %d, want the token's exp %d (before the TTL)", role, uc.Expires, exp.Unix())
		}
	}
	user, _ := nkeys.CreateUser()
	userPub, _ := user.PublicKey()
	token, err := c.svc.issue(userPub, Identity{Role: bus.RoleRouter, ID: "x1", PodUID: "u-1", Expires: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	uc, _ := jwt.DecodeUserClaims(token)
	if d := time.Until(time.Unix(uc.Expires, 0)); d > time.Minute || d < 50*time.Second {
		t.Errorf("expires in %s, want the TTL of 1m", d)
	}
}

// TestAuthdRefusesBadTokensRBUS11 proves that an expired, wrongly
// signed, wrong-audience, wrong-issuer, other namespace's, pod-less or
// garbage token, and no token at all, are refused: the connect fails
// fast (two refused attempts, not the bus's auth timeout) and the
// refusal is counted under its reason.
func TestAuthdRefusesBadTokensRBUS11(t *testing.T) {
	c := newCluster(t, time.Minute)
	other := newSigner(t, "k1") // the same key id, another key
	expired := validToken("narwhal-router", "r1")
	expired.Expiry, expired.IssuedAt = time.Now().Add(-2*time.Minute), time.Now().Add(-time.Hour)
	aud := validToken("narwhal-router", "r1")
	aud.Audience = []string{"https://kubernetes.default.svc"}
	iss := validToken("narwhal-router", "r1")
	iss.Issuer = "https://evil.example"
	ns := validToken("narwhal-router", "r1")
	ns.Namespace = "other"
	noPod := validToken("narwhal-router", "r1")
	noPod.NoPod = true
	noRole := validToken("default", "r1")
	for _, tc := range []struct {
		name, token, reason string
	}{
		{"expired", c.key.sign(t, expired), ReasonExpired},
		{"another key", other.sign(t, validToken("narwhal-router", "r1")), ReasonSignature},
		{"wrong audience", c.key.sign(t, aud), ReasonAudience},
		{"wrong issuer", c.key.sign(t, iss), ReasonIssuer},
		{"other namespace's service account", c.key.sign(t, ns), ReasonNoRole},
		{"service account without a role", c.key.sign(t, noRole), ReasonNoRole},
		{"no pod claim", c.key.sign(t, noPod), ReasonNoPod},
		{"garbage", "eyJhbGciOiJub25lIn0.e30.", ReasonMalformed},
		{"no token", "", ReasonNoToken},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := c.refused(t, tc.reason)
			opts := []nats.Option{nats.Name("attacker"), nats.MaxReconnects(0), nats.Timeout(time.Second)}
			if tc.token != "" {
				opts = append(opts, nats.Token(tc.token))
			}
			start := time.Now()
			nc, err := nats.Connect(c.emb.ClientURL(), opts...)
			took := time.Since(start)
			if err == nil {
				nc.Close()
				t.Fatal("connected, want the token refused")
			}
			if !errors.Is(err, nats.ErrAuthorization) {
				t.Errorf("connect: %v, want an authorization violation", err)
			}
			if took > refusedBound {
				t.Errorf("refused after %s, want within %s", took, refusedBound)
			}
			testkit.WaitFor(t, waitBound, "the refusal counted", func() bool { return c.refused(t, tc.reason) == before+1 })
		})
	}
	// Through bus.Connect, as a router started with the token does: the
	// connect fails fast, saying the callout refused the token.
	path := writeToken(t, c.key.sign(t, expired))
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	start := time.Now()
	b, err := bus.Connect(ctx, bus.ConnectOptions{URL: c.emb.ClientURL(), TokenFile: path, Role: bus.RoleRouter})
	if err == nil {
		b.Close()
		t.Fatal("bus.Connect with an expired token connected")
	}
	if took := time.Since(start); took > 2*refusedBound {
		t.Errorf("bus.Connect refused after %s", took)
	}
	if !strings.Contains(err.Error(), "NARWHAL_NATS_TOKEN_FILE="+path) || !strings.Contains(err.Error(), "authd") {
		t.Errorf("bus.Connect: %v, want it to name the token file and authd", err)
	}
	if c.issued(t, bus.RoleRouter) != 0 {
		t.Errorf("issued %v router identities for refused tokens", c.issued(t, bus.RoleRouter))
	}
}

// TestAuthdIssuedJWTExpiresAndIsRenewedRBUS11 proves, with --ttl 2s,
// that the bus disconnects a client when its issued JWT expires, that the
// client reconnects with its token (re-read from the file) and a fresh
// JWT, and that a reader and a publisher of the identity keep working:
// events published after the renewal arrive through the reader's
// consumer, which it made again under its name.
func TestAuthdIssuedJWTExpiresAndIsRenewedRBUS11(t *testing.T) {
	c := newCluster(t, 2*time.Second)
	r1Token := writeToken(t, c.key.sign(t, validToken("narwhal-router", "r1")))
	r1 := c.connect(t, bus.RoleRouter, r1Token)
	r2 := c.connect(t, bus.RoleRouter, writeToken(t, c.key.sign(t, validToken("narwhal-router", "r2"))))
	var reconnects atomic.Int64
	r1.Conn().SetReconnectHandler(func(*nats.Conn) { reconnects.Add(1) })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got := make(chan string, 16)
	rd, err := bus.StartReader(ctx, r1, bus.ReaderOptions{Stream: bus.StreamName, Filter: "narwhal.events.quarantine.*.r2",
		Name: r1.ConsumerName(bus.PurposeQuarantine), Deliver: jetstream.DeliverNewPolicy}, func(m jetstream.Msg) { got <- string(m.Data()) })
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Stop()
	publish := func(b *bus.Bus, subject, body string) {
		t.Helper()
		testkit.WaitFor(t, waitBound, "publishing "+body, func() bool {
			pctx, pcancel := context.WithTimeout(ctx, time.Second)
			defer pcancel()
			_, err := b.JetStream().Publish(pctx, subject, []byte(body))
			return err == nil
		})
	}
	read := func(want string) {
		t.Helper()
		deadline := time.After(waitBound)
		for {
			select {
			case s := <-got:
				if s == want {
					return
				}
			case <-deadline:
				t.Fatalf("the reader did not read %s", want)
			}
		}
	}
	publish(r2, "narwhal.events.quarantine.d1.r2", `"before"`)
	read(`"before"`)
	issued := c.issued(t, bus.RoleRouter)
	testkit.WaitFor(t, waitBound, "router r1 disconnected by the expiry and reconnected", func() bool { return reconnects.Load() >= 2 })
	if now := c.issued(t, bus.RoleRouter); now < issued+2 {
		t.Errorf("issued %v router JWTs after two renewals, want ≥ %v", now, issued+2)
	}
	if rd.Resets() == 0 {
		t.Error("the reader did not make its consumer again after the reconnects")
	}
	publish(r2, "narwhal.events.quarantine.d1.r2", `"after"`)
	read(`"after"`)
	publish(r1, "narwhal.events.quarantine.d1.r1", `"r1 after"`)
	if err := r1.CredentialRefused(); err != nil {
		t.Errorf("an expiry passed for a refusal: %v", err)
	}
	// The token file is read again at every reconnect: once it holds an
	// expired token, the next renewal presents that one, refused.
	expired := validToken("narwhal-router", "r1")
	expired.Expiry, expired.IssuedAt = time.Now().Add(-2*time.Minute), time.Now().Add(-time.Hour)
	refused := c.refused(t, ReasonExpired)
	if err := os.WriteFile(r1Token, []byte(c.key.sign(t, expired)), 0o600); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, waitBound, "the renewal with the file's new, expired token refused", func() bool { return c.refused(t, ReasonExpired) > refused })
}

// credsSeed and credsClaims read an identity's credential file.
func credsSeed(t *testing.T, path string) []byte {
	t.Helper()
	raw := readFile(t, path)
	kp, err := nkeys.ParseDecoratedNKey(raw)
	if err != nil {
		t.Fatal(err)
	}
	seed, err := kp.Seed()
	if err != nil {
		t.Fatal(err)
	}
	return seed
}

func credsClaims(t *testing.T, path string) *jwt.UserClaims {
	t.Helper()
	token, err := jwt.ParseDecoratedJWT(readFile(t, path))
	if err != nil {
		t.Fatal(err)
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		t.Fatal(err)
	}
	return uc
}
