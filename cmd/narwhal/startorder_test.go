package main

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// setUpBound is how soon after `narwhal bus setup` a process that
// started before it must be ready.
const setUpBound = 5 * time.Second

// missingStream is what a router's /readyz says on a bus not set up.
const missingStream = "stream NARWHAL_EVENTS does not exist: run narwhal bus setup"

// setUp runs the admin's set-up on e, as `narwhal bus setup` does.
func setUp(t *testing.T, e *bus.Embedded) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()
	admin, err := bus.Connect(ctx, bus.ConnectOptions{URL: e.ClientURL(), Name: "narwhal-bus-setup", Setup: &bus.SetupOptions{}})
	if err != nil {
		t.Fatal(err)
	}
	admin.Close()
}

// TestRouterWaitsForSetupRBUS8 proves that a router started on a bus that
// no admin has set up yet (R-BUS-8: only the admin creates streams and
// buckets) keeps running: /readyz and every request answer 503 naming the
// missing stream and `narwhal bus setup`, the log says so once (not per
// retry), and the router turns ready by itself within 5 s of the set-up.
func TestRouterWaitsForSetupRBUS8(t *testing.T) {
	testkit.CheckLeaks(t, testkit.FasthttpLongLived()...)
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, NoSetup: true})
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	t.Setenv("NARWHAL_NATS_URL", e.ClientURL())
	t.Setenv("NARWHAL_ROUTER_ID", "rt-early")
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testkit.LockedBuffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	listen := "127.0.0.1:" + strconv.Itoa(freeTCPPort(t))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runRouter(ctx, cfg, listen, log, nil) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runRouter: %v", err)
		}
	}()
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	defer client.CloseIdleConnections()

	var status int
	var body string
	testkit.WaitFor(t, cmdTestBound, "/readyz naming the missing stream", func() bool {
		status, body = getBody(client, "http://"+listen+"/readyz")
		return strings.Contains(body, missingStream)
	})
	if want := `{"problems":["` + missingStream + `"],"status":"not ready"}`; status != http.StatusServiceUnavailable || body != want {
		t.Errorf("/readyz on a bus not set up: %d %s, want 503 %s", status, body, want)
	}
	if s, b := getBody(client, "http://"+listen+"/v1/models"); s != http.StatusServiceUnavailable || !strings.Contains(b, "not ready: "+missingStream) {
		t.Errorf("/v1/models on a bus not set up: %d %s", s, b)
	}
	// For a second (four retries or more) it says so once, not per retry.
	if testkit.Poll(time.Second, 50*time.Millisecond, func() bool {
		return strings.Count(logs.String(), "waiting for the bus to be set up") != 1
	}) {
		t.Errorf("not one waiting line in the first second:\n%s", logs.String())
	}
	select {
	case err := <-done:
		t.Fatalf("the router stopped on a bus not set up: %v", err)
	default:
	}

	setUp(t, e)
	start := time.Now()
	testkit.WaitFor(t, setUpBound, "a ready router after the set-up", func() bool {
		s, _ := getBody(client, "http://"+listen+"/readyz")
		return s == http.StatusOK
	})
	t.Logf("ready %v after the set-up", time.Since(start))
	if !strings.Contains(logs.String(), "bus set up") {
		t.Errorf("no line says the bus was set up:\n%s", logs.String())
	}
}

// TestBreakerWaitsForSetupRBUS8 proves that `narwhal breaker` started on
// a bus not set up yet keeps running, says on its log what is missing and
// which command creates it, and once the set-up has run takes the lease
// by itself (R-BUS-8, R-BRK-8).
func TestBreakerWaitsForSetupRBUS8(t *testing.T) {
	testkit.CheckLeaks(t)
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, NoSetup: true})
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	t.Setenv("NARWHAL_NATS_URL", e.ClientURL())
	t.Setenv("NARWHAL_ROUTER_LOG_LEVEL", "info")
	cfg, err := loadMesh(path)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testkit.LockedBuffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		b, stop, err := joinBus(ctx, cfg, "narwhal-breaker-early", bus.RoleBreaker, log)
		if err != nil {
			done <- err
			return
		}
		defer stop()
		done <- runBreaker(ctx, cfg, b, "breaker-early", nil, log)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("breaker: %v", err)
		}
	}()
	testkit.WaitFor(t, cmdTestBound, "the breaker's waiting line", func() bool {
		return strings.Contains(logs.String(), "waiting for the bus to be set up")
	})
	if !strings.Contains(logs.String(), missingStream) {
		t.Errorf("the waiting line does not name the stream and the command:\n%s", logs.String())
	}

	setUp(t, e)
	start := time.Now()
	peer := bustest.Connect(t, e, bus.ConnectOptions{})
	defer peer.Close()
	testkit.WaitFor(t, setUpBound, "the lease held by the early breaker", func() bool {
		kv, err := peer.JetStream().KeyValue(ctx, breaker.LeaseBucket)
		if err != nil {
			return false
		}
		en, err := kv.Get(ctx, breaker.LeaseKey)
		if err != nil {
			return false
		}
		var l breaker.Lease
		return json.Unmarshal(en.Value(), &l) == nil && l.BreakerID == "breaker-early"
	})
	t.Logf("leading %v after the set-up", time.Since(start))
}
