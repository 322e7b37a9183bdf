package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testkit.NATSLongLived()...)
}

// testBound bounds every wait of these tests: generous next to what the
// proxy needs (milliseconds), short enough that a hang fails quickly.
const testBound = 10 * time.Second

const testModel = "m"

// testContext returns a context that ends with the test or after
// testBound.
func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testBound)
	t.Cleanup(cancel)
	return ctx
}

// testBus is an embedded NATS server with a connection, an event
// publisher, a Store, and a log of the chaos events on the bus.
type testBus struct {
	emb    *bus.Embedded
	b      *bus.Bus
	store  *Store
	events *eventLog
}

// startBus starts an in-process NATS server and everything on it; all of
// it stops when the test ends.
func startBus(t *testing.T) *testBus {
	t.Helper()
	tb := &testBus{emb: bustest.StartWith(t, bus.EmbeddedOptions{Port: 0})}
	tb.b, tb.store = tb.connect(t, "test")
	tb.events = &eventLog{}
	sub, err := tb.b.Conn().Subscribe("narwhal.events.chaos.>", tb.events.add)
	if err != nil {
		t.Fatal(err)
	}
	if err := tb.b.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	return tb
}

// connect opens another connection to the server with its own publisher
// and Store, closed when the test ends.
func (tb *testBus) connect(t *testing.T, name string) (*bus.Bus, *Store) {
	t.Helper()
	b := bustest.Connect(t, tb.emb, bus.ConnectOptions{Name: name})
	pub := bus.NewPublisher(b, 1024, nil)
	t.Cleanup(pub.Close)
	st, err := OpenStore(testContext(t), b, pub)
	if err != nil {
		t.Fatal(err)
	}
	return b, st
}

// eventLog collects the chaos events seen on the bus, each validated
// against its JSON Schema (R-BUS-3).
type eventLog struct {
	mu      sync.Mutex
	events  []schemas.Chaos
	invalid []string
}

func (l *eventLog) add(m *nats.Msg) {
	var ev schemas.Chaos
	err := bus.ValidateEvent(m.Data)
	if err == nil {
		err = json.Unmarshal(m.Data, &ev)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err != nil {
		l.invalid = append(l.invalid, string(m.Data)+": "+err.Error())
		return
	}
	if m.Subject != ev.Subject() {
		l.invalid = append(l.invalid, "subject "+m.Subject+" for "+string(m.Data))
	}
	l.events = append(l.events, ev)
}

// reset forgets the events seen so far.
func (l *eventLog) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = nil
}

// snapshot returns the events seen so far.
func (l *eventLog) snapshot() []schemas.Chaos {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]schemas.Chaos(nil), l.events...)
}

// of returns the events of one action seen so far.
func (l *eventLog) of(action string) []schemas.Chaos {
	var out []schemas.Chaos
	for _, ev := range l.snapshot() {
		if ev.Action == action {
			out = append(out, ev)
		}
	}
	return out
}

// wait waits until n events of action have been seen and returns them,
// failing the test on an invalid event.
func (l *eventLog) wait(t *testing.T, action string, n int) []schemas.Chaos {
	t.Helper()
	testkit.WaitFor(t, testBound, "chaos events", func() bool { return len(l.of(action)) >= n })
	l.mu.Lock()
	invalid := l.invalid
	l.mu.Unlock()
	if len(invalid) > 0 {
		t.Fatalf("invalid chaos events: %v", invalid)
	}
	return l.of(action)
}

// startSim starts a simulator that plays both roles, stopped when the test
// ends.
func startSim(t *testing.T, id string, itl time.Duration) *sim.Server {
	t.Helper()
	return simtest.Start(t, sim.Config{EngineID: id, Model: testModel, ITL: itl})
}

// startProxy starts a chaos proxy for engine in front of target, serves it
// with httptest, and stops both when the test ends.
func startProxy(t *testing.T, engine, target string, st *Store) (*Proxy, string) {
	t.Helper()
	p, err := NewProxy(ProxyOptions{Target: target, EngineID: engine, Store: st})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Start(testContext(t)); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(func() {
		srv.Close()
		p.Close()
	})
	return p, srv.URL
}

