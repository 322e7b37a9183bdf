package router

import (
	"go/ast"
	"go/parser"
	"go/token"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// gathered returns the router's metric families by name.
func (s *stack) gathered() map[string]*dto.MetricFamily {
	s.t.Helper()
	mfs, err := s.rt.Registry().Gather()
	if err != nil {
		s.t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

// series returns the metric of family name whose labels include every
// pair of labels, or nil.
func series(mf *dto.MetricFamily, labels ...string) *dto.Metric {
	if mf == nil {
		return nil
	}
next:
	for _, m := range mf.GetMetric() {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, lp := range m.GetLabel() {
				if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		return m
	}
	return nil
}

// TestRequestMetricsByModelRTIME1 proves the request series carry the
// model label (the request's model when the fleet serves it, "other"
// otherwise), that token counts and the inter-token latency are counted
// per generated chunk, and that narwhal_ttft_seconds and
// narwhal_first_byte_seconds are both observed (R-TIME-1).
func TestRequestMetricsByModelRTIME1(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	const tokens = 6
	resp, body := s.post(schemas.EndpointChat, `{"model":"sim-model","messages":[{"role":"user","content":"a b c"}],"max_tokens":`+strconv.Itoa(tokens)+`,"stream":true}`)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if resp, body := s.post(schemas.EndpointChat, `{"model":"no-such-model","messages":[{"role":"user","content":"a"}]}`); resp.StatusCode != 404 {
		t.Fatalf("unknown model: %d %s", resp.StatusCode, body)
	}
	s.idle()
	g := s.gathered()
	if m := series(g["narwhal_requests_total"], "model", testModel, "outcome", "ok", "code", "200"); m.GetCounter().GetValue() != 1 {
		t.Errorf("narwhal_requests_total{model=%s,outcome=ok} = %v, want 1", testModel, m.GetCounter().GetValue())
	}
	if m := series(g["narwhal_requests_total"], "model", otherModel, "code", "404"); m.GetCounter().GetValue() != 1 {
		t.Errorf(`narwhal_requests_total{model="other",code="404"} = %v, want 1`, m.GetCounter().GetValue())
	}
	if m := series(g["narwhal_requests_total"], "model", "no-such-model"); m != nil {
		t.Errorf("a model the fleet does not serve has its own series: %v", m)
	}
	for _, name := range []string{"narwhal_ttft_seconds", "narwhal_first_byte_seconds"} {
		if m := series(g[name], "model", testModel); m.GetHistogram().GetSampleCount() != 1 {
			t.Errorf("%s{model=%s} count %v, want 1", name, testModel, m.GetHistogram().GetSampleCount())
		}
	}
	// One observation per generated chunk after the first (the chunk
	// with finish_reason counts as output).
	outputs := 0
	for _, p := range sseEvents(body) {
		if schemas.ClassifyChunk([]byte(p)) == schemas.ChunkOutput {
			outputs++
		}
	}
	if outputs < tokens {
		t.Fatalf("%d output chunks for %d tokens", outputs, tokens)
	}
	if m := series(g["narwhal_inter_token_seconds"], "model", testModel); m.GetHistogram().GetSampleCount() != uint64(outputs-1) {
		t.Errorf("narwhal_inter_token_seconds{model=%s} count %v, want %d", testModel, m.GetHistogram().GetSampleCount(), outputs-1)
	}
	ev := s.events.requests()[0]
	if m := series(g["narwhal_generation_tokens_total"], "model", testModel); m.GetCounter().GetValue() != float64(tokens) {
		t.Errorf("narwhal_generation_tokens_total{model=%s} = %v, want %d (event: %+v)", testModel, m.GetCounter().GetValue(), tokens, ev)
	}
	if m := series(g["narwhal_prompt_tokens_total"], "model", testModel); m.GetCounter().GetValue() < 3 {
		t.Errorf("narwhal_prompt_tokens_total{model=%s} = %v, want the prompt's tokens", testModel, m.GetCounter().GetValue())
	}
	for _, phase := range []string{schemas.PhasePrefill, schemas.PhaseDecode} {
		if m := series(g["narwhal_leg_seconds"], "phase", phase, "model", testModel); m.GetHistogram().GetSampleCount() != 1 {
			t.Errorf("narwhal_leg_seconds{phase=%s,model=%s} count %v, want 1", phase, testModel, m.GetHistogram().GetSampleCount())
		}
	}
}

// TestModelLabelBounded proves the model label's values stay bounded
// whatever the engines list (R-BUS-1): a model id longer than
// maxModelLabelBytes, and every model past the first maxModelLabels, is
// counted as "other".
func TestModelLabelBounded(t *testing.T) {
	m := newMetrics(prometheus.NewRegistry(), func() *fleet { return &fleet{} }, "r", time.Minute)
	if got := m.series(strings.Repeat("m", maxModelLabelBytes+1)); got != m.other {
		t.Errorf("a %d-byte model has the label %.20q…, want %q", maxModelLabelBytes+1, got.label, otherModel)
	}
	if got := m.series(strings.Repeat("m", maxModelLabelBytes)); got.label != strings.Repeat("m", maxModelLabelBytes) {
		t.Errorf("a %d-byte model has the label %q", maxModelLabelBytes, got.label)
	}
	for i := range maxModelLabels {
		m.series("model-" + strconv.Itoa(i))
	}
	if got := m.series("one-too-many"); got != m.other {
		t.Errorf("model %d has the label %q, want %q", maxModelLabels+2, got.label, otherModel)
	}
}

// TestLabelledCountersStartAtZeroRBUS1 proves that the labelled counters
// alerts watch have their series before anything happened: engine faults
// for every engine, phase it serves and kind, retry denials by reason,
// ignored bus values by reason, successes per key and model.
func TestLabelledCountersStartAtZeroRBUS1(t *testing.T) {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}, {id: "b1", role: "both"}}, func(c *config.Config) {
		c.Auth.APIKeys = []config.APIKey{{Name: "team-a", KeySHA256: keyDigest("sk-a")}}
	})
	s.waitModels()
	g := s.gathered()
	want := [][]string{
		{"narwhal_engine_faults_total", "engine", "p1", "phase", "prefill", "kind", string(engines.KindConnectError)},
		{"narwhal_engine_faults_total", "engine", "d1", "phase", "decode", "kind", string(engines.KindFirstTokenTimeout)},
		{"narwhal_engine_faults_total", "engine", "b1", "phase", "prefill", "kind", string(engines.KindPrefillTimeout)},
		{"narwhal_engine_faults_total", "engine", "b1", "phase", "decode", "kind", string(engines.KindMidStreamSilence)},
		{"narwhal_engine_credentials_refused_total", "engine", "d1"},
		{"narwhal_retries_denied_total", "reason", "budget"},
		{"narwhal_retries_denied_total", "reason", "deadline"},
		{"narwhal_placement_ignored_total", "reason", "not_leader"},
		{"narwhal_fleet_ignored_total", "reason", "invalid"},
		{"narwhal_front_door_refused_total", "reason", "max_inflight"},
		{"narwhal_requests_total", "endpoint", schemas.EndpointChat, "code", "200", "outcome", "ok", "key", "team-a", "model", testModel},
		{"narwhal_prompt_tokens_total", "model", testModel},
		{"narwhal_generation_tokens_total", "model", otherModel},
		{"narwhal_router_info", "router", "rt-test"},
	}
	for _, w := range want {
		m := series(g[w[0]], w[1:]...)
		if m == nil {
			t.Errorf("%s%v: no series at start", w[0], w[1:])
			continue
		}
		if v := m.GetCounter().GetValue() + m.GetGauge().GetValue(); v != 0 && w[0] != "narwhal_router_info" {
			t.Errorf("%s%v = %v at start, want 0", w[0], w[1:], v)
		}
	}
	if m := series(g["narwhal_engine_faults_total"], "engine", "p1", "phase", "decode"); m != nil {
		t.Errorf("a prefill engine has decode fault series: %v", m)
	}
}

// TestHistogramsReachTheRequestDeadlineRTMO5 proves the latency
// histograms' top bucket is the request deadline (request.timeout_s,
// R-TMO-5): a request that lasted minutes still lands in a bucket.
func TestHistogramsReachTheRequestDeadlineRTMO5(t *testing.T) {
	b := latencyBuckets(600 * time.Second)
	if b[len(b)-1] != 600 || b[0] != 0.0005 {
		t.Errorf("buckets %v: want 0.0005 … 600", b)
	}
	for i := 1; i < len(b); i++ {
		if b[i] <= b[i-1] {
			t.Fatalf("buckets not increasing: %v", b)
		}
	}
	s := newStack(t, pd(), func(c *config.Config) { c.Request.TimeoutS = 900 })
	for name, mf := range s.gathered() {
		if mf.GetType() != dto.MetricType_HISTOGRAM || len(mf.GetMetric()) == 0 || !strings.HasSuffix(name, "_seconds") {
			continue
		}
		bk := mf.GetMetric()[0].GetHistogram().GetBucket()
		if top := bk[len(bk)-1].GetUpperBound(); top != 900 {
			t.Errorf("%s: top bucket %v, want the deadline 900", name, top)
		}
	}
}

// TestMetricHelpIsPlainRTIME1 proves the help texts say what users need:
// a unit for every histogram, the TTFT that vLLM users know on
// narwhal_first_byte_seconds, the prefill leg on narwhal_ttft_seconds
// (R-TIME-1), and no rule id.
func TestMetricHelpIsPlainRTIME1(t *testing.T) {
	s := newStack(t, pd(), nil)
	rule := regexp.MustCompile(`R-[A-Z]+-[0-9]`)
	g := s.gathered()
	for name, mf := range g {
		help := mf.GetHelp()
		if rule.MatchString(help) || len(help) < 20 {
			t.Errorf("%s: help %q", name, help)
		}
		if mf.GetType() == dto.MetricType_HISTOGRAM && !strings.Contains(help, "Seconds") && !(strings.HasSuffix(name, "_tokens") && strings.Contains(help, "tokens")) {
			t.Errorf("%s: help %q names no unit", name, help)
		}
	}
	if h := g["narwhal_first_byte_seconds"].GetHelp(); !strings.Contains(h, "vllm:time_to_first_token_seconds") || !strings.Contains(h, "first generated token") {
		t.Errorf("narwhal_first_byte_seconds help %q", h)
	}
	if h := g["narwhal_ttft_seconds"].GetHelp(); !strings.Contains(h, "prefill leg completed") || !strings.Contains(h, "not the time to the first generated token") {
		t.Errorf("narwhal_ttft_seconds help %q", h)
	}
}

// TestEngineFaultKindsAreListedRBUS1 proves engineFaultKinds holds every
// engine fault kind engines declares, so that each has its zero series.
func TestEngineFaultKindsAreListedRBUS1(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "../engines/fault.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	listed := map[engines.FaultKind]bool{}
	for _, k := range engineFaultKinds {
		listed[k] = true
		if !(&engines.Fault{Kind: k}).EngineFault() {
			t.Errorf("%s is listed but is not an engine fault", k)
		}
	}
	n := 0
	for _, d := range f.Decls {
		gd, ok := d.(*ast.GenDecl)
		if !ok || gd.Tok != token.CONST {
			continue
		}
		for _, sp := range gd.Specs {
			vs := sp.(*ast.ValueSpec)
			if id, ok := vs.Type.(*ast.Ident); !ok || id.Name != "FaultKind" {
				continue
			}
			for _, v := range vs.Values {
				lit, ok := v.(*ast.BasicLit)
				if !ok {
					continue
				}
				k := engines.FaultKind(strings.Trim(lit.Value, `"`))
				n++
				if (&engines.Fault{Kind: k}).EngineFault() && !listed[k] {
					t.Errorf("engine fault kind %s is missing from engineFaultKinds", k)
				}
			}
		}
	}
	if n < 10 {
		t.Fatalf("found %d fault kinds in engines/fault.go; did the file move?", n)
	}
}
