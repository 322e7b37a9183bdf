package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// meshModel is the model every simulator of the mesh serves.
const meshModel = "e2e-model"

// meshRouterID is the router's id (NARWHAL_ROUTER_ID): its request events
// are on narwhal.events.request.e2e-router.
const meshRouterID = "e2e-router"

// simProc is one `narwhal sim` process of the mesh.
type simProc struct {
	id, role string
	url      string // API base URL, http://127.0.0.1:port
	kvAddr   string // KV side channel host:port, advertised in descriptors
	p        *process
}

// kvLine is the sim's listening line on stdout: "sim ID (ROLE) listening
// on URL kv=HOST:PORT".
var kvLine = regexp.MustCompile(`listening on (\S+) kv=(\S+)`)

// getJSON decodes GET url into v.
func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := probeClient.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: HTTP %d %s", url, resp.StatusCode, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s: %v: %s", url, err, body)
	}
}

// requests returns what the simulator recorded (GET /sim/requests).
func (s *simProc) requests(t *testing.T) []sim.RecordedRequest {
	t.Helper()
	var out []sim.RecordedRequest
	getJSON(t, s.url+"/sim/requests", &out)
	return out
}

// stats returns the simulator's counters (GET /sim/stats).
func (s *simProc) stats(t *testing.T) sim.Stats {
	t.Helper()
	var st sim.Stats
	getJSON(t, s.url+"/sim/stats", &st)
	return st
}

// busEvent is one message read from stream NARWHAL_EVENTS.
type busEvent struct {
	subject string
	payload []byte
}

// eventLog collects the events of a bus subscription.
type eventLog struct {
	mu  sync.Mutex
	all []busEvent
}

func (l *eventLog) add(subject string, payload []byte) {
	l.mu.Lock()
	l.all = append(l.all, busEvent{subject, append([]byte(nil), payload...)})
	l.mu.Unlock()
}

func (l *eventLog) snapshot() []busEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]busEvent(nil), l.all...)
}

// mesh is the multi-process deployment of the end-to-end tests: an
// embedded NATS server in the test process, two prefill and two decode
// simulators and one router joined to that NATS, each its own process.
type mesh struct {
	routerURL string
	router    *process
	sims      []*simProc // p1, p2, d1, d2
	byID      map[string]*simProc
	bus       *bus.Bus
	events    *eventLog
}

// startMesh starts the mesh and waits until every process answers: the
// simulators' /health and the router's /readyz. Everything is stopped
// when the test ends, the router first.
func startMesh(t *testing.T) *mesh {
	t.Helper()
	m := &mesh{byID: map[string]*simProc{}, events: &eventLog{}}

	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: t.TempDir(), Host: "127.0.0.1", Port: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	natsURL := emb.ClientURL()
	m.bus, err = bus.Connect(testContext(t, readyBound), bus.ConnectOptions{URL: natsURL, Name: "narwhal-e2e"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.bus.Close)
	stopSub, err := bus.Subscribe(context.Background(), m.bus, bus.SubjectPrefix+">", true, m.events.add)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopSub)

	ports := freePorts(t, 5)
	for i, d := range []struct{ id, role string }{
		{"p1", sim.RolePrefill}, {"p2", sim.RolePrefill}, {"d1", sim.RoleDecode}, {"d2", sim.RoleDecode},
	} {
		s := &simProc{id: d.id, role: d.role, url: "http://" + hostPort(ports[i])}
		s.p = startProcess(t, "sim "+d.id, nil, "sim",
			"--role", d.role, "--listen", hostPort(ports[i]), "--engine-id", d.id,
			"--model", meshModel, "--kv-listen", "127.0.0.1:0")
		m.sims = append(m.sims, s)
		m.byID[d.id] = s
	}
	for _, s := range m.sims {
		waitHTTP(t, s.p, s.url+"/health")
		testkit.WaitEvery(t, readyBound, pollInterval, s.id+"'s listening line", func() bool { return kvLine.MatchString(s.p.stdout.String()) })
		match := kvLine.FindStringSubmatch(s.p.stdout.String())
		if match[1] != s.url {
			t.Fatalf("sim %s says it listens on %s, want %s", s.id, match[1], s.url)
		}
		s.kvAddr = match[2]
	}

	var cfg strings.Builder
	cfg.WriteString(`engine:
  first_token_timeout_s: 5
  decode_read_timeout_s: 5
  prefill_timeout_s: 5
request:
  timeout_s: 20
fleet:
`)
	for _, s := range m.sims {
		fmt.Fprintf(&cfg, "  - id: %s\n    url: %s\n    role: %s\n    connector: nixl\n", s.id, s.url, s.role)
	}
	path := filepath.Join(t.TempDir(), "narwhal.yaml")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	m.routerURL = "http://" + hostPort(ports[4])
	m.router = startProcess(t, "router",
		[]string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_ROUTER_ID=" + meshRouterID},
		"router", "--config", path, "--listen", hostPort(ports[4]))
	waitHTTP(t, m.router, m.routerURL+"/readyz")
	return m
}

// allEvents stops the router — which flushes its publisher — and returns
// every event stream NARWHAL_EVENTS holds, once the subscription has
// delivered them all.
func (m *mesh) allEvents(t *testing.T) []busEvent {
	t.Helper()
	if err := m.router.stop(syscall.SIGTERM); err != nil {
		t.Errorf("router did not exit cleanly: %v", err)
	}
	ctx := testContext(t, readyBound)
	stream, err := m.bus.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := int(info.State.Msgs)
	testkit.WaitEvery(t, readyBound, pollInterval, fmt.Sprintf("%d events from the subscription", want), func() bool {
		return len(m.events.snapshot()) >= want
	})
	return m.events.snapshot()
}
