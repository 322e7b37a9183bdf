package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"sort"
	"strings"
	"time"
)

// Report is every figure of one measured run against one target. Figures
// ending in S are seconds, PerS are per second, US are microseconds.
type Report struct {
	// Target is "router" or "floor".
	Target string `json:"target"`
	// URL is the router's base URL ("" for the floor).
	URL string `json:"url,omitempty"`
	// ElapsedS is the measured wall time (the sum of the slices' for a
	// comparison), seconds.
	ElapsedS float64 `json:"elapsed_s"`
	// Requests is the number of requests that ended, OK plus errors.
	Requests int `json:"requests"`
	// OK is the number of successful requests: HTTP 200 and, streamed, a
	// stream that ended with data: [DONE] after generated output.
	OK int `json:"ok"`
	// Errors counts the failed requests by class (Class* constants,
	// "http_<status>", "sse_error_<code>", "engine_<fault kind>" for the
	// floor). Never nil.
	Errors map[string]int `json:"errors"`
	// RequestsPerS is Requests / ElapsedS.
	RequestsPerS float64 `json:"requests_per_s"`
	// OutputTokens is the number of generated tokens of the successful
	// requests (the decode engine's usage.completion_tokens, R-LEG-6, else
	// the number of output chunks).
	OutputTokens int64 `json:"output_tokens"`
	// OutputTokensPerS is OutputTokens / ElapsedS.
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	// TTFT is the time from sending a request (its scheduled arrival, open
	// loop) to its first generated output, as the client measured it.
	TTFT Distribution `json:"ttft"`
	// ITL is the time between consecutive output chunks of a stream.
	ITL Distribution `json:"itl"`
	// E2E is the time from sending a request to data: [DONE] (or to the
	// whole JSON completion).
	E2E Distribution `json:"e2e"`
	// BenchProcess is the CPU time and allocations of this process over
	// the measured run: the client, and whatever else runs in it (Holds).
	BenchProcess ProcessCost `json:"bench_process"`
	// RouterProcess is the router's CPU time over the measured run, when
	// the router ran as a separate process; nil otherwise.
	RouterProcess *ProcessCost `json:"router_process,omitempty"`

	ttft, itl, e2e []time.Duration // sorted samples, for histograms
}

// ProcessCost is what one process spent over a measured run.
type ProcessCost struct {
	// Holds says what ran in the process (e.g. "client + 4 sims").
	Holds string `json:"holds"`
	// CPUS is user + system CPU time, seconds.
	CPUS float64 `json:"cpu_s"`
	// CPUCores is CPUS / elapsed: the average number of cores busy.
	CPUCores float64 `json:"cpu_cores"`
	// CPUPerRequestUS is CPUS per ended request, microseconds.
	CPUPerRequestUS float64 `json:"cpu_per_request_us"`
	// AllocsPerRequest is heap allocations per ended request (this
	// process only; 0 when not measured).
	AllocsPerRequest float64 `json:"allocs_per_request,omitempty"`
	// AllocBytesPerRequest is heap bytes allocated per ended request (this
	// process only; 0 when not measured).
	AllocBytesPerRequest float64 `json:"alloc_bytes_per_request,omitempty"`
	// RSSBeforeBytes and RSSPeakBytes are the process's resident memory
	// before the run (before its warm-up too: idle) and its peak during the
	// measured run (sampled every 200 ms); 0 when not measured.
	RSSBeforeBytes int64 `json:"rss_before_bytes,omitempty"`
	RSSPeakBytes   int64 `json:"rss_peak_bytes,omitempty"`
	// RSSPerStreamBytes is (peak − before) / concurrency: the memory one
	// open stream costs, for closed-loop runs of at least 100 clients; 0
	// when not measured.
	RSSPerStreamBytes float64 `json:"rss_per_stream_bytes,omitempty"`
}

// Added is the router's added latency at three percentiles: router minus
// floor, seconds (negative when the router was faster).
type Added struct {
	// P50S is router p50 minus floor p50, seconds.
	P50S float64 `json:"p50_s"`
	// P90S is router p90 minus floor p90, seconds.
	P90S float64 `json:"p90_s"`
	// P99S is router p99 minus floor p99, seconds.
	P99S float64 `json:"p99_s"`
}

