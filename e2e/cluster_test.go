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
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// The cluster of the mesh tests (behaviour.md §8, §9): `narwhal bus`, three
// `narwhal router` processes r1, r2, r3, two `narwhal breaker` processes and
// four `narwhal sim` engines p1, p2 (prefill) and d1, d2 (decode), every one
// its own process, all reading the same YAML file. clusterOptions may ask
// for fewer routers or breakers, and for a `narwhal chaos proxy` in front
// of chosen engines (the chaos tests). The test process joins
// the bus too, to read the events, the placement bucket and the lease.

// Settings of the cluster's routers and breakers, given as environment
// overrides of the YAML file (behaviour.md §11).
const (
	// readmitInterval is recovery.readmit_interval_s.
	readmitInterval = 300 * time.Millisecond
	// leaseTTL is breaker.lease_ttl_s.
	leaseTTL = time.Second
	// ejectAfter is recovery.eject_after.
	ejectAfter = 3
)

// clusterEnv are those overrides.
var clusterEnv = []string{
	"NARWHAL_RECOVERY_READMIT_INTERVAL_S=0.3",
	"NARWHAL_BREAKER_LEASE_TTL_S=1",
	"NARWHAL_RECOVERY_EJECT_AFTER=3",
}

// Bounds of the cluster tests.
const (
	// placementBound is how soon every router must apply an eligibility
	// change of the breaker (R-BRK-8).
	placementBound = time.Second
	// handoverMargin is what a standby may take beyond the lease TTL to lead:
	// one campaign period (a third of the TTL) plus 500 ms of expiry and
	// scheduling slack.
	handoverMargin = leaseTTL/3 + 500*time.Millisecond
	// decisionBound bounds a wait for a breaker decision that takes a few
	// readmission rounds (with probe backoff up to 8 × readmitInterval).
	decisionBound = 10 * time.Second
	// maxDriven bounds the requests one drive sends.
	maxDriven = 300
)

// clusterModel is the model every engine of the cluster serves.
const clusterModel = meshModel

// clusterContract is the engine_contract of the clusters that pin one
// (R-BRK-6): the simulator says it is vLLM 0.11.0 (sim.DefaultEngineVersion).
const clusterContract = `engine_contract:
  model: ` + clusterModel + `
  engine: vllm
  version: ">=0.10"
  connector: nixl
`

// clusterOptions shapes a cluster.
type clusterOptions struct {
	// contract adds clusterContract to the YAML file.
	contract bool
	// routerEnv is added to the routers' environment.
	routerEnv []string
	// breakerEnv is added to the breakers' environment (it overrides
	// clusterEnv).
	breakerEnv []string
	// enginesOnly starts the simulators and writes the YAML file, nothing
	// else (no bus, routers or breakers).
	enginesOnly bool
	// routers is the number of routers, r1, r2, …; 0 means 3 (at most 3).
	routers int
	// breakers is the number of breakers started; 0 means 2.
	breakers int
	// chaos names the engines that get a `narwhal chaos proxy` in front of
	// them (R-CHAOS-1): the proxy's --engine-id is the engine's id, and the
	// fleet's URL of the engine is the proxy's. It needs the bus (not with
	// enginesOnly).
	chaos []string
	// simArgs are added to every simulator's command line, e.g. --itl.
	simArgs []string
	// auth runs the mesh with least privilege (R-BUS-8): `narwhal bus
	// creds` writes the credentials, `narwhal bus --auth` enforces them,
	// and every process connects with its role's (the test with admin's).
	auth bool
}

// chaosFront is a `narwhal chaos proxy` process in front of one simulator.
type chaosFront struct {
	id  string // the engine id, the proxy's --engine-id
	url string // the proxy's base URL: the fleet's URL of the engine
	p   *process
}

// routerProc is one `narwhal router` of the cluster.
type routerProc struct {
	id   string // NARWHAL_ROUTER_ID
	addr string // HOST:PORT
	url  string // http://HOST:PORT
	env  []string
	p    *process
}

