package breaker

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
)

// startEngine starts a simulator and returns it with its client-side
// description.
func startEngine(t *testing.T, cfg sim.Config) (*sim.Server, *engines.Engine) {
	t.Helper()
	if cfg.Model == "" {
		cfg.Model = testModel
	}
	srv := simtest.Start(t, cfg)
	role := connector.Role(cfg.Role)
	if role == "" {
		role = connector.RoleBoth
	}
	return srv, &engines.Engine{ID: cfg.EngineID, URL: srv.URL(), Role: role, Connector: nixl.Nixl{}}
}

func probeClient(t *testing.T) *engines.Client {
	t.Helper()
	cfg := config.Default()
	cfg.Engine.FirstTokenTimeoutS = 2
	c := kvprobe.NewClient(&cfg)
	t.Cleanup(c.HTTPClient().CloseIdleConnections)
	return c
}

// otherConnector is a KV connector other than nixl.
type otherConnector struct{ nixl.Nixl }

func (otherConnector) Name() string { return "other" }

// TestCheckContract proves R-BRK-6 and R-PRE-1: the served model, the
// engine kind, the version constraint and the connector are each checked,
// every mismatch is reported as a *engines.ContractError naming the key, and a nil
// contract only needs a model list.
func TestCheckContract(t *testing.T) {
	ctx := context.Background()
	httpc := &http.Client{}
	t.Cleanup(httpc.CloseIdleConnections)
	srv, e := startEngine(t, sim.Config{Role: "decode", EngineID: "d1", EngineVersion: "0.10.2"})
	contract := &config.Contract{Model: testModel, Engine: "VLLM", Version: ">=0.10,<0.11", Connector: "nixl"}
	if err := engines.CheckContract(ctx, httpc, e, contract); err != nil {
		t.Fatalf("matching engine: %v", err)
	}
	if err := engines.CheckContract(ctx, httpc, e, nil); err != nil {
		t.Fatalf("no contract: %v", err)
	}
	if err := engines.CheckHealth(ctx, httpc, e); err != nil {
		t.Fatal(err)
	}

	fields := func(err error) []string {
		var out []string
		for _, x := range err.(interface{ Unwrap() []error }).Unwrap() {
			var ce *engines.ContractError
			if !errors.As(x, &ce) || ce.EngineID != "d1" {
				t.Fatalf("not a contract error of d1: %v", x)
			}
			out = append(out, ce.Field)
		}
		return out
	}
	bad := &config.Contract{Model: "other", Engine: "sglang", Version: ">=0.11", Connector: "nixl"}
	err := engines.CheckContract(ctx, httpc, &engines.Engine{ID: e.ID, URL: e.URL, Role: e.Role, Connector: otherConnector{}}, bad)
	if got := strings.Join(fields(err), ","); got != "model,engine,version,connector" {
		t.Fatalf("mismatches %q: %v", got, err)
	}
	if !strings.Contains(err.Error(), `engine d1 breaks engine_contract.version: want ">=0.11", got "0.10.2"`) {
		t.Fatalf("message: %v", err)
	}

	srv.Arm(sim.Fault{Kind: sim.FaultHealthStatus, Status: 503, Message: "warming up"})
	if err := engines.CheckHealth(ctx, httpc, e); err == nil || !strings.Contains(err.Error(), "HTTP 503: warming up") {
		t.Fatalf("unhealthy engine: %v", err)
	}
	srv.Close()
	if err := engines.CheckContract(ctx, httpc, e, contract); err == nil || !strings.Contains(err.Error(), "engine d1: /v1/models") {
		t.Fatalf("engine down: %v", err)
	}
}
