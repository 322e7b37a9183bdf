package kvevents

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// waitBound bounds every wait of these tests: generous next to the
// milliseconds each step takes on a loaded machine.
const waitBound = 10 * time.Second

// python is Debian's interpreter, with python3-zmq and python3-msgpack
// (the python3 first on PATH may be another build without them).
const python = "/usr/bin/python3"

// pyPublisher is testdata/vllm_publisher.py running: an independent
// vLLM-format publisher on libzmq, driven one JSON command per line.
type pyPublisher struct {
	t   *testing.T
	in  io.WriteCloser
	out *bufio.Scanner
	mu  sync.Mutex
}

// startPublisher starts the publisher script; without Debian's python3
// with zmq and msgpack the test skips, or fails under CI=true.
func startPublisher(t *testing.T) *pyPublisher {
	t.Helper()
	if err := exec.Command(python, "-c", "import zmq, msgpack").Run(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s with python3-zmq and python3-msgpack is needed (apt-get install python3-zmq python3-msgpack): %v", python, err)
		}
		t.Skipf("%s with python3-zmq and python3-msgpack not installed (apt-get install python3-zmq python3-msgpack): %v", python, err)
	}
	cmd := exec.Command(python, filepath.Join("testdata", "vllm_publisher.py"))
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = testWriter{t}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &pyPublisher{t: t, in: in, out: bufio.NewScanner(out)}
	p.out.Buffer(make([]byte, 1<<16), 1<<20)
	t.Cleanup(func() {
		_ = in.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(waitBound):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return p
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("publisher: %s", strings.TrimSpace(string(p)))
	return len(p), nil
}

// do sends one command and returns its answer; an answer without "ok"
// fails the test.
func (p *pyPublisher) do(cmd map[string]any) map[string]any {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	line, _ := json.Marshal(cmd)
	if _, err := p.in.Write(append(line, '\n')); err != nil {
		p.t.Fatalf("publisher %v: %v", cmd["op"], err)
	}
	if !p.out.Scan() {
		p.t.Fatalf("publisher %v: no answer (%v)", cmd["op"], p.out.Err())
	}
	var ans map[string]any
	if err := json.Unmarshal(p.out.Bytes(), &ans); err != nil {
		p.t.Fatalf("publisher %v: %q: %v", cmd["op"], p.out.Text(), err)
	}
	if ans["ok"] != true {
		p.t.Fatalf("publisher %v: %v", cmd["op"], ans)
	}
	return ans
}

// open binds the publisher (its PUB on a free port of 127.0.0.1, and a
// replay ROUTER when replay) and returns the endpoints.
func (p *pyPublisher) open(replay bool) (pub, rep string) {
	cmd := map[string]any{"op": "open", "endpoint": "tcp://127.0.0.1:*", "bind": true}
	if replay {
		cmd["replay"] = "tcp://127.0.0.1:*"
	}
	ans := p.do(cmd)
	pub, _ = ans["endpoint"].(string)
	rep, _ = ans["replay"].(string)
	return pub, rep
}

// subscribed waits until the publisher has seen n subscriptions (the
// agent's SUB connected n times).
func (p *pyPublisher) subscribed(n int) {
	p.t.Helper()
	p.do(map[string]any{"op": "wait_subscribed", "count": n, "timeout": waitBound.Seconds()})
}

// send publishes one batch of events (encoding "array" or "map") and
// returns its sequence; skip only buffers it for the replay, as if the
// message was lost on the way.
func (p *pyPublisher) send(format string, skip bool, events ...map[string]any) uint64 {
	p.t.Helper()
	ans := p.do(map[string]any{"op": "send", "format": format, "batch": "array", "events": events, "skip": skip})
	return uint64(ans["seq"].(float64))
}

// stored is a BlockStored event of the publisher's JSON form.
func stored(hashes []any, parent any, tokens []uint32, extra map[string]any) map[string]any {
	ev := map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
		"token_ids": tokens, "block_size": 16, "lora_id": nil, "medium": "GPU"}
	for k, v := range extra {
		ev[k] = v
	}
	return ev
}

func removed(medium string, hashes ...any) map[string]any {
	return map[string]any{"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
}

// tokens returns n token ids from first on.
func tokens(first uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = first + uint32(i)
	}
	return out
}

