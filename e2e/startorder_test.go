package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// setUpBound is how soon after `narwhal bus setup` a router or breaker
// that started before it must be ready, with no restart.
const setUpBound = 5 * time.Second

// missingStream is what a router's /readyz names on a bus not set up.
const missingStream = "stream NARWHAL_EVENTS does not exist: run narwhal bus setup"

// buildNATSServer builds the official nats-server of go.mod's version (a
// plain NATS server, which sets nothing of Narwhal's up) into dir. Without
// a Go toolchain able to build it the test skips on a developer machine
// and fails under CI=true.
func buildNATSServer(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "nats-server")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/nats-io/nats-server/v2").CombinedOutput()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("go build nats-server: %v\n%s", err, out)
		}
		t.Skipf("go build nats-server: %v\n%s", err, out)
	}
	return bin
}

// readyz returns the status and body of GET url/readyz (0 when it did not
// answer).
func readyz(url string) (int, string) {
	resp, err := probeClient.Get(url + "/readyz")
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestStartBeforeSetupRBUS8 proves that the mesh starts in any order: on a
// fresh cluster of three plain nats-server processes (JetStream, clustered,
// nothing of Narwhal's created — only the admin's `narwhal bus setup`
// creates streams and buckets, R-BUS-8) a router and a breaker started
// first keep running, the router's /readyz answers 503 naming the missing
// stream and `narwhal bus setup`, both log that once (not per retry), and
// both become ready within 5 s of the set-up — the router's /readyz 200,
// the breaker holding the lease — with no restart.
func TestStartBeforeSetupRBUS8(t *testing.T) {
	c := startCluster(t, clusterOptions{enginesOnly: true})
	bin := buildNATSServer(t, t.TempDir())

	ports := freePorts(t, 7)
	var urls, routes []string
	for i := range 3 {
		urls = append(urls, "nats://"+hostPort(ports[i]))
		routes = append(routes, "nats://"+hostPort(ports[3+i]))
	}
	natsURL := strings.Join(urls, ",")
	var nodes []*process
	for i := range 3 {
		var others []string
		for j, r := range routes {
			if j != i {
				others = append(others, r)
			}
		}
		name := fmt.Sprintf("n%d", i+1)
		nodes = append(nodes, spawnCommand(t, "nats-server "+name, nil, bin, "-js", "-sd", filepath.Join(c.dir, name),
			"-a", "127.0.0.1", "-p", fmt.Sprint(ports[i]), "-n", name, "--cluster_name", "narwhal-e2e",
			"--cluster", routes[i], "--routes", strings.Join(others, ",")))
	}
	routerURL := "http://" + hostPort(ports[6])
	env := append([]string{"NARWHAL_NATS_URL=" + natsURL}, clusterEnv...)
	router := spawn(t, "router r1", append([]string{"NARWHAL_ROUTER_ID=r1"}, env...),
		"router", "--config", c.cfgPath, "--listen", hostPort(ports[6]))
	brk := spawn(t, "breaker", env, "breaker", "--config", c.cfgPath)
	t.Cleanup(func() {
		haltAll(t, router, brk)
		haltAll(t, nodes...)
	})
	for i, n := range nodes {
		addr := hostPort(ports[i])
		testkit.WaitEvery(t, readyBound, pollInterval, n.name+" accepting clients", func() bool {
			if n.exited() {
				n.dump(t)
				t.Fatalf("%s exited: %v", n.name, n.waitErr)
			}
			conn, err := net.Dial("tcp", addr)
			if err == nil {
				conn.Close()
			}
			return err == nil
		})
	}

	alive := func() {
		t.Helper()
		for _, p := range []*process{router, brk} {
			if p.exited() {
				p.dump(t)
				t.Fatalf("%s exited before the set-up: %v", p.name, p.waitErr)
			}
		}
	}
	var status int
	var body string
	testkit.WaitEvery(t, 3*readyBound, pollInterval, "the router's /readyz naming the missing stream", func() bool {
		alive()
		status, body = readyz(routerURL)
		return strings.Contains(body, missingStream)
	})
	if want := `{"status":"not ready","problems":["` + missingStream + `"]}`; status != http.StatusServiceUnavailable || body != want {
		t.Errorf("/readyz before the set-up: %d %s, want 503 %s", status, body, want)
	}
	const waiting = "waiting for the bus to be set up"
	testkit.WaitEvery(t, readyBound, pollInterval, "the breaker's waiting line", func() bool {
		alive()
		return strings.Contains(brk.stderr.String(), waiting)
	})
	if !strings.Contains(brk.stderr.String(), missingStream) {
		t.Errorf("the breaker's waiting line does not name the stream and the command:\n%s", brk.stderr.String())
	}
	// For two seconds (eight retries or more) each has said so once.
	if testkit.Poll(2*time.Second, 50*time.Millisecond, func() bool {
		return strings.Count(router.stderr.String(), waiting) != 1 || strings.Count(brk.stderr.String(), waiting) != 1
	}) {
		t.Errorf("not one waiting line each over two seconds:\n---- router\n%s\n---- breaker\n%s", router.stderr.String(), brk.stderr.String())
	}
	alive()

	out, code := runNarwhalEnv(t, []string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_NATS_REPLICAS=3", "NARWHAL_BREAKER_LEASE_TTL_S=1"}, "bus", "setup")
	if code != 0 {
		t.Fatalf("narwhal bus setup: exit %d\n%s", code, out)
	}
	setUpAt := time.Now()
	var routerReady, breakerLeads time.Duration
	ctx, cancel := context.WithTimeout(context.Background(), readyBound)
	defer cancel()
	peer, err := bus.Connect(ctx, bus.ConnectOptions{URL: natsURL, Name: "narwhal-e2e-start-order"})
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	leader := func() string {
		kv, err := peer.JetStream().KeyValue(ctx, breaker.LeaseBucket)
		if err != nil {
			return ""
		}
		e, err := kv.Get(ctx, breaker.LeaseKey)
		if err != nil {
			return ""
		}
		var l breaker.Lease
		_ = json.Unmarshal(e.Value(), &l)
		return l.BreakerID
	}
	testkit.WaitEvery(t, setUpBound, pollInterval, "a ready router and a leading breaker after the set-up", func() bool {
		if routerReady == 0 {
			if s, _ := readyz(routerURL); s == http.StatusOK {
				routerReady = time.Since(setUpAt)
			}
		}
		if breakerLeads == 0 && strings.HasSuffix(leader(), fmt.Sprintf("-%d", brk.cmd.Process.Pid)) {
			breakerLeads = time.Since(setUpAt)
		}
		return routerReady > 0 && breakerLeads > 0
	})
	t.Logf("after narwhal bus setup: router ready in %v, breaker leading in %v", routerReady, breakerLeads)
	for _, p := range []*process{router, brk} {
		if p.exited() {
			t.Errorf("%s exited: %v", p.name, p.waitErr)
		}
		if n := strings.Count(p.stderr.String(), `msg="bus set up"`); n != 1 {
			t.Errorf("%s said %d times that the bus was set up, want 1", p.name, n)
		}
	}
	if n := strings.Count(router.stderr.String(), "router listening"); n != 1 {
		t.Errorf("the router started %d times, want once", n)
	}
}
