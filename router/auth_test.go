package router

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
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
	if n := testkit.LeastAllocs(100, func() { a.lookup(&ctx) }); n != 0 {
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

// TestUnauthenticatedBodyNotRead proves that a request without a valid key
// gets its 401 from its headers alone (R-API-9): the router neither waits
// for its body nor counts it against server.max_body_bytes_inflight, so
// callers without a key cannot take the body budget from those with one.
// The client announces a body it never sends: reading it would end in a
// 408 at server.header_timeout_s, not a 401.
func TestUnauthenticatedBodyNotRead(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) {
		c.Auth.APIKeys = []config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a")}}
		c.Server.HeaderTimeoutS = 30
	})
	s.waitModels()
	for _, auth := range []string{"", "Authorization: Bearer sk-wrong\r\n"} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(s.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = conn.Write([]byte("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth +
			"Content-Length: 20000000\r\n\r\n{\"model\":"))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("%q: %v", auth, err)
		}
		body, _ := io.ReadAll(resp.Body)
		conn.Close()
		if resp.StatusCode != 401 || !strings.Contains(string(body), "AuthenticationError") || resp.Header.Get("X-Request-Id") == "" {
			t.Errorf("%q: HTTP %d %s (X-Request-Id %q), want 401 at once", auth, resp.StatusCode, body, resp.Header.Get("X-Request-Id"))
		}
		if got := s.metricSum("narwhal_body_bytes_inflight"); got != 0 {
			t.Errorf("%q: %v body bytes held for a request without a key", auth, got)
		}
	}
	if got := s.metricSum("narwhal_requests_total", "code", "401", "key", "none"); got != 2 {
		t.Errorf("401s counted %v, want 2", got)
	}
	// With the key the same request shape is read and served.
	body := `{"model":"` + testModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	if resp, b := s.post("/v1/chat/completions", body, "Authorization", "Bearer sk-a"); resp.StatusCode != 200 {
		t.Errorf("with the key: HTTP %d %s", resp.StatusCode, b)
	}
}

// BenchmarkAuthLookup measures the bearer lookup of R-API-9 (hash, map
// lookup, constant-time compare) with few and many configured keys: its
// cost does not grow with their number, and it allocates nothing.
func BenchmarkAuthLookup(b *testing.B) {
	for _, n := range []int{3, 3000} {
		b.Run(strconv.Itoa(n)+"keys", func(b *testing.B) {
			var a auth
			keys := make([]config.APIKey, n)
			for i := range keys {
				keys[i] = config.APIKey{Name: "k" + strconv.Itoa(i), KeySHA256: keyDigest("sk-" + strconv.Itoa(i))}
			}
			a.set(keys)
			var ctx fasthttp.RequestCtx
			ctx.Request.Header.Set("Authorization", "Bearer sk-"+strconv.Itoa(n-1))
			b.ReportAllocs()
			for b.Loop() {
				if a.lookup(&ctx) == nil {
					b.Fatal("no key")
				}
			}
		})
	}
}

