package router

import (
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestBackpressureRFAIL7 proves R-FAIL-7 on both phases: an engine's 503
// with Retry-After reaches the client as 503 with the same Retry-After, is
// published as overload that does not count towards ejection (R-BRK-2),
// and the engine is skipped by this router's placement for that long,
// then placeable again; no quarantine is published.
func TestBackpressureRFAIL7(t *testing.T) {
	for _, phase := range []string{sim.PhasePrefill, sim.PhaseDecode} {
		t.Run(phase, func(t *testing.T) {
			s := faultStack(t, nil)
			engine := "p1"
			if phase == sim.PhaseDecode {
				engine = "d1"
			}
			s.sims[engine].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: phase, Status: 503, RetryAfterS: 1, Count: 1, Message: "busy"})
			hit := time.Now()
			resp, body := s.post(schemas.EndpointChat, chatBody("back off", `"stream":true`))
			if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" {
				t.Fatalf("status %d Retry-After %q, want 503 and 1: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
			}
			if e := errorBody(t, 503, body); e.Message != "busy" {
				t.Fatalf("message %q, want the engine's", e.Message)
			}
			s.idle()
			s.oneFailure(engine, phase, "overload", false)
			s.events.mu.Lock()
			for _, ev := range s.events.all {
				if _, ok := ev.(*schemas.Quarantine); ok {
					t.Errorf("backpressure published a quarantine: %+v", ev)
				}
			}
			s.events.mu.Unlock()
			m := s.rt.fleet().Member(engine)
			if m.Available(time.Now().UnixNano()) || !strings.Contains(m.Unplaceable(time.Now().UnixNano()), "Retry-After") {
				t.Fatal("the engine is placeable right after its Retry-After")
			}
			// While it lasts, the router places nothing on the engine.
			calls := len(s.sims[engine].Requests())
			resp, body = s.post(schemas.EndpointChat, chatBody("still backing off", `"stream":true`))
			if resp.StatusCode != 503 || !strings.Contains(string(body), "no eligible engine for "+phase) {
				t.Fatalf("status %d during the back-off: %s", resp.StatusCode, body)
			}
			if n := len(s.sims[engine].Requests()); n != calls {
				t.Fatalf("the engine got %d requests while it asked to be left alone", n-calls)
			}
			testkit.WaitFor(t, 5*time.Second, "the engine placeable again", func() bool { return m.Available(time.Now().UnixNano()) })
			if waited := time.Since(hit); waited < 900*millisecond {
				t.Fatalf("placeable again after %v, want about 1 s", waited)
			}
			resp, body = s.post(schemas.EndpointChat, chatBody("after the back-off", `"stream":true`))
			if resp.StatusCode != 200 {
				t.Fatalf("status %d after the back-off: %s", resp.StatusCode, body)
			}
			s.validEvents()
		})
	}
}

// TestUnavailableWithoutRetryAfterRFAIL7 proves that a 503 without
// Retry-After stays an engine fault: 502, counted (R-FAIL-6, R-FAIL-7).
func TestUnavailableWithoutRetryAfterRFAIL7(t *testing.T) {
	s := faultStack(t, nil)
	s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 503, Count: 1})
	resp, body := s.post(schemas.EndpointChat, chatBody("plain 503", `"stream":true`))
	if resp.StatusCode != 502 || resp.Header.Get("Retry-After") != "" {
		t.Fatalf("status %d Retry-After %q, want 502 and none: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	s.idle()
	s.oneFailure("d1", "decode", "upstream_status", true)
	if m := s.rt.fleet().Member("d1"); m.BackedOffUntil() != 0 {
		t.Fatal("a 503 without Retry-After made the router back off")
	}
}

// TestBackpressureCappedRFAIL7 proves the engine's Retry-After is capped
// at recovery.max_quarantine_s.
func TestBackpressureCappedRFAIL7(t *testing.T) {
	s := faultStack(t, func(c *config.Config) { c.Recovery.MaxQuarantineS = 2 })
	s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultStatus, Phase: sim.PhaseDecode, Status: 503, RetryAfterS: 3600, Count: 1})
	resp, body := s.post(schemas.EndpointChat, chatBody("long back-off", `"stream":true`))
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "2" {
		t.Fatalf("status %d Retry-After %q, want 503 and 2: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	until := time.Unix(0, s.rt.fleet().Member("d1").BackedOffUntil())
	if d := time.Until(until); d > 2*time.Second || d < time.Second {
		t.Fatalf("skipped for %v more, want at most 2 s", d)
	}
}
