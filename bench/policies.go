package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
)

// PolicyVariant is one way of placing that ComparePolicies measures: a
// placement policy (placement.policy), a number of routers and whether
// they share the prefix index over the bus (placement.share_index).
type PolicyVariant struct {
	// Policy is the router's placement.policy: prefix, least_loaded or
	// random; or PolicyOracle, the bench's own placement (one router per
	// producer, chosen per request by OracleTarget).
	Policy string `json:"policy"`
	// Routers is the number of routers, ≥ 1; requests go to them in turn.
	// PolicyOracle ignores it (it runs one router per producer).
	Routers int `json:"routers"`
	// ShareIndex is placement.share_index (meaningful with several
	// routers and the prefix policy).
	ShareIndex bool `json:"share_index"`
	// Index is the prefix policy's placement.index: "" leaves the
	// routers' default (auto, with no engine publishing KV events: the
	// approximate index); IndexExact runs the variant's prefill
	// simulators with KV events, each carried to the variant's bus by an
	// agent's bridge (kvevents), and the routers with placement.index
	// exact; IndexApproximate sets placement.index approximate.
	Index string `json:"index,omitempty"`
}

// Values of PolicyVariant.Index.
const (
	IndexExact       = "exact"
	IndexApproximate = "approximate"
)

// Name is the variant as tables show it: the policy, then "×N" for
// several routers, and for the prefix policy "shared" or "isolated".
// An Index is added last ("prefix exact", "prefix ×3 shared exact").
func (v PolicyVariant) Name() string {
	name := v.Policy
	switch {
	case v.Routers <= 1 || v.Policy == PolicyOracle:
	case v.Policy != "prefix":
		name = fmt.Sprintf("%s ×%d", v.Policy, v.Routers)
	case v.ShareIndex:
		name = fmt.Sprintf("%s ×%d shared", v.Policy, v.Routers)
	default:
		name = fmt.Sprintf("%s ×%d isolated", v.Policy, v.Routers)
	}
	if v.Index != "" && v.Policy == "prefix" {
		name += " " + v.Index
	}
	return name
}

// PolicySims configure the simulators of each variant's own fleet.
type PolicySims struct {
	// Prefill and Decode are the simulators of each role per variant; 0
	// means 4 and 2.
	Prefill, Decode int
	// BlockSize, KVCacheBlocks and MaxNumSeqs are the simulators'
	// --block-size, --kv-cache-blocks and --max-num-seqs (0: the
	// simulator's defaults; MaxNumSeqs 0 is unbounded).
	BlockSize, KVCacheBlocks, MaxNumSeqs int
	// PrefillPerToken is the prefill compute time per uncached prompt
	// token.
	PrefillPerToken time.Duration
	// TTFT and ITL are the decode simulators' artificial latencies.
	TTFT, ITL time.Duration
}

func (s PolicySims) withDefaults() PolicySims {
	if s.Prefill <= 0 {
		s.Prefill = 4
	}
	if s.Decode <= 0 {
		s.Decode = 2
	}
	if s.BlockSize <= 0 {
		s.BlockSize = sim.BlockSize
	}
	if s.KVCacheBlocks <= 0 {
		s.KVCacheBlocks = sim.DefaultKVCacheBlocks
	}
	return s
}

// PolicyCompareOptions configure ComparePolicies.
type PolicyCompareOptions struct {
	// Variants are measured in this order within each window (reversed in
	// every other window). At least one.
	Variants []PolicyVariant
	// Sims configure each variant's own simulators.
	Sims PolicySims
	// Windows is the number of windows the trace is cut into; every
	// variant runs every window, interleaved; 0 means 4.
	Windows int
	// Router starts one router process: the bench passes the fleet, the
	// router's id, the bus URL and the placement settings as environment
	// variables in env. nil means StartRouterProcess with the narwhal
	// binary.
	Router func(ctx context.Context, id string, fleet []config.EngineSpec, env []string) (*RouterProcess, error)
	// Bus starts one message bus per variant and returns its client URL
	// and its stop function; the variant's routers join it (they publish
	// and apply placements there). nil runs routers without a bus, so
	// several routers cannot share an index, and no variant can have
	// Index IndexExact.
	Bus func() (url string, stop func(), err error)
	// Timeout bounds each request; 0 means 60 s.
	Timeout time.Duration
	// GuardAbs and GuardRel, when set, are the routers' load-imbalance
	// guard thresholds (placement.balance_abs_threshold and
	// balance_rel_threshold); they also tell the samples in which the
	// guard's condition held. 0 leaves the routers' defaults (32 and 1.5).
	GuardAbs int
	GuardRel float64
	// SampleEvery is the period of the outstanding-load samples; 0 means
	// 50 ms.
	SampleEvery time.Duration
	// Progress, when set, receives one line per window.
	Progress io.Writer
}