// Comparison is one workload measured through the router and against the
// floor, interleaved (Compare).
type Comparison struct {
	// Slices is the number of measured slices, half of them each side's.
	Slices int `json:"slices"`
	// Router is the router's report over its slices.
	Router *Report `json:"router"`
	// Floor is the floor's report over its slices.
	Floor *Report `json:"floor"`
	// AddedTTFT is the router's added TTFT (router minus floor).
	AddedTTFT Added `json:"added_ttft"`
	// AddedITL is the router's added ITL (router minus floor).
	AddedITL Added `json:"added_itl"`
	// AddedE2E is the router's added end-to-end latency.
	AddedE2E Added `json:"added_e2e"`
	// ThroughputRatio is the router's requests/s over the floor's.
	ThroughputRatio float64 `json:"throughput_ratio"`
	// RouterCPUPerRequestUS is the router process's CPU time per request
	// during the router's slices, microseconds (0 when not measured).
	RouterCPUPerRequestUS float64 `json:"router_cpu_per_request_us"`
	// RouterIdleCPUCores is the router process's CPU use while the floor
	// ran (its background: bus, refresh loops), in cores.
	RouterIdleCPUCores float64 `json:"router_idle_cpu_cores"`
	// SimsCPUPerRequestUSLow and SimsCPUPerRequestUSHigh bound, as an
	// estimate, the in-process sims' CPU time per request: the bench
	// process runs the sims and a client, so its CPU per request in the
	// floor's slices is an upper bound; the floor client does what the
	// router's engine legs do, which costs less than the whole router, so
	// that figure minus the router's CPU per request is a lower bound
	// (floored at 0). Both 0 when the router's CPU was not measured.
	SimsCPUPerRequestUSLow  float64 `json:"sims_cpu_per_request_us_low"`
	SimsCPUPerRequestUSHigh float64 `json:"sims_cpu_per_request_us_high"`
}

// Params are a run's parameters, as given.
type Params struct {
	// Target is the router URL, or "local" for in-process engines.
	Target string `json:"target"`
	// RouterProcess is true when the router ran as a child process.
	RouterProcess bool `json:"router_process"`
	// Endpoint is the request path (/v1/chat/completions or
	// /v1/completions).
	Endpoint string `json:"endpoint"`
	// Model is the model name sent.
	Model string `json:"model"`
	// Stream is true for SSE streams, false for JSON completions.
	Stream bool `json:"stream"`
	// PromptWords is the prompt length in words, "N" or "N:M".
	PromptWords string `json:"prompt_words"`
	// MaxTokens is max_tokens, "N" or "N:M".
	MaxTokens string `json:"max_tokens"`
	// IgnoreEOS is true when "ignore_eos": true was sent.
	IgnoreEOS bool `json:"ignore_eos"`
	// Concurrency is the closed loop's clients (0 for an open loop).
	Concurrency int `json:"concurrency"`
	// RatePerS is the open loop's arrival rate (0 for a closed loop).
	RatePerS float64 `json:"rate_per_s"`
	// DurationS is the measured duration asked for, seconds (0: none).
	DurationS float64 `json:"duration_s"`
	// Requests is the request budget asked for (0: none).
	Requests int `json:"requests"`
	// WarmupS is the warm-up per target, seconds.
	WarmupS float64 `json:"warmup_s"`
	// TimeoutS is the per-request timeout, seconds.
	TimeoutS float64 `json:"timeout_s"`
	// Seed seeded prompts, lengths and arrivals.
	Seed uint64 `json:"seed"`
	// CompareFloor is true for a router/floor comparison.
	CompareFloor bool `json:"compare_floor"`
	// Slices is the comparison's number of slices (0 otherwise).
	Slices int `json:"slices,omitempty"`
	// SimTTFTS is the local sims' artificial TTFT, seconds.
	SimTTFTS float64 `json:"sim_ttft_s"`
	// SimITLS is the local sims' artificial ITL, seconds.
	SimITLS float64 `json:"sim_itl_s"`
}

// NewParams returns the Params of wl against target ("local" or a URL).
func NewParams(target string, wl Workload) Params {
	return Params{
		Target:      target,
		Endpoint:    wl.Endpoint,
		Model:       wl.Model,
		Stream:      wl.Stream,
		PromptWords: wl.PromptWords.String(),
		MaxTokens:   wl.MaxTokens.String(),
		IgnoreEOS:   wl.IgnoreEOS,
		Concurrency: wl.Concurrency,
		RatePerS:    wl.Rate,
		DurationS:   wl.Duration.Seconds(),
		Requests:    wl.Requests,
		WarmupS:     wl.Warmup.Seconds(),
		TimeoutS:    wl.timeout().Seconds(),
		Seed:        wl.Seed,
	}
}