// readyzStatus returns the HTTP status of r's /readyz; a request that
// fails fails the test.
func (r *routerProc) readyzStatus(t *testing.T) int {
	t.Helper()
	resp, err := probeClient.Get(r.url + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// cluster is the running deployment; startCluster builds it.
type cluster struct {
	dir        string
	cfgPath    string
	busAddr    string
	busData    string
	natsURL    string
	busProc    *process
	sims       map[string]*simProc // p1, p2, d1, d2
	simOrder   []*simProc
	routers    []*routerProc // r1, r2, r3
	breakers   []*process
	breakerEnv []string
	simArgs    []string               // added to every simulator's command line
	credsDir   string                 // the credentials of `narwhal bus creds`; "" without auth
	fronts     map[string]*chaosFront // chaos proxies by engine id
	extra      []*process             // other processes of a test, stopped with the mesh

	conn    *bus.Bus        // the test's own connection
	events  *bustest.Events // every event on the bus since the cluster started
	stopSub func()

	transport *http.Transport
	client    *http.Client
	sent      atomic.Int64 // client request counter, for X-Request-Id
}

// busLine is `narwhal bus`'s listening line.
var busLine = regexp.MustCompile(`bus listening on (nats://\S+)`)

// startCluster starts the cluster and waits until every process is ready:
// the bus's listening line, the simulators' /health, the routers' /readyz,
// and a leading breaker that has written every engine's placement entry.
// Everything is stopped when the test ends — breakers and routers first
// (so that their last events reach the bus), then every event the stream
// holds is validated against its JSON Schema (R-BUS-3), then the engines
// and the bus.
func startCluster(t *testing.T, opts clusterOptions) *cluster {
	t.Helper()
	c := &cluster{dir: t.TempDir(), sims: map[string]*simProc{}, events: &bustest.Events{}, breakerEnv: opts.breakerEnv,
		simArgs: opts.simArgs, fronts: map[string]*chaosFront{}}
	nRouters, nBreakers := opts.routers, opts.breakers
	if nRouters == 0 {
		nRouters = 3
	}
	if nBreakers == 0 {
		nBreakers = 2
	}
	if nRouters > 3 {
		t.Fatalf("a cluster has at most 3 routers, not %d", nRouters)
	}
	c.transport = &http.Transport{MaxIdleConnsPerHost: 16}
	c.client = &http.Client{Transport: c.transport, Timeout: requestBound}
	t.Cleanup(func() { c.teardown(t) })

	ports := freePorts(t, 8)
	if opts.auth && !opts.enginesOnly {
		c.credsDir = filepath.Join(c.dir, "creds")
		if out, code := runNarwhal(t, "bus", "creds", "--out", c.credsDir); code != 0 {
			t.Fatalf("narwhal bus creds: exit %d\n%s", code, out)
		}
	}
	if !opts.enginesOnly {
		c.busAddr = hostPort(ports[0])
		c.busData = filepath.Join(c.dir, "bus")
		c.startBus(t)
	}

	for i, d := range []struct{ id, role string }{
		{"p1", sim.RolePrefill}, {"p2", sim.RolePrefill}, {"d1", sim.RoleDecode}, {"d2", sim.RoleDecode},
	} {
		s := &simProc{id: d.id, role: d.role, url: "http://" + hostPort(ports[1+i])}
		c.sims[d.id] = s
		c.simOrder = append(c.simOrder, s)
		c.spawnSim(t, s)
	}
	for _, s := range c.simOrder {
		c.waitSim(t, s)
	}
	if len(opts.chaos) > 0 && !opts.enginesOnly {
		c.startFronts(t, opts.chaos)
	}

	var cfg strings.Builder
	cfg.WriteString(`engine:
  first_token_timeout_s: 2
  decode_read_timeout_s: 2
  prefill_timeout_s: 2
request:
  timeout_s: 10
`)
	if opts.contract {
		cfg.WriteString(clusterContract)
	}
	cfg.WriteString("fleet:\n")
	for _, s := range c.simOrder {
		url := s.url
		if f, ok := c.fronts[s.id]; ok {
			url = f.url
		}
		fmt.Fprintf(&cfg, "  - id: %s\n    url: %s\n    role: %s\n    connector: nixl\n", s.id, url, s.role)
	}
	c.cfgPath = filepath.Join(c.dir, "narwhal.yaml")
	if err := os.WriteFile(c.cfgPath, []byte(cfg.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if opts.enginesOnly {
		return c
	}

	var err error
	c.conn, err = bus.Connect(testContext(t, readyBound), bus.ConnectOptions{URL: c.natsURL, Name: "narwhal-e2e-cluster",
		CredsFile: c.credsPath(bus.RoleAdmin)})
	if err != nil {
		t.Fatal(err)
	}
	c.stopSub, err = bus.Subscribe(context.Background(), c.conn, bus.SubjectPrefix+">", true, c.events.Add)
	if err != nil {
		t.Fatal(err)
	}

	for i := range nRouters {
		r := &routerProc{id: fmt.Sprintf("r%d", i+1), addr: hostPort(ports[5+i])}
		r.url = "http://" + r.addr
		r.env = append(append(append([]string{"NARWHAL_NATS_URL=" + c.natsURL, "NARWHAL_ROUTER_ID=" + r.id}, clusterEnv...),
			c.identityEnv(t, bus.RoleRouter, r.id)...), opts.routerEnv...)
		c.routers = append(c.routers, r)
		c.spawnRouter(t, r)
	}
	c.awaitRouters(t, nBreakers)
	return c
}

// awaitRouters waits for every router's /readyz, then starts breakers
// breakers and waits for a leading one that has written every engine's
// placement entry.
func (c *cluster) awaitRouters(t *testing.T, breakers int) {
	t.Helper()
	for _, r := range c.routers {
		waitHTTP(t, r.p, r.url+"/readyz")
	}
	for range breakers {
		c.startBreaker(t)
	}
	testkit.WaitEvery(t, readyBound, pollInterval, "a leading breaker and a placement entry for every engine", func() bool {
		if c.leader(t) == "" {
			return false
		}
		for _, s := range c.simOrder {
			if _, ok := c.placement(t, s.id); !ok {
				return false
			}
		}
		return true
	})
}

// startBus starts `narwhal bus` on the cluster's address and data dir and
// waits for its listening line. It gets the cluster's settings too: as the
// bus's admin it makes the lease bucket with breaker.lease_ttl_s (R-BUS-8).
func (c *cluster) startBus(t *testing.T) {
	t.Helper()
	args := []string{"bus", "--listen", c.busAddr, "--data", c.busData}
	if c.credsDir != "" {
		args = append(args, "--auth", c.credsDir)
	}
	c.busProc = spawn(t, "bus", clusterEnv, args...)
	testkit.WaitEvery(t, readyBound, pollInterval, "the bus's listening line", func() bool {
		if c.busProc.exited() {
			c.busProc.dump(t)
			t.Fatalf("narwhal bus exited: %v", c.busProc.waitErr)
		}
		return busLine.MatchString(c.busProc.stdout.String())
	})
	url := busLine.FindStringSubmatch(c.busProc.stdout.String())[1]
	if c.natsURL != "" && url != c.natsURL {
		t.Fatalf("the bus came back on %s, not %s", url, c.natsURL)
	}
	c.natsURL = url
}

// spawnSim starts s's `narwhal sim` process on s's port with the
// cluster's simArgs and args added.
func (c *cluster) spawnSim(t *testing.T, s *simProc, args ...string) {
	t.Helper()
	base := []string{"sim", "--role", s.role, "--listen", strings.TrimPrefix(s.url, "http://"),
		"--engine-id", s.id, "--model", clusterModel, "--kv-listen", "127.0.0.1:0"}
	args = append(append(base, c.simArgs...), args...)
	s.p = spawn(t, "sim "+s.id, nil, args...)
}

// waitSim waits for s's /health and its listening line.
func (c *cluster) waitSim(t *testing.T, s *simProc) {
	t.Helper()
	s.await(t)
}

// restartSim stops s (SIGTERM) and starts it again on the same port with
// args added, e.g. another --engine-version: the engine "came back".
func (c *cluster) restartSim(t *testing.T, s *simProc, args ...string) {
	t.Helper()
	s.p.halt(t)
	c.spawnSim(t, s, args...)
	c.waitSim(t, s)
}

// frontLine is a chaos proxy's listening line.
var frontLine = regexp.MustCompile(`chaos proxy (\S+) listening on (http://\S+) -> `)

// startFronts starts a `narwhal chaos proxy` on a free port in front of
// each named simulator, joined to the cluster's bus, and waits until each
// prints its listening line and passes the simulator's /health through.
// The proxies are stopped with the routers (they are extra processes).
func (c *cluster) startFronts(t *testing.T, ids []string) {
	t.Helper()
	for _, id := range ids {
		s, ok := c.sims[id]
		if !ok {
			t.Fatalf("no simulator %s to put a chaos proxy in front of", id)
		}
		f := &chaosFront{id: id}
		f.p = spawn(t, "chaos proxy "+id, append([]string{"NARWHAL_NATS_URL=" + c.natsURL}, c.credsEnv(bus.RoleChaos)...),
			"chaos", "proxy", "--target", s.url, "--listen", "127.0.0.1:0", "--engine-id", id)
		c.extra = append(c.extra, f.p)
		c.fronts[id] = f
	}
	for _, id := range ids {
		f := c.fronts[id]
		testkit.WaitEvery(t, readyBound, pollInterval, "chaos proxy "+id+"'s listening line", func() bool {
			if f.p.exited() {
				f.p.dump(t)
				t.Fatalf("chaos proxy %s exited: %v", id, f.p.waitErr)
			}
			m := frontLine.FindStringSubmatch(f.p.stdout.String())
			if m == nil {
				return false
			}
			if m[1] != id {
				t.Fatalf("chaos proxy for %s says it is %s", id, m[1])
			}
			f.url = m[2]
			return true
		})
		waitHTTP(t, f.p, f.url+"/health")
	}
}

// spawnRouter starts r's `narwhal router` process.
func (c *cluster) spawnRouter(t *testing.T, r *routerProc) {
	t.Helper()
	r.p = spawn(t, "router "+r.id, r.env, "router", "--config", c.cfgPath, "--listen", r.addr)
}

// startBreaker starts one more `narwhal breaker`.
func (c *cluster) startBreaker(t *testing.T) *process {
	t.Helper()
	p := spawn(t, fmt.Sprintf("breaker %d", len(c.breakers)+1),
		append(append(append([]string{"NARWHAL_NATS_URL=" + c.natsURL}, clusterEnv...), c.credsEnv(bus.RoleBreaker)...), c.breakerEnv...),
		"breaker", "--config", c.cfgPath)
	c.breakers = append(c.breakers, p)
	return p
}

// credsPath returns the path of role's credential, or "" without auth.
func (c *cluster) credsPath(role string) string {
	if c.credsDir == "" {
		return ""
	}
	return filepath.Join(c.credsDir, bus.CredsFile(role))
}

// credsEnv returns the NARWHAL_NATS_CREDS setting of role, or nothing
// without auth.
func (c *cluster) credsEnv(role string) []string {
	if c.credsDir == "" {
		return nil
	}
	return []string{"NARWHAL_NATS_CREDS=" + c.credsPath(role)}
}

// identityPath returns the path of engine or router id's own credential
// (kind bus.RoleEngine or bus.RoleRouter, R-BUS-11), issuing it from the
// mesh's keys when it is not there yet, or "" without auth.
func (c *cluster) identityPath(t *testing.T, kind, id string) string {
	t.Helper()
	if c.credsDir == "" {
		return ""
	}
	path := filepath.Join(c.credsDir, bus.IdentityCredsFile(kind, id))
	if _, err := os.Stat(path); err == nil {
		return path
	}
	if _, err := bus.IssueIdentity(c.credsDir, kind, id); err != nil {
		t.Fatal(err)
	}
	return path
}

// identityEnv returns the NARWHAL_NATS_CREDS setting of engine or router
// id's own credential (identityPath), or nothing without auth.
func (c *cluster) identityEnv(t *testing.T, kind, id string) []string {
	t.Helper()
	if c.credsDir == "" {
		return nil
	}
	return []string{"NARWHAL_NATS_CREDS=" + c.identityPath(t, kind, id)}
}

// teardown stops everything (see startCluster).
func (c *cluster) teardown(t *testing.T) {
	// The rest runs even when the event check below ends the cleanup.
	defer func() {
		if c.stopSub != nil {
			c.stopSub()
		}
		if c.conn != nil {
			c.conn.Close()
		}
		var sims []*process
		for _, s := range c.simOrder {
			if s.p != nil {
				sims = append(sims, s.p)
			}
		}
		haltAll(t, sims...)
		haltAll(t, c.busProc)
		c.transport.CloseIdleConnections()
		probeClient.CloseIdleConnections()
	}()
	haltAll(t, c.breakers...)
	var routers []*process
	for _, r := range c.routers {
		routers = append(routers, r.p)
	}
	haltAll(t, routers...)
	haltAll(t, c.extra...)
	if c.conn != nil && c.busProc != nil && !c.busProc.exited() && !t.Failed() {
		for _, e := range c.storedEvents(t) {
			if err := bus.ValidateEvent(e.Payload); err != nil {
				t.Errorf("event on %s does not validate (R-BUS-3): %v\n%s", e.Subject, err, e.Payload)
			}
		}
	}
}

// haltAll halts every process at once and waits for all of them.
func haltAll(t *testing.T, ps ...*process) {
	var wg sync.WaitGroup
	for _, p := range ps {
		if p != nil {
			wg.Go(func() { p.halt(t) })
		}
	}
	wg.Wait()
}

// storedEvents returns every event stream NARWHAL_EVENTS holds now, read
// with a subscription of its own, in stream order.
func (c *cluster) storedEvents(t *testing.T) []bustest.Event {
	t.Helper()
	want := storedCount(t, c.conn)
	log := &bustest.Events{}
	stop, err := bus.Subscribe(testContext(t, readyBound), c.conn, bus.SubjectPrefix+">", true, log.Add)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	testkit.WaitEvery(t, readyBound, pollInterval, fmt.Sprintf("%d stored events", want), func() bool { return log.Len() >= want })
	return log.All()
}

// ---- engines

// arm arms faults (a sim.Fault JSON object or array) on s at run time.
func (c *cluster) arm(t *testing.T, s *simProc, faults string) {
	t.Helper()
	resp, err := probeClient.Post(s.url+"/sim/faults", "application/json", strings.NewReader(faults))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("arm %s on %s: HTTP %d %s", faults, s.id, resp.StatusCode, body)
	}
}

// disarm clears every fault of s.
func (c *cluster) disarm(t *testing.T, s *simProc) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodDelete, s.url+"/sim/faults", nil)
	resp, err := probeClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("disarm %s: HTTP %d", s.id, resp.StatusCode)
	}
}

