package e2e

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// The front door's authentication and TLS through the real binaries
// (behaviour.md R-API-9, issue 10 items 4–6): `narwhal router` and two `narwhal
// sim` engines, each its own process, with the official OpenAI Go SDK as
// the client and the test process's own embedded NATS as the bus.

// authStackOptions shapes an authStack.
type authStackOptions struct {
	// auth is the YAML of the auth section (indented under "auth:").
	auth string
	// keysFile is written to a file named by NARWHAL_AUTH_API_KEYS_FILE.
	keysFile string
	// engineKey, when set, starts both simulators with --api-key and
	// gives the router the key through fleet[].api_key_env.
	engineKey string
	// tls serves the router and both simulators over HTTPS with
	// certificates of one test CA; the router trusts it through
	// engine.tls_ca_file.
	tls bool
	// metricsOnAdmin sets server.metrics_on_admin and starts the router
	// with --admin.
	metricsOnAdmin bool
	// simArgs are added to both simulators' command lines.
	simArgs []string
	// routerEngineKey, when set, is the router's value of engineKeyEnv
	// instead of engineKey (a wrong key).
	routerEngineKey string
}

// authStack is one router over prefill p1 and decode d1.
type authStack struct {
	dir       string
	url       string // the router's base URL, https:// with tls
	adminURL  string // http://… of --admin, "" without
	keysPath  string
	router    *process
	sims      []*simProc
	bus       *bus.Bus
	events    *bustest.Events
	ca        *testkit.CA // with tls
	certPath  string
	keyPath   string
	transport *http.Transport
	natsURL   string
	cfgPath   string
}

// engineKeyEnv is the variable fleet[].api_key_env names.
const engineKeyEnv = "E2E_ENGINE_API_KEY"