// kvBus is a real embedded bus enforcing credentials, the engine's own
// connection (the agent publishes with it) and a router's, recording
// every KV batch it receives.
type kvBus struct {
	emb    *bus.Embedded
	engine *bus.Bus
	router *bus.Bus
	got    *batches
}

func startBus(t *testing.T, engineID string) *kvBus {
	t.Helper()
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: dir})
	kb := &kvBus{emb: emb, got: &batches{}}
	kb.engine = bustest.Connect(t, emb, bus.ConnectOptions{Name: "engine-" + engineID, Role: bus.RoleEngine, ID: engineID,
		CredsFile: bustest.Identity(t, dir, bus.RoleEngine, engineID)})
	kb.router = bustest.Connect(t, emb, bus.ConnectOptions{Name: "router-r1", Role: bus.RoleRouter, ID: "r1",
		CredsFile: bustest.Identity(t, dir, bus.RoleRouter, "r1")})
	kb.got.subscribe(t, kb.router.Conn())
	return kb
}

// batches records the KV batches a router receives, decoded with
// bus.ParseKVBatch.
type batches struct {
	mu      sync.Mutex
	headers []bus.KVHeader
	ops     []bus.KVEntry
	batchOf []int // of each op, its batch's index in headers
	bad     []error
}

func (b *batches) subscribe(t *testing.T, nc *nats.Conn) {
	t.Helper()
	sub, err := nc.Subscribe(bus.KVSubjectPrefix+"*", func(m *nats.Msg) {
		h, ops, err := bus.ParseKVBatch(m.Data)
		b.mu.Lock()
		defer b.mu.Unlock()
		if err != nil || m.Subject != bus.KVSubject(string(h.EngineID)) {
			b.bad = append(b.bad, err)
			return
		}
		b.headers = append(b.headers, h)
		b.ops = append(b.ops, ops...)
		for range ops {
			b.batchOf = append(b.batchOf, len(b.headers)-1)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// all returns the ops received so far.
func (b *batches) all() []bus.KVEntry {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]bus.KVEntry(nil), b.ops...)
}

// batchIndexes returns, for every op received so far, its batch's index.
func (b *batches) batchIndexes() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]int(nil), b.batchOf...)
}

// keys returns the keys of every op of kind op on medium, in order.
func (b *batches) keys(op bus.KVOp, medium bus.KVMedium) []uint64 {
	var out []uint64
	for _, e := range b.all() {
		if e.Op == op && e.Medium == medium {
			out = append(out, e.Keys...)
		}
	}
	return out
}

// count returns how many ops of kind op of rank were received.
func (b *batches) count(op bus.KVOp, rank int) int {
	n := 0
	for _, e := range b.all() {
		if e.Op == op && e.Rank == rank {
			n++
		}
	}
	return n
}

func (b *batches) check(t *testing.T, epoch uint64) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.bad) > 0 {
		t.Fatalf("the router received batches it could not parse: %v", b.bad)
	}
	for i, h := range b.headers {
		if h.Epoch != epoch {
			t.Fatalf("batch %d of epoch %d, want the agent's %d", i, h.Epoch, epoch)
		}
		if i > 0 && h.Seq <= b.headers[i-1].Seq {
			t.Fatalf("batch %d has seq %d after %d", i, h.Seq, b.headers[i-1].Seq)
		}
	}
}

// agent runs a Bridge with cfg (EngineID and short bounds filled in) on
// the engine's connection until the test ends, and returns it with its
// registry.
func runAgent(t *testing.T, kb *kvBus, cfg Config) (*Bridge, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	if cfg.EngineID == "" {
		cfg.EngineID = "e1"
	}
	cfg.Registry = reg
	if cfg.Flush == 0 {
		cfg.Flush = 2 * time.Millisecond
	}
	if cfg.ReplayWait == 0 {
		cfg.ReplayWait = 500 * time.Millisecond
	}
	if cfg.Checkpoint == 0 {
		cfg.Checkpoint = -1 // only the tests of checkpoints want them
	}
	br, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = br.Run(ctx, kb.engine.Conn())
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(waitBound):
			t.Error("the bridge did not stop")
		}
	})
	return br, reg
}

// series sums a metric of reg with labels.
func series(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v, _ := testkit.Sum(fams, name, labels...)
	return v
}

// freeEndpoint returns tcp://127.0.0.1:PORT of a port free a moment ago.
func freeEndpoint(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return "tcp://" + ln.Addr().String()
}