// LoadSpread is how evenly the outstanding load (requests in flight on
// each prefill engine, sampled) was spread over the engines.
type LoadSpread struct {
	// Samples is the number of samples with at least one request in
	// flight.
	Samples int `json:"samples"`
	// MeanMaxOverMean is the mean over those samples of max / mean
	// outstanding (1 is perfectly even).
	MeanMaxOverMean float64 `json:"mean_max_over_mean"`
	// PeakMaxOverMean is the largest max / mean of any sample.
	PeakMaxOverMean float64 `json:"peak_max_over_mean"`
	// OverShare is the share of samples in which some engine had more
	// than 1.5× the mean.
	OverShare float64 `json:"over_share"`
	// GuardSamples is the number of samples in which the guard's
	// condition held (max − min > GuardAbs and max > GuardRel × min).
	GuardSamples int `json:"guard_samples"`
	// GuardPeakMaxOverMean is the largest max / mean among GuardSamples
	// (0 when there were none).
	GuardPeakMaxOverMean float64 `json:"guard_peak_max_over_mean"`
	// GuardOverShare is the share of GuardSamples in which some engine had
	// more than 1.5× the mean (0 when there were none).
	GuardOverShare float64 `json:"guard_over_share"`
	// MeanOutstanding is the mean over samples of the mean outstanding.
	MeanOutstanding float64 `json:"mean_outstanding"`
}

// PolicyReport is one variant's figures over all its windows.
type PolicyReport struct {
	// Variant is what was measured; Name its label.
	Variant PolicyVariant `json:"variant"`
	Name    string        `json:"name"`
	// Run holds the client's figures: TTFT (to Narwhal's first token as
	// the client saw it), ITL, end-to-end, throughput and errors.
	Run *Report `json:"run"`
	// CacheCounters is false when the simulators exposed no prefix-cache
	// counters (then the hit rate figures are 0).
	CacheCounters bool `json:"cache_counters"`
	// QueryTokens and HitTokens are the deltas of the prefill simulators'
	// vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total
	// over the variant's windows, summed over the fleet.
	QueryTokens int64 `json:"query_tokens"`
	HitTokens   int64 `json:"hit_tokens"`
	// HitRate is HitTokens / QueryTokens.
	HitRate float64 `json:"hit_rate"`
	// HitRateOfIdeal is HitRate / the oracle's ideal hit rate.
	HitRateOfIdeal float64 `json:"hit_rate_of_ideal"`
	// PrefillsPerEngine counts the prefill legs each engine served.
	PrefillsPerEngine map[string]int64 `json:"prefills_per_engine"`
	// PrefillSpread is max / mean of PrefillsPerEngine.
	PrefillSpread float64 `json:"prefill_spread"`
	// PrefillShares is each engine's share of the prefill legs, in the
	// fleet's order (prefill-1 first); they sum to 1.
	PrefillShares []float64 `json:"prefill_shares"`
	// OracleLookupMeanS is, for PolicyOracle, the mean duration of one
	// request's look-ups (left out of its latencies), seconds; and
	// OracleLookupFailed the requests for which no simulator answered
	// (sent round-robin).
	OracleLookupMeanS  float64 `json:"oracle_lookup_mean_s,omitempty"`
	OracleLookupFailed int64   `json:"oracle_lookup_failed,omitempty"`
	// Tokenize counts, summed over the variant's routers at the end of its
	// last window, the prompts whose token ids placement looked for, by
	// outcome (the routers' narwhal_tokenize_total{outcome}: hit, ok,
	// timeout, error, token_ids, unsupported); nil when no router
	// exposed it.
	Tokenize map[string]int64 `json:"tokenize,omitempty"`
	// ExactEngines is the fewest engines whose exact index any of the
	// variant's routers held at the end (narwhal_prefix_exact_engines);
	// -1 when a router did not say.
	ExactEngines int `json:"exact_engines"`
	// Outstanding is the spread of the sampled outstanding load.
	Outstanding LoadSpread `json:"outstanding"`
	// TTFTP50Ratio is the first variant's TTFT p50 over this one's
	// (how many times lower this variant's p50 is); 1 for the first.
	TTFTP50Ratio float64 `json:"ttft_p50_ratio"`
	// ThroughputRatio is this variant's requests/s over the first's.
	ThroughputRatio float64 `json:"throughput_ratio"`
}