// newClient returns an HTTP client whose idle connections close when the
// test ends.
func newClient(t *testing.T) *http.Client {
	t.Helper()
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// Request bodies, with a fixed seed so that the simulator's output is
// deterministic.
const (
	chatStream  = `{"model":"m","messages":[{"role":"user","content":"tell me about narwhals"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":6,"seed":7}`
	chatPlain   = `{"model":"m","messages":[{"role":"user","content":"tell me about narwhals"}],"stream":false,"max_tokens":6,"seed":7}`
	complStream = `{"model":"m","prompt":"tell me about narwhals","stream":true,"max_tokens":5,"seed":3}`
	// prefillLeg is a prefill leg as a router sends it (R-LEG-1).
	prefillLeg = `{"model":"m","messages":[{"role":"user","content":"tell me about narwhals"}],"stream":false,"max_tokens":1,"max_completion_tokens":1,"ignore_eos":true,` +
		`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`
)

// post sends body to base+path with X-Request-Id id and returns the
// response (the caller closes its body).
func post(t *testing.T, ctx context.Context, c *http.Client, base, path, id, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if id != "" {
		req.Header.Set("X-Request-Id", id)
	}
	return c.Do(req)
}

// exchangeResult is what a client saw of one request.
type exchangeResult struct {
	status  int
	header  http.Header
	body    []byte
	start   time.Time // when the request was sent
	headers time.Time // when the response headers arrived
	end     time.Time // when the body ended
	chunks  []chunkSeen
	err     error // the error that ended the body, nil at a clean end
}

// chunkSeen is one SSE line with data, as the client read it.
type chunkSeen struct {
	payload string
	kind    schemas.ChunkKind
	at      time.Time
}

// outputs returns the number of generated-output chunks seen.
func (r *exchangeResult) outputs() int {
	n := 0
	for _, c := range r.chunks {
		if c.kind == schemas.ChunkOutput {
			n++
		}
	}
	return n
}

// hasDone reports whether a data: [DONE] was seen.
func (r *exchangeResult) hasDone() bool {
	for _, c := range r.chunks {
		if c.kind == schemas.ChunkDone {
			return true
		}
	}
	return false
}

// do sends one request and reads the whole response line by line,
// recording when each data line arrived. A failed request fails the test;
// a body that breaks off is recorded in err.
func do(t *testing.T, c *http.Client, base, path, id, body string) *exchangeResult {
	t.Helper()
	r := &exchangeResult{start: time.Now()}
	resp, err := post(t, testContext(t), c, base, path, id, body)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	r.headers = time.Now()
	r.status, r.header = resp.StatusCode, resp.Header
	br := bufio.NewReader(resp.Body)
	var all bytes.Buffer
	for {
		line, err := br.ReadBytes('\n')
		all.Write(line)
		if payload, ok := schemas.SSEData(line); ok {
			r.chunks = append(r.chunks, chunkSeen{payload: string(payload), kind: schemas.ClassifyChunk(payload), at: time.Now()})
		}
		if err != nil {
			if err != io.EOF {
				r.err = err
			}
			break
		}
	}
	r.end = time.Now()
	r.body = all.Bytes()
	return r
}

// createdField matches the simulator's "created" timestamps (seconds).
var createdField = regexp.MustCompile(`"created":[0-9]+`)

// normalised returns body with every "created" timestamp set to 0: the
// only bytes that differ between two identical requests sent with the
// same X-Request-Id (the simulator derives the completion id from it).
func normalised(body []byte) string {
	return createdField.ReplaceAllString(string(body), `"created":0`)
}

// events splits an SSE body into its events, each with its blank line.
func sseEvents(body string) []string {
	var out []string
	for rest := body; rest != ""; {
		i := strings.Index(rest, "\n\n")
		if i < 0 {
			out = append(out, rest)
			break
		}
		out = append(out, rest[:i+2])
		rest = rest[i+2:]
	}
	return out
}

// eventKind classifies an SSE event by its data line.
func eventKind(ev string) schemas.ChunkKind {
	payload, ok := schemas.SSEData([]byte(strings.TrimRight(ev, "\n") + "\n"))
	if !ok {
		return schemas.ChunkMetadata
	}
	return schemas.ClassifyChunk(payload)
}

// prefixThroughOutputs returns the events of body up to and including its
// n-th output event (all events before the first output when n is 0).
func prefixThroughOutputs(body string, n int) string {
	var b strings.Builder
	seen := 0
	for _, ev := range sseEvents(body) {
		if eventKind(ev) == schemas.ChunkOutput {
			if seen == n {
				break
			}
			seen++
		}
		if eventKind(ev) == schemas.ChunkDone {
			break
		}
		b.WriteString(ev)
	}
	return b.String()
}

// armAndWait arms f on st and waits until proxy p applies it.
func armAndWait(t *testing.T, st *Store, p *Proxy, f Fault, d time.Duration) Fault {
	t.Helper()
	armed, err := st.Arm(testContext(t), f, d)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, testBound, "the proxy to apply "+armed.Key(), func() bool {
		for _, g := range p.Faults() {
			if g.Key() == armed.Key() && g.ArmedAt.Equal(armed.ArmedAt) {
				return true
			}
		}
		return false
	})
	return armed
}

// disarmAndWait disarms every fault of p's engine and waits until p
// applies none.
func disarmAndWait(t *testing.T, st *Store, p *Proxy) {
	t.Helper()
	if _, err := st.Disarm(testContext(t), p.EngineID(), ""); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, testBound, "the proxy to drop its faults", func() bool { return len(p.Faults()) == 0 })
}
