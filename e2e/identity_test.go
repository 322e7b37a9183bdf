package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// The identity mesh (behaviour.md R-BUS-11, R-FLEET-5): a JetStream
// cluster of three `narwhal bus --auth` processes (busCluster); `narwhal
// bus creds --out DIR --router r1 --engine ID…` issues every engine's and
// router's own credential into the running mesh's directory; one `narwhal
// router` r1 and one `narwhal breaker` (with --metrics) read a config file
// whose fleet is empty, so that every engine the routers place on came
// in through its own registration — a `narwhal sim --register` process
// with its own engine-<id>.creds.

// Settings of the identity mesh.
const (
	// identityMaxEngines is the breaker's membership.max_engines.
	identityMaxEngines = 8
	// identityBound bounds a wait for the breaker's decision on a
	// registration: a probe, a write, every router applying it.
	identityBound = 15 * time.Second
)

// identityMesh is the running identity mesh.
type identityMesh struct {
	bc         *busCluster
	cfgPath    string
	router     *routerProc
	breaker    *process
	breakerURL string // the breaker's /metrics
	client     *http.Client
	events     *bustest.Events // every event since the mesh started
	sims       map[string]*identitySim
	sent       atomic.Int64
}

// identitySim is one `narwhal sim --register` of the identity mesh.
type identitySim struct {
	id  string
	url string
	p   *process
}

// startIdentityMesh starts the bus cluster, issues the credentials of
// router r1 and of engines into its directory with `narwhal bus creds`
// (the servers run on: R-BUS-11's "without restarting the bus"), and
// starts the router and the breaker with breakerEnv added.
func startIdentityMesh(t *testing.T, engines []string, breakerEnv ...string) *identityMesh {
	t.Helper()
	bc := startBusCluster(t)
	args := []string{"bus", "creds", "--out", bc.credsDir, "--router", "r1"}
	for _, id := range engines {
		args = append(args, "--engine", id)
	}
	if out, code := runNarwhal(t, args...); code != 0 {
		t.Fatalf("narwhal %s: exit %d\n%s", strings.Join(args, " "), code, out)
	}
	for _, f := range append([]string{bus.IdentityCredsFile(bus.RoleRouter, "r1")}, identityFiles(engines)...) {
		if _, err := os.Stat(filepath.Join(bc.credsDir, f)); err != nil {
			t.Fatalf("narwhal bus creds did not write %s: %v", f, err)
		}
	}
	m := &identityMesh{bc: bc, cfgPath: filepath.Join(t.TempDir(), "narwhal.yaml"), events: &bustest.Events{}, sims: map[string]*identitySim{},
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}, Timeout: requestBound}}
	t.Cleanup(m.client.CloseIdleConnections)
	stopSub, err := bus.Subscribe(context.Background(), bc.conn, bus.SubjectPrefix+">", true, m.events.Add)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopSub)
	cfg := "engine:\n  first_token_timeout_s: 2\n  decode_read_timeout_s: 2\n  prefill_timeout_s: 2\nrequest:\n  timeout_s: 10\n"
	if err := os.WriteFile(m.cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	ports := freePorts(t, 2)
	m.router = &routerProc{id: "r1", addr: hostPort(ports[0])}
	m.router.url = "http://" + m.router.addr
	m.router.env = append([]string{"NARWHAL_NATS_URL=" + bc.natsURL, "NARWHAL_ROUTER_ID=r1",
		"NARWHAL_NATS_CREDS=" + filepath.Join(bc.credsDir, bus.IdentityCredsFile(bus.RoleRouter, "r1"))}, clusterEnv...)
	m.router.p = startProcess(t, "router r1", m.router.env, "router", "--config", m.cfgPath, "--listen", m.router.addr)
	m.breakerURL = "http://" + hostPort(ports[1]) + "/metrics"
	m.breaker = startProcess(t, "breaker", append(append(append([]string{"NARWHAL_NATS_URL=" + bc.natsURL}, clusterEnv...),
		"NARWHAL_NATS_CREDS="+bc.creds(bus.RoleBreaker)), breakerEnv...), "breaker", "--config", m.cfgPath, "--metrics", hostPort(ports[1]))
	waitHTTP(t, m.router.p, m.router.url+"/metrics")
	waitHTTP(t, m.breaker, m.breakerURL)
	return m
}

