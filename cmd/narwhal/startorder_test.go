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
	listen, logs, client, done := startRouter(t, path)

	var status int
	var body string
	testkit.WaitFor(t, cmdTestBound, "/readyz naming the missing stream", func() bool {
		status, body = getBody(client, "http://"+listen+"/readyz")
		return strings.Contains(body, missingStream)
	})
	if want := `{"status":"not ready","problems":["` + missingStream + `"]}`; status != http.StatusServiceUnavailable || body != want {
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

// TestChaosArmWaitsForTheBucketRBUS8 proves that `narwhal chaos arm` on a
// bus without the chaos bucket (no `narwhal bus setup` has made it, R-BUS-8)
// waits for it up to --timeout and then fails naming the bucket and the
// command that creates it; once the bucket exists the same command arms.
func TestChaosArmWaitsForTheBucketRBUS8(t *testing.T) {
	testkit.CheckLeaks(t)
	e := bustest.Start(t)
	t.Setenv("NARWHAL_NATS_URL", e.ClientURL())
	admin := bustest.Connect(t, e, bus.ConnectOptions{})
	defer admin.Close()
	if err := admin.JetStream().DeleteKeyValue(context.Background(), bus.ChaosBucket); err != nil {
		t.Fatal(err)
	}
	arm := []string{"arm", "--engine", "d1", "--fault", "http-status", "--param", "code=503", "--timeout", "1s"}
	start := time.Now()
	_, err := chaosCmd(t, arm...)
	d := time.Since(start)
	if err == nil {
		t.Fatal("arm without the chaos bucket succeeded")
	}
	for _, want := range []string{"within --timeout 1s", "bucket narwhal_chaos does not exist", "narwhal bus setup"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if d < 900*time.Millisecond || d > 5*time.Second {
		t.Errorf("arm gave up after %v, want about --timeout 1s", d)
	}
	t.Logf("arm gave up after %v: %v", d, err)

	setUp(t, e)
	if out := mustChaos(t, arm...); !strings.HasPrefix(out, "armed d1/http-status ") {
		t.Errorf("arm after the set-up printed %q", out)
	}
}

// TestEventsAndDashboardWaitForSetupRBUS8 proves that `narwhal events`
// and `narwhal dashboard` started on a bus not set up yet keep running
// (past --connect-timeout, which bounds only reaching the bus), say on
// stderr what is missing and which command creates it, and follow the
// bus by themselves once the set-up has run (R-BUS-8, R-BUS-5).
func TestEventsAndDashboardWaitForSetupRBUS8(t *testing.T) {
	testkit.CheckLeaks(t)
	e := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, NoSetup: true})
	t.Setenv("NARWHAL_NATS_URL", e.ClientURL())
	ctx, cancel := context.WithCancel(context.Background())
	evOut, evErr := &testkit.LockedBuffer{}, &testkit.LockedBuffer{}
	dashOut, dashErr := &testkit.LockedBuffer{}, &testkit.LockedBuffer{}
	evDone, dashDone := make(chan error, 1), make(chan error, 1)
	go func() { evDone <- runEvents(ctx, []string{"--connect-timeout", "300ms"}, evOut, evErr) }()
	go func() { dashDone <- runDashboard(ctx, []string{"--listen", "127.0.0.1:0"}, dashOut, dashErr) }()
	defer func() {
		cancel()
		if err := <-evDone; err != nil {
			t.Errorf("narwhal events: %v", err)
		}
		if err := <-dashDone; err != nil {
			t.Errorf("narwhal dashboard: %v", err)
		}
	}()
	for name, stderr := range map[string]*testkit.LockedBuffer{"events": evErr, "dashboard": dashErr} {
		testkit.WaitFor(t, cmdTestBound, name+"'s waiting line", func() bool {
			return strings.Contains(stderr.String(), "waiting for the bus to be set up") && strings.Contains(stderr.String(), missingStream)
		})
	}
	// Past --connect-timeout: still waiting, not gone.
	if testkit.Poll(600*time.Millisecond, 50*time.Millisecond, func() bool { return len(evDone) > 0 || len(dashDone) > 0 }) {
		t.Fatalf("a command ended on a bus not set up:\nevents: %s\ndashboard: %s", evErr.String(), dashErr.String())
	}

	setUp(t, e)
	testkit.WaitFor(t, setUpBound, "narwhal events following the bus", func() bool { return strings.Contains(evErr.String(), "following ") })
	testkit.WaitFor(t, setUpBound, "the fleet page served", func() bool { return strings.Contains(dashOut.String(), "Fleet page: ") })
}

// TestChaosArmWithoutBucketLeader proves that `narwhal chaos arm` on a bus
// cluster that lost its quorum — the chaos bucket exists but nothing leads
// it — waits up to --timeout and then says that the bus did not answer
// for want of a leader, instead of a bare timeout.
func TestChaosArmWithoutBucketLeader(t *testing.T) {
	testkit.CheckLeaks(t)
	ports := []int{freeTCPPort(t), freeTCPPort(t), freeTCPPort(t)}
	route := func(i int) string { return "nats://127.0.0.1:" + strconv.Itoa(ports[i]) }
	var nodes []*bus.Embedded
	for i, name := range []string{"a", "b", "c"} {
		var routes []string
		for j := range ports {
			if j != i {
				routes = append(routes, route(j))
			}
		}
		nodes = append(nodes, bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, NoSetup: true,
			ServerName: name, Cluster: "127.0.0.1:" + strconv.Itoa(ports[i]), Routes: routes}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*cmdTestBound)
	defer cancel()
	admin, err := bus.Connect(ctx, bus.ConnectOptions{URL: nodes[0].ClientURL(), Name: "narwhal-bus-setup", Setup: &bus.SetupOptions{Replicas: 3}})
	if err != nil {
		t.Fatal(err)
	}
	admin.Close()
	nodes[1].Shutdown()
	nodes[2].Shutdown()
	t.Setenv("NARWHAL_NATS_URL", nodes[0].ClientURL())
	start := time.Now()
	_, err = chaosCmd(t, "arm", "--engine", "d1", "--fault", "http-status", "--timeout", "2s")
	d := time.Since(start)
	if err == nil {
		t.Fatal("arm on a cluster without a quorum succeeded")
	}
	t.Logf("arm gave up after %v: %v", d, err)
	for _, want := range []string{"within --timeout 2s", "leader"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if d < 1900*time.Millisecond || d > 8*time.Second {
		t.Errorf("arm gave up after %v, want about --timeout 2s", d)
	}
}