func startAuthStack(t *testing.T, o authStackOptions) *authStack {
	t.Helper()
	s := &authStack{dir: t.TempDir()}
	s.natsURL, s.bus, s.events = eventBus(t, "narwhal-e2e-auth")

	scheme := "http://"
	var simTLS []string
	if o.tls {
		scheme = "https://"
		s.ca = testkit.NewCA(t)
		s.certPath, s.keyPath = filepath.Join(s.dir, "router.crt"), filepath.Join(s.dir, "router.key")
		s.ca.WriteIssued(t, "router-1", s.certPath, s.keyPath)
		simCert, simKey := filepath.Join(s.dir, "sim.crt"), filepath.Join(s.dir, "sim.key")
		s.ca.WriteIssued(t, "engines", simCert, simKey)
		simTLS = []string{"--tls-cert-file", simCert, "--tls-key-file", simKey}
	}
	ports := freePorts(t, 4)
	for i, d := range []struct{ id, role string }{{"p1", sim.RolePrefill}, {"d1", sim.RoleDecode}} {
		var args []string
		if o.engineKey != "" {
			args = append(args, "--api-key", o.engineKey)
		}
		args = append(append(args, simTLS...), o.simArgs...)
		sp := startSim(t, d.id, d.role, hostPort(ports[i]), args...)
		sp.url = scheme + hostPort(ports[i])
		s.sims = append(s.sims, sp)
	}
	for _, sp := range s.sims {
		testkit.WaitEvery(t, readyBound, pollInterval, sp.id+"'s listening line", func() bool { return kvLine.MatchString(sp.p.stdout.String()) })
	}

	var cfg strings.Builder
	cfg.WriteString("engine:\n  first_token_timeout_s: 5\n  decode_read_timeout_s: 5\n  prefill_timeout_s: 5\n")
	if o.tls {
		fmt.Fprintf(&cfg, "  tls_ca_file: %s\n", s.ca.Path)
	}
	cfg.WriteString("request:\n  timeout_s: 20\nserver:\n")
	if o.tls {
		fmt.Fprintf(&cfg, "  tls_cert_file: %s\n  tls_key_file: %s\n", s.certPath, s.keyPath)
	}
	fmt.Fprintf(&cfg, "  metrics_on_admin: %v\n", o.metricsOnAdmin)
	if o.auth != "" {
		cfg.WriteString("auth:\n" + o.auth)
	}
	cfg.WriteString("fleet:\n")
	for _, sp := range s.sims {
		fmt.Fprintf(&cfg, "  - id: %s\n    url: %s\n    role: %s\n", sp.id, sp.url, sp.role)
		if o.engineKey != "" {
			fmt.Fprintf(&cfg, "    api_key_env: %s\n", engineKeyEnv)
		}
	}
	path := filepath.Join(s.dir, "narwhal.yaml")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	s.cfgPath = path
	env := []string{"NARWHAL_NATS_URL=" + s.natsURL, "NARWHAL_ROUTER_ID=" + meshRouterID, "NARWHAL_ROUTER_LOG_LEVEL=debug"}
	if o.keysFile != "" {
		s.keysPath = filepath.Join(s.dir, "keys.yaml")
		if err := os.WriteFile(s.keysPath, []byte(o.keysFile), 0o600); err != nil {
			t.Fatal(err)
		}
		env = append(env, "NARWHAL_AUTH_API_KEYS_FILE="+s.keysPath)
	}
	if o.engineKey != "" {
		key := o.engineKey
		if o.routerEngineKey != "" {
			key = o.routerEngineKey
		}
		env = append(env, engineKeyEnv+"="+key)
	}
	args := []string{"router", "--config", path, "--listen", hostPort(ports[2])}
	if o.metricsOnAdmin {
		args = append(args, "--admin", hostPort(ports[3]))
		s.adminURL = "http://" + hostPort(ports[3])
	}
	s.url = scheme + hostPort(ports[2])
	s.router = startProcess(t, "router", env, args...)

	s.transport = &http.Transport{MaxIdleConnsPerHost: 16}
	if o.tls {
		s.transport.TLSClientConfig = &tls.Config{RootCAs: s.ca.Pool}
	}
	t.Cleanup(s.transport.CloseIdleConnections)
	ready := "/readyz"
	if o.routerEngineKey != "" {
		ready = "/healthz" // no engine accepts the router: it is never ready
	}
	testkit.WaitEvery(t, readyBound, pollInterval, "the router's "+ready, func() bool {
		if s.router.exited() {
			s.router.dump(t)
			t.Fatalf("router exited: %v", s.router.waitErr)
		}
		resp, err := s.http().Get(s.url + ready)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return s
}

// http returns a plain client on the stack's transport (trusting the test
// CA with tls).
func (s *authStack) http() *http.Client {
	return &http.Client{Transport: s.transport, Timeout: requestBound}
}

// sdk returns an OpenAI SDK client for the router with apiKey ("" sends no
// Authorization header at all) and no retries.
func (s *authStack) sdk(apiKey string, opts ...option.RequestOption) *openai.Client {
	base := []option.RequestOption{
		option.WithBaseURL(s.url + "/v1/"),
		option.WithAPIKey(apiKey),
		option.WithMaxRetries(0),
		option.WithHTTPClient(&http.Client{Transport: s.transport}),
	}
	if apiKey == "" {
		base = append(base, option.WithMiddleware(func(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
			req.Header.Del("Authorization")
			return next(req)
		}))
	}
	c := openai.NewClient(append(base, opts...)...)
	return &c
}

// chatParams asks meshModel for n tokens.
func chatParams(model string, n int64) openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("tell me about narwhals")},
		MaxTokens: openai.Int(n),
	}
}

// apiError returns err as the SDK's *openai.Error, failing the test when
// it is not one with the status and type want.
func apiError(t *testing.T, what string, err error, status int, typ string) *openai.Error {
	t.Helper()
	var ae *openai.Error
	if !errors.As(err, &ae) {
		t.Fatalf("%s: got %v, want an API error %d", what, err, status)
	}
	if ae.StatusCode != status || ae.Type != typ {
		t.Errorf("%s: HTTP %d type %q (%s), want %d %q", what, ae.StatusCode, ae.Type, ae.Message, status, typ)
	}
	return ae
}

// streamed is an SDK stream read in the background.
type streamed struct {
	first  chan struct{} // closed at the first content chunk
	done   chan struct{}
	tokens int
	finish string
	err    error
}

// startStream opens a streamed chat completion of n tokens and reads it to
// its end in the background.
func startStream(ctx context.Context, c *openai.Client, n int64) *streamed {
	st := &streamed{first: make(chan struct{}), done: make(chan struct{})}
	stream := c.Chat.Completions.NewStreaming(ctx, chatParams(meshModel, n))
	go func() {
		defer close(st.done)
		defer stream.Close()
		gotFirst := false
		for stream.Next() {
			ch := stream.Current()
			for _, choice := range ch.Choices {
				if choice.Delta.Content != "" {
					st.tokens++
					if !gotFirst {
						gotFirst = true
						close(st.first)
					}
				}
				if choice.FinishReason != "" {
					st.finish = choice.FinishReason
				}
			}
		}
		st.err = stream.Err()
		if !gotFirst {
			close(st.first)
		}
	}()
	return st
}