// identityFiles returns the credential files of engines.
func identityFiles(engines []string) []string {
	var out []string
	for _, id := range engines {
		out = append(out, bus.IdentityCredsFile(bus.RoleEngine, id))
	}
	return out
}

// startSim starts `narwhal sim --register` engine id (role both, so that
// it serves whole requests alone) with its own credential and a
// registration TTL of ttl seconds; it is stopped when the test ends.
func (m *identityMesh) startSim(t *testing.T, id string, ttl float64) *identitySim {
	t.Helper()
	s := &identitySim{id: id, url: "http://" + hostPort(freePorts(t, 1)[0])}
	s.p = startProcess(t, "sim "+id, []string{"NARWHAL_NATS_URL=" + m.bc.natsURL,
		"NARWHAL_NATS_CREDS=" + filepath.Join(m.bc.credsDir, bus.IdentityCredsFile(bus.RoleEngine, id)),
		"NARWHAL_MEMBERSHIP_REGISTRATION_TTL_S=" + strconv.FormatFloat(ttl, 'f', -1, 64)},
		"sim", "--role", "both", "--listen", strings.TrimPrefix(s.url, "http://"), "--engine-id", id, "--model", clusterModel,
		"--kv-listen", "127.0.0.1:0", "--register")
	m.sims[id] = s
	return s
}

// waitPlaceable waits until the router may place on every engine of ids.
func (m *identityMesh) waitPlaceable(t *testing.T, ids ...string) {
	t.Helper()
	testkit.WaitEvery(t, identityBound, pollInterval, fmt.Sprintf("%v placeable on router r1", ids), func() bool {
		for _, id := range ids {
			if s := m.sims[id]; s != nil && s.p.exited() {
				s.p.dump(t)
				t.Fatalf("sim %s exited: %v", id, s.p.waitErr)
			}
			if !placeable(m.router, id) {
				return false
			}
		}
		return true
	})
}

// send posts one small completion to the router and returns its status
// and the decode engine that served it.
func (m *identityMesh) send(ctx context.Context) (int, string, error) {
	body := fmt.Sprintf(`{"model":%q,"prompt":"every engine speaks for itself","max_tokens":3}`, clusterModel)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, m.router.url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", fmt.Sprintf("e2e-identity-%d", m.sent.Add(1)))
	resp, err := m.client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return 0, "", err
	}
	return resp.StatusCode, resp.Header.Get("X-Narwhal-Decode-Engine"), nil
}

// trickle is a steady stream of client requests, one every 20 ms, each
// of whose replies is kept.
type trickle struct {
	stopC chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	ok    int
	bad   []string
	on    map[string]int // 200s by decode engine
}

// startTrickle starts one.
func (m *identityMesh) startTrickle() *trickle {
	tr := &trickle{stopC: make(chan struct{}), on: map[string]int{}}
	tr.wg.Go(func() {
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-tr.stopC:
				return
			case <-tick.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), requestBound)
			code, decode, err := m.send(ctx)
			cancel()
			tr.mu.Lock()
			if err == nil && code == http.StatusOK {
				tr.ok++
				tr.on[decode]++
			} else {
				tr.bad = append(tr.bad, fmt.Sprintf("HTTP %d on %q: %v", code, decode, err))
			}
			tr.mu.Unlock()
		}
	})
	return tr
}

// stop ends the trickle and returns how many requests were answered 200,
// by decode engine, and the failures.
func (tr *trickle) stop() (int, map[string]int, []string) {
	select {
	case <-tr.stopC:
	default:
		close(tr.stopC)
	}
	tr.wg.Wait()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.ok, maps.Clone(tr.on), slices.Clone(tr.bad)
}

// lastOn returns the sequence and payload of the last message stream
// holds on subject; 0 and nil when it holds none.
func (m *identityMesh) lastOn(t *testing.T, stream, subject string) (uint64, []byte) {
	t.Helper()
	ctx := testContext(t, readyBound)
	st, err := m.bc.conn.JetStream().Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	msg, err := st.GetLastMsgForSubject(ctx, subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		t.Fatalf("stream %s, subject %s: %v", stream, subject, err)
	}
	return msg.Sequence, msg.Data
}

// engineState is what the bus holds of one engine: the last message of
// its key in narwhal_fleet and of its subject in NARWHAL_REGISTRATIONS.
type engineState struct {
	fleetSeq uint64
	fleet    schemas.FleetEntry
	regSeq   uint64
	reg      schemas.Registration
}