// Result is one workload's outcome: a single Run or a Comparison.
type Result struct {
	// Params are the workload's parameters.
	Params Params `json:"params"`
	// Run is set for a single run.
	Run *Report `json:"run,omitempty"`
	// Comparison is set for a router/floor comparison.
	Comparison *Comparison `json:"comparison,omitempty"`
}

// Machine describes where the bench ran.
type Machine struct {
	// GOMAXPROCS is this process's runtime.GOMAXPROCS(0).
	GOMAXPROCS int `json:"gomaxprocs"`
	// NumCPU is runtime.NumCPU().
	NumCPU int `json:"num_cpu"`
	// GoVersion is runtime.Version().
	GoVersion string `json:"go_version"`
	// GOOS and GOARCH are the platform.
	GOOS   string `json:"goos"`
	GOARCH string `json:"goarch"`
	// CPUModel is the first "model name" of /proc/cpuinfo, or "".
	CPUModel string `json:"cpu_model,omitempty"`
	// LoadAverage is the 1, 5 and 15 minute load averages of
	// /proc/loadavg when the bench started, or "": other work on a shared
	// machine shows here.
	LoadAverage string `json:"load_average,omitempty"`
}

// ThisMachine returns the Machine this process runs on.
func ThisMachine() Machine {
	m := Machine{
		GOMAXPROCS: runtime.GOMAXPROCS(0),
		NumCPU:     runtime.NumCPU(),
		GoVersion:  runtime.Version(),
		GOOS:       runtime.GOOS,
		GOARCH:     runtime.GOARCH,
	}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) >= 3 {
			m.LoadAverage = strings.Join(f[:3], " ")
		}
	}
	return m
}

// File is the content of `narwhal bench --json FILE`.
type File struct {
	// StartedAt is when the bench started, RFC 3339 UTC.
	StartedAt string `json:"started_at"`
	// Machine is where it ran.
	Machine Machine `json:"machine"`
	// Results holds one entry per workload, in the order run.
	Results []Result `json:"results"`
}

// WriteFile writes f as indented JSON to path (mode 0644).
func WriteFile(path string, f *File) error {
	b, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// ReadFile reads a File written by WriteFile.
func ReadFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var f File
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &f, nil
}

func perS(n float64, elapsed time.Duration) float64 {
	if elapsed <= 0 {
		return 0
	}
	return n / elapsed.Seconds()
}

func perRequestUS(d time.Duration, requests int) float64 {
	if requests == 0 {
		return 0
	}
	return float64(d) / float64(time.Microsecond) / float64(requests)
}

func newReport(t Target, st *stretch, holds string) *Report {
	rec := &st.rec
	n := rec.ok + rec.failed()
	rep := &Report{
		Target:           t.Name(),
		ElapsedS:         st.elapsed.Seconds(),
		Requests:         n,
		OK:               rec.ok,
		Errors:           map[string]int{},
		RequestsPerS:     perS(float64(n), st.elapsed),
		OutputTokens:     rec.tokens,
		OutputTokensPerS: perS(float64(rec.tokens), st.elapsed),
		ttft:             rec.ttft,
		itl:              rec.itl,
		e2e:              rec.e2e,
	}
	for k, v := range rec.errors {
		if v > 0 {
			rep.Errors[k] = v
		}
	}
	if r, ok := t.(*RouterTarget); ok {
		rep.URL = r.URL()
	}
	rep.TTFT = Summarize(rep.ttft)
	rep.ITL = Summarize(rep.itl)
	rep.E2E = Summarize(rep.e2e)
	desc := "client"
	if holds != "" {
		desc += " + " + holds
	}
	rep.BenchProcess = ProcessCost{
		Holds:           desc,
		CPUS:            st.benchCPU.Seconds(),
		CPUCores:        perS(st.benchCPU.Seconds(), st.elapsed),
		CPUPerRequestUS: perRequestUS(st.benchCPU, n),
	}
	if n > 0 {
		rep.BenchProcess.AllocsPerRequest = float64(st.allocs) / float64(n)
		rep.BenchProcess.AllocBytesPerRequest = float64(st.allocB) / float64(n)
	}
	return rep
}