// PolicyComparison is the outcome of ComparePolicies.
type PolicyComparison struct {
	// Workload is the trace's workload.
	Workload PrefixWorkload `json:"workload"`
	// Requests is the number of requests of the trace (each variant sent
	// them all).
	Requests int `json:"requests"`
	// Sims are the simulators' settings (per variant).
	Sims PolicySims `json:"sims"`
	// Windows is the number of interleaved windows.
	Windows int `json:"windows"`
	// Ideal is the oracle's accounting of the trace (Oracle).
	Ideal OracleResult `json:"ideal"`
	// Policies holds one report per variant, in the order asked.
	Policies []*PolicyReport `json:"policies"`
}

// lane is one variant's fleet: its own simulators, bus and routers.
type lane struct {
	variant PolicyVariant
	sims    *LocalEngines
	stopBus func()
	agents  *kvAgents // Index IndexExact: the prefill sims' KV events to the bus
	routers []*RouterProcess
	targets []*RouterTarget
	oracle  *OracleTarget // PolicyOracle: chooses among targets, one per producer

	acc       stretch
	spread    spreadAcc
	before    map[string]cacheCounts
	prefills0 map[string]int64
	queries   int64
	hits      int64
	counters  bool
}

func (l *lane) close() {
	if l.oracle != nil {
		l.oracle.Close()
	}
	for _, t := range l.targets {
		t.Close()
	}
	for _, r := range l.routers {
		_ = r.Stop()
	}
	if l.agents != nil {
		l.agents.close()
	}
	if l.stopBus != nil {
		l.stopBus()
	}
	if l.sims != nil {
		l.sims.Close()
	}
}

// ComparePolicies sends the requests of tr to every variant of opts, each
// over a fleet of its own (its own simulators, bus and routers, so one
// variant never warms another's caches), interleaved: the trace is cut
// into Windows windows of consecutive requests, and every window is run
// by every variant in turn (in the given order in even windows, reversed
// in odd ones), each keeping the trace's own arrival times within the
// window. Every variant thus sends the same requests at the same times
// in the same order, its caches carrying over from its previous window,
// while drift of a shared machine falls on all of them alike.
func ComparePolicies(ctx context.Context, tr *Trace, opts PolicyCompareOptions) (*PolicyComparison, error) {
	if len(opts.Variants) == 0 {
		return nil, fmt.Errorf("no policy to compare")
	}
	if len(tr.Requests) == 0 {
		return nil, fmt.Errorf("empty trace")
	}
	sims := opts.Sims.withDefaults()
	windows := opts.Windows
	if windows <= 0 {
		windows = 4
	}
	windows = min(windows, len(tr.Requests))
	ideal, err := Oracle{BlockSize: sims.BlockSize, Engines: sims.Prefill, CacheBlocks: sims.KVCacheBlocks}.Run(tr)
	if err != nil {
		return nil, err
	}
	var lanes []*lane
	defer func() {
		for _, l := range lanes {
			l.close()
		}
	}()
	for i, v := range opts.Variants {
		if v.Routers < 1 {
			v.Routers = 1
		}
		l, err := startLane(ctx, string(rune('a'+i)), tr.Workload.Model, v, sims, &opts)
		if l != nil {
			lanes = append(lanes, l)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.Name(), err)
		}
	}
	for w := 0; w < windows && ctx.Err() == nil; w++ {
		lo, hi := w*len(tr.Requests)/windows, (w+1)*len(tr.Requests)/windows
		for k := range lanes {
			l := lanes[k]
			if w%2 == 1 {
				l = lanes[len(lanes)-1-k]
			}
			st := l.runWindow(ctx, tr, lo, hi, &opts)
			if opts.Progress != nil {
				fmt.Fprintf(opts.Progress, "window %d/%d %-24s %5d requests in %6.1fs, errors %d\n",
					w+1, windows, l.variant.Name(), hi-lo, st.elapsed.Seconds(), st.rec.failed())
			}
		}
	}
	pc := &PolicyComparison{Workload: tr.Workload, Requests: len(tr.Requests), Sims: sims, Windows: windows, Ideal: ideal}
	for _, l := range lanes {
		pc.Policies = append(pc.Policies, l.report(ideal))
	}
	pc.compute()
	return pc, nil
}