// randomToken returns a fresh bearer token.
func randomToken(t *testing.T, prefix string) string {
	t.Helper()
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return prefix + hex.EncodeToString(b)
}

func sha256Hex(s string) string {
	d := sha256.Sum256([]byte(s))
	return hex.EncodeToString(d[:])
}

// TestAuthAPIKeys proves R-API-9 through the real binary with the OpenAI
// SDK: the right key works, a wrong or missing one gets 401
// (AuthenticationError), a model outside the key's list 403
// (PermissionDeniedError), the key's max_inflight 429 (RateLimitError, with
// Retry-After) without touching an engine; /healthz and /readyz stay open;
// SIGHUP reloads the keys file (a new key works, a removed one gets 401)
// without dropping streams in flight; the key's name is in the request
// events and the key label, and no key nor its digest is in any log, event
// or metric. The engines run with --api-key, so both legs also prove the
// engine credentials of issue 10 item 6.
func TestAuthAPIKeys(t *testing.T) {
	tokA, tokB, tokC := randomToken(t, "sk-a-"), randomToken(t, "sk-b-"), randomToken(t, "sk-c-")
	engineKey := randomToken(t, "engine-")
	s := startAuthStack(t, authStackOptions{
		auth: fmt.Sprintf("  api_keys:\n    - name: team-a\n      key_sha256: %s\n      max_inflight: 2\n", sha256Hex(tokA)),
		keysFile: fmt.Sprintf("- name: team-b\n  key_sha256: %s\n  models: [other-model]\n",
			strings.ToUpper(sha256Hex(tokB))),
		engineKey: engineKey,
		// Slow enough that two streams of 40 tokens are surely in flight
		// while the cap and the reload are checked.
		simArgs: []string{"--itl", "50ms"},
	})
	ctx := testContext(t, 2*time.Minute)

	// The right key: a completion over both legs of engines that require
	// their own key.
	resp, err := s.sdk(tokA).Chat.Completions.New(ctx, chatParams(meshModel, 3))
	if err != nil {
		t.Fatalf("right key: %v", err)
	}
	if len(resp.Choices) != 1 || resp.Choices[0].Message.Content == "" {
		t.Fatalf("right key: %+v", resp)
	}
	for _, sp := range s.sims {
		st := sp.stats(t)
		if st.Unauthorized != 0 {
			t.Errorf("%s refused %d router requests", sp.id, st.Unauthorized)
		}
	}
	if st := s.sims[0].stats(t); st.Prefills != 1 {
		t.Errorf("p1 ran %d prefill legs, want 1", st.Prefills)
	}
	if st := s.sims[1].stats(t); st.Decodes != 1 || st.KVPulled != 1 {
		t.Errorf("d1: %+v, want one decode that pulled its KV", st)
	}
	models, err := s.sdk(tokA).Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != meshModel {
		t.Errorf("right key: /v1/models %+v %v", models, err)
	}

	// Wrong and missing keys: 401, no engine touched.
	before := s.sims[0].stats(t).Prefills
	_, err = s.sdk(randomToken(t, "sk-wrong-")).Chat.Completions.New(ctx, chatParams(meshModel, 3))
	if ae := apiError(t, "wrong key", err, 401, "AuthenticationError"); ae.Message != "invalid API key" {
		t.Errorf("wrong key: message %q", ae.Message)
	}
	_, err = s.sdk(tokA[:len(tokA)-1]).Chat.Completions.New(ctx, chatParams(meshModel, 3))
	apiError(t, "the right key less one character", err, 401, "AuthenticationError")
	_, err = s.sdk("").Chat.Completions.New(ctx, chatParams(meshModel, 3))
	if ae := apiError(t, "missing key", err, 401, "AuthenticationError"); !strings.HasPrefix(ae.Message, "missing API key") {
		t.Errorf("missing key: message %q", ae.Message)
	}
	_, err = s.sdk("").Models.List(ctx)
	apiError(t, "missing key on /v1/models", err, 401, "AuthenticationError")
	for _, path := range []string{"/healthz", "/readyz"} {
		r, err := s.http().Get(s.url + path)
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		if r.StatusCode != 200 {
			t.Errorf("GET %s without a key: HTTP %d, want 200", path, r.StatusCode)
		}
	}

	// A model outside the key's list: 403, no engine touched.
	_, err = s.sdk(tokB).Chat.Completions.New(ctx, chatParams(meshModel, 3))
	if ae := apiError(t, "model outside the key", err, 403, "PermissionDeniedError"); !strings.Contains(ae.Message, "team-b") {
		t.Errorf("403 message %q does not name the key", ae.Message)
	}
	models, err = s.sdk(tokB).Models.List(ctx)
	if err != nil || len(models.Data) != 0 {
		t.Errorf("team-b sees models %+v (%v), want none of the fleet's", models.Data, err)
	}
	if got := s.sims[0].stats(t).Prefills; got != before {
		t.Errorf("refused requests reached the prefill engine: %d prefills, want %d", got, before)
	}

	// max_inflight 2: two streams in flight, the third request of the key
	// gets 429 with Retry-After, at once, without touching an engine.
	s1, s2 := startStream(ctx, s.sdk(tokA), 40), startStream(ctx, s.sdk(tokA), 40)
	for _, st := range []*streamed{s1, s2} {
		select {
		case <-st.first:
		case <-ctx.Done():
			t.Fatal("streams did not start")
		}
	}
	before = s.sims[0].stats(t).Prefills
	var raw *http.Response
	_, err = s.sdk(tokA).Chat.Completions.New(ctx, chatParams(meshModel, 3), option.WithResponseInto(&raw))
	apiError(t, "third request of a key with max_inflight 2", err, 429, "RateLimitError")
	if raw == nil || raw.Header.Get("Retry-After") == "" {
		t.Error("429 without Retry-After")
	}
	if got := s.sims[0].stats(t).Prefills; got != before {
		t.Errorf("the 429 reached the prefill engine")
	}

	if m := s.get(t, s.url+"/metrics"); !strings.Contains(m, `code="403",endpoint="/v1/chat/completions",key="team-b",model="`+meshModel+`",outcome="permission_denied"} 1`) {
		t.Errorf("/metrics lacks the 403 of team-b:\n%s", grepLines(m, "narwhal_requests_total"))
	}

	// Reload while both streams run: team-c replaces team-b in the keys
	// file; SIGHUP applies it.
	if err := os.WriteFile(s.keysPath, []byte(fmt.Sprintf("api_keys:\n  - name: team-c\n    key_sha256: %s\n", sha256Hex(tokC))), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.router.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testkit.WaitEvery(t, 5*time.Second, pollInterval, "the new key to work", func() bool {
		_, err := s.sdk(tokC).Chat.Completions.New(ctx, chatParams(meshModel, 1))
		return err == nil
	})
	_, err = s.sdk(tokB).Chat.Completions.New(ctx, chatParams(meshModel, 3))
	apiError(t, "a key removed by the reload", err, 401, "AuthenticationError")
	// The cap still counts the streams that started before the reload.
	_, err = s.sdk(tokA).Chat.Completions.New(ctx, chatParams(meshModel, 3))
	apiError(t, "team-a at its cap after the reload", err, 429, "RateLimitError")
	for i, st := range []*streamed{s1, s2} {
		<-st.done
		if st.err != nil || st.tokens != 40 || st.finish != "length" {
			t.Errorf("stream %d in flight across the reload: %d tokens, finish %q, err %v; want 40, length, nil", i+1, st.tokens, st.finish, st.err)
		}
	}
	if _, err := s.sdk(tokA).Chat.Completions.New(ctx, chatParams(meshModel, 2)); err != nil {
		t.Errorf("team-a after its streams ended: %v", err)
	}

	// Metrics: the key label holds names, bounded; 401s are "none".
	metrics := s.get(t, s.url+"/metrics")
	for _, want := range []string{`key="team-a"`, `key="team-c"`, `code="401"`, `key="none"`, `code="429"`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(metrics, `key="team-b"`) {
		t.Error("/metrics still has series of team-b, removed by the reload")
	}

	// Events: every request event names its key; none names an
	// unauthenticated caller.
	if err := s.router.stop(syscall.SIGTERM); err != nil {
		t.Errorf("router did not exit cleanly: %v", err)
	}
	events := s.allEvents(t)
	byKey := map[string]int{}
	for _, ev := range events {
		if !strings.HasPrefix(ev.Subject, "narwhal.events.request.") {
			continue
		}
		if err := bus.ValidateEvent(ev.Payload); err != nil {
			t.Errorf("request event does not match its schema: %v: %s", err, ev.Payload)
		}
		var rc schemas.RequestCompleted
		if err := json.Unmarshal(ev.Payload, &rc); err != nil {
			t.Fatal(err)
		}
		byKey[rc.KeyName+" "+fmt.Sprint(rc.Status)]++
	}
	for _, want := range []string{"team-a 200", "team-b 403", "team-a 429", "team-c 200"} {
		if byKey[want] == 0 {
			t.Errorf("no request event for %q (events by key and status: %v)", want, byKey)
		}
	}
	if byKey[" 401"] != 0 {
		t.Errorf("401s published %d request events, want none", byKey[" 401"])
	}

	// No key nor its digest anywhere: router logs, events, metrics.
	var everything strings.Builder
	everything.WriteString(s.router.stdout.String() + s.router.stderr.String() + metrics)
	for _, ev := range events {
		everything.Write(ev.Payload)
	}
	all := everything.String()
	if !strings.Contains(all, "team-a") {
		t.Fatal("the haystack holds no key name: it proves nothing")
	}
	for _, secret := range []string{tokA, tokB, tokC, engineKey} {
		for _, form := range []string{secret, sha256Hex(secret), strings.ToUpper(sha256Hex(secret)), sha256Hex(secret)[:16]} {
			if strings.Contains(all, form) {
				t.Errorf("a key or its digest (%.12s…) appears in the router's logs, events or metrics", form)
			}
		}
	}
}

// get returns the body of GET url, failing on a non-200.
func (s *authStack) get(t *testing.T, url string) string {
	t.Helper()
	resp, err := s.http().Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: HTTP %d %s", url, resp.StatusCode, b)
	}
	return string(b)
}

// allEvents returns every event stream NARWHAL_EVENTS holds once the
// subscription delivered them (the router must have stopped).
func (s *authStack) allEvents(t *testing.T) []bustest.Event {
	t.Helper()
	return allDelivered(t, s.bus, s.events)
}

// TestTLSFrontEnd proves server.tls_cert_file / tls_key_file with the
// OpenAI SDK over https:// (custom CA through option.WithHTTPClient), the
// certificate's reload when its files change, https:// engines verified
// through engine.tls_ca_file, and /metrics moved to the admin listener by
// server.metrics_on_admin.
func TestTLSFrontEnd(t *testing.T) {
	tok := randomToken(t, "sk-tls-")
	s := startAuthStack(t, authStackOptions{
		auth:           fmt.Sprintf("  api_keys:\n    - name: tls-user\n      key_sha256: %s\n", sha256Hex(tok)),
		tls:            true,
		metricsOnAdmin: true,
	})
	if !strings.HasPrefix(s.url, "https://") || !strings.HasPrefix(s.sims[0].url, "https://") {
		t.Fatalf("not over TLS: router %s, engine %s", s.url, s.sims[0].url)
	}
	ctx := testContext(t, time.Minute)
	st := startStream(ctx, s.sdk(tok), 5)
	<-st.done
	if st.err != nil || st.tokens != 5 {
		t.Fatalf("stream over https: %d tokens, %v", st.tokens, st.err)
	}
	resp, err := s.sdk(tok).Chat.Completions.New(ctx, chatParams(meshModel, 3))
	if err != nil || resp.Choices[0].Message.Content == "" {
		t.Fatalf("completion over https: %+v %v", resp, err)
	}

	// Plain HTTP on the TLS port gets no completion.
	plain := &http.Client{Timeout: 2 * time.Second}
	if r, err := plain.Get("http://" + strings.TrimPrefix(s.url, "https://") + "/healthz"); err == nil {
		r.Body.Close()
		if r.StatusCode == 200 {
			t.Error("plain HTTP served on the TLS listener")
		}
	}
	// A client that does not trust the CA fails the handshake.
	untrusting := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{}}
	if _, err := untrusting.Get(s.url + "/healthz"); err == nil {
		t.Error("a client without the test CA completed the handshake")
	}

	// /metrics: gone from the front end, served on the admin listener.
	r, err := s.http().Get(s.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != 404 {
		t.Errorf("front-end /metrics with metrics_on_admin: HTTP %d, want 404", r.StatusCode)
	}
	if m := s.get(t, s.adminURL+"/metrics"); !strings.Contains(m, `narwhal_requests_total{code="200",endpoint="/v1/chat/completions",key="tls-user",model="`+meshModel+`",outcome="ok"} 2`) {
		t.Errorf("admin /metrics lacks the two requests of tls-user:\n%s", grepLines(m, "narwhal_requests_total"))
	}

	// Rotation: a new certificate written over the files is served to new
	// connections without a restart.
	old := s.peerSerial(t)
	serial := s.ca.WriteIssued(t, "router-2", s.certPath, s.keyPath)
	testkit.WaitEvery(t, 5*time.Second, pollInterval, "the rotated certificate", func() bool { return s.peerSerial(t).Cmp(serial) == 0 })
	if old.Cmp(serial) == 0 {
		t.Fatal("the rotated certificate has the old serial")
	}
	if _, err := s.sdk(tok).Chat.Completions.New(ctx, chatParams(meshModel, 2)); err != nil {
		t.Errorf("completion after the rotation: %v", err)
	}
}

// peerSerial returns the serial number of the certificate the router
// presents to a new connection.
func (s *authStack) peerSerial(t *testing.T) *big.Int {
	t.Helper()
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", strings.TrimPrefix(s.url, "https://"),
		&tls.Config{RootCAs: s.ca.Pool})
	if err != nil {
		t.Fatalf("TLS dial: %v", err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestEngineKeysBreakerProbe proves engines behind --api-key through the
// real binaries (issue 10 item 6, R-BRK-3): a `narwhal breaker` process
// ejects a decode engine after counted failures and readmits it after an
// inference probe that carries the engine's key on both of its legs; the
// key appears in no log of the router or the breaker.
func TestEngineKeysBreakerProbe(t *testing.T) {
	engineKey := randomToken(t, "engine-")
	s := startAuthStack(t, authStackOptions{engineKey: engineKey})
	brk := startProcess(t, "breaker", []string{"NARWHAL_NATS_URL=" + s.natsURL, engineKeyEnv + "=" + engineKey,
		"NARWHAL_RECOVERY_READMIT_INTERVAL_S=0.3", "NARWHAL_RECOVERY_EJECT_AFTER=2", "NARWHAL_BREAKER_LEASE_TTL_S=1"},
		"breaker", "--config", s.cfgPath)
	ctx := testContext(t, time.Minute)
	c := s.sdk("unused")
	if _, err := c.Chat.Completions.New(ctx, chatParams(meshModel, 2)); err != nil {
		t.Fatalf("before the faults: %v", err)
	}
	testkit.WaitEvery(t, readyBound, pollInterval, "the breaker to lead", func() bool {
		return strings.Contains(brk.stderr.String(), "breaker leading")
	})
	d1 := s.sims[1]
	resp, err := probeClient.Post(d1.url+"/sim/faults", "application/json",
		strings.NewReader(`{"kind":"status","phase":"decode","status":500}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	availability := func() float64 {
		return testkit.ScrapedSum(t, probeClient, s.url+"/metrics", "narwhal_engine_available", "engine", "d1")
	}
	// Struck requests until the breaker, which counts their failures,
	// ejects d1 (the breaker's consumer may start after the first ones).
	testkit.WaitEvery(t, decisionBound, 100*time.Millisecond, "d1 ejected", func() bool {
		if availability() == 0 {
			return true
		}
		_, err := c.Chat.Completions.New(ctx, chatParams(meshModel, 2))
		var ae *openai.Error
		// 502 from the fault; 503 once the ejection reached the router
		// between the look at the metric and the request.
		if !errors.As(err, &ae) || (ae.StatusCode != 502 && ae.StatusCode != 503) {
			t.Fatalf("a struck request: %v, want 502 or 503", err)
		}
		return false
	})
	// Readmitted by a probe that the engine, which refuses requests
	// without its key, answered.
	req, _ := http.NewRequest(http.MethodDelete, d1.url+"/sim/faults", nil)
	if resp, err := probeClient.Do(req); err != nil {
		t.Fatal(err)
	} else {
		resp.Body.Close()
	}
	testkit.WaitEvery(t, decisionBound, pollInterval, "d1 readmitted", func() bool { return availability() == 1 })
	var probes int
	for _, r := range d1.requests(t) {
		if strings.HasPrefix(r.RequestID, kvprobe.RequestIDPrefix) && r.Phase == "decode" {
			probes++
		}
	}
	if probes == 0 {
		t.Error("d1 recorded no probe decode")
	}
	var probePrefills int
	for _, r := range s.sims[0].requests(t) {
		if strings.HasPrefix(r.RequestID, kvprobe.RequestIDPrefix) {
			probePrefills++
		}
	}
	if probePrefills == 0 {
		t.Error("p1 recorded no probe prefill")
	}
	for _, sp := range s.sims {
		if st := sp.stats(t); st.Unauthorized != 0 {
			t.Errorf("%s refused %d requests of the router or the breaker", sp.id, st.Unauthorized)
		}
	}
	if _, err := c.Chat.Completions.New(ctx, chatParams(meshModel, 2)); err != nil {
		t.Errorf("after the readmission: %v", err)
	}
	if err := brk.stop(syscall.SIGTERM); err != nil {
		t.Errorf("breaker did not exit cleanly: %v", err)
	}
	logs := brk.stdout.String() + brk.stderr.String() + s.router.stdout.String() + s.router.stderr.String()
	if !strings.Contains(brk.stderr.String(), "readmitted") {
		t.Errorf("the breaker's log does not tell the readmission:\n%s", brk.stderr.String())
	}
	if strings.Contains(logs, engineKey) {
		t.Error("the engine key appears in the router's or the breaker's log")
	}
}

// TestEngineWrongKey proves the classification of an engine's 401 through
// the real binaries (docs/failures.md, engine_unauthorized): engines that
// refuse the router's key get no leg, the router says why in one error
// line per engine naming it, counts it, is not ready, answers 503 no
// eligible engine, and publishes no failure that counts towards ejection.
func TestEngineWrongKey(t *testing.T) {
	engineKey, wrong := randomToken(t, "engine-"), randomToken(t, "wrong-")
	s := startAuthStack(t, authStackOptions{engineKey: engineKey, routerEngineKey: wrong})
	for _, id := range []string{"p1", "d1"} {
		testkit.WaitEvery(t, readyBound, pollInterval, id+"'s refusal in the router's log", func() bool {
			return strings.Contains(s.router.stderr.String(), "engine refused the router's credentials; not placeable on this router until its /v1/models accepts them\" router_id="+meshRouterID+" engine_id="+id+" status=401")
		})
	}
	refused := testkit.ScrapedSum(t, probeClient, s.url+"/metrics", "narwhal_engine_credentials_refused_total")
	if refused != 2 {
		t.Errorf("narwhal_engine_credentials_refused_total = %v, want 2 (one episode per engine)", refused)
	}
	if r, err := s.http().Get(s.url + "/readyz"); err != nil {
		t.Fatal(err)
	} else {
		r.Body.Close()
		if r.StatusCode != 503 {
			t.Errorf("/readyz %d while every engine refuses the key, want 503", r.StatusCode)
		}
	}
	ctx := testContext(t, 30*time.Second)
	_, err := s.sdk("unused").Chat.Completions.New(ctx, chatParams(meshModel, 2))
	var ae *openai.Error
	if !errors.As(err, &ae) || (ae.StatusCode != 404 && ae.StatusCode != 503) {
		t.Errorf("a request while the engines refuse the key: %v, want 503 no eligible engine (or 404: no model known)", err)
	}
	for _, sp := range s.sims {
		st := sp.stats(t)
		if st.Prefills+st.Decodes != 0 || st.Unauthorized == 0 {
			t.Errorf("%s: %+v, want no leg and refused requests", sp.id, st)
		}
	}
	if err := s.router.stop(syscall.SIGTERM); err != nil {
		t.Errorf("router did not exit cleanly: %v", err)
	}
	for _, ev := range s.allEvents(t) {
		if strings.HasPrefix(ev.Subject, "narwhal.events.failure.") && strings.Contains(string(ev.Payload), `"counts":true`) {
			t.Errorf("a refused key published a counted failure: %s", ev.Payload)
		}
	}
	if strings.Contains(s.router.stderr.String(), wrong) || strings.Contains(s.router.stderr.String(), engineKey) {
		t.Error("an engine key appears in the router's log")
	}
}