func routerCost(st *stretch, requests, concurrency int) *ProcessCost {
	if !st.routerOK {
		return nil
	}
	pc := &ProcessCost{
		Holds:           "router (child process)",
		CPUS:            st.routerCPU.Seconds(),
		CPUCores:        perS(st.routerCPU.Seconds(), st.elapsed),
		CPUPerRequestUS: perRequestUS(st.routerCPU, requests),
		RSSBeforeBytes:  st.routerRSS0,
		RSSPeakBytes:    st.routerRSSPeak,
	}
	// Per stream only where streams dominate the memory (hundreds open).
	if concurrency >= 100 && st.routerRSS0 > 0 {
		pc.RSSPerStreamBytes = float64(st.routerRSSPeak-st.routerRSS0) / float64(concurrency)
	}
	return pc
}

func added(r, f Distribution) Added {
	return Added{P50S: r.P50S - f.P50S, P90S: r.P90S - f.P90S, P99S: r.P99S - f.P99S}
}

// compute fills the derived figures of c from its two reports.
func (c *Comparison) compute() {
	c.AddedTTFT = added(c.Router.TTFT, c.Floor.TTFT)
	c.AddedITL = added(c.Router.ITL, c.Floor.ITL)
	c.AddedE2E = added(c.Router.E2E, c.Floor.E2E)
	if c.Floor.RequestsPerS > 0 {
		c.ThroughputRatio = c.Router.RequestsPerS / c.Floor.RequestsPerS
	}
	if c.Router.RouterProcess != nil {
		high := c.Floor.BenchProcess.CPUPerRequestUS
		c.SimsCPUPerRequestUSHigh = high
		c.SimsCPUPerRequestUSLow = max(0, high-c.RouterCPUPerRequestUS)
	}
}

// fmtDur formats seconds with a unit chosen for readability: µs below a
// millisecond, ms below a second, else s.
func fmtDur(s float64) string {
	a := s
	if a < 0 {
		a = -a
	}
	switch {
	case a == 0:
		return "0"
	case a < 1e-3:
		return fmt.Sprintf("%.1fµs", s*1e6)
	case a < 1:
		return fmt.Sprintf("%.3fms", s*1e3)
	}
	return fmt.Sprintf("%.3fs", s)
}

func fmtAdded(s float64) string {
	if s >= 0 {
		return "+" + fmtDur(s)
	}
	return fmtDur(s)
}

func errorsLine(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, m[k])
	}
	return strings.Join(parts, " ")
}

// Title is a one-line description of the workload of p.
func (p Params) Title() string {
	load := fmt.Sprintf("concurrency %d", p.Concurrency)
	if p.RatePerS > 0 {
		load = fmt.Sprintf("rate %g/s", p.RatePerS)
	}
	mode := "stream"
	if !p.Stream {
		mode = "no-stream"
	}
	return fmt.Sprintf("%s, %s %s, prompt %s words, max_tokens %s", load, p.Endpoint, mode, p.PromptWords, p.MaxTokens)
}