// routed returns the requests s received from routers: everything it
// recorded except the breaker's probes (X-Request-Id with
// kvprobe.RequestIDPrefix).
func routed(t *testing.T, s *simProc) []sim.RecordedRequest {
	t.Helper()
	var out []sim.RecordedRequest
	for _, r := range s.requests(t) {
		if !strings.HasPrefix(r.RequestID, kvprobe.RequestIDPrefix) {
			out = append(out, r)
		}
	}
	return out
}

// firstRouted and firstProbe are the positions in s's recorded requests
// of its first routed request and of its first probe request, -1 when
// there is none.
func firstRouted(t *testing.T, s *simProc) int {
	t.Helper()
	return slices.IndexFunc(s.requests(t), func(r sim.RecordedRequest) bool {
		return !strings.HasPrefix(r.RequestID, kvprobe.RequestIDPrefix)
	})
}

func firstProbe(t *testing.T, s *simProc) int {
	t.Helper()
	return slices.IndexFunc(s.requests(t), func(r sim.RecordedRequest) bool {
		return strings.HasPrefix(r.RequestID, kvprobe.RequestIDPrefix)
	})
}

// probed returns the probe requests s received, by phase.
func probed(t *testing.T, s *simProc, phase string) []sim.RecordedRequest {
	t.Helper()
	var out []sim.RecordedRequest
	for _, r := range s.requests(t) {
		if strings.HasPrefix(r.RequestID, kvprobe.RequestIDPrefix) && r.Phase == phase {
			out = append(out, r)
		}
	}
	return out
}

