//go:build linux

package router

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// resourcesChildEnv, when set, makes TestRouterResourcesChild run a router
// in this process; its value is the fleet, as "id=role=url,…".
const resourcesChildEnv = "NARWHAL_TEST_RESOURCES_CHILD"

// resourcesChildWindow is the child's unready window after its last
// router_resources fault (resourceWindow, 5 s, is proved by
// TestResourceWindowRFAIL9).
const resourcesChildWindow = 2 * time.Second

// roundTrip writes one HTTP/1.1 request on the kept-alive connection c and
// reads its answer.
func roundTrip(t *testing.T, c net.Conn, method, path, body string) (*http.Response, []byte) {
	t.Helper()
	req := method + " " + path + " HTTP/1.1\r\nHost: router\r\n"
	if body != "" {
		req += "Content-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n"
	}
	if _, err := io.WriteString(c, req+"\r\n"+body); err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	return readResponse(t, c, 10*time.Second)
}

// TestRouterResourcesRFAIL9 proves behaviour.md R-FAIL-9 with a real
// EMFILE: a router in a child process lowers its hard RLIMIT_NOFILE to a
// few descriptors above those it holds, and idle client connections take
// the rest. A completion on a connection kept alive from before then
// cannot dial its producer ("socket: too many open files"): it gets 503
// with Retry-After: 1 naming the router's resources, not 502 naming the
// engine; no failure event is published; no engine fault is counted;
// narwhal_router_resource_errors_total{kind="emfile"} is; /readyz says
// 503 naming the reason. Once the idle connections close, completions
// succeed again, and /readyz is 200 again only after the window passed
// without another such error.
func TestRouterResourcesRFAIL9(t *testing.T) {
	if os.Getenv(resourcesChildEnv) != "" {
		t.Skip("in the child")
	}
	s := newStack(t, pd(), nil) // the engines, in this process
	ch := startChild(t, "TestRouterResourcesChild", resourcesChildEnv+"="+fleetSpec(s.cfg))
	addr := ch.line(t, "LISTEN ")
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
	testkit.WaitFor(t, 10*time.Second, "the child ready", func() bool {
		resp, err := client.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})

	// The kept-alive connection, accepted while descriptors were left; no
	// completion ran yet, so no engine connection waits in a pool.
	kept, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer kept.Close()
	if resp, _ := roundTrip(t, kept, "GET", "/healthz", ""); resp.StatusCode != 200 {
		t.Fatalf("/healthz: %d", resp.StatusCode)
	}
	io.WriteString(ch.stdin, "LOWER\n")
	ch.line(t, "LOWERED ")
	var idle []net.Conn
	for i := 0; i < 40; i++ {
		c, err := net.Dial("tcp", addr) // the kernel queues what the child cannot accept
		if err != nil {
			t.Fatalf("idle connection %d: %v", i, err)
		}
		idle = append(idle, c)
	}
	testkit.WaitFor(t, 10*time.Second, "the child out of descriptors (an accept error logged)", func() bool {
		return strings.Contains(ch.stderr.String(), "accepting client connections failed")
	})

	var lastFailure time.Time
	for i := 0; i < 3; i++ {
		lastFailure = time.Now()
		resp, b := roundTrip(t, kept, "POST", schemas.EndpointChat, doorChat)
		if resp.StatusCode != 503 {
			t.Fatalf("completion %d while out of descriptors: %d %s, want 503", i, resp.StatusCode, b)
		}
		if ra := resp.Header.Get("Retry-After"); ra != "1" {
			t.Errorf("Retry-After %q, want 1", ra)
		}
		if e := errorObject(t, b); !strings.HasPrefix(e.Message, "router out of local resources (emfile") || !strings.Contains(e.Message, "too many open files") {
			t.Errorf("message %q, want the router's resources named", e.Message)
		}
	}
	resp, b := roundTrip(t, kept, "GET", "/readyz", "")
	if resp.StatusCode != 503 || !strings.Contains(string(b), "router out of local resources (emfile)") {
		t.Fatalf("/readyz while out of descriptors: %d %s, want 503 naming the router's resources", resp.StatusCode, b)
	}

	for _, c := range idle {
		c.Close()
	}
	testkit.WaitFor(t, 10*time.Second, "a completion served again", func() bool {
		// The router notes the fault after the request is sent: take the
		// time before, so that the window is measured from no later
		// than the router's own clock started it.
		sent := time.Now()
		resp, _ := roundTrip(t, kept, "POST", schemas.EndpointChat, doorChat)
		if resp.StatusCode == 503 {
			lastFailure = sent
		}
		return resp.StatusCode == 200
	})
	var readyAt time.Time
	testkit.WaitFor(t, resourcesChildWindow+5*time.Second, "/readyz 200 again", func() bool {
		resp, _ := roundTrip(t, kept, "GET", "/readyz", "")
		readyAt = time.Now()
		return resp.StatusCode == 200
	})
	if el := readyAt.Sub(lastFailure); el < resourcesChildWindow {
		t.Errorf("/readyz 200 %v after the last router_resources fault, want at least %v", el, resourcesChildWindow)
	}

	metrics := "http://" + addr + "/metrics"
	if n := testkit.ScrapedSum(t, client, metrics, "narwhal_router_resource_errors_total", "kind", "emfile"); n < 3 {
		t.Errorf("narwhal_router_resource_errors_total{kind=emfile} = %v after 3 refused legs", n)
	}
	if n := testkit.ScrapedSum(t, client, metrics, "narwhal_engine_faults_total"); n != 0 {
		t.Errorf("narwhal_engine_faults_total = %v: the router's own fault was counted against an engine", n)
	}
	if n := ch.count("EVENT " + schemas.SchemaFailure); n != 0 {
		t.Errorf("%d failure events published for the router's own faults", n)
	}
	if n := ch.count("EVENT " + schemas.SchemaQuarantine); n != 0 {
		t.Errorf("%d quarantine events published for the router's own faults", n)
	}
	if n := ch.count("EVENT "); n == 0 {
		t.Error("the child published no event at all: its publisher is not wired")
	}
}

