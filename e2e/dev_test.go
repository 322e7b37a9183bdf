package e2e

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// devModel is the model `narwhal dev` serves.
const devModel = "narwhal-sim"

// curlLine is the ready-to-paste command `narwhal dev` prints:
// curl -N URL -H 'Content-Type: application/json' -d 'JSON'.
var curlLine = regexp.MustCompile(`(?m)^curl -N (\S+) -H '([^']*)' -d '([^']*)'$`)

// TestDevStackCurl runs `narwhal dev` as a process, reads the curl command
// it prints (behaviour.md §14), sends the same request with net/http and checks
// that it streams the simulator's tokens for that prompt and ends with
// data: [DONE] (R-API-1, R-FAIL-2). SIGINT then stops the whole stack with
// exit status 0.
func TestDevStackCurl(t *testing.T) {
	port := freePorts(t, 1)[0]
	dev := startProcess(t, "dev", nil, "dev", "--listen", hostPort(port))
	testkit.WaitEvery(t, readyBound, pollInterval, "the curl line on stdout", func() bool {
		if dev.exited() {
			t.Fatalf("narwhal dev exited: %v", dev.waitErr)
		}
		return curlLine.MatchString(dev.stdout.String())
	})
	// The banner spells this binary one way, as it was started (not go
	// run: TestMain built it), in every line a user pastes.
	banner := dev.stdout.String()
	if strings.Contains(banner, "go run") || !strings.Contains(banner, "NARWHAL_NATS_URL=nats://127.0.0.1:") ||
		!regexp.MustCompile(`(?m) `+regexp.QuoteMeta(narwhalBin)+` events$`).MatchString(banner) {
		t.Errorf("the banner does not spell narwhal as %s throughout:\n%s", narwhalBin, banner)
	}
	m := curlLine.FindStringSubmatch(banner)
	url, header, body := m[1], m[2], m[3]
	if want := "http://" + hostPort(port) + "/v1/chat/completions"; url != want {
		t.Fatalf("curl URL %q, want %q", url, want)
	}
	name, value, ok := strings.Cut(header, ": ")
	if !ok {
		t.Fatalf("curl header %q", header)
	}
	var req struct {
		Model     string          `json:"model"`
		Messages  json.RawMessage `json:"messages"`
		Stream    bool            `json:"stream"`
		MaxTokens int             `json:"max_tokens"`
		Seed      int64           `json:"seed"`
	}
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatalf("curl body %q: %v", body, err)
	}
	if req.Model != devModel || !req.Stream || req.MaxTokens < 1 {
		t.Fatalf("curl body %s: want model %s, a stream, max_tokens ≥ 1", body, devModel)
	}

	// The request exactly as curl sends it: POST, the header, the body.
	transport := &http.Transport{}
	defer transport.CloseIdleConnections()
	hreq, err := http.NewRequestWithContext(testContext(t, requestBound), http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	hreq.Header.Set(name, value)
	resp, err := (&http.Client{Transport: transport}).Do(hreq)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("HTTP %d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), raw)
	}
	if resp.Header.Get("X-Request-Id") == "" {
		t.Error("no X-Request-Id (R-API-6)")
	}
	events := sseData(raw)
	if len(events) == 0 || events[len(events)-1] != "[DONE]" || !strings.HasSuffix(string(raw), "data: [DONE]\n\n") {
		t.Fatalf("stream does not end with data: [DONE]:\n%s", raw)
	}
	var tokens []string
	for _, e := range events[:len(events)-1] {
		var ch struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(e), &ch); err != nil {
			t.Fatalf("event %q: %v", e, err)
		}
		for _, c := range ch.Choices {
			if c.Delta.Content != "" {
				tokens = append(tokens, c.Delta.Content)
			}
		}
	}
	prompt, err := sim.RenderChat(req.Messages)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := sim.Generate(prompt, req.Seed, req.MaxTokens, nil, false)
	if len(tokens) == 0 || strings.Join(tokens, "|") != strings.Join(want, "|") {
		t.Fatalf("streamed tokens %q, want %q", tokens, want)
	}

	// Ctrl-C stops everything; the process exits 0 within stopBound,
	// having said it stops: with no request in flight, a plain
	// "stopping" and no wait to announce.
	if err := dev.stop(os.Interrupt); err != nil {
		t.Fatalf("narwhal dev after SIGINT: %v (exit status %d)", err, exitCode(err))
	}
	if !regexp.MustCompile(`(?m)^stopping$`).MatchString(dev.stderr.String()) || strings.Contains(dev.stderr.String(), "waiting up to") {
		t.Errorf("narwhal dev's stderr after SIGINT with nothing in flight lacks a plain \"stopping\" line:\n%s", dev.stderr.String())
	}
}