// ---- client requests

// reply is what a client got from a router.
type reply struct {
	id         string // the X-Request-Id sent
	router     string
	status     int
	body       string
	retryAfter string
	decode     string // X-Narwhal-Decode-Engine
}

// send posts one small non-streaming completion to r (R-API-1).
func (c *cluster) send(ctx context.Context, r *routerProc) (reply, error) {
	body := fmt.Sprintf(`{"model":%q,"prompt":"the mesh keeps serving","max_tokens":3}`, clusterModel)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	id := fmt.Sprintf("e2e-cluster-%d", c.sent.Add(1))
	req.Header.Set("X-Request-Id", id)
	resp, err := c.client.Do(req)
	if err != nil {
		return reply{}, fmt.Errorf("POST %s/v1/completions: %w", r.url, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, fmt.Errorf("POST %s/v1/completions: %w", r.url, err)
	}
	return reply{id: id, router: r.id, status: resp.StatusCode, body: string(raw), retryAfter: resp.Header.Get("Retry-After"),
		decode: resp.Header.Get("X-Narwhal-Decode-Engine")}, nil
}

// mustSend is send that fails the test on a transport error.
func (c *cluster) mustSend(t *testing.T, r *routerProc) reply {
	t.Helper()
	rep, err := c.send(testContext(t, requestBound), r)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// drive sends requests to r1, r2, r3 in turn, one at a time, until done
// returns true for a reply. Every reply's status must be one of allowed.
// It fails the test after maxDriven requests.
func (c *cluster) drive(t *testing.T, allowed []int, done func(reply) bool) {
	t.Helper()
	for i := range maxDriven {
		rep := c.mustSend(t, c.routers[i%len(c.routers)])
		ok := false
		for _, s := range allowed {
			ok = ok || rep.status == s
		}
		if !ok {
			t.Fatalf("router %s answered HTTP %d %s, want one of %v", rep.router, rep.status, rep.body, allowed)
		}
		if done(rep) {
			return
		}
	}
	t.Fatalf("no end after %d requests", maxDriven)
}

// failTimes drives requests until n of them failed with HTTP 502 (the
// engine faults armed by the test); 200 and the statuses in also are
// allowed on the way.
func (c *cluster) failTimes(t *testing.T, n int, also ...int) {
	t.Helper()
	failed := 0
	c.drive(t, append([]int{200, 502}, also...), func(r reply) bool {
		if r.status == 502 {
			failed++
		}
		return failed == n
	})
}

// ---- router state

// available reads narwhal_engine_available{engine="id"} from r's /metrics:
// 1 when r may place on the engine (eligible and not quarantined).
func available(r *routerProc, id string) (bool, error) {
	mfs, err := testkit.Scrape(probeClient, r.url+"/metrics")
	if err != nil {
		return false, err
	}
	v, found := testkit.Sum(mfs, "narwhal_engine_available", "engine", id)
	if !found {
		return false, fmt.Errorf("router %s: no narwhal_engine_available{engine=%q} in /metrics", r.id, id)
	}
	return v == 1, nil
}

// availabilityWatch polls every router's /metrics from its start and
// records, per router, the first time the engine's availability was want.
type availabilityWatch struct {
	seen []time.Time // per router; zero when not seen
	errs []error
	wg   sync.WaitGroup
}

// watchAvailability starts the watch: one goroutine per router, each
// polling every pollInterval for at most bound.
func (c *cluster) watchAvailability(id string, want bool, bound time.Duration) *availabilityWatch {
	w := &availabilityWatch{seen: make([]time.Time, len(c.routers)), errs: make([]error, len(c.routers))}
	for i, r := range c.routers {
		w.wg.Go(func() {
			var err error
			if !testkit.Poll(bound, pollInterval, func() bool {
				var got bool
				got, err = available(r, id)
				if err != nil || got != want {
					return false
				}
				w.seen[i] = time.Now()
				return true
			}) {
				w.errs[i] = fmt.Errorf("router %s: %s's availability not %v within %v (last error: %v)", r.id, id, want, bound, err)
			}
		})
	}
	return w
}

// wait waits for every router and returns the times seen; the test fails
// when a router did not get there.
func (w *availabilityWatch) wait(t *testing.T) []time.Time {
	t.Helper()
	w.wg.Wait()
	for _, err := range w.errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	return w.seen
}

// waitAvailable waits until every router's availability of id is want.
func (c *cluster) waitAvailable(t *testing.T, id string, want bool, bound time.Duration) {
	t.Helper()
	c.watchAvailability(id, want, bound).wait(t)
}

// ---- bus state

// placement reads engine id's entry of narwhal_placement (R-BUS-2).
func (c *cluster) placement(t *testing.T, id string) (schemas.Eligibility, bool) {
	t.Helper()
	ctx := testContext(t, readyBound)
	var e schemas.Eligibility
	kve, err := c.conn.Placement().Get(ctx, id)
	if err != nil {
		return e, false
	}
	if err := json.Unmarshal(kve.Value(), &e); err != nil {
		t.Fatalf("placement entry %s: %v: %s", id, err, kve.Value())
	}
	return e, true
}

// leader returns the breaker_id of the lease holder (key leader of bucket
// narwhal_breaker), or "" when nobody holds it.
func (c *cluster) leader(t *testing.T) string {
	t.Helper()
	ctx := testContext(t, readyBound)
	kv, err := c.conn.JetStream().KeyValue(ctx, breaker.LeaseBucket)
	if err != nil {
		return ""
	}
	kve, err := kv.Get(ctx, breaker.LeaseKey)
	if err != nil {
		return ""
	}
	var l breaker.Lease
	if err := json.Unmarshal(kve.Value(), &l); err != nil {
		t.Fatalf("lease %s: %v", kve.Value(), err)
	}
	return l.BreakerID
}

// breakerOf returns the breaker process whose breaker_id ("breaker-<host>-
// <pid>") is id, or nil.
func (c *cluster) breakerOf(id string) *process {
	for _, p := range c.breakers {
		if id != "" && strings.HasSuffix(id, "-"+strconv.Itoa(p.cmd.Process.Pid)) {
			return p
		}
	}
	return nil
}

// consumerInfo reads a consumer of stream NARWHAL_EVENTS.
func (c *cluster) consumerInfo(t *testing.T, name string) *jetstream.ConsumerInfo {
	t.Helper()
	ctx := testContext(t, readyBound)
	cons, err := c.conn.JetStream().Consumer(ctx, bus.StreamName, name)
	if err != nil {
		t.Fatalf("consumer %s: %v", name, err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatalf("consumer %s: %v", name, err)
	}
	return info
}

// streamInfo reads a stream (a bucket is stream KV_<bucket>).
func (c *cluster) streamInfo(t *testing.T, name string) *jetstream.StreamInfo {
	t.Helper()
	ctx := testContext(t, readyBound)
	s, err := c.conn.JetStream().Stream(ctx, name)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	return info
}

// ---- events

// event is the fields of every event schema the tests read (behaviour.md §9), with
// its position in the stream's delivery order.
type event struct {
	seq     int
	subject string
	kind    string // the subject's kind token
	raw     []byte

	Schema     string    `json:"schema"`
	At         time.Time `json:"at"`
	RouterID   string    `json:"router_id"`
	BreakerID  string    `json:"breaker_id"`
	EngineID   string    `json:"engine_id"`
	RequestID  string    `json:"request_id"`
	Phase      string    `json:"phase"`
	Kind       string    `json:"kind"`
	Status     int       `json:"status"`
	Counts     bool      `json:"counts"`
	ProducerID string    `json:"producer_id"`
	ConsumerID string    `json:"consumer_id"`
	Outcome    string    `json:"outcome"`
	Message    string    `json:"message"`
	Eligible   bool      `json:"eligible"`
	State      string    `json:"state"`
	Reason     string    `json:"reason"`
	Streak     int       `json:"streak"`
	DurationS  float64   `json:"duration_s"`
	Until      time.Time `json:"until"`
	ErrorKind  string    `json:"error_kind"`
}

// parseEvent decodes one bus message; the kind comes from the subject
// (narwhal.events.<kind>.<id>) or, without one, from the schema name
// (narwhal.<kind>.v1).
func parseEvent(t *testing.T, seq int, subject string, payload []byte) event {
	t.Helper()
	e := event{seq: seq, subject: subject, raw: payload}
	if err := json.Unmarshal(payload, &e); err != nil {
		t.Fatalf("event %s: %v: %s", subject, err, payload)
	}
	if rest, ok := strings.CutPrefix(subject, bus.SubjectPrefix); ok {
		e.kind, _, _ = strings.Cut(rest, ".")
	} else {
		e.kind = strings.TrimSuffix(strings.TrimPrefix(e.Schema, "narwhal."), ".v1")
	}
	return e
}

// matching returns the events recorded so far that match, in stream
// order.
func matching(t *testing.T, events *bustest.Events, match func(event) bool) []event {
	t.Helper()
	var out []event
	for i, be := range events.All() {
		if e := parseEvent(t, i, be.Subject, be.Payload); match(e) {
			out = append(out, e)
		}
	}
	return out
}

// list returns the events of the cluster's subscription so far that
// match, in stream order.
func (c *cluster) list(t *testing.T, match func(event) bool) []event {
	t.Helper()
	return matching(t, c.events, match)
}

// waitEvents waits until at least n events match and returns them all.
func (c *cluster) waitEvents(t *testing.T, bound time.Duration, n int, what string, match func(event) bool) []event {
	t.Helper()
	var got []event
	testkit.WaitEvery(t, bound, pollInterval, what, func() bool {
		got = c.list(t, match)
		return len(got) >= n
	})
	return got
}

// Event predicates.

func isFailure(engine string) func(event) bool {
	return func(e event) bool { return e.kind == schemas.KindFailure && e.EngineID == engine }
}

func isState(engine, state string) func(event) bool {
	return func(e event) bool {
		return e.kind == schemas.KindEligibility && e.EngineID == engine && e.State == state
	}
}

// isEjection matches the eligibility events that eject engine.
func isEjection(engine string) func(event) bool { return isState(engine, schemas.StateEjected) }

// isReadmission matches the eligibility events that readmit engine (a
// breaker's first entry for an engine says "joined", not "readmitted").
func isReadmission(engine string) func(event) bool {
	return func(e event) bool {
		return isState(engine, schemas.StateEligible)(e) && strings.Contains(e.Reason, "readmitted")
	}
}

func isProbe(engine, outcome string) func(event) bool {
	return func(e event) bool {
		return e.kind == schemas.KindProbe && e.EngineID == engine && (outcome == "" || e.Outcome == outcome)
	}
}

// after restricts match to events after e in stream order.
func after(e event, match func(event) bool) func(event) bool {
	return func(x event) bool { return x.seq > e.seq && match(x) }
}

// eject arms a decode fault on s (HTTP 500) and drives requests until the
// breaker ejects s after ejectAfter failures (R-BRK-1); it returns the
// ejecting eligibility event. The fault stays armed.
func (c *cluster) eject(t *testing.T, s *simProc) event {
	t.Helper()
	before := len(c.list(t, isEjection(s.id)))
	c.arm(t, s, `{"kind":"status","status":500,"phase":"decode","message":"`+s.id+` is broken"}`)
	c.failTimes(t, ejectAfter)
	ej := c.waitEvents(t, decisionBound, before+1, s.id+"'s ejection", isEjection(s.id))
	return ej[before]
}

// checkReadmittedByProbe checks that rd (a readmission of its engine) comes
// after a successful probe of that engine which itself follows since, and
// that no other readmission happened after since (R-BRK-3).
func (c *cluster) checkReadmittedByProbe(t *testing.T, since, rd event) {
	t.Helper()
	id := rd.EngineID
	if all := c.list(t, after(since, isReadmission(id))); len(all) != 1 || all[0].seq != rd.seq {
		t.Fatalf("%s readmitted %d times since its ejection, want once: %+v", id, len(all), all)
	}
	var success *event
	for _, p := range c.list(t, after(since, isProbe(id, ""))) {
		if p.seq < rd.seq && p.Outcome == schemas.ProbeSuccess {
			success = &p
		}
	}
	if success == nil {
		t.Fatalf("%s readmitted (%s) without a successful probe before it (R-BRK-3)", id, rd.raw)
	}
}