// WriteTable writes res as a human-readable table: throughput, the TTFT,
// ITL and end-to-end percentiles, errors and process costs; for a
// comparison, router and floor side by side with the router's added
// latency.
func WriteTable(w io.Writer, res *Result) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "\n== %s — %s\n", res.Params.Target, res.Params.Title())
	if rep := res.Run; rep != nil {
		fmt.Fprintf(bw, "%s %s: %d requests in %.1fs (ok %d, errors %d)\n", rep.Target, rep.URL, rep.Requests, rep.ElapsedS, rep.OK, rep.Requests-rep.OK)
		fmt.Fprintf(bw, "%-12s %12.1f\n%-12s %12.1f\n", "requests/s", rep.RequestsPerS, "tokens/s", rep.OutputTokensPerS)
		fmt.Fprintf(bw, "%-12s %12s %12s %12s %12s\n", "", "p50", "p90", "p99", "max")
		for _, row := range []struct {
			name string
			d    Distribution
		}{{"TTFT", rep.TTFT}, {"ITL", rep.ITL}, {"E2E", rep.E2E}} {
			fmt.Fprintf(bw, "%-12s %12s %12s %12s %12s\n", row.name, fmtDur(row.d.P50S), fmtDur(row.d.P90S), fmtDur(row.d.P99S), fmtDur(row.d.MaxS))
		}
		fmt.Fprintf(bw, "errors: %s\n", errorsLine(rep.Errors))
		writeCost(bw, "bench process", &rep.BenchProcess)
		if rep.RouterProcess != nil {
			writeCost(bw, "router process", rep.RouterProcess)
		}
	}
	if c := res.Comparison; c != nil {
		r, f := c.Router, c.Floor
		fmt.Fprintf(bw, "router vs floor, %d interleaved slices (ABBA), %.1fs + %.1fs measured\n", c.Slices, r.ElapsedS, f.ElapsedS)
		fmt.Fprintf(bw, "%-12s %14s %14s %14s\n", "", "router", "floor", "added")
		fmt.Fprintf(bw, "%-12s %14.1f %14.1f %14s\n", "requests/s", r.RequestsPerS, f.RequestsPerS, fmt.Sprintf("ratio %.3f", c.ThroughputRatio))
		fmt.Fprintf(bw, "%-12s %14.1f %14.1f\n", "tokens/s", r.OutputTokensPerS, f.OutputTokensPerS)
		fmt.Fprintf(bw, "%-12s %14d %14d\n", "requests", r.Requests, f.Requests)
		for _, row := range []struct {
			name string
			r, f Distribution
			a    Added
		}{{"TTFT", r.TTFT, f.TTFT, c.AddedTTFT}, {"ITL", r.ITL, f.ITL, c.AddedITL}, {"E2E", r.E2E, f.E2E, c.AddedE2E}} {
			fmt.Fprintf(bw, "%-12s %14s %14s %14s\n", row.name+" p50", fmtDur(row.r.P50S), fmtDur(row.f.P50S), fmtAdded(row.a.P50S))
			fmt.Fprintf(bw, "%-12s %14s %14s %14s\n", row.name+" p90", fmtDur(row.r.P90S), fmtDur(row.f.P90S), fmtAdded(row.a.P90S))
			fmt.Fprintf(bw, "%-12s %14s %14s %14s\n", row.name+" p99", fmtDur(row.r.P99S), fmtDur(row.f.P99S), fmtAdded(row.a.P99S))
			fmt.Fprintf(bw, "%-12s %14s %14s\n", row.name+" max", fmtDur(row.r.MaxS), fmtDur(row.f.MaxS))
		}
		fmt.Fprintf(bw, "errors: router %s; floor %s\n", errorsLine(r.Errors), errorsLine(f.Errors))
		if r.RouterProcess != nil {
			fmt.Fprintf(bw, "router CPU: %.1f µs/request (%.2f cores busy in its slices; %.3f cores idle in the floor's)\n",
				c.RouterCPUPerRequestUS, r.RouterProcess.CPUCores, c.RouterIdleCPUCores)
			fmt.Fprintf(bw, "sims CPU (estimate): %.1f–%.1f µs/request\n", c.SimsCPUPerRequestUSLow, c.SimsCPUPerRequestUSHigh)
			writeCost(bw, "router process", r.RouterProcess)
		}
		writeCost(bw, "bench process, router slices", &r.BenchProcess)
		writeCost(bw, "bench process, floor slices", &f.BenchProcess)
	}
	return bw.Flush()
}

func writeCost(w io.Writer, name string, c *ProcessCost) {
	fmt.Fprintf(w, "%s (%s): %.1f µs CPU/request, %.2f cores", name, c.Holds, c.CPUPerRequestUS, c.CPUCores)
	if c.AllocsPerRequest > 0 {
		fmt.Fprintf(w, ", %.0f allocs and %.0f B/request", c.AllocsPerRequest, c.AllocBytesPerRequest)
	}
	if c.RSSPeakBytes > 0 {
		fmt.Fprintf(w, ", RSS %.1f MiB before, %.1f MiB peak", float64(c.RSSBeforeBytes)/(1<<20), float64(c.RSSPeakBytes)/(1<<20))
		if c.RSSPerStreamBytes > 0 {
			fmt.Fprintf(w, " (%.1f KiB per open stream)", c.RSSPerStreamBytes/1024)
		}
	}
	fmt.Fprintln(w)
}

// WriteMachine writes one line describing m.
func WriteMachine(w io.Writer, m Machine) {
	fmt.Fprintf(w, "machine: %d CPUs, GOMAXPROCS %d, %s %s/%s", m.NumCPU, m.GOMAXPROCS, m.GoVersion, m.GOOS, m.GOARCH)
	if m.CPUModel != "" {
		fmt.Fprintf(w, ", %s", m.CPUModel)
	}
	if m.LoadAverage != "" {
		fmt.Fprintf(w, ", load average %s", m.LoadAverage)
	}
	fmt.Fprintln(w)
}