// stateOf reads engine id's engineState.
func (m *identityMesh) stateOf(t *testing.T, id string) engineState {
	t.Helper()
	var s engineState
	var raw []byte
	s.fleetSeq, raw = m.lastOn(t, "KV_"+bus.FleetBucket, "$KV."+bus.FleetBucket+"."+id)
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &s.fleet); err != nil {
			t.Fatalf("%s's fleet value: %v: %s", id, err, raw)
		}
	}
	s.regSeq, raw = m.lastOn(t, bus.RegistrationsStream, bus.RegistrationSubject(id))
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &s.reg); err != nil {
			t.Fatalf("%s's registration: %v: %s", id, err, raw)
		}
	}
	return s
}

// own reports why s is not what engine id's own registrations and the
// breaker's renewals of them make it — its key active with url, its last
// registration its own (by sim-<id>) with url — or "".
func (s engineState) own(id, url string) string {
	switch {
	case s.fleetSeq == 0 || s.fleet.EngineID != id || s.fleet.URL != url || s.fleet.State != schemas.FleetActive ||
		s.fleet.Source != schemas.SourceRegistration || !strings.HasPrefix(s.fleet.By, "breaker-"):
		return fmt.Sprintf("fleet key at seq %d: %+v", s.fleetSeq, s.fleet)
	case s.regSeq == 0 || s.reg.EngineID != id || s.reg.URL != url || s.reg.By != "sim-"+id || s.reg.State != schemas.AskJoining:
		return fmt.Sprintf("registration at seq %d: %+v", s.regSeq, s.reg)
	}
	return ""
}

// attacker is a raw NATS connection with one engine's own credential:
// it sends what it likes and collects what the server refuses.
type attacker struct {
	nc       *nats.Conn
	js       jetstream.JetStream
	refusals chan error
}

// connectAttacker connects with engine id's credential and its own inbox
// prefix.
func (m *identityMesh) connectAttacker(t *testing.T, id string) *attacker {
	t.Helper()
	a := &attacker{refusals: make(chan error, 64)}
	nc, err := nats.Connect(m.bc.natsURL, nats.Name("narwhal-e2e-attacker-"+id),
		nats.UserCredentials(filepath.Join(m.bc.credsDir, bus.IdentityCredsFile(bus.RoleEngine, id))),
		nats.CustomInboxPrefix("_INBOX."+bus.UserName(bus.RoleEngine, id)),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			select {
			case a.refusals <- err:
			default:
			}
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	a.nc = nc
	a.js, err = jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// refused publishes msg and waits for the server's permissions violation
// naming msg's subject; the test fails when none comes within two seconds.
func (a *attacker) refused(t *testing.T, what string, msg *nats.Msg) {
	t.Helper()
	if err := a.nc.PublishMsg(msg); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if err := a.nc.Flush(); err != nil {
		t.Fatalf("%s: flush: %v", what, err)
	}
	timer := time.NewTimer(2 * time.Second)
	defer timer.Stop()
	for {
		select {
		case err := <-a.refusals:
			if strings.Contains(err.Error(), `"`+msg.Subject+`"`) && strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
				t.Logf("R-BUS-11: %s: refused by the server: %v", what, err)
				return
			}
			t.Logf("%s: another error meanwhile: %v", what, err)
		case <-timer.C:
			t.Fatalf("%s: the server did not refuse a publish on %s within 2 s", what, msg.Subject)
		}
	}
}

// forgedRegistration returns a schema-valid registration of engine id at
// url, published by by.
func forgedRegistration(t *testing.T, id, url, state, by string) []byte {
	t.Helper()
	b, err := json.Marshal(schemas.Registration{Schema: schemas.SchemaRegistration, EngineID: id, URL: url, Role: "both", Connector: "nixl",
		State: state, TTLS: 60, At: time.Now().UTC(), By: by})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.ParseRegistration(bus.RegistrationSubject(id), b); err != nil {
		t.Fatalf("the forged registration is not a valid one: %v", err)
	}
	return b
}

// forgedEntry returns a fleet entry of engine id at url in state, as if
// the breaker had written it.
func forgedEntry(t *testing.T, id, url, state string) []byte {
	t.Helper()
	now := time.Now().UTC()
	b, err := json.Marshal(schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: id, URL: url, Role: "both", Connector: "nixl",
		State: state, Since: now, At: now, Source: schemas.SourceRegistration, By: "breaker-forged", TTLS: 60})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// connCounter is a TCP listener that counts the connections it accepts:
// the target of every forged URL.
type connCounter struct {
	ln    net.Listener
	url   string
	count atomic.Int64
}

// listenCounter starts one, closed when the test ends.
func listenCounter(t *testing.T) *connCounter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &connCounter{ln: ln, url: "http://" + ln.Addr().String()}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			c.count.Add(1)
			conn.Close()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
	})
	return c
}