// authCurlLine is the curl `narwhal dev` prints when client API keys are
// configured: the key read from $OPENAI_API_KEY.
var authCurlLine = regexp.MustCompile(`(?m)^curl -N (\S+) -H "Authorization: Bearer \$OPENAI_API_KEY" -H '([^']*)' -d '([^']*)'$`)

// TestDevStackAuthBanner runs `narwhal dev` with NARWHAL_AUTH_API_KEYS_FILE
// (behaviour.md R-API-9, §14): its banner says authentication is on and
// prints a curl that sends the key from $OPENAI_API_KEY; that request,
// with the key exported, streams to [DONE], and without the header it is
// a 401 — the newcomer's curl no longer meets a silent 401.
func TestDevStackAuthBannerRAPI9(t *testing.T) {
	const token = "sk-dev-banner"
	keys := filepath.Join(t.TempDir(), "keys.yaml")
	if err := os.WriteFile(keys, []byte("- name: newcomer\n  key_sha256: "+sha256Hex(token)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePorts(t, 1)[0]
	dev := startProcess(t, "dev", []string{"NARWHAL_AUTH_API_KEYS_FILE=" + keys}, "dev", "--listen", hostPort(port), "--dashboard", "")
	testkit.WaitEvery(t, readyBound, pollInterval, "the curl line on stdout", func() bool {
		if dev.exited() {
			t.Fatalf("narwhal dev exited: %v\n%s", dev.waitErr, dev.stderr.String())
		}
		return authCurlLine.MatchString(dev.stdout.String()) || curlLine.MatchString(dev.stdout.String())
	})
	banner := dev.stdout.String()
	if !strings.Contains(banner, "Client authentication is on: 1 API key(s) from "+keys+" (newcomer)") ||
		!strings.Contains(banner, "export OPENAI_API_KEY='<the key of newcomer>'") {
		t.Errorf("the banner does not say that authentication is on:\n%s", banner)
	}
	m := authCurlLine.FindStringSubmatch(banner)
	if m == nil {
		t.Fatalf("the banner's curl sends no Authorization header:\n%s", banner)
	}
	url, header, body := m[1], m[2], m[3]
	name, value, _ := strings.Cut(header, ": ")
	transport := &http.Transport{}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport}
	for _, bearer := range []string{"Bearer " + token, ""} {
		hreq, err := http.NewRequestWithContext(testContext(t, requestBound), http.MethodPost, url, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		hreq.Header.Set(name, value)
		if bearer != "" {
			hreq.Header.Set("Authorization", bearer) // as the shell expands $OPENAI_API_KEY
		}
		resp, err := client.Do(hreq)
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch {
		case bearer != "" && (resp.StatusCode != http.StatusOK || !strings.HasSuffix(string(raw), "data: [DONE]\n\n")):
			t.Errorf("the banner's curl with the key: HTTP %d %s", resp.StatusCode, raw)
		case bearer == "" && resp.StatusCode != http.StatusUnauthorized:
			t.Errorf("the banner's curl without the key: HTTP %d, want 401", resp.StatusCode)
		}
	}
	if err := dev.stop(os.Interrupt); err != nil {
		t.Fatalf("narwhal dev after SIGINT: %v (exit status %d)", err, exitCode(err))
	}
}
