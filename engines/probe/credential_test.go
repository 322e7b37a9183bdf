package probe

import (
	"context"
	"crypto/tls"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// testTLS returns a server TLS configuration for 127.0.0.1 signed by a
// fresh CA, and that CA's certificate as a PEM file.
func testTLS(t *testing.T) (*tls.Config, string) {
	t.Helper()
	ca := testkit.NewCA(t)
	return ca.ServerTLS(t, "engine"), ca.Path
}

// TestProbeWithEngineKeys proves the breaker's checks and inference probe
// against engines behind --api-key over https:// (issue 10 item 6,
// R-BRK-3): the engine's credential rides on the health check, the model
// list, both probe legs and the release of an unconsumed handoff, and a
// refused credential comes back as engine_unauthorized, not as a stream
// failure.
func TestProbeWithEngineKeys(t *testing.T) {
	const key = "probe-key-51e0"
	serverTLS, caFile := testTLS(t)
	cfg, err := config.Parse([]byte("engine:\n  first_token_timeout_s: 2\n  tls_ca_file: " + caFile + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient(cfg)
	t.Cleanup(c.HTTPClient().CloseIdleConnections)
	psrv, p := startEngine(t, sim.Config{Role: "prefill", EngineID: "p1", APIKey: key, TLS: serverTLS})
	dsrv, d := startEngine(t, sim.Config{Role: "decode", EngineID: "d1", APIKey: key, TLS: serverTLS})
	if !strings.HasPrefix(p.URL, "https://") {
		t.Fatalf("engine not on https: %s", p.URL)
	}
	p.Credential, d.Credential = engines.NewCredential(key), engines.NewCredential(key)
	ctx := context.Background()

	if err := engines.CheckHealth(ctx, c.HTTPClient(), p); err != nil {
		t.Fatal(err)
	}
	if err := CheckContract(ctx, c.HTTPClient(), d, nil); err != nil {
		t.Fatalf("model list with the key: %v", err)
	}
	if err := Transfer(ctx, c, p, d, testModel); err != nil {
		t.Fatalf("probe with the key: %v", err)
	}
	if ps, ds := psrv.Stats(), dsrv.Stats(); ps.Prefills != 1 || ds.KVPulled != 1 || ps.Unauthorized+ds.Unauthorized != 0 {
		t.Fatalf("producer %+v consumer %+v", ps, ds)
	}

	// The consumer refuses a wrong key: the probe fails on the decode leg
	// as engine_unauthorized, and the producer's handoff is released with
	// the producer's own (right) key.
	wrong := *d
	wrong.Credential = engines.NewCredential("not-the-key")
	err = Transfer(ctx, c, p, &wrong, testModel)
	var f *engines.Fault
	if !errors.As(err, &f) || f.Kind != engines.KindEngineUnauthorized || f.EngineID != "d1" || f.Phase != schemas.PhaseDecode || f.CountsTowardEjection() {
		t.Fatalf("probe with a wrong decode key: %v, want a decode engine_unauthorized of d1 that does not count", err)
	}
	testkit.WaitFor(t, 2*time.Second, "the producer's release", func() bool { return psrv.Stats().KVReleased == 1 })
	if st := psrv.Stats(); st.KVReleased != 1 || st.KVHeld != 0 {
		t.Errorf("producer after the refused decode: %+v, want its handoff released", st)
	}
	if dsrv.Stats().Unauthorized != 1 {
		t.Errorf("d1 refused %d requests, want 1", dsrv.Stats().Unauthorized)
	}

	// Without a key at all: the health check passes (vLLM leaves /health
	// open) but the model list and the prefill leg are refused.
	bare := *p
	bare.Credential = engines.Credential{}
	if err := engines.CheckHealth(ctx, c.HTTPClient(), &bare); err != nil {
		t.Errorf("health without a key: %v", err)
	}
	if err := CheckContract(ctx, c.HTTPClient(), &bare, nil); err == nil || !strings.Contains(err.Error(), "HTTP 401") {
		t.Errorf("model list without a key: %v, want HTTP 401", err)
	}
	err = Transfer(ctx, c, &bare, d, testModel)
	if !errors.As(err, &f) || f.Kind != engines.KindEngineUnauthorized || f.Phase != schemas.PhasePrefill || f.UpstreamStatus != 401 {
		t.Errorf("probe without the producer's key: %v", err)
	}
}