// linePublisher writes every event's schema to stdout as "EVENT <schema>".
type linePublisher struct{ mu sync.Mutex }

func (p *linePublisher) Publish(ev schemas.Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(os.Stdout, "EVENT %s\n", ev.Head().Schema)
}

// TestRouterResourcesChild is the child of TestRouterResourcesRFAIL9: a
// router over the parent's engines (quarantine on, so a counted fault
// would show), its events on stdout; on "LOWER" it lowers its hard and
// soft RLIMIT_NOFILE to 6 above the descriptors open; it runs until stdin
// closes.
func TestRouterResourcesChild(t *testing.T) {
	spec := os.Getenv(resourcesChildEnv)
	if spec == "" {
		t.Skip("run by TestRouterResourcesRFAIL9")
	}
	cfg := childConfig(t, spec, func(c *config.Config) { c.Recovery.FailureQuarantineS = 1 })
	rt, err := New(Options{Config: cfg, Publisher: &linePublisher{}, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)),
		ShutdownGrace: time.Second, ModelRefresh: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	rt.resources.window = resourcesChildWindow
	addr, stop := serveChild(t, rt)
	os.Stdout.WriteString("LISTEN " + addr + "\n")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if sc.Text() == "LOWER" {
			limit := uint64(openFDs() + 6)
			if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: limit, Max: limit}); err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(os.Stdout, "LOWERED %d\n", limit)
		}
	}
	stop()
}

// limitChildEnv, when set, makes TestConnectionLimitChild build routers
// under a hard RLIMIT_NOFILE of 256.
const limitChildEnv = "NARWHAL_TEST_LIMIT_CHILD"

// TestMaxConnectionsRefusedAtStartRFAIL9 proves that the descriptors of
// engine legs are reserved at start (behaviour.md R-API-7, R-FAIL-9): in a
// child process whose hard RLIMIT_NOFILE is 256, New refuses a
// server.max_connections of 10,000 with the arithmetic in its error,
// derives 64 ((256 − 64) ÷ 3) when it is unset, and takes 64 when set.
func TestMaxConnectionsRefusedAtStartRFAIL9(t *testing.T) {
	if os.Getenv(limitChildEnv) != "" {
		t.Skip("in the child")
	}
	ch := startChild(t, "TestConnectionLimitChild", limitChildEnv+"=1")
	want := "router: config: server.max_connections 10000 leaves no descriptors for engine legs: limit 256 − room 64 (listeners, bus, files, engine control connections) = 192, 3 per client connection (itself, its prefill leg, its decode leg): at most 64"
	if got := ch.line(t, "SET 10000: "); !strings.HasPrefix(got, want) {
		t.Errorf("max_connections 10000 under a limit of 256: %q, want %q…", got, want)
	}
	if got := ch.line(t, "SET 0: "); got != "ok 64" {
		t.Errorf("max_connections unset under a limit of 256: %q, want ok 64", got)
	}
	if got := ch.line(t, "SET 64: "); got != "ok 64" {
		t.Errorf("max_connections 64 under a limit of 256: %q, want ok 64", got)
	}
	if got := ch.line(t, "SET 65: "); !strings.Contains(got, "server.max_connections 65 leaves no descriptors") {
		t.Errorf("max_connections 65 under a limit of 256: %q, want refused", got)
	}
}

// TestConnectionLimitChild is the child of
// TestMaxConnectionsRefusedAtStartRFAIL9: it lowers its hard and soft
// RLIMIT_NOFILE to 256 and prints, for each server.max_connections, what
// New made of it.
func TestConnectionLimitChild(t *testing.T) {
	if os.Getenv(limitChildEnv) == "" {
		t.Skip("run by TestMaxConnectionsRefusedAtStartRFAIL9")
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: 256, Max: 256}); err != nil {
		t.Fatal(err)
	}
	for _, set := range []int{10000, 0, 64, 65} {
		cfg := config.Default()
		cfg.Router.ID = "rt-limit"
		cfg.Server.MaxConnections = set
		cfg.Fleet = []config.EngineSpec{{ID: "p1", Role: connector.RolePrefill, URL: "http://127.0.0.1:9", Connector: "nixl"},
			{ID: "d1", Role: connector.RoleDecode, URL: "http://127.0.0.1:9", Connector: "nixl"}}
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		rt, err := New(Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), ShutdownGrace: time.Second})
		if err != nil {
			fmt.Fprintf(os.Stdout, "SET %d: %v\n", set, err)
			continue
		}
		fmt.Fprintf(os.Stdout, "SET %d: ok %d\n", set, rt.MaxConnections())
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = rt.Shutdown(ctx)
		cancel()
	}
}
