package router

import (
	"context"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestRevokedCredentialIsUnreadyRBUS11 proves what a router does once its
// own credential is revoked (behaviour.md R-BUS-11): with a real --auth
// bus and a real revocation (bus.Revoke, as `narwhal bus revoke` does),
// /readyz turns 503 within 5 s naming the credential file, saying revoked
// and how to get a new one; the router logs it at ERROR exactly once and
// still serves requests on the view it last had.
func TestRevokedCredentialIsUnreadyRBUS11(t *testing.T) {
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	logs := &syncBuffer{}
	s := newStackLogged(t, pd(), nil, nil, logs)
	s.waitModels()
	id := s.rt.ID()
	path, pub := bustest.IssueIdentity(t, dir, bus.RoleRouter, id)
	b := bustest.Connect(t, emb, bus.ConnectOptions{CredsFile: path, Role: bus.RoleRouter, ID: id})
	if err := s.rt.JoinMesh(b, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 5*time.Second, "/readyz 200 before the revocation", func() bool {
		resp, _ := s.get("/readyz")
		return resp.StatusCode == 200
	})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	if _, _, err := bus.Revoke(ctx, dir, []string{pub}, bus.PushOptions{URL: emb.ClientURL(), CredsFile: filepath.Join(dir, bus.SysCredsFile)}); err != nil {
		t.Fatal(err)
	}
	var body []byte
	file := bus.IdentityCredsFile(bus.RoleRouter, id)
	testkit.WaitFor(t, 5*time.Second-time.Since(start), "/readyz 503 saying the credential was revoked", func() bool {
		var resp *http.Response
		resp, body = s.get("/readyz")
		return resp.StatusCode == 503 && strings.Contains(string(body), file+" was revoked") &&
			strings.Contains(string(body), "narwhal bus creds --out DIR --router "+id) && strings.Contains(string(body), "restart")
	})
	t.Logf("/readyz %v after the revocation: %s", time.Since(start), body)
	if _, status := s.decodeEngineOf("still served after the revocation"); status != 200 {
		t.Errorf("a request after the revocation: %d, want 200 on the last view", status)
	}
	testkit.WaitFor(t, 5*time.Second, "the refusal logged", func() bool {
		return strings.Contains(logs.String(), "the bus refused this router's credential")
	})
	time.Sleep(500 * time.Millisecond) // a second line would come from the watches' retries
	if n := strings.Count(logs.String(), "the bus refused this router's credential"); n != 1 {
		t.Errorf("the refusal logged %d times, want once:\n%s", n, logs.String())
	}
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "the bus refused this router's credential") && !strings.Contains(line, "level=ERROR") {
			t.Errorf("refusal logged as %q, want level ERROR", line)
		}
	}
}