// compute fills the ratios against the first variant.
func (pc *PolicyComparison) compute() {
	if len(pc.Policies) == 0 {
		return
	}
	base := pc.Policies[0].Run
	for _, p := range pc.Policies {
		if p.Run.TTFT.P50S > 0 {
			p.TTFTP50Ratio = base.TTFT.P50S / p.Run.TTFT.P50S
		}
		if base.RequestsPerS > 0 {
			p.ThroughputRatio = p.Run.RequestsPerS / base.RequestsPerS
		}
	}
}

func startLane(ctx context.Context, name, model string, v PolicyVariant, sims PolicySims, opts *PolicyCompareOptions) (*lane, error) {
	l := &lane{variant: v}
	exact := v.Policy == "prefix" && v.Index == IndexExact
	if exact && opts.Bus == nil {
		return l, fmt.Errorf("the exact index needs a bus (PolicyCompareOptions.Bus)")
	}
	var err error
	l.sims, err = StartLocal(LocalConfig{
		Prefill: sims.Prefill, Decode: sims.Decode, IDPrefix: name + "-", Model: model,
		TTFT: sims.TTFT, ITL: sims.ITL, PrefillPerToken: sims.PrefillPerToken,
		BlockSize: sims.BlockSize, KVCacheBlocks: sims.KVCacheBlocks, MaxNumSeqs: sims.MaxNumSeqs,
		KVEvents: exact,
	})
	if err != nil {
		return l, err
	}
	policy := v.Policy
	if policy == PolicyOracle {
		policy = "least_loaded" // each router has one producer: the policy places decodes only
	}
	env := []string{
		"NARWHAL_ROUTER_LOG_LEVEL=error",
		"NARWHAL_PLACEMENT_POLICY=" + policy,
		"NARWHAL_PLACEMENT_SHARE_INDEX=" + strconv.FormatBool(v.ShareIndex),
	}
	if v.Policy == "prefix" && v.Index != "" {
		env = append(env, "NARWHAL_PLACEMENT_INDEX="+v.Index)
	}
	if opts.GuardAbs > 0 {
		env = append(env, "NARWHAL_PLACEMENT_BALANCE_ABS_THRESHOLD="+strconv.Itoa(opts.GuardAbs))
	}
	if opts.GuardRel > 0 {
		env = append(env, "NARWHAL_PLACEMENT_BALANCE_REL_THRESHOLD="+strconv.FormatFloat(opts.GuardRel, 'g', -1, 64))
	}
	if opts.Bus != nil {
		url, stop, err := opts.Bus()
		if err != nil {
			return l, err
		}
		l.stopBus = stop
		env = append(env, "NARWHAL_NATS_URL="+url)
		if exact {
			if l.agents, err = startKVAgents(url, l.sims); err != nil {
				return l, err
			}
		}
	}
	start := opts.Router
	if start == nil {
		start = func(ctx context.Context, id string, fleet []config.EngineSpec, env []string) (*RouterProcess, error) {
			return StartRouterProcess(ctx, RouterProcessOptions{ID: id, Fleet: fleet, Env: env})
		}
	}
	fleets := make([][]config.EngineSpec, v.Routers)
	for r := range fleets {
		fleets[r] = l.sims.Specs
	}
	if v.Policy == PolicyOracle {
		// One router per producer, its fleet that producer and every
		// decode: the oracle's choice of producer is the choice of router.
		np := len(l.sims.Prefill)
		fleets = make([][]config.EngineSpec, np)
		for i := range fleets {
			fleets[i] = append([]config.EngineSpec{l.sims.Specs[i]}, l.sims.Specs[np:]...)
		}
	}
	for r, fleet := range fleets {
		p, err := start(ctx, fmt.Sprintf("bench-%s-%d", name, r+1), fleet, env)
		if err != nil {
			return l, err
		}
		l.routers = append(l.routers, p)
		l.targets = append(l.targets, NewRouterTarget(p.URL, 64))
	}
	if v.Policy == PolicyOracle {
		routers := make([]Target, len(l.targets))
		urls := make([]string, len(l.targets))
		for i, t := range l.targets {
			routers[i], urls[i] = t, l.sims.Prefill[i].URL
		}
		l.oracle = NewOracleTarget(routers, urls)
	}
	l.acc.rec.errors = map[string]int{}
	l.before = map[string]cacheCounts{}
	l.prefills0 = map[string]int64{}
	for i, e := range l.sims.Prefill {
		l.prefills0[e.ID] = l.sims.Sims[i].Stats().Prefills
	}
	return l, nil
}

