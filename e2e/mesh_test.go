package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
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

// eventBus starts an embedded bus in the test process on a free port of
// 127.0.0.1 and connects to it as name, recording every event from the
// first; all of it stops when the test ends. It returns the bus's URL for
// the processes.
func eventBus(t *testing.T, name string) (natsURL string, b *bus.Bus, events *bustest.Events) {
	t.Helper()
	emb := bustest.Start(t)
	b = bustest.Connect(t, emb, bus.ConnectOptions{Name: name})
	return emb.ClientURL(), b, bustest.Record(t, b, "", true)
}

// storedCount returns how many events stream NARWHAL_EVENTS holds now.
func storedCount(t *testing.T, b *bus.Bus) int {
	t.Helper()
	ctx := testContext(t, readyBound)
	stream, err := b.JetStream().Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return int(info.State.Msgs)
}

// allDelivered returns every event stream NARWHAL_EVENTS holds, once
// events, a subscription of every event from the first, has them all.
func allDelivered(t *testing.T, b *bus.Bus, events *bustest.Events) []bustest.Event {
	t.Helper()
	want := storedCount(t, b)
	testkit.WaitEvery(t, readyBound, pollInterval, fmt.Sprintf("%d events from the subscription", want), func() bool {
		return events.Len() >= want
	})
	return events.All()
}

// startSim starts `narwhal sim` on addr (HOST:PORT) as engine id of role
// serving meshModel, its KV side channel on a free port, with args
// added; it is stopped when the test ends.
func startSim(t *testing.T, id, role, addr string, args ...string) *simProc {
	t.Helper()
	s := &simProc{id: id, role: role, url: "http://" + addr}
	s.p = startProcess(t, "sim "+id, nil, append([]string{"sim", "--role", role, "--listen", addr, "--engine-id", id,
		"--model", meshModel, "--kv-listen", "127.0.0.1:0"}, args...)...)
	return s
}

// meshConfig writes the router config of the mesh tests — 5 s engine
// bounds, a 20 s request bound, sims as a nixl fleet — and returns its
// path.
func meshConfig(t *testing.T, sims []*simProc) string {
	t.Helper()
	var cfg strings.Builder
	cfg.WriteString(`engine:
  first_token_timeout_s: 5
  decode_read_timeout_s: 5
  prefill_timeout_s: 5
request:
  timeout_s: 20
fleet:
`)
	for _, s := range sims {
		fmt.Fprintf(&cfg, "  - id: %s\n    url: %s\n    role: %s\n    connector: nixl\n", s.id, s.url, s.role)
	}
	return writeConfig(t, cfg.String())
}

// await waits until s answers /health and has printed its listening
// line, takes its KV address from the line and returns the URL the line
// names.
func (s *simProc) await(t *testing.T) string {
	t.Helper()
	waitHTTP(t, s.p, s.url+"/health")
	testkit.WaitEvery(t, readyBound, pollInterval, s.id+"'s listening line", func() bool { return kvLine.MatchString(s.p.stdout.String()) })
	match := kvLine.FindStringSubmatch(s.p.stdout.String())
	s.kvAddr = match[2]
	return match[1]
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
	events    *bustest.Events
}

// startMesh starts the mesh and waits until every process answers: the
// simulators' /health and the router's /readyz. Everything is stopped
// when the test ends, the router first.
func startMesh(t *testing.T) *mesh {
	t.Helper()
	m := &mesh{byID: map[string]*simProc{}}
	var natsURL string
	natsURL, m.bus, m.events = eventBus(t, "narwhal-e2e")

	ports := freePorts(t, 5)
	for i, d := range []struct{ id, role string }{
		{"p1", sim.RolePrefill}, {"p2", sim.RolePrefill}, {"d1", sim.RoleDecode}, {"d2", sim.RoleDecode},
	} {
		s := startSim(t, d.id, d.role, hostPort(ports[i]))
		m.sims = append(m.sims, s)
		m.byID[d.id] = s
	}
	for _, s := range m.sims {
		if url := s.await(t); url != s.url {
			t.Fatalf("sim %s says it listens on %s, want %s", s.id, url, s.url)
		}
	}
	path := meshConfig(t, m.sims)
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
func (m *mesh) allEvents(t *testing.T) []bustest.Event {
	t.Helper()
	if err := m.router.stop(syscall.SIGTERM); err != nil {
		t.Errorf("router did not exit cleanly: %v", err)
	}
	return allDelivered(t, m.bus, m.events)
}
