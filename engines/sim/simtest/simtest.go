// Package simtest starts simulators for tests, as net/http/httptest
// starts HTTP servers: on a free port of 127.0.0.1, closed when the test
// ends. It lives beside the simulator rather than in internal/testkit so
// that the simulator's own tests can use testkit.
package simtest

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/narwhalmesh/narwhal/engines/sim"
)

// Start builds a simulator from cfg, serves its API and KV side channel
// on free ports of 127.0.0.1, and closes it (every stream and held KV
// handoff with it) when the test ends, failing the test when closing
// fails. Its base URL is the returned
// server's URL(). An invalid cfg or a port that cannot be opened fails
// the test.
func Start(t testing.TB, cfg sim.Config) *sim.Server {
	t.Helper()
	s, err := sim.New(cfg)
	if err != nil {
		t.Fatalf("simulator %q: %v", cfg.EngineID, err)
	}
	if _, err := s.Start("127.0.0.1:0"); err != nil {
		t.Fatalf("simulator %q: %v", cfg.EngineID, err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("simulator %q: close: %v", cfg.EngineID, err)
		}
	})
	return s
}

// KVEventsLeakOptions are the goleak options of a package whose tests
// start simulators with KV events (sim.Config.KVEvents or
// KVEventsConnect): zmq4 v0.17.0, the ZeroMQ implementation behind them,
// leaves one writer goroutine parked per closed PUB socket (docs/
// architecture.md). Pass them to goleak.VerifyTestMain.
func KVEventsLeakOptions() []goleak.Option {
	return []goleak.Option{goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run")}
}
