package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// checkSane asserts a report of a run that should have had no errors:
// requests done, every one OK, max_tokens tokens each (ignore_eos), one
// TTFT and E2E per request, one ITL per output chunk after the first (the
// tokens and the finish chunk), TTFT ≤ E2E at every percentile, and rates
// that agree with the counts.
func checkSane(t *testing.T, rep *Report, tokens int) {
	t.Helper()
	if rep.Requests == 0 || rep.OK != rep.Requests || len(rep.Errors) != 0 {
		t.Fatalf("%s: requests %d ok %d errors %v; want some, all OK", rep.Target, rep.Requests, rep.OK, rep.Errors)
	}
	if rep.OutputTokens != int64(tokens*rep.OK) {
		t.Errorf("%s: output tokens %d, want %d × %d", rep.Target, rep.OutputTokens, tokens, rep.OK)
	}
	if rep.TTFT.Count != rep.OK || rep.E2E.Count != rep.OK || rep.ITL.Count != tokens*rep.OK {
		t.Errorf("%s: samples ttft %d e2e %d itl %d; want %d, %d, %d", rep.Target, rep.TTFT.Count, rep.E2E.Count, rep.ITL.Count, rep.OK, rep.OK, tokens*rep.OK)
	}
	// The bound on E2E catches a unit slip (milliseconds or nanoseconds
	// read as seconds), not a slow machine: an open loop on a loaded one
	// queues its arrivals for seconds.
	if rep.TTFT.P50S <= 0 || rep.TTFT.P50S > rep.E2E.P50S || rep.TTFT.P99S > rep.E2E.P99S || rep.E2E.MaxS > 30 {
		t.Errorf("%s: TTFT %+v / E2E %+v not sane", rep.Target, rep.TTFT, rep.E2E)
	}
	if rep.ElapsedS <= 0 || rep.RequestsPerS <= 0 {
		t.Fatalf("%s: elapsed %g s, %g req/s", rep.Target, rep.ElapsedS, rep.RequestsPerS)
	}
	if got := float64(rep.Requests) / rep.ElapsedS; got != rep.RequestsPerS {
		t.Errorf("%s: requests/s %g, want requests/elapsed %g", rep.Target, rep.RequestsPerS, got)
	}
	if rep.BenchProcess.CPUS <= 0 || rep.BenchProcess.AllocsPerRequest <= 0 {
		t.Errorf("%s: bench process cost not measured: %+v", rep.Target, rep.BenchProcess)
	}
}

func stackWorkload(model string) Workload {
	wl := testWorkload(model, 8)
	wl.Requests = 0
	wl.Duration = 300 * time.Millisecond
	wl.Warmup = 50 * time.Millisecond
	// An open loop on a loaded machine queues its arrivals for seconds
	// (checkSane's E2E bound): 5 s timed out a third of 100 arrivals under
	// -race in the full suite. A request that hangs still fails.
	wl.Timeout = 30 * time.Second
	return wl
}

