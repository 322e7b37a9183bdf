package meshview

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/kvevents"
)

// BenchmarkKVEventToEveryRouter3Nodes measures the whole path of an
// engine's KV event (behaviour.md R-PLACE-4): a simulator publishing
// vLLM's KV events on ZeroMQ, the agent's bridge (kvevents, its default
// 5 ms flush) under the engine's credential on one server of a 3-node
// JetStream cluster enforcing the mesh's credentials, and three routers'
// views, each on another server. Each op sends a new 2-block prompt
// straight to the simulator and times from just before the request until
// every router's exact index holds its blocks: an upper bound of publish
// to index, which includes the simulator's answer (its prefill time is
// zero). Reported: p50 and p99 over the ops, in ms, of the slowest
// router each time. Target: p99 within 100 ms. Run with a count of ops,
// e.g. -benchtime 500x.
func BenchmarkKVEventToEveryRouter3Nodes(b *testing.B) {
	dir := bustest.Credentials(b)
	ports := bustest.FreePorts(b, 3)
	var nodes []*bus.Embedded
	for i := range ports {
		var routes []string
		for j := range ports {
			if j != i {
				routes = append(routes, "nats://127.0.0.1:"+strconv.Itoa(ports[j]))
			}
		}
		nodes = append(nodes, bustest.StartWith(b, bus.EmbeddedOptions{Dir: b.TempDir(), Port: -1, AuthDir: dir, NoSetup: true,
			ServerName: fmt.Sprintf("n%d", i+1), Cluster: "127.0.0.1:" + strconv.Itoa(ports[i]), Routes: routes}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*kvWait)
	admin, err := bus.Connect(ctx, bus.ConnectOptions{URL: nodes[0].ClientURL(), Name: "narwhal-bus-setup",
		CredsFile: bustest.CredsFile(dir, bus.RoleAdmin), Setup: &bus.SetupOptions{Replicas: 3}})
	cancel()
	if err != nil {
		b.Fatal(err)
	}
	admin.Close()
	connect := func(node *bus.Embedded, kind, id string) *bus.Bus {
		return bustest.Connect(b, node, bus.ConnectOptions{Name: kind + "-" + id, CredsFile: bustest.Identity(b, dir, kind, id), Role: kind, ID: id})
	}

	engine := simtest.Start(b, sim.Config{Role: sim.RolePrefill, EngineID: "p1", Model: testModel, BlockSize: 16,
		KVCacheBlocks: 1 << 16, KVEvents: "tcp://127.0.0.1:0"})
	br, err := kvevents.New(kvevents.Config{EngineID: "p1", Checkpoint: -1,
		Sources: []kvevents.Source{{Rank: 0, Endpoint: "tcp://" + engine.KVEventsAddr()}}})
	if err != nil {
		b.Fatal(err)
	}
	agentBus := connect(nodes[0], bus.RoleEngine, "p1")
	runCtx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = br.Run(runCtx, agentBus.Conn())
	}()
	b.Cleanup(func() { stop(); wg.Wait() })

	var views []*View
	for i, node := range nodes {
		id := fmt.Sprintf("r%d", i+1)
		s := newStack(b, prefixFleet(), func(c *config.Config) { c.Router.ID = id })
		s.waitModels()
		if err := s.v.Join(connect(node, bus.RoleRouter, id), 500*time.Millisecond); err != nil {
			b.Fatal(err)
		}
		views = append(views, s.v)
	}
	client := &http.Client{Timeout: kvWait}
	b.Cleanup(client.CloseIdleConnections)
	send := func(i int) {
		var p strings.Builder
		for w := range 33 {
			fmt.Fprintf(&p, "q%dw%d ", i, w)
		}
		body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, testModel, p.String())
		resp, err := client.Post(engine.URL()+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("sim: HTTP %d", resp.StatusCode)
		}
	}
	blocks := func(v *View) int {
		if e := v.ExactIndex().Lookup("p1"); e != nil {
			return e.Blocks()
		}
		return 0
	}
	// Each op waits for a growth in all three indexes.
	settled := func(before []int, start time.Time) bool {
		for i, v := range views {
			if blocks(v) <= before[i] {
				if time.Since(start) > kvWait {
					b.Fatalf("router r%d: the prompt's blocks did not reach the index in %v", i+1, kvWait)
				}
				return false
			}
		}
		return true
	}
	before := make([]int, len(views))
	// sendAndWait sends prompt i and polls (every 20 µs, as
	// BenchmarkKVBatchLatency) until every index grew.
	sendAndWait := func(i int) time.Duration {
		for k, v := range views {
			before[k] = blocks(v)
		}
		start := time.Now()
		send(i)
		for !settled(before, start) {
			time.Sleep(20 * time.Microsecond)
		}
		return time.Since(start)
	}
	sendAndWait(-1) // the first batch makes the engine exact in every view
	var lat []time.Duration
	for i := 0; b.Loop(); i++ {
		lat = append(lat, sendAndWait(i))
	}
	reportLatencies(b, lat)
	b.ReportMetric(float64(lat[len(lat)-1])/1e6, "max-ms")
}
