package meshview

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestIndexForgetsEnginesWhoseCacheIsGoneRPLACE2: the entries of an engine
// that is ejected, not active (draining), gone from the fleet or restarted
// (its process_start_time_seconds changed) are dropped, and its queue
// reaches the scorer.
func TestIndexForgetsEnginesWhoseCacheIsGoneRPLACE2(t *testing.T) {
	var start atomic.Value
	start.Store("1700000000.5")
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			fmt.Fprintf(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=%q} 7\nprocess_start_time_seconds %s\n", testModel, start.Load())
		case "/v1/models":
			fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, testModel)
		default:
			http.NotFound(w, r)
		}
	}))
	defer fake.Close()
	s := newStack(t, prefixFleet(), func(c *config.Config) {
		c.Fleet = append(c.Fleet, config.EngineSpec{ID: "p9", URL: fake.URL, Role: connector.RolePrefill, Connector: "nixl"})
		c.Placement.EngineMetricsIntervalS = 0.05
	})
	s.waitModels()
	ix := s.v.PrefixIndex()
	p9 := s.v.Fleet().Member("p9")
	testkit.WaitFor(t, 5*time.Second, "p9's queue to be read", func() bool { return p9.Waiting() == 7 })

	// p9 was read at least once: its start time is known.
	ix.Record("p9", []uint64{1, 2, 3}, nil)
	start.Store("1700000100.25") // p9 restarted
	testkit.WaitFor(t, 2*time.Second, "p9's entries to be dropped", func() bool { return ix.Blocks("p9") == 0 })

	ix.Record("p1", []uint64{1, 2}, nil)
	s.v.setEligibility("p1", false, "test")
	testkit.WaitFor(t, 2*time.Second, "ejected p1's entries to be dropped", func() bool { return ix.Blocks("p1") == 0 })

	ix.Record("p2", []uint64{1, 2}, nil)
	p2 := s.v.Fleet().Member("p2")
	e := *p2.entry.Load()
	e.State = schemas.FleetDraining
	p2.SetEntry(e)
	testkit.WaitFor(t, 2*time.Second, "draining p2's entries to be dropped", func() bool { return ix.Blocks("p2") == 0 })

	ix.Record("gone", []uint64{1}, nil)
	testkit.WaitFor(t, 2*time.Second, "the entries of an engine not in the fleet to be dropped", func() bool { return ix.Blocks("gone") == 0 })
	for _, r := range []string{"restarted", "ejected", "inactive", "removed"} {
		if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_index_drops_total", "reason", r); n != 1 {
			t.Errorf("%v drops for %s, want 1", n, r)
		}
	}
}

// TestIndexRestartFlappingRPLACE2: an engine whose start time changes at
// every read (lying, or restarting in a loop) costs only its own entries:
// a read that finds nothing held for it drops, counts and logs nothing.
func TestIndexRestartFlappingRPLACE2(t *testing.T) {
	var reads atomic.Int64
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			fmt.Fprintf(w, "process_start_time_seconds %d\n", 1700000000+reads.Add(1))
		case "/v1/models":
			fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, testModel)
		default:
			http.NotFound(w, r)
		}
	}))
	defer fake.Close()
	s := newStack(t, prefixFleet(), func(c *config.Config) {
		c.Fleet = append(c.Fleet, config.EngineSpec{ID: "p9", URL: fake.URL, Role: connector.RolePrefill, Connector: "nixl"})
		c.Placement.EngineMetricsIntervalS = 0.02
	})
	s.waitModels()
	testkit.WaitFor(t, 5*time.Second, "p9 to be read a few times", func() bool { return reads.Load() >= 5 })
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_index_drops_total", "reason", "restarted"); n != 0 {
		t.Fatalf("%v restart drops of an engine the index held nothing for", n)
	}
	s.v.PrefixIndex().Record("p9", []uint64{1, 2, 3}, nil)
	testkit.WaitFor(t, 5*time.Second, "p9's entries to be dropped", func() bool { return s.v.PrefixIndex().Blocks("p9") == 0 })
	seen := reads.Load()
	testkit.WaitFor(t, 5*time.Second, "p9 to be read a few times more", func() bool { return reads.Load() >= seen+5 })
	if n := testkit.GatheredSum(t, s.reg, "narwhal_prefix_index_drops_total", "reason", "restarted"); n != 1 {
		t.Fatalf("%v restart drops, want 1: only the read that found entries", n)
	}
}
