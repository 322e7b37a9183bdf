package e2e

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// spawnLimited starts `narwhal args…` through `prlimit --nofile=N:N`
// (util-linux), so that the process runs with soft and hard RLIMIT_NOFILE
// both N; stopping it is left to the caller (see halt). prlimit execs the
// command: the process's pid is narwhal's.
func spawnLimited(t *testing.T, prlimit string, nofile int, name string, env []string, args ...string) *process {
	t.Helper()
	return spawnCommand(t, name, env, prlimit, append([]string{"--nofile=" + strconv.Itoa(nofile) + ":" + strconv.Itoa(nofile), narwhalBin}, args...)...)
}

// lookPrlimit returns the path of prlimit; without it the test skips, and
// fails under CI=true.
func lookPrlimit(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("prlimit")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("no prlimit on PATH: the test needs it under CI (util-linux)")
		}
		t.Skip("no prlimit on PATH (util-linux)")
	}
	return path
}

// keptConn is a client connection kept alive across requests.
type keptConn struct {
	c  net.Conn
	br *bufio.Reader
}

// do sends one HTTP/1.1 request on the connection and reads the answer.
func (k *keptConn) do(t *testing.T, method, path, body string) (*http.Response, string) {
	t.Helper()
	req := method + " " + path + " HTTP/1.1\r\nHost: router\r\n"
	if body != "" {
		req += "Content-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n"
	}
	_ = k.c.SetDeadline(time.Now().Add(requestBound))
	if _, err := io.WriteString(k.c, req+"\r\n"+body); err != nil {
		t.Fatalf("%s %s on the kept-alive connection: %v", method, path, err)
	}
	resp, err := http.ReadResponse(k.br, nil)
	if err != nil {
		t.Fatalf("%s %s on the kept-alive connection: %v", method, path, err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b)
}

// openFDsOf is how many descriptors process pid holds now.
func openFDsOf(t *testing.T, pid int) int {
	t.Helper()
	es, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(es)
}

// TestRouterOutOfDescriptorsRFAIL9 proves behaviour.md R-FAIL-9 with real
// processes: a router that runs out of file descriptors blames nobody.
//
// How the descriptors run out, for real: the router rl is started through
// `prlimit --nofile=256:256`, so it derives server.max_connections 64
// ((256 − 64) ÷ 3, the reserve of configuration.md "Descriptors for engine
// legs"; its start log says so) and idle clients alone could no longer
// take the descriptors of its engine legs (R-API-7 would turn the 65th
// away). The test then lowers the running router's hard and soft limit
// with `prlimit --pid` to 8 above the descriptors it holds — what the
// start check could not see coming — and opens 60 idle client connections
// (within max_connections): the router accepts 8, its accept fails with
// EMFILE for the rest, and a completion on a connection kept alive from
// before cannot open its prefill connection ("socket: too many open
// files"). Before R-FAIL-9 that was 502 `prefill engine p1 unreachable`,
// published as a counted connect_error, and the breaker (eject_after 2)
// ejected healthy engines.
//
// Now: every such completion gets 503 with Retry-After: 1 naming the
// router's resources; no failure event is published; the breaker ejects
// nothing; /readyz says 503 naming the reason; and once the idle
// connections close the router recovers by itself: completions succeed,
// and /readyz is 200 again, 5 s after the last such error. A
// server.max_connections of 10,000 under the same limit is refused at
// start with the arithmetic.
func TestRouterOutOfDescriptorsRFAIL9(t *testing.T) {
	prlimit := lookPrlimit(t)
	c := startCluster(t, clusterOptions{routers: 1, breakers: 1, breakerEnv: []string{"NARWHAL_RECOVERY_EJECT_AFTER=2"}})
	env := append([]string{"NARWHAL_NATS_URL=" + c.natsURL, "NARWHAL_ROUTER_ID=rl"}, clusterEnv...)

	// Refused at start: 10,000 connections leave no descriptors for legs.
	bad := spawnLimited(t, prlimit, 256, "router refused", append(env, "NARWHAL_SERVER_MAX_CONNECTIONS=10000", "NARWHAL_ROUTER_ID=rl-refused"),
		"router", "--config", c.cfgPath, "--listen", hostPort(freePorts(t, 1)[0]))
	select {
	case <-bad.done:
	case <-time.After(readyBound):
		bad.crash()
		t.Fatalf("a router with server.max_connections 10000 under a limit of 256 still runs\n%s", bad.stderr.String())
	}
	want := "server.max_connections 10000 leaves no descriptors for engine legs: limit 256 − room 64"
	if code := exitCode(bad.waitErr); code == 0 || !strings.Contains(bad.stderr.String(), want) {
		t.Fatalf("a router with server.max_connections 10000 under a limit of 256: exit %d, want non-zero with %q\n%s", code, want, bad.stderr.String())
	}

	r := &routerProc{id: "rl", addr: hostPort(freePorts(t, 1)[0])}
	r.url = "http://" + r.addr
	r.p = spawnLimited(t, prlimit, 256, "router rl", env, "router", "--config", c.cfgPath, "--listen", r.addr)
	c.extra = append(c.extra, r.p)
	waitHTTP(t, r.p, r.url+"/readyz")
	if log := r.p.stderr.String(); !strings.Contains(log, "max_connections=64 derived=true nofile=256") {
		t.Fatalf("rl's start log does not show max_connections derived as 64 from a limit of 256:\n%s", log)
	}

	raw, err := net.Dial("tcp", r.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	kept := &keptConn{c: raw, br: bufio.NewReader(raw)}
	if resp, body := kept.do(t, "GET", "/healthz", ""); resp.StatusCode != 200 {
		t.Fatalf("/healthz: %d %s", resp.StatusCode, body)
	}

	pid := r.p.cmd.Process.Pid
	limit := openFDsOf(t, pid) + 8
	if out, err := exec.Command(prlimit, "--pid", strconv.Itoa(pid), fmt.Sprintf("--nofile=%d:%d", limit, limit)).CombinedOutput(); err != nil {
		t.Fatalf("prlimit --pid %d: %v\n%s", pid, err, out)
	}
	var idle []net.Conn
	closeIdle := func() {
		for _, c := range idle {
			c.Close()
		}
		idle = nil
	}
	defer closeIdle()
	for i := 0; i < 60; i++ {
		ic, err := net.Dial("tcp", r.addr) // the kernel queues what rl cannot accept
		if err != nil {
			t.Fatalf("idle connection %d: %v", i, err)
		}
		idle = append(idle, ic)
	}
	testkit.WaitEvery(t, readyBound, pollInterval, "rl out of descriptors (its accept error logged)", func() bool {
		return strings.Contains(r.p.stderr.String(), "accepting client connections failed")
	})

	body := fmt.Sprintf(`{"model":%q,"prompt":"out of descriptors","max_tokens":3}`, clusterModel)
	const tries = 12
	var lastFailure time.Time
	for i := range tries {
		lastFailure = time.Now()
		resp, b := kept.do(t, "POST", schemas.EndpointCompletions, body)
		if resp.StatusCode != 503 {
			t.Fatalf("completion %d of %d while rl is out of descriptors: %d %s, want 503", i+1, tries, resp.StatusCode, b)
		}
		if ra := resp.Header.Get("Retry-After"); ra != "1" {
			t.Errorf("completion %d: Retry-After %q, want 1", i+1, ra)
		}
		if !strings.Contains(b, "router out of local resources (emfile") {
			t.Errorf("completion %d: %s, want the router's resources named", i+1, b)
		}
	}
	if resp, b := kept.do(t, "GET", "/readyz", ""); resp.StatusCode != 503 || !strings.Contains(b, "router out of local resources (emfile)") {
		t.Fatalf("rl's /readyz while out of descriptors: %d %s, want 503 naming the router's resources", resp.StatusCode, b)
	}

	closeIdle()
	testkit.WaitEvery(t, readyBound, pollInterval, "rl serving completions again", func() bool {
		// Taken before the request: the router's fault, which starts its
		// 5 s, came after it was sent and before its answer arrived.
		sent := time.Now()
		resp, _ := kept.do(t, "POST", schemas.EndpointCompletions, body)
		if resp.StatusCode == 503 {
			lastFailure = sent
		}
		return resp.StatusCode == 200
	})
	var readyAt time.Time
	testkit.WaitEvery(t, readyBound, pollInterval, "rl's /readyz 200 again", func() bool {
		resp, _ := kept.do(t, "GET", "/readyz", "")
		readyAt = time.Now()
		return resp.StatusCode == 200
	})
	if el := readyAt.Sub(lastFailure); el < 5*time.Second {
		t.Errorf("rl ready %v after its last router_resources fault, want at least 5 s", el)
	}
	t.Logf("rl: limit lowered to %d descriptors, %d of %d completions answered 503, ready again %v after the last",
		limit, tries, tries, readyAt.Sub(lastFailure).Round(time.Millisecond))
	for i := range 3 {
		if rep := c.mustSend(t, r); rep.status != 200 {
			t.Fatalf("completion %d after recovery on a new connection: %d %s", i+1, rep.status, rep.body)
		}
	}

	// Every refused completion's request event is on the bus, so a failure
	// event published before it would be too (one publisher, in order).
	c.waitEvents(t, readyBound, tries, "rl's request events of the refused completions", func(e event) bool {
		return e.kind == "request" && e.RouterID == "rl" && e.ErrorKind == "router_resources"
	})
	if got := c.list(t, func(e event) bool { return e.kind == "failure" }); len(got) != 0 {
		t.Errorf("%d failure events published, want none; the first: %s", len(got), got[0].raw)
	}
	if got := c.list(t, func(e event) bool { return e.State == "ejected" }); len(got) != 0 {
		t.Errorf("the breaker ejected engines: %s", got[0].raw)
	}
	for _, s := range c.simOrder {
		if e, ok := c.placement(t, s.id); !ok || !e.Eligible {
			t.Errorf("%s's placement %+v (%v), want eligible", s.id, e, ok)
		}
	}
	metrics := r.url + "/metrics"
	if n := testkit.ScrapedSum(t, probeClient, metrics, "narwhal_router_resource_errors_total", "kind", "emfile"); n < tries {
		t.Errorf("narwhal_router_resource_errors_total{kind=emfile} = %v after %d refused completions", n, tries)
	}
	if n := testkit.ScrapedSum(t, probeClient, metrics, "narwhal_engine_faults_total"); n != 0 {
		t.Errorf("narwhal_engine_faults_total = %v: the router's own faults were counted against engines", n)
	}
}
