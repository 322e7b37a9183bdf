package probe

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
	"github.com/narwhalmesh/narwhal/engines/connector/sglang"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// testModel is the model every simulated engine serves.
const testModel = "m"

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
	c := NewClient(&cfg)
	t.Cleanup(c.HTTPClient().CloseIdleConnections)
	return c
}

// TestProbeTransfer proves the probe of R-BRK-3 and R-PRE-1: a crossed
// transfer is a real one-token prefill with a handoff and a real decode
// that pulls it; a same-worker transfer carries no transfer parameters
// (R-LEG-4); a failing leg comes back as the *engines.Fault of that leg's
// engine, and a handoff that was not consumed is released (R-OWN-6).
func TestTransfer(t *testing.T) {
	ctx := context.Background()
	c := probeClient(t)
	psrv, p := startEngine(t, sim.Config{Role: "prefill", EngineID: "p1"})
	dsrv, d := startEngine(t, sim.Config{Role: "decode", EngineID: "d1"})
	bsrv, b := startEngine(t, sim.Config{Role: "both", EngineID: "b1"})

	if err := Transfer(ctx, c, p, d, testModel); err != nil {
		t.Fatal(err)
	}
	if ps, ds := psrv.Stats(), dsrv.Stats(); ps.Prefills != 1 || ps.KVServed != 1 || ds.KVPulled != 1 || ds.Completed != 1 {
		t.Fatalf("crossed probe: producer %+v consumer %+v", ps, ds)
	}
	pre := psrv.Requests()[0]
	if !strings.HasPrefix(pre.RequestID, RequestIDPrefix) || !strings.Contains(string(pre.Body), `"max_tokens":1`) || pre.Path != schemas.EndpointCompletions {
		t.Fatalf("prefill leg %+v", pre)
	}

	if err := Transfer(ctx, c, b, b, testModel); err != nil {
		t.Fatal(err)
	}
	for _, r := range bsrv.Requests() {
		if strings.Contains(string(r.Body), "kv_transfer_params") {
			t.Fatalf("same-worker leg with transfer parameters: %s", r.Body)
		}
	}

	dsrv.Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 500, Message: "boom"})
	err := Transfer(ctx, c, p, d, testModel)
	var f *engines.Fault
	if !errors.As(err, &f) || f.EngineID != "d1" || f.Phase != schemas.PhaseDecode || !strings.Contains(f.Message, "boom") {
		t.Fatalf("decode failure: %v", err)
	}
	if st := psrv.Stats(); st.KVHeld != 0 || st.KVReleased != 1 {
		t.Fatalf("unconsumed handoff not released: %+v", st)
	}
	dsrv.Disarm()

	psrv.Arm(sim.Fault{Kind: sim.FaultNoDescriptor})
	err = Transfer(ctx, c, p, d, testModel)
	if !errors.As(err, &f) || f.EngineID != "p1" || f.Kind != engines.KindDescriptorRejected {
		t.Fatalf("missing descriptor: %v", err)
	}
	psrv.Disarm()

	// Each leg is bounded by the first-token timeout (R-BRK-3).
	dsrv.Arm(sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhaseDecode, DelayMS: 5000})
	started := time.Now()
	err = Transfer(ctx, c, p, d, testModel)
	if !errors.As(err, &f) || f.Kind != engines.KindFirstTokenTimeout || f.EngineID != "d1" || time.Since(started) > 4*time.Second {
		t.Fatalf("slow decode: %v after %v", err, time.Since(started))
	}
	dsrv.Disarm()

	if err := Transfer(ctx, c, p, d, ""); err == nil {
		t.Fatal("a probe without a model succeeded")
	}
}

// otherConnector is a KV connector other than nixl.
type otherConnector struct{ nixl.Nixl }

func (otherConnector) Name() string { return "other" }

