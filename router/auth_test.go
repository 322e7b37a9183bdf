package router

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/config"
)

func keyDigest(token string) string {
	d := sha256.Sum256([]byte(token))
	return hex.EncodeToString(d[:])
}

// TestAuthenticateHeader proves how R-API-9 reads the Authorization
// header: the Bearer scheme in any case, surrounding blanks ignored,
// anything else refused; and that a lookup allocates nothing.
func TestAuthenticateHeader(t *testing.T) {
	var a auth
	if !a.open() {
		t.Fatal("no keys must mean open")
	}
	a.set([]config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a")}, {Name: "team-b", KeySHA256: keyDigest("sk-b"), Models: []string{"m"}}})
	for header, want := range map[string]string{
		"Bearer sk-a":    "team-a",
		"bearer sk-a":    "team-a",
		"BEARER  sk-b  ": "team-b",
		"Bearer sk-a ":   "team-a",
		"Bearer sk-":     "",
		"Bearer sk-aa":   "",
		"Basic sk-a":     "",
		"sk-a":           "",
		"Bearer":         "",
		"Bearer ":        "",
		"":               "",
	} {
		var ctx fasthttp.RequestCtx
		if header != "" {
			ctx.Request.Header.Set("Authorization", header)
		}
		k := a.lookup(&ctx)
		got := ""
		if k != nil {
			got = k.name
		}
		if got != want {
			t.Errorf("Authorization %q: key %q, want %q", header, got, want)
		}
	}
	var ctx fasthttp.RequestCtx
	ctx.Request.Header.Set("Authorization", "Bearer sk-b")
	if n := testing.AllocsPerRun(100, func() { a.lookup(&ctx) }); n != 0 {
		t.Errorf("lookup allocates %v times, want 0", n)
	}
	if k := a.lookup(&ctx); !k.allows("m") || k.allows("other") {
		t.Error("team-b's model list is not applied")
	}
}

// TestAPIKeysReloadKeepsInflight proves a reload keeps a staying key's
// in-flight count (max_inflight holds across SIGHUP) and drops the series
// of removed keys only.
func TestAPIKeysReloadKeepsInflight(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) {
		c.Auth.APIKeys = []config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a"), MaxInflight: 1}, {Name: "team-b", KeySHA256: keyDigest("sk-b")}}
	})
	s.waitModels()
	body := `{"model":"` + testModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	for _, tok := range []string{"sk-a", "sk-b"} {
		if resp, b := s.post("/v1/chat/completions", body, "Authorization", "Bearer "+tok); resp.StatusCode != 200 {
			t.Fatalf("%s: HTTP %d %s", tok, resp.StatusCode, b)
		}
	}
	// An unknown /v1 path is a 401 before it is a 404: nothing about the
	// API is told to a caller without a key.
	if resp, _ := s.get("/v1/nothing-here"); resp.StatusCode != 401 {
		t.Errorf("unknown /v1 path without a key: HTTP %d, want 401", resp.StatusCode)
	}
	k := s.rt.auth.lookupName("team-a")
	k.inflight.Add(1) // a request of team-a in flight across the reload
	s.rt.SetAPIKeys([]config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a2"), MaxInflight: 1}})
	resp, b := s.post("/v1/chat/completions", body, "Authorization", "Bearer sk-a2")
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" {
		t.Errorf("team-a with one request in flight before the reload: HTTP %d %s, want 429 with Retry-After", resp.StatusCode, b)
	}
	if resp, _ := s.post("/v1/chat/completions", body, "Authorization", "Bearer sk-a"); resp.StatusCode != 401 {
		t.Errorf("the replaced token: HTTP %d, want 401", resp.StatusCode)
	}
	k.inflight.Add(-1)
	if resp, b := s.post("/v1/chat/completions", body, "Authorization", "Bearer sk-a2"); resp.StatusCode != 200 {
		t.Errorf("team-a after its request ended: HTTP %d %s", resp.StatusCode, b)
	}
	if got := s.metricSum("narwhal_requests_total", "key", "team-b"); got != 0 {
		t.Errorf("series of the removed team-b: %v, want none", got)
	}
	if got := s.metricSum("narwhal_requests_total", "key", "team-a", "code", "200"); got != 2 {
		t.Errorf("team-a 200s: %v, want 2", got)
	}
	s.idle()
	if n := s.rt.auth.lookupName("team-a").inflight.Load(); n != 0 {
		t.Errorf("team-a in flight %d after idle, want 0", n)
	}
	for _, r := range s.events.requests() {
		if strings.Contains(r.KeyName, "sk-") {
			t.Errorf("request event carries a key: %+v", r)
		}
	}
}
