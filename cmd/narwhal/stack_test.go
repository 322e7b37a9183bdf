package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// freeTCPPort returns a port nothing listens on now.
func freeTCPPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return port
}

// getBody GETs url and returns the status and body ("" and 0 on a
// transport error).
func getBody(c *http.Client, url string) (int, string) {
	resp, err := c.Get(url)
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// startRouter runs runRouter in a goroutine for the config at path (read
// with the environment as it is now) on a free loopback port, its text log
// into logs. It returns the address, the log, a client without keep-alive
// and the channel runRouter's result arrives on. When the test ends the
// router is stopped and the test fails if runRouter returned an error.
func startRouter(t *testing.T, path string) (listen string, logs *testkit.LockedBuffer, client *http.Client, done <-chan error) {
	t.Helper()
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	logs = &testkit.LockedBuffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	listen = "127.0.0.1:" + strconv.Itoa(freeTCPPort(t))
	ctx, cancel := context.WithCancel(context.Background())
	result := make(chan error, 1)
	go func() { result <- runRouter(ctx, cfg, listen, log, nil) }()
	t.Cleanup(func() {
		cancel()
		if err := <-result; err != nil {
			t.Errorf("runRouter: %v", err)
		}
	})
	client = &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	t.Cleanup(client.CloseIdleConnections)
	return listen, logs, client, result
}

// TestRouterSaysWhatItWaitsFor proves the start-up of issue 11 (R-BUS-8):
// a router whose bus is not there logs it at once and keeps logging, its
// address answers at once — /readyz 503 naming "bus unreachable" — and once
// the bus comes it serves and turns ready.
func TestRouterSaysWhatItWaitsFor(t *testing.T) {
	testkit.CheckLeaks(t, testkit.FasthttpLongLived()...)
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	busPort := freeTCPPort(t)
	t.Setenv("NARWHAL_NATS_URL", "nats://127.0.0.1:"+strconv.Itoa(busPort))
	t.Setenv("NARWHAL_ROUTER_ID", "rt-wait")
	listen, logs, client, _ := startRouter(t, path)

	start := time.Now()
	testkit.WaitFor(t, cmdTestBound, "the router's waiting line", func() bool { return strings.Contains(logs.String(), "waiting for the bus") })
	if d := time.Since(start); d > time.Second {
		t.Errorf("the first waiting line came after %v, want it at once", d)
	}
	var status int
	var body string
	testkit.WaitFor(t, cmdTestBound, "a 503 on /readyz", func() bool {
		status, body = getBody(client, "http://"+listen+"/readyz")
		return status != 0
	})
	if status != http.StatusServiceUnavailable || !strings.Contains(body, "bus unreachable") {
		t.Errorf("/readyz while the bus is missing: %d %s, want 503 naming the bus", status, body)
	}
	if s, b := getBody(client, "http://"+listen+"/v1/models"); s != http.StatusServiceUnavailable || !strings.Contains(b, "bus unreachable") {
		t.Errorf("/v1/models while the bus is missing: %d %s", s, b)
	}
	// Its 503s are answers like any other: logged as each ends, and in
	// narwhal_requests_total once the router runs.
	for range 2 {
		resp, err := client.Post("http://"+listen+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("X-Request-Id") == "" {
			t.Errorf("a completion while the bus is missing: %d X-Request-Id %q, want 503 with one", resp.StatusCode, resp.Header.Get("X-Request-Id"))
		}
	}
	if n := strings.Count(logs.String(), "msg=\"request ended\""); n != 3 {
		t.Errorf("%d request-ended lines for the 3 answers under /v1/:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "status=503 outcome=not_ready") {
		t.Errorf("no log line gives the 503's outcome:\n%s", logs.String())
	}

	// Deferred: the bus stops as the test returns, before the router does.
	defer bustest.StartWith(t, bus.EmbeddedOptions{Port: busPort}).Shutdown()
	testkit.WaitFor(t, cmdTestBound, "a ready router", func() bool {
		s, _ := getBody(client, "http://"+listen+"/readyz")
		return s == http.StatusOK
	})
	if !strings.Contains(logs.String(), "bus reachable") {
		t.Errorf("no line says the bus was reached:\n%s", logs.String())
	}
	_, metrics := getBody(client, "http://"+listen+"/metrics")
	for _, want := range []string{
		`narwhal_requests_total{code="503",endpoint="/v1/chat/completions",key="none",model="other",outcome="not_ready"} 2`,
		`narwhal_requests_total{code="503",endpoint="",key="none",model="other",outcome="not_ready"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics of the ready router lacks %s", want)
		}
	}
}

// TestRouterConnectTimeout proves bus.connect_timeout_s: with nothing at
// the bus URL the router gives up after it with an error naming the bus
// (a non-zero exit), instead of waiting for ever.
func TestRouterConnectTimeout(t *testing.T) {
	testkit.CheckLeaks(t)
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	url := "nats://127.0.0.1:" + strconv.Itoa(freeTCPPort(t))
	t.Setenv("NARWHAL_NATS_URL", url)
	t.Setenv("NARWHAL_NATS_CONNECT_TIMEOUT_S", "0.5")
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = runRouter(context.Background(), cfg, "127.0.0.1:0", slog.New(slog.DiscardHandler), nil)
	d := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), url) || !strings.Contains(err.Error(), "gave up") {
		t.Errorf("runRouter with an unreachable bus: %v, want an error naming %s", err, url)
	}
	if d < 400*time.Millisecond || d > 5*time.Second {
		t.Errorf("gave up after %v, want about 0.5s", d)
	}
}

// TestStoppingLine proves the line narwhal dev prints on Ctrl-C: the
// router's shutdown grace and the requests in flight, in words, and a
// plain "stopping" when none is in flight (no wait to announce).
func TestStoppingLine(t *testing.T) {
	for _, c := range []struct {
		n    int64
		want string
	}{
		{-1, "stopping"},
		{0, "stopping"},
		{1, "stopping: waiting up to 10s for 1 request in flight"},
		{3, "stopping: waiting up to 10s for 3 requests in flight"},
	} {
		if got := stoppingLine(10*time.Second, c.n); got != c.want {
			t.Errorf("stoppingLine(10s, %d) = %q, want %q", c.n, got, c.want)
		}
	}
}

// TestRouterListeningCountsTheLiveFleetRFLEET1 proves that the router's
// "router listening" line counts the fleet it joined (R-FLEET-1): the
// config file's engines and those the live fleet (narwhal_fleet) holds,
// with config_engines the file's alone — so a router whose engines come
// from the bucket does not say engines=0.
func TestRouterListeningCountsTheLiveFleetRFLEET1(t *testing.T) {
	testkit.CheckLeaks(t, testkit.FasthttpLongLived()...)
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	e := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1})
	defer e.Shutdown()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()
	kv, err := bustest.Connect(t, e, bus.ConnectOptions{}).BindBucket(ctx, bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	live, _ := json.Marshal(schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "d5", URL: "http://127.0.0.1:1", Role: "decode",
		Connector: "nixl", State: schemas.FleetActive, Since: now, At: now, Source: schemas.SourceCommand, By: "narwhal-fleet"})
	if _, err := kv.Put(ctx, "d5", live); err != nil {
		t.Fatal(err)
	}
	t.Setenv("NARWHAL_NATS_URL", e.ClientURL())
	t.Setenv("NARWHAL_ROUTER_ID", "rt-count")
	_, logs, _, _ := startRouter(t, path)
	testkit.WaitFor(t, cmdTestBound, "the router's listening line", func() bool { return strings.Contains(logs.String(), "router listening") })
	if !strings.Contains(logs.String(), "engines=3 config_engines=2") {
		t.Errorf("the listening line of a router with 2 engines in its file and 1 more in the live fleet, want engines=3 config_engines=2:\n%s", logs.String())
	}
}