// checkNoViolations fails the test for every permissions violation a
// bus node logged but those of the connection named except (none when
// empty): every identity's permissions suffice for its work (R-BUS-11).
// It returns how many violations of except the nodes logged.
func (m *identityMesh) checkNoViolations(t *testing.T, except string) int {
	t.Helper()
	n := 0
	for _, node := range m.bc.nodes {
		for line := range strings.Lines(node.p.stderr.String() + node.p.stdout.String()) {
			if !strings.Contains(line, "Violation") {
				continue
			}
			if except != "" && strings.Contains(line, except) {
				n++
				continue
			}
			t.Errorf("bus %s logged a permissions violation of normal work: %s", node.name, strings.TrimSpace(line))
		}
	}
	return n
}

// refusedCount reads narwhal_breaker_registrations_refused_total{reason}.
func (m *identityMesh) refusedCount(t *testing.T, reason string) float64 {
	t.Helper()
	return testkit.ScrapedSum(t, probeClient, m.breakerURL, "narwhal_breaker_registrations_refused_total", "reason", reason)
}

// TestEngineIdentityClusterRBUS11 proves R-BUS-11 and R-FLEET-5 with real
// processes on a three-node `narwhal bus --auth` cluster: engine d1
// (`narwhal sim --register` with its own engine-d1.creds) registers, is
// probed by the breaker and placed, and router r1 (its own
// router-r1.creds) serves clients on it. Then engine x9's own credential
// tries to hijack d1 while a steady trickle of client requests runs:
//
//   - (a) a registration of d1 with a forged URL on d1's subject: refused
//     by the server; the same on x9's own subject (payload engine_id d1):
//     stored, then ignored and counted by the breaker (id_mismatch);
//   - (b) puts of d1's fleet key with a forged URL, and with state
//     draining; a put of x9's own key as active: refused by the server;
//   - (c) publishes with Nats-Rollup: all and KV-Operation: PURGE on
//     x9's own registration subject (the rollup refused by the stream),
//     on d1's, and on $KV.narwhal_fleet.d1 (refused by the server).
//
// Nothing changes that a client sees: the forged URL's listener gets no
// connection, every request of the trickle is answered 200 (on d1), d1
// stays active and placeable, and d1's fleet key and registration are
// after every act what d1's own heartbeats and the breaker's renewals
// made them.
func TestEngineIdentityClusterRBUS11(t *testing.T) {
	start := time.Now()
	m := startIdentityMesh(t, []string{"d1", "x9"}, "NARWHAL_MEMBERSHIP_MAX_ENGINES="+strconv.Itoa(identityMaxEngines))
	t.Logf("3-node bus cluster, router and breaker up in %v", time.Since(start).Round(time.Millisecond))
	d1 := m.startSim(t, "d1", 3)
	m.waitPlaceable(t, "d1")
	t.Logf("d1 registered with its own credential and placeable %v after the start", time.Since(start).Round(time.Millisecond))
	// The probe event travels to the test's own subscriber on another bus
	// node, so it may come a little after the router placed d1: wait for
	// it, bounded, rather than read at once.
	probed := func() bool {
		for _, e := range m.events.All() {
			if e.Subject == bus.SubjectPrefix+schemas.KindProbe+".d1" {
				return true
			}
		}
		return false
	}
	testkit.WaitEvery(t, identityBound, pollInterval, "d1's probe event of the breaker (R-FLEET-2: no placement without one)", probed)
	for range 5 {
		code, decode, err := m.send(testContext(t, requestBound))
		if err != nil || code != http.StatusOK || decode != "d1" {
			t.Fatalf("a request through r1: HTTP %d on %q: %v", code, decode, err)
		}
	}
	if why := m.stateOf(t, "d1").own("d1", d1.url); why != "" {
		t.Fatalf("d1 before the attempts: %s", why)
	}

	forged := listenCounter(t)
	x9 := m.connectAttacker(t, "x9")
	mismatchBefore := m.refusedCount(t, "id_mismatch")
	tr := m.startTrickle()
	t.Cleanup(func() { tr.stop() })

	var moved int // acts during which d1's own heartbeat moved a sequence
	act := func(what string, do func()) {
		t.Helper()
		before := m.stateOf(t, "d1")
		do()
		after := m.stateOf(t, "d1")
		if why := after.own("d1", d1.url); why != "" {
			t.Fatalf("%s: d1's state is no longer its own: %s", what, why)
		}
		if after.fleetSeq != before.fleetSeq || after.regSeq != before.regSeq {
			moved++
		}
	}
	hdr := func(kv ...string) nats.Header {
		h := nats.Header{}
		for i := 0; i < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		return h
	}
	rollupPurge := hdr(jetstream.MsgRollup, jetstream.MsgRollupAll, "KV-Operation", "PURGE")

	// (a) Registrations of d1 with a forged URL.
	act("(a) d1's registration on d1's subject", func() {
		x9.refused(t, "(a) x9 publishes d1's registration with a forged URL on d1's subject",
			&nats.Msg{Subject: bus.RegistrationSubject("d1"), Data: forgedRegistration(t, "d1", forged.url, schemas.AskJoining, "sim-d1")})
	})
	act("(a) d1's registration on x9's subject", func() {
		ack, err := x9.js.PublishMsg(testContext(t, readyBound),
			&nats.Msg{Subject: bus.RegistrationSubject("x9"), Data: forgedRegistration(t, "d1", forged.url, schemas.AskJoining, "sim-d1")})
		if err != nil {
			t.Fatalf("(a) x9's own registration subject refused a publish: %v", err)
		}
		t.Logf("(a) stored on x9's own subject at seq %d: a registration naming d1", ack.Sequence)
		testkit.WaitEvery(t, identityBound, pollInterval, "the breaker counting the id mismatch", func() bool {
			return m.refusedCount(t, "id_mismatch") > mismatchBefore
		})
	})

	// (b) d1's fleet key, x9's own.
	act("(b) d1's key with a forged URL", func() {
		x9.refused(t, "(b) x9 puts d1's fleet key with a forged URL",
			&nats.Msg{Subject: "$KV." + bus.FleetBucket + ".d1", Data: forgedEntry(t, "d1", forged.url, schemas.FleetActive)})
	})
	act("(b) d1's key draining", func() {
		x9.refused(t, "(b) x9 puts d1's fleet key as draining",
			&nats.Msg{Subject: "$KV." + bus.FleetBucket + ".d1", Data: forgedEntry(t, "d1", d1.url, schemas.FleetDraining)})
	})
	act("(b) x9's own key active", func() {
		x9.refused(t, "(b) x9 puts its own fleet key as active",
			&nats.Msg{Subject: "$KV." + bus.FleetBucket + ".x9", Data: forgedEntry(t, "x9", forged.url, schemas.FleetActive)})
	})

	// (c) Rollups and purges.
	act("(c) rollup on x9's subject", func() {
		_, err := x9.js.PublishMsg(testContext(t, readyBound), &nats.Msg{Subject: bus.RegistrationSubject("x9"), Header: rollupPurge})
		var apiErr *jetstream.APIError
		if !errors.As(err, &apiErr) {
			t.Fatalf("(c) a rollup on x9's own registration subject: %v, want the stream's refusal", err)
		}
		t.Logf("R-BUS-11: (c) a rollup on x9's own registration subject: refused by the stream: %v", err)
	})
	act("(c) purge marker on x9's subject", func() {
		ack, err := x9.js.PublishMsg(testContext(t, readyBound), &nats.Msg{Subject: bus.RegistrationSubject("x9"), Header: hdr("KV-Operation", "PURGE")})
		t.Logf("(c) KV-Operation: PURGE alone on x9's own subject: ack %+v, %v (x9's own message; the breaker ignores it as invalid)", ack, err)
	})
	act("(c) rollup on d1's subject", func() {
		x9.refused(t, "(c) x9 rolls up d1's registration subject", &nats.Msg{Subject: bus.RegistrationSubject("d1"), Header: rollupPurge})
	})
	act("(c) rollup on d1's key", func() {
		x9.refused(t, "(c) x9 rolls up and purges $KV.narwhal_fleet.d1", &nats.Msg{Subject: "$KV." + bus.FleetBucket + ".d1", Header: rollupPurge})
	})

	// The breaker has read on: two more of d1's heartbeats renewed its key
	// since the last act, and none of them took the forged URL.
	last := m.stateOf(t, "d1")
	renewals := 0
	testkit.WaitEvery(t, identityBound, pollInterval, "two renewals of d1's key after the attempts", func() bool {
		now := m.stateOf(t, "d1")
		if why := now.own("d1", d1.url); why != "" {
			t.Fatalf("d1 after the attempts: %s", why)
		}
		if now.fleetSeq != last.fleetSeq {
			renewals++
			last = now
		}
		return renewals >= 2
	})
	ok, on, bad := tr.stop()
	if n := forged.count.Load(); n != 0 {
		t.Errorf("the forged URL's listener got %d connections, want 0 (R-FLEET-5)", n)
	}
	if len(bad) > 0 {
		t.Errorf("%d client requests failed during the attempts (of %d answered): %v", len(bad), ok, bad)
	}
	if ok == 0 || on["d1"] != ok {
		t.Errorf("client requests during the attempts: %d answered, by decode engine %v; want all on d1", ok, on)
	}
	if !placeable(m.router, "d1") {
		t.Error("d1 not placeable on r1 after the attempts")
	}
	if placeable(m.router, "x9") {
		t.Error("x9 placeable on r1: an engine that never registered itself")
	}
	mismatch := m.refusedCount(t, "id_mismatch")
	violations := m.checkNoViolations(t, "narwhal-e2e-attacker-x9")
	if violations == 0 {
		t.Error("no bus node logged x9's refused publishes")
	}
	t.Logf("R-BUS-11, R-FLEET-5: %d client requests answered 200 on d1 during x9's attempts, 0 failed; forged URL connections %d; "+
		"refused{id_mismatch} %v -> %v, refused{invalid} %v; d1's own heartbeats moved its sequences during %d of the acts; d1 at fleet seq %d, registration seq %d; "+
		"%d violations of x9 logged by the bus nodes, none of r1, d1 or the breaker",
		ok, forged.count.Load(), mismatchBefore, mismatch, m.refusedCount(t, "invalid"), moved, last.fleetSeq, last.regSeq, violations)
	t.Logf("TestEngineIdentityClusterRBUS11 took %v", time.Since(start).Round(time.Millisecond))
}

