package bench

import (
	"context"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/kvevents"
)

// kvAgents carry the KV events of a lane's prefill simulators to its bus,
// as `narwhal agent --kv-events` does beside each engine: one bridge per
// simulator (kvevents.Bridge), with the agent's defaults, on one
// connection of the bench's (the bench's bus enforces no credentials).
type kvAgents struct {
	nc     *nats.Conn
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// startKVAgents connects to the bus at url and starts a bridge for every
// prefill simulator of l, which must have been started with
// LocalConfig.KVEvents. It returns an error when the bus is unreachable
// or a simulator has no KV event endpoint.
func startKVAgents(url string, l *LocalEngines) (*kvAgents, error) {
	nc, err := nats.Connect(url, nats.Name("narwhal-bench-agents"))
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	a := &kvAgents{nc: nc, cancel: cancel}
	for i, e := range l.Prefill {
		addr := l.Sims[i].KVEventsAddr()
		if addr == "" {
			a.close()
			return nil, fmt.Errorf("%s publishes no KV events", e.ID)
		}
		br, err := kvevents.New(kvevents.Config{EngineID: e.ID, Sources: []kvevents.Source{{Rank: 0, Endpoint: "tcp://" + addr}}})
		if err != nil {
			a.close()
			return nil, err
		}
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			_ = br.Run(ctx, nc)
		}()
	}
	return a, nil
}

// close stops the bridges and closes the connection.
func (a *kvAgents) close() {
	a.cancel()
	a.wg.Wait()
	a.nc.Close()
}
