package router

import (
	"crypto/tls"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// unreadyGet sends method to url and returns the response with its body.
func unreadyGet(t *testing.T, c *http.Client, method, url string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// unreadyListener listens on a loopback TCP port for a stand-in and
// returns the listener, its http:// base URL and a client for it; both are
// closed when the test ends.
func unreadyListener(t *testing.T) (net.Listener, string, *http.Client) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	client := &http.Client{Timeout: 5 * time.Second}
	t.Cleanup(client.CloseIdleConnections)
	return ln, "http://" + ln.Addr().String(), client
}

// checkUnready asserts ServeUnready's answers on base for why: /readyz
// names why in its problems, anything else gets the error object; all 503
// with Retry-After: 1, JSON, the connection closed.
func checkUnready(t *testing.T, c *http.Client, base, why string) {
	t.Helper()
	for _, r := range []struct{ method, path string }{
		{"GET", "/readyz"}, {"GET", "/healthz"}, {"GET", "/v1/models"}, {"POST", "/v1/chat/completions"}, {"GET", "/nowhere"},
	} {
		resp, b := unreadyGet(t, c, r.method, base+r.path)
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" ||
			resp.Header.Get("Content-Type") != "application/json" || !resp.Close {
			t.Errorf("%s %s: %d Retry-After %q Content-Type %q close %v, want 503, 1, JSON, closed",
				r.method, r.path, resp.StatusCode, resp.Header.Get("Retry-After"), resp.Header.Get("Content-Type"), resp.Close)
		}
		if r.path == "/readyz" {
			if want := `{"status":"not ready","problems":["` + why + `"]}`; string(b) != want {
				t.Errorf("/readyz body %s, want %s", b, want)
			}
			continue
		}
		if e := errorObject(t, b); e.Message != "not ready: "+why || e.Code != http.StatusServiceUnavailable {
			t.Errorf("%s %s: error %+v, want 503 %q", r.method, r.path, e, "not ready: "+why)
		}
	}
}

// TestServeUnready proves the stand-in a router answers with while it
// waits for the bus at start (docs/mesh.md, behaviour.md R-API-2): every
// request gets 503 naming why, and stop leaves the listener open for the
// server that takes over, with nothing of its own left running.
func TestServeUnready(t *testing.T) {
	testkit.CheckLeaks(t)
	ln, base, client := unreadyListener(t)

	stop := ServeUnready(ln, config.Server{}, "bus unreachable", slog.New(slog.DiscardHandler))
	checkUnready(t, client, base, "bus unreachable")
	done := make(chan struct{})
	go func() { stop(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("stop did not return")
	}

	// The same listener, taken over at once.
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ready") })}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		srv.Close()
		<-served
	}()
	if resp, b := unreadyGet(t, client, "GET", base+"/readyz"); resp.StatusCode != http.StatusOK || string(b) != "ready" {
		t.Errorf("after stop, the next server answers %d %s, want 200 ready", resp.StatusCode, b)
	}
}

// TestServeUnreadyTLS proves the stand-in speaks HTTPS with the router's
// certificate when server.tls_cert_file is set, so a client of the
// router's https:// URL gets the 503 rather than a handshake error.
func TestServeUnreadyTLS(t *testing.T) {
	testkit.CheckLeaks(t)
	ca := testkit.NewCA(t)
	dir := t.TempDir()
	front := config.Server{TLSCertFile: filepath.Join(dir, "router.crt"), TLSKeyFile: filepath.Join(dir, "router.key")}
	ca.WriteIssued(t, "router", front.TLSCertFile, front.TLSKeyFile)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool}}}
	defer client.CloseIdleConnections()

	stop := ServeUnready(ln, front, "bus unreachable", slog.New(slog.DiscardHandler))
	defer stop()
	checkUnready(t, client, "https://"+ln.Addr().String(), "bus unreachable")
}

// TestServeUnreadyOtherListener proves that a listener ServeUnready
// cannot hand back intact (not TCP) is left alone, its stop doing
// nothing.
func TestServeUnreadyOtherListener(t *testing.T) {
	testkit.CheckLeaks(t)
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		if runtime.GOOS == "linux" {
			t.Fatalf("unix socket: %v", err)
		}
		t.Skipf("no unix socket on %s: %v", runtime.GOOS, err)
	}
	defer ln.Close()
	stop := ServeUnready(ln, config.Server{}, "bus unreachable", slog.New(slog.DiscardHandler))
	stop()
	go func() {
		if c, err := net.Dial("unix", ln.Addr().String()); err == nil {
			c.Close()
		}
	}()
	c, err := ln.Accept()
	if err != nil {
		t.Fatalf("the listener after stop: %v", err)
	}
	c.Close()
}

// TestUnreadyAnswersCounted proves that the stand-in's 503s under /v1/
// are counted as the Router counts its answers (docs/observability.md,
// behaviour.md R-API-2): by endpoint label, none for /readyz or /healthz,
// moved into narwhal_requests_total by the Router that takes them over,
// and counted there directly after that.
func TestUnreadyAnswersCountedRAPI2(t *testing.T) {
	testkit.CheckLeaks(t)
	ln, base, client := unreadyListener(t)
	answers := &UnreadyAnswers{}
	stop := ServeUnreadyCounted(ln, config.Server{}, "bus unreachable", slog.New(slog.DiscardHandler), answers)
	defer stop()
	checkUnready(t, client, base, "bus unreachable") // /readyz, /healthz, /v1/models, a chat completion, /nowhere
	if got := answers.Count("/v1/chat/completions"); got != 1 {
		t.Errorf("chat completions counted %v, want 1", got)
	}
	if got := answers.Count(""); got != 1 {
		t.Errorf("other /v1/ paths counted %v, want 1 (/v1/models; /readyz, /healthz, /nowhere are not)", got)
	}
	vec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_requests_total"}, []string{"endpoint", "code", "outcome", "key", "model"})
	answers.moveInto(vec)
	unreadyGet(t, client, "POST", base+"/v1/chat/completions")
	if got := testutil.ToFloat64(vec.WithLabelValues("/v1/chat/completions", "503", OutcomeNotReady, config.NoKeyName, otherModel)); got != 2 {
		t.Errorf("narwhal_requests_total of the chat 503s %v, want 2 (one moved, one after)", got)
	}
	if got := answers.Count("/v1/chat/completions"); got != 0 {
		t.Errorf("%v left uncounted after the move", got)
	}
}