// cacheCounts are one engine's prefix-cache counters, tokens.
type cacheCounts struct {
	queries, hits int64
	ok            bool
}

// readCacheCounts reads vllm:prefix_cache_queries_total and
// vllm:prefix_cache_hits_total from GET url/metrics (summed over label
// sets); ok is false when either is missing.
func readCacheCounts(ctx context.Context, client *http.Client, url string) (cacheCounts, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	if err != nil {
		return cacheCounts{}, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return cacheCounts{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return cacheCounts{}, fmt.Errorf("GET %s/metrics: status %d", url, resp.StatusCode)
	}
	m, err := ParsePromCounters(io.LimitReader(resp.Body, 4<<20), "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
	if err != nil {
		return cacheCounts{}, err
	}
	q, okQ := m["vllm:prefix_cache_queries"]
	h, okH := m["vllm:prefix_cache_hits"]
	return cacheCounts{queries: int64(q), hits: int64(h), ok: okQ && okH}, nil
}

// ParsePromCounters reads Prometheus text exposition from r and returns,
// for each of names, the sum of its samples over every label set. A
// counter may be exposed as NAME or NAME_total; both count under NAME.
// Names absent from the text are absent from the map. Malformed sample
// lines are skipped.
func ParsePromCounters(r io.Reader, names ...string) (map[string]float64, error) {
	want := make(map[string]string, 2*len(names))
	for _, n := range names {
		want[n], want[n+"_total"] = n, n
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		end := strings.IndexAny(line, "{ ")
		if end < 0 {
			continue
		}
		name, ok := want[line[:end]]
		if !ok {
			continue
		}
		rest := line[end:]
		if rest[0] == '{' {
			brace := strings.LastIndexByte(rest, '}')
			if brace < 0 {
				continue
			}
			rest = rest[brace+1:]
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			continue
		}
		out[name] += v
	}
	return out, sc.Err()
}

// runWindow sends requests [lo, hi) of tr to the lane's routers in turn,
// each at its arrival time relative to request lo's, waits for them, and
// accumulates what it measured.
func (l *lane) runWindow(ctx context.Context, tr *Trace, lo, hi int, opts *PolicyCompareOptions) *stretch {
	client := &http.Client{Timeout: 5 * time.Second}
	before := make([]cacheCounts, len(l.sims.Prefill))
	for i, e := range l.sims.Prefill {
		before[i], _ = readCacheCounts(ctx, client, e.URL)
	}
	wl := Workload{Stream: true, Timeout: opts.Timeout, Seed: tr.Workload.Seed}
	shape := &bodyShape{endpoint: tr.Endpoint()}
	var live counters
	var mu sync.Mutex
	var free, all []*worker
	take := func() *worker {
		mu.Lock()
		defer mu.Unlock()
		if n := len(free); n > 0 {
			w := free[n-1]
			free = free[:n-1]
			return w
		}
		w := newWorker(shape, &wl, uint64(len(all)+1), &live)
		all = append(all, w)
		return w
	}
	give := func(w *worker) {
		mu.Lock()
		free = append(free, w)
		mu.Unlock()
	}
	stopSampling := l.sample(opts)
	st := &stretch{}
	start := time.Now()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var wg sync.WaitGroup
	for i := lo; i < hi && ctx.Err() == nil; i++ {
		due := start.Add(tr.Requests[i].At - tr.Requests[lo].At)
		if d := time.Until(due); d > 0 {
			timer.Reset(d)
			select {
			case <-timer.C:
			case <-ctx.Done():
			}
		}
		if ctx.Err() != nil {
			break
		}
		w := take()
		w.fixed = tr.Requests[i].Body
		var t Target = l.targets[i%len(l.targets)]
		if l.oracle != nil {
			t = l.oracle
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			t.do(ctx, w, due)
			give(w)
		}()
	}
	wg.Wait()
	st.elapsed = time.Since(start)
	stopSampling()
	for _, w := range all {
		st.rec.merge(&w.rec)
	}
	if st.rec.errors == nil {
		st.rec.errors = map[string]int{}
	}
	l.acc.add(st)
	l.counters = true
	for i, e := range l.sims.Prefill {
		after, err := readCacheCounts(ctx, client, e.URL)
		if err != nil || !after.ok || !before[i].ok {
			l.counters = false
			continue
		}
		l.queries += after.queries - before[i].queries
		l.hits += after.hits - before[i].hits
	}
	client.CloseIdleConnections()
	return st
}

// sample samples the outstanding load on every prefill simulator every
// opts.SampleEvery until the returned function is called.
func (l *lane) sample(opts *PolicyCompareOptions) (stop func()) {
	every := opts.SampleEvery
	if every <= 0 {
		every = 50 * time.Millisecond
	}
	abs, rel := opts.GuardAbs, opts.GuardRel
	if abs <= 0 {
		abs = 32
	}
	if rel <= 0 {
		rel = 1.5
	}
	done, finished := make(chan struct{}), make(chan struct{})
	n := len(l.sims.Prefill)
	load := make([]int64, n)
	go func() {
		defer close(finished)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				for i := range load {
					load[i] = l.sims.Sims[i].Stats().ActiveStreams
				}
				l.spread.add(load, abs, rel)
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}

// spreadAcc accumulates LoadSpread samples.
type spreadAcc struct {
	samples, over, guard int
	guardOver            int
	sumRatio, peak       float64
	guardPeak, sumMean   float64
}

// add accounts for one sample of per-engine outstanding load; samples
// with nothing in flight are ignored.
func (a *spreadAcc) add(load []int64, abs int, rel float64) {
	if len(load) == 0 {
		return
	}
	lo, hi, sum := load[0], load[0], int64(0)
	for _, v := range load {
		lo, hi, sum = min(lo, v), max(hi, v), sum+v
	}
	if sum == 0 {
		return
	}
	mean := float64(sum) / float64(len(load))
	ratio := float64(hi) / mean
	a.samples++
	a.sumRatio += ratio
	a.sumMean += mean
	a.peak = max(a.peak, ratio)
	if ratio > 1.5 {
		a.over++
	}
	if hi-lo > int64(abs) && float64(hi) > rel*float64(lo) {
		a.guard++
		a.guardPeak = max(a.guardPeak, ratio)
		if ratio > 1.5 {
			a.guardOver++
		}
	}
}

func (a *spreadAcc) spread() LoadSpread {
	s := LoadSpread{Samples: a.samples, PeakMaxOverMean: a.peak, GuardSamples: a.guard, GuardPeakMaxOverMean: a.guardPeak}
	if a.samples > 0 {
		s.MeanMaxOverMean = a.sumRatio / float64(a.samples)
		s.OverShare = float64(a.over) / float64(a.samples)
		s.MeanOutstanding = a.sumMean / float64(a.samples)
	}
	if a.guard > 0 {
		s.GuardOverShare = float64(a.guardOver) / float64(a.guard)
	}
	return s
}

// report builds the variant's PolicyReport from what its windows
// accumulated.
func (l *lane) report(ideal OracleResult) *PolicyReport {
	var t Target = &RouterTarget{}
	if len(l.targets) > 0 {
		t = l.targets[0]
	}
	run := newReport(t, &l.acc, fmt.Sprintf("%d sims", len(l.sims.Sims)))
	run.Target = l.variant.Name()
	p := &PolicyReport{
		Variant: l.variant, Name: l.variant.Name(), Run: run,
		CacheCounters: l.counters, QueryTokens: l.queries, HitTokens: l.hits,
		PrefillsPerEngine: map[string]int64{}, Outstanding: l.spread.spread(),
	}
	if p.CacheCounters && p.QueryTokens > 0 {
		p.HitRate = float64(p.HitTokens) / float64(p.QueryTokens)
		if ideal.HitRate > 0 {
			p.HitRateOfIdeal = p.HitRate / ideal.HitRate
		}
	}
	var sum, peak int64
	counts := make([]int64, len(l.sims.Prefill))
	for i, e := range l.sims.Prefill {
		n := l.sims.Sims[i].Stats().Prefills - l.prefills0[e.ID]
		p.PrefillsPerEngine[e.ID] = n
		counts[i] = n
		sum += n
		peak = max(peak, n)
	}
	if sum > 0 {
		p.PrefillSpread = float64(peak) / (float64(sum) / float64(len(l.sims.Prefill)))
		for _, n := range counts {
			p.PrefillShares = append(p.PrefillShares, float64(n)/float64(sum))
		}
	}
	l.readRouterMetrics(p)
	if l.oracle != nil {
		rounds, spent, failed := l.oracle.LookupStats()
		if rounds > 0 {
			p.OracleLookupMeanS = spent.Seconds() / float64(rounds)
		}
		p.OracleLookupFailed = failed
	}
	return p
}

// readRouterMetrics fills p.Tokenize and p.ExactEngines from the
// variant's routers' GET /metrics.
func (l *lane) readRouterMetrics(p *PolicyReport) {
	p.ExactEngines = -1
	client := &http.Client{Timeout: 5 * time.Second}
	for i, r := range l.routers {
		m, err := readLabelled(client, r.URL, "narwhal_tokenize_total", "outcome")
		if err == nil && len(m) > 0 {
			if p.Tokenize == nil {
				p.Tokenize = map[string]int64{}
			}
			for k, v := range m {
				p.Tokenize[k] += int64(v)
			}
		}
		n, err := readLabelled(client, r.URL, "narwhal_prefix_exact_engines", "")
		v, ok := n[""]
		switch {
		case err != nil || !ok:
			p.ExactEngines = -1
			return
		case i == 0 || int(v) < p.ExactEngines:
			p.ExactEngines = int(v)
		}
	}
}

// readLabelled reads from GET url/metrics the samples of name (a counter
// may be exposed as name_total too), summed per value of label ("" sums
// every sample under "").
func readLabelled(client *http.Client, url, name, label string) (map[string]float64, error) {
	resp, err := client.Get(url + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s/metrics: status %d", url, resp.StatusCode)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 4<<20))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		end := strings.IndexAny(line, "{ ")
		if line == "" || line[0] == '#' || end < 0 || (line[:end] != name && line[:end] != name+"_total") {
			continue
		}
		rest, key := line[end:], ""
		if rest[0] == '{' {
			brace := strings.LastIndexByte(rest, '}')
			if brace < 0 {
				continue
			}
			if label != "" {
				key = labelValue(rest[1:brace], label)
			}
			rest = rest[brace+1:]
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		out[key] += v
	}
	return out, sc.Err()
}

// labelValue returns the value of label in the label set labels
// (`a="x",b="y"`), "" when absent.
func labelValue(labels, label string) string {
	for _, kv := range strings.Split(labels, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if ok && strings.TrimSpace(k) == label {
			return strings.Trim(v, `"`)
		}
	}
	return ""
}

// WritePolicyTable writes pc as a human-readable table, one column per
// variant.
func WritePolicyTable(w io.Writer, pc *PolicyComparison) error {
	bw := bufio.NewWriter(w)
	wl := pc.Workload
	extra := ""
	if on, off := wl.bursts(); on > 0 {
		extra = fmt.Sprintf(" + %d short chats, bursts %s on / %s off", wl.sharedRequests(), on, off)
	}
	if wl.Shape == ShapeCachePressure {
		extra = fmt.Sprintf(", contexts %.1f× the fleet's %d KV tokens", float64(wl.Tenants*wl.ContextTokens)/float64(wl.FleetKVTokens), wl.FleetKVTokens)
	}
	fmt.Fprintf(bw, "\n== %s: %d tenants × %d-token context × %d users × %d queries of %d tokens%s, max_tokens %d, %g req/s Poisson, seed %d (%d requests, %d windows)\n",
		wl.Shape, wl.Tenants, wl.ContextTokens, wl.UsersPerTenant, wl.QueriesPerUser, wl.QueryTokens, extra, wl.MaxTokens, wl.Rate, wl.Seed, pc.Requests, pc.Windows)
	s := pc.Sims
	fmt.Fprintf(bw, "sims per variant: %d prefill + %d decode, block size %d, %d KV cache blocks, max-num-seqs %d, prefill %s/token\n",
		s.Prefill, s.Decode, s.BlockSize, s.KVCacheBlocks, s.MaxNumSeqs, s.PrefillPerToken)
	fmt.Fprintf(bw, "ideal hit rate (pooled LRU of %d blocks): %.3f\n", s.Prefill*s.KVCacheBlocks, pc.Ideal.HitRate)
	const col = "%22s"
	row := func(name string, cell func(p *PolicyReport) string) {
		fmt.Fprintf(bw, "%-22s", name)
		for _, p := range pc.Policies {
			fmt.Fprintf(bw, col, cell(p))
		}
		fmt.Fprintln(bw)
	}
	row("", func(p *PolicyReport) string { return p.Name })
	row("requests (ok)", func(p *PolicyReport) string { return fmt.Sprintf("%d (%d)", p.Run.Requests, p.Run.OK) })
	row("requests/s", func(p *PolicyReport) string { return fmt.Sprintf("%.2f", p.Run.RequestsPerS) })
	row("throughput ratio", func(p *PolicyReport) string { return fmt.Sprintf("%.3f", p.ThroughputRatio) })
	row("TTFT p50", func(p *PolicyReport) string { return fmtDur(p.Run.TTFT.P50S) })
	row("TTFT p90", func(p *PolicyReport) string { return fmtDur(p.Run.TTFT.P90S) })
	row("TTFT p99", func(p *PolicyReport) string { return fmtDur(p.Run.TTFT.P99S) })
	row("TTFT p50 ×lower", func(p *PolicyReport) string { return fmt.Sprintf("%.2f", p.TTFTP50Ratio) })
	row("E2E p50", func(p *PolicyReport) string { return fmtDur(p.Run.E2E.P50S) })
	row("hit rate", func(p *PolicyReport) string {
		if !p.CacheCounters {
			return "n/a"
		}
		return fmt.Sprintf("%.3f", p.HitRate)
	})
	row("hit rate / ideal", func(p *PolicyReport) string {
		if !p.CacheCounters {
			return "n/a"
		}
		return fmt.Sprintf("%.3f", p.HitRateOfIdeal)
	})
	row("prefills max/mean", func(p *PolicyReport) string { return fmt.Sprintf("%.2f", p.PrefillSpread) })
	row("prefill shares", func(p *PolicyReport) string {
		cells := make([]string, len(p.PrefillShares))
		for i, v := range p.PrefillShares {
			cells[i] = fmt.Sprintf("%.2f", v)
		}
		return strings.Join(cells, "/")
	})
	row("outst. mean", func(p *PolicyReport) string { return fmt.Sprintf("%.2f", p.Outstanding.MeanOutstanding) })
	row("outst. max/mean avg", func(p *PolicyReport) string { return fmt.Sprintf("%.2f", p.Outstanding.MeanMaxOverMean) })
	row("outst. >1.5× mean", func(p *PolicyReport) string { return fmt.Sprintf("%.0f%%", 100*p.Outstanding.OverShare) })
	row("guard peak max/mean", func(p *PolicyReport) string { return fmt.Sprintf("%.2f", p.Outstanding.GuardPeakMaxOverMean) })
	row("guard samples", func(p *PolicyReport) string {
		if p.Outstanding.GuardSamples == 0 {
			return "0"
		}
		return fmt.Sprintf("%d, %.0f%% >1.5×", p.Outstanding.GuardSamples, 100*p.Outstanding.GuardOverShare)
	})
	row("oracle look-up mean", func(p *PolicyReport) string {
		if p.Variant.Policy != PolicyOracle {
			return "-"
		}
		return fmtDur(p.OracleLookupMeanS)
	})
	row("exact engines", func(p *PolicyReport) string {
		if p.ExactEngines < 0 || p.Variant.Policy != "prefix" {
			return "-"
		}
		return strconv.Itoa(p.ExactEngines)
	})
	row("tokenize ok/hit/fail", func(p *PolicyReport) string {
		if p.Tokenize == nil || p.Variant.Policy != "prefix" {
			return "-"
		}
		t := p.Tokenize
		return fmt.Sprintf("%d/%d/%d", t["ok"], t["hit"], t["timeout"]+t["error"])
	})
	row("errors", func(p *PolicyReport) string { return errorsLine(p.Run.Errors) })
	return bw.Flush()
}