// metricsNaming returns the lines of url's /metrics that name one of ids
// as a label value.
func metricsNaming(t *testing.T, url string, ids []string) []string {
	t.Helper()
	resp, err := probeClient.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for line := range strings.Lines(string(body)) {
		for _, id := range ids {
			if strings.Contains(line, `="`+id+`"`) {
				out = append(out, strings.TrimSpace(line))
			}
		}
	}
	return out
}

// fleetKeys returns the keys of narwhal_fleet.
func (m *identityMesh) fleetKeys(t *testing.T) []string {
	t.Helper()
	kv, err := m.bc.conn.BindBucket(testContext(t, readyBound), bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := kv.Keys(testContext(t, readyBound))
	if errors.Is(err, jetstream.ErrNoKeysFound) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	return keys
}

// refusedAdmission reports whether the breaker published an admission
// event refusing engine id.
func (m *identityMesh) refusedAdmission(t *testing.T, id string) bool {
	t.Helper()
	for _, e := range m.events.All() {
		if e.Subject != bus.SubjectPrefix+schemas.KindAdmission+"."+id {
			continue
		}
		var a schemas.Admission
		if err := json.Unmarshal(e.Payload, &a); err != nil {
			t.Fatalf("admission event %s: %v", e.Payload, err)
		}
		if a.State == schemas.AdmissionRefused {
			return true
		}
	}
	return false
}

// TestFleetBoundClusterRFLEET5 proves R-FLEET-5's bound and clean-up with
// real processes on a three-node `narwhal bus --auth` cluster: with
// membership.max_engines 8, ten `narwhal sim --register` engines, each
// with its own credential: the first eight are placed, the ninth's and
// tenth's registrations are refused and counted
// (narwhal_breaker_registrations_refused_total{reason="max_engines"} ≥ 2,
// an admission event "refused" for each), the fleet holds eight and the
// router places on none of the two; then three engines stopped with
// SIGTERM leave, and no line of the router's or the breaker's /metrics
// names them any more; the two refused engines get in once there is
// room.
func TestFleetBoundClusterRFLEET5(t *testing.T) {
	start := time.Now()
	var ids []string
	for i := range identityMaxEngines + 2 {
		ids = append(ids, fmt.Sprintf("e%02d", i+1))
	}
	admitted, over := ids[:identityMaxEngines], ids[identityMaxEngines:]
	m := startIdentityMesh(t, ids, "NARWHAL_MEMBERSHIP_MAX_ENGINES="+strconv.Itoa(identityMaxEngines))
	t.Logf("3-node bus cluster, router and breaker up in %v", time.Since(start).Round(time.Millisecond))
	for _, id := range admitted {
		m.startSim(t, id, 3)
	}
	m.waitPlaceable(t, admitted...)
	t.Logf("%d engines placeable %v after the start", len(admitted), time.Since(start).Round(time.Millisecond))
	refusedBefore := m.refusedCount(t, "max_engines")
	if refusedBefore != 0 {
		t.Errorf("refused{max_engines} is %v before the fleet was full", refusedBefore)
	}
	for _, id := range over {
		m.startSim(t, id, 3)
	}
	testkit.WaitEvery(t, identityBound, pollInterval, fmt.Sprintf("%v refused for max_engines", over), func() bool {
		for _, id := range over {
			if !m.refusedAdmission(t, id) {
				return false
			}
		}
		return m.refusedCount(t, "max_engines") >= 2
	})
	refused := m.refusedCount(t, "max_engines")
	if keys := m.fleetKeys(t); !slices.Equal(keys, admitted) {
		t.Errorf("narwhal_fleet holds %v, want the %d admitted engines %v", keys, identityMaxEngines, admitted)
	}
	for _, id := range over {
		if placeable(m.router, id) {
			t.Errorf("router r1 places on %s, refused for max_engines", id)
		}
		if lines := metricsNaming(t, m.router.url+"/metrics", []string{id}); len(lines) > 0 {
			t.Errorf("router r1's /metrics names refused engine %s: %v", id, lines)
		}
		if lines := metricsNaming(t, m.breakerURL, []string{id}); len(lines) > 0 {
			t.Errorf("the breaker's /metrics names refused engine %s: %v", id, lines)
		}
	}
	for range 16 {
		if code, decode, err := m.send(testContext(t, requestBound)); err != nil || code != http.StatusOK || slices.Contains(over, decode) {
			t.Fatalf("a request with the fleet full: HTTP %d on %q: %v", code, decode, err)
		}
	}
	t.Logf("R-FLEET-5: the fleet holds %d; %v refused, refused{max_engines} = %v", identityMaxEngines, over, refused)

	leaving := admitted[:3]
	if lines := metricsNaming(t, m.router.url+"/metrics", leaving); len(lines) == 0 {
		t.Fatalf("router r1's /metrics names none of %v before they leave: the check below would prove nothing", leaving)
	}
	if lines := metricsNaming(t, m.breakerURL, leaving); len(lines) == 0 {
		t.Fatalf("the breaker's /metrics names none of %v before they leave: the check below would prove nothing", leaving)
	}
	var procs []*process
	for _, id := range leaving {
		procs = append(procs, m.sims[id].p)
	}
	stopped := time.Now()
	haltAll(t, procs...) // SIGTERM: each asks to leave, exit 0
	var left []string
	if !testkit.Poll(identityBound, pollInterval, func() bool {
		left = append(metricsNaming(t, m.router.url+"/metrics", leaving), metricsNaming(t, m.breakerURL, leaving)...)
		return len(left) == 0
	}) {
		t.Fatalf("%v after %v left, the router's and the breaker's /metrics still name them (R-FLEET-5):\n%s", identityBound, leaving, strings.Join(left, "\n"))
	}
	gone := time.Since(stopped)
	for _, id := range leaving {
		if slices.Contains(m.fleetKeys(t), id) {
			t.Errorf("%s still in narwhal_fleet after it left", id)
		}
	}
	m.waitPlaceable(t, over...)
	t.Logf("R-FLEET-5: %v left (SIGTERM): no series of theirs on either /metrics %v after the signal; %v placed once there was room; fleet %v",
		leaving, gone.Round(time.Millisecond), over, m.fleetKeys(t))
	m.checkNoViolations(t, "")
	t.Logf("TestFleetBoundClusterRFLEET5 took %v", time.Since(start).Round(time.Millisecond))
}