// A short closed-loop run through the router (behaviour.md R-API-1, R-LEG-5)
// ends in a report with no errors and sane numbers; the progress line is
// written meanwhile.
func TestClosedLoopThroughRouter(t *testing.T) {
	s := startStack(t, LocalConfig{})
	target := NewRouterTarget(s.url, 4)
	defer target.Close()
	models, err := target.Models(context.Background())
	if err != nil || len(models) != 1 || models[0] != s.engines.Model {
		t.Fatalf("models %v, %v; want [%s]", models, err, s.engines.Model)
	}
	wl := stackWorkload(models[0])
	wl.Concurrency = 4
	var progress bytes.Buffer
	rep, err := Run(context.Background(), target, wl, RunOptions{Progress: &Progress{W: &progress, Interval: 50 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	checkSane(t, rep, 8)
	if rep.Target != "router" || rep.URL != s.url {
		t.Errorf("target %q url %q", rep.Target, rep.URL)
	}
	lines := strings.Split(strings.TrimSpace(progress.String()), "\n")
	if len(lines) < 3 || !strings.Contains(lines[len(lines)-1], "req/s") || !strings.HasPrefix(lines[len(lines)-1], "router") {
		t.Errorf("progress lines: %q", lines)
	}
}

// A short open-loop run (Poisson arrivals at 200/s) through the router
// ends with no errors; the number of arrivals is about rate × duration.
func TestOpenLoopThroughRouter(t *testing.T) {
	s := startStack(t, LocalConfig{})
	target := NewRouterTarget(s.url, 16)
	defer target.Close()
	wl := stackWorkload(s.engines.Model)
	wl.Concurrency, wl.Rate = 0, 200
	wl.Duration = 500 * time.Millisecond
	rep, err := Run(context.Background(), target, wl, RunOptions{})
	if err != nil {
		t.Fatal(err)
	}
	checkSane(t, rep, 8)
	// Poisson with mean 100: [50, 150] is more than 5 standard deviations.
	if rep.Requests < 50 || rep.Requests > 150 {
		t.Errorf("%d arrivals in 0.5 s at 200/s, want about 100", rep.Requests)
	}
}

// Open loop with --requests sends exactly that many.
func TestOpenLoopRequestBudget(t *testing.T) {
	s := startStack(t, LocalConfig{})
	target := NewRouterTarget(s.url, 16)
	defer target.Close()
	wl := stackWorkload(s.engines.Model)
	wl.Concurrency, wl.Rate, wl.Duration, wl.Requests, wl.Warmup = 0, 500, 0, 37, 0
	rep, err := Run(context.Background(), target, wl, RunOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Requests != 37 || rep.OK != 37 {
		t.Fatalf("requests %d ok %d, want 37", rep.Requests, rep.OK)
	}
}

// The floor runs the same legs the router runs (R-LEG-1…5): for the same
// prompt and sampling it streams the same generated text as the router.
func TestFloorMatchesRouterText(t *testing.T) {
	s := startStack(t, LocalConfig{})
	rt := NewRouterTarget(s.url, 1)
	defer rt.Close()
	floor, err := s.engines.Floor()
	if err != nil {
		t.Fatal(err)
	}
	defer floor.Close()
	for _, endpoint := range []string{schemas.EndpointChat, schemas.EndpointCompletions} {
		for _, stream := range []bool{true, false} {
			wl := testWorkload(s.engines.Model, 12)
			wl.Endpoint, wl.Stream, wl.IgnoreEOS = endpoint, stream, false
			texts := map[string][]string{}
			for _, target := range []Target{rt, floor} {
				var live counters
				w := newWorker(wl.shape(), &wl, 42, &live) // same seed: same prompts
				for i := 0; i < 3; i++ {
					agg := schemas.NewAggregator(endpoint == schemas.EndpointChat)
					var whole []byte
					w.onPayload = func(p []byte) {
						if !stream && target == Target(rt) {
							whole = append(whole[:0], p...) // the router's aggregated JSON
							return
						}
						if err := agg.Add(p); err != nil {
							t.Fatalf("%s: aggregate %s: %v", target.Name(), p, err)
						}
					}
					target.do(context.Background(), w, time.Now())
					if whole == nil {
						whole = agg.AppendJSON(nil)
					}
					texts[target.Name()] = append(texts[target.Name()], completionText(t, whole))
				}
				if w.rec.ok != 3 {
					t.Fatalf("%s %s stream=%v: ok %d errors %v", target.Name(), endpoint, stream, w.rec.ok, w.rec.errors)
				}
			}
			r, f := texts["router"], texts["floor"]
			if len(r) != 3 || r[0] == "" || r[0] == r[1] || strings.Join(r, "|") != strings.Join(f, "|") {
				t.Errorf("%s stream=%v: router texts %q, floor texts %q; want the same three different texts", endpoint, stream, r, f)
			}
		}
	}
}

// completionText returns the generated text of a chat or text completion
// JSON (the last request's).
func completionText(t *testing.T, completion []byte) string {
	t.Helper()
	var c struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(completion, &c); err != nil || len(c.Choices) != 1 {
		t.Fatalf("completion %s: %v", completion, err)
	}
	return c.Choices[0].Text + c.Choices[0].Message.Content
}

// Compare interleaves the router and the floor over the same sims and
// reports both sides, the added latency as router minus floor and the
// throughput ratio.
func TestCompareInterleaved(t *testing.T) {
	s := startStack(t, LocalConfig{})
	rt := NewRouterTarget(s.url, 2)
	defer rt.Close()
	floor, err := s.engines.Floor()
	if err != nil {
		t.Fatal(err)
	}
	defer floor.Close()
	wl := stackWorkload(s.engines.Model)
	wl.Concurrency = 2
	wl.Duration = 400 * time.Millisecond
	var progress bytes.Buffer
	cmp, err := Compare(context.Background(), rt, floor, wl, CompareOptions{Slices: 3, RunOptions: RunOptions{Progress: &Progress{W: &progress, Interval: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	if cmp.Slices != 4 {
		t.Errorf("slices = %d, want 3 rounded up to 4", cmp.Slices)
	}
	checkSane(t, cmp.Router, 8)
	checkSane(t, cmp.Floor, 8)
	if cmp.Router.Target != "router" || cmp.Floor.Target != "floor" {
		t.Errorf("sides %q, %q", cmp.Router.Target, cmp.Floor.Target)
	}
	if cmp.AddedTTFT.P90S != cmp.Router.TTFT.P90S-cmp.Floor.TTFT.P90S || cmp.AddedE2E.P50S != cmp.Router.E2E.P50S-cmp.Floor.E2E.P50S {
		t.Errorf("added latency %+v / %+v is not router minus floor", cmp.AddedTTFT, cmp.AddedE2E)
	}
	if want := cmp.Router.RequestsPerS / cmp.Floor.RequestsPerS; cmp.ThroughputRatio != want {
		t.Errorf("throughput ratio %g, want %g", cmp.ThroughputRatio, want)
	}
	// The slices ran in ABBA order: the final progress lines tell.
	var order []string
	for _, l := range strings.Split(progress.String(), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] != "warmup" {
			order = append(order, f[0])
		}
	}
	if strings.Join(order, " ") != "router floor floor router" {
		t.Errorf("slice order %v, want router floor floor router", order)
	}
	if cmp.Router.RouterProcess != nil || cmp.RouterCPUPerRequestUS != 0 {
		t.Error("router CPU reported for an in-process router")
	}
}

// With the router in a child process, Compare reads its CPU time from
// /proc and reports it per request.
func TestCompareRouterProcessCPU(t *testing.T) {
	l, err := StartLocal(LocalConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	proc, err := StartRouterProcess(context.Background(), RouterProcessOptions{Exe: exe, Fleet: l.Specs, Env: []string{childRouterEnv + "=1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := proc.Stop(); err != nil {
			t.Errorf("stop router process: %v\n%s", err, proc.Output())
		}
	}()
	if _, err := ProcessCPU(proc.PID()); err != nil {
		t.Fatal(err)
	}
	rt := NewRouterTarget(proc.URL, 4)
	defer rt.Close()
	floor, _ := l.Floor()
	defer floor.Close()
	wl := stackWorkload(l.Model)
	wl.Concurrency = 4
	wl.Duration = 600 * time.Millisecond
	cmp, err := Compare(context.Background(), rt, floor, wl, CompareOptions{Slices: 2, RunOptions: RunOptions{RouterPID: proc.PID(), BenchHolds: "4 sims"}})
	if err != nil {
		t.Fatal(err)
	}
	checkSane(t, cmp.Router, 8)
	rp := cmp.Router.RouterProcess
	if rp == nil || rp.CPUS <= 0 || cmp.RouterCPUPerRequestUS <= 0 {
		t.Fatalf("router CPU not measured: %+v, %g µs/request", rp, cmp.RouterCPUPerRequestUS)
	}
	if want := rp.CPUS * 1e6 / float64(cmp.Router.Requests); !near(cmp.RouterCPUPerRequestUS, want) {
		t.Errorf("router CPU per request %g µs, want %g", cmp.RouterCPUPerRequestUS, want)
	}
	if cmp.Floor.RouterProcess != nil {
		t.Error("the floor side has a router process cost")
	}
	if cmp.SimsCPUPerRequestUSHigh != cmp.Floor.BenchProcess.CPUPerRequestUS || cmp.SimsCPUPerRequestUSLow > cmp.SimsCPUPerRequestUSHigh {
		t.Errorf("sims estimate %g–%g µs, floor bench process %g µs", cmp.SimsCPUPerRequestUSLow, cmp.SimsCPUPerRequestUSHigh, cmp.Floor.BenchProcess.CPUPerRequestUS)
	}
	if !strings.Contains(cmp.Router.BenchProcess.Holds, "4 sims") {
		t.Errorf("holds %q", cmp.Router.BenchProcess.Holds)
	}
}

func near(a, b float64) bool { return a-b < 1e-9*b+1e-9 && b-a < 1e-9*b+1e-9 }

func TestParseStatCPU(t *testing.T) {
	// A command name with spaces and parentheses; utime 250, stime 50.
	stat := []byte("4242 (narwhal (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 100 0 0")
	got, err := parseStatCPU(stat)
	if want := time.Duration(300 * int64(time.Second) / clockTicks); err != nil || got != want {
		t.Fatalf("parseStatCPU = %v, %v; want %v", got, err, want)
	}
	for _, bad := range []string{"", "1 (x) S 1 2", "1 (x) S 1 2 3 4 5 6 7 8 9 a b c d"} {
		if _, err := parseStatCPU([]byte(bad)); err == nil {
			t.Errorf("parseStatCPU(%q) accepted", bad)
		}
	}
}

// Workload validation names what is wrong.
func TestWorkloadValidate(t *testing.T) {
	ok := testWorkload("m", 1)
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, mutate := range map[string]func(*Workload){
		"endpoint":    func(w *Workload) { w.Endpoint = "/v1/embeddings" },
		"model":       func(w *Workload) { w.Model = "" },
		"both loops":  func(w *Workload) { w.Rate = 5 },
		"no loop":     func(w *Workload) { w.Concurrency = 0 },
		"no end":      func(w *Workload) { w.Requests = 0 },
		"max tokens":  func(w *Workload) { w.MaxTokens = Range{3, 2} },
		"prompt":      func(w *Workload) { w.PromptWords = Range{0, 0} },
		"neg timeout": func(w *Workload) { w.Timeout = -1 },
	} {
		w := ok
		mutate(&w)
		if err := w.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
		if _, err := Run(context.Background(), NewRouterTarget("http://127.0.0.1:1", 1), w, RunOptions{}); err == nil {
			t.Errorf("%s: Run accepted", name)
		}
	}
}