// TestProbeTransferSGLang: with the sglang connector the probe runs the
// router's path (R-DESC-7, R-BRK-3, R-PRE-1): one body with bootstrap
// fields to both engines at once, the decode's KV taken from the room; it
// fails as the producer's fault when the prefill fails (the decode is not
// left waiting for KV), as the consumer's when the decode does.
func TestProbeTransferSGLang(t *testing.T) {
	ctx := context.Background()
	c := probeClient(t)
	sg := func(role, id string) (*sim.Server, *engines.Engine) {
		srv, e := startEngine(t, sim.Config{Role: role, EngineID: id, Connector: sim.ConnectorSGLang, KVTimeout: 10 * time.Second})
		e.Connector = sglang.SGLang{}
		if role == "prefill" {
			_, port, _ := net.SplitHostPort(srv.KVAddr())
			e.BootstrapPort, _ = strconv.Atoi(port)
		}
		return srv, e
	}
	psrv, p := sg("prefill", "p1")
	dsrv, d := sg("decode", "d1")
	if err := Transfer(ctx, c, p, d, testModel); err != nil {
		t.Fatal(err)
	}
	pr, dr := psrv.Requests(), dsrv.Requests()
	if len(pr) != 1 || len(dr) != 1 || string(pr[0].Body) != string(dr[0].Body) || !strings.Contains(string(pr[0].Body), `"bootstrap_room":`) {
		t.Fatalf("probe legs: prefill %+v decode %+v", pr, dr)
	}
	// The simulator counts a completion once its handler returns, which
	// may be just after the probe read [DONE].
	testkit.Poll(2*time.Second, 10*time.Millisecond, func() bool { return dsrv.Stats().Completed == 1 })
	if ds := dsrv.Stats(); ds.KVPulled != 1 || ds.Completed != 1 {
		t.Fatalf("decode %+v", ds)
	}

	psrv.Arm(sim.Fault{Kind: sim.FaultHeaderDelay, DelayMS: 100, Count: 1})
	psrv.Arm(sim.Fault{Kind: sim.FaultStatus, Status: 500, Count: 1})
	start := time.Now()
	err := Transfer(ctx, c, p, d, testModel)
	var f *engines.Fault
	if !errors.As(err, &f) || f.EngineID != "p1" || f.Phase != schemas.PhasePrefill || time.Since(start) > 2*time.Second {
		t.Fatalf("probe with a failing prefill: %v after %v", err, time.Since(start))
	}

	dsrv.Arm(sim.Fault{Kind: sim.FaultStatus, Status: 500, Count: 1})
	err = Transfer(ctx, c, p, d, testModel)
	if !errors.As(err, &f) || f.EngineID != "d1" || f.Phase != schemas.PhaseDecode {
		t.Fatalf("probe with a failing decode: %v", err)
	}
}

// TestCheckContract proves R-BRK-6 and R-PRE-1: the served model, the
// engine kind, the version constraint and the connector are each checked,
// every mismatch is reported as a *ContractError naming the key, and a nil
// contract only needs a model list.
func TestCheckContract(t *testing.T) {
	ctx := context.Background()
	httpc := &http.Client{}
	t.Cleanup(httpc.CloseIdleConnections)
	srv, e := startEngine(t, sim.Config{Role: "decode", EngineID: "d1", EngineVersion: "0.10.2"})
	contract := &config.Contract{Model: testModel, Engine: "VLLM", Version: ">=0.10,<0.11", Connector: "nixl"}
	if err := CheckContract(ctx, httpc, e, contract); err != nil {
		t.Fatalf("matching engine: %v", err)
	}
	if err := CheckContract(ctx, httpc, e, nil); err != nil {
		t.Fatalf("no contract: %v", err)
	}
	if err := engines.CheckHealth(ctx, httpc, e); err != nil {
		t.Fatal(err)
	}

	fields := func(err error) []string {
		var out []string
		for _, x := range err.(interface{ Unwrap() []error }).Unwrap() {
			var ce *ContractError
			if !errors.As(x, &ce) || ce.EngineID != "d1" {
				t.Fatalf("not a contract error of d1: %v", x)
			}
			out = append(out, ce.Field)
		}
		return out
	}
	bad := &config.Contract{Model: "other", Engine: "sglang", Version: ">=0.11", Connector: "nixl"}
	err := CheckContract(ctx, httpc, &engines.Engine{ID: e.ID, URL: e.URL, Role: e.Role, Connector: otherConnector{}}, bad)
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
	if err := CheckContract(ctx, httpc, e, contract); err == nil || !strings.Contains(err.Error(), "engine d1: /v1/models") {
		t.Fatalf("engine down: %v", err)
	}
}