// TestDuplicateAuthorizationRAPI9 proves that a request with two
// Authorization headers gets 400 naming the header (behaviour.md
// R-API-9), whichever of them holds a valid key and in whichever order,
// before its body is read, counted with the key "none" and with no event.
// The requests are written byte for byte on a raw socket, so what fasthttp
// does with a repeated header is what is tested.
func TestDuplicateAuthorizationRAPI9(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) {
		c.Auth.APIKeys = []config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a")}, {Name: "team-b", KeySHA256: keyDigest("sk-b")}}
		c.Server.HeaderTimeoutS = 30
	})
	s.waitModels()
	body := `{"model":"` + testModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	cases := []struct{ name, head string }{
		{"valid then invalid", "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\nAuthorization: Bearer sk-wrong\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body},
		{"invalid then valid", "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-wrong\r\nContent-Type: application/json\r\nauthorization: Bearer sk-a\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body},
		{"two valid keys", "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\nAuthorization: Bearer sk-b\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body},
		// A body announced and never sent: reading it would end in a 408
		// at server.header_timeout_s, not a 400 at once.
		{"body never sent", "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\nAuthorization: Bearer sk-a\r\nContent-Length: 20000000\r\n\r\n{\"model\":"},
		{"models", "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\nAuthorization: Bearer sk-a\r\n\r\n"},
	}
	for _, tc := range cases {
		conn, err := net.Dial("tcp", strings.TrimPrefix(s.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := conn.Write([]byte(tc.head)); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		b, _ := io.ReadAll(resp.Body)
		conn.Close()
		e := errorObject(t, b)
		if resp.StatusCode != 400 || e.Code != 400 || e.Type != "BadRequestError" || !strings.Contains(e.Message, "more than one Authorization header") ||
			resp.Header.Get("X-Request-Id") == "" {
			t.Errorf("%s: HTTP %d %s (X-Request-Id %q), want 400 naming the Authorization header", tc.name, resp.StatusCode, b, resp.Header.Get("X-Request-Id"))
		}
	}
	if got := s.metricSum("narwhal_requests_total", "code", "400", "key", "none", "outcome", "client_error"); got != float64(len(cases)) {
		t.Errorf("400s counted %v, want %d", got, len(cases))
	}
	if got := s.metricSum("narwhal_requests_total", "key", "team-a"); got != 0 {
		t.Errorf("requests counted for team-a: %v, want none", got)
	}
	if got := s.metricSum("narwhal_body_bytes_inflight"); got != 0 {
		t.Errorf("%v body bytes held after the refusals", got)
	}
	if n := len(s.events.requests()); n != 0 {
		t.Errorf("%d request events, want none", n)
	}
	// One header is served as before.
	if resp, b := s.post("/v1/chat/completions", body, "Authorization", "Bearer sk-a"); resp.StatusCode != 200 {
		t.Errorf("one Authorization header: HTTP %d %s", resp.StatusCode, b)
	}
	// The check costs a request no allocation.
	var h fasthttp.RequestHeader
	if err := h.Read(bufio.NewReader(strings.NewReader("GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n\r\n"))); err != nil {
		t.Fatal(err)
	}
	if n := testkit.LeastAllocs(100, func() { duplicateAuthorization(&h) }); n != 0 || duplicateAuthorization(&h) {
		t.Errorf("duplicateAuthorization on one header: %v allocations, true %v; want 0, false", n, duplicateAuthorization(&h))
	}
}

// TestRemovedKeySeriesStayRemovedRAPI9 proves that the series of a key a
// reload removed stay deleted when a stream of that key, running across
// the reload, ends afterwards (behaviour.md R-API-9): the stream is served
// to its end and counted under the key "none", and the key's name
// reappears on no series.
func TestRemovedKeySeriesStayRemovedRAPI9(t *testing.T) {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode", cfg: sim.Config{ITL: 20 * time.Millisecond}}}, func(c *config.Config) {
		c.Auth.APIKeys = []config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a")}, {Name: "team-b", KeySHA256: keyDigest("sk-b")}}
	})
	s.waitModels()
	body := `{"model":"` + testModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":30,"ignore_eos":true,"stream":true}`
	req, _ := http.NewRequest("POST", s.url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer sk-b")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r := bufio.NewReader(resp.Body)
	if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line of team-b's stream %q: %v", line, err)
	}
	if got := s.metricSum("narwhal_requests_total", "key", "team-b"); got != 0 {
		t.Fatalf("team-b counted %v before its stream ended", got)
	}
	s.rt.SetAPIKeys([]config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a")}})
	rest, err := io.ReadAll(r)
	if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("team-b's stream after the reload: %v\n%s", err, rest)
	}
	s.idle()
	if n := testkit.GatheredSeries(t, s.rt.Registry(), "narwhal_requests_total", "key", "team-b"); n != 0 {
		t.Errorf("%d series of the removed team-b after its stream ended, want none", n)
	}
	if got := s.metricSum("narwhal_requests_total", "key", "none", "code", "200"); got != 1 {
		t.Errorf("the stream counted %v times under key none, want 1", got)
	}
	if n := testkit.GatheredSeries(t, s.rt.Registry(), "narwhal_requests_total", "key", "team-a"); n == 0 {
		t.Error("the staying team-a lost its series")
	}
	// The key comes back: its series are created again and count.
	s.rt.SetAPIKeys([]config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a")}, {Name: "team-b", KeySHA256: keyDigest("sk-b")}})
	if resp, b := s.post("/v1/chat/completions", `{"model":"`+testModel+`","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`, "Authorization", "Bearer sk-b"); resp.StatusCode != 200 {
		t.Fatalf("team-b back: HTTP %d %s", resp.StatusCode, b)
	}
	if got := s.metricSum("narwhal_requests_total", "key", "team-b", "code", "200"); got != 1 {
		t.Errorf("team-b back: counted %v, want 1", got)
	}
}
