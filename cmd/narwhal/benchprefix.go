package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/bench"
	"github.com/narwhalmesh/narwhal/bus"
)

// prefixFlags are the flags of `narwhal bench --workload`: a multi-tenant
// shared-prefix trace sent to one fleet per placement policy.
type prefixFlags struct {
	workload, policies, shareIndex         string
	tenants, contextTokens, users, queries int
	queryTokens, routers, windows          int
	prefillSims, decodeSims                int
	blockSize, kvCacheBlocks, maxNumSeqs   int
	prefillPerToken                        time.Duration
	guardAbs                               int
	guardRel                               float64
}

func (p *prefixFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&p.workload, "workload", "", "shared-prefix, no-shared-prefix, hot-tenant (one tenant, 64 users, 96/s), cache-pressure (contexts 3× the fleet's KV capacity, 24/s) or mixed (shared contexts and as many short chats, 1 s on / 1 s off bursts): a multi-tenant chat trace (tenants × context × users × queries, Poisson arrivals at --rate, drawn from --seed) sent to local sims, one fleet per policy; without it, the random-prompt workload")
	fs.IntVar(&p.tenants, "tenants", 32, "--workload: tenants, each with its own shared context (the system prompt)")
	fs.IntVar(&p.contextTokens, "context-tokens", 512, "--workload: tokens (words) of a tenant's shared context")
	fs.IntVar(&p.users, "users", 2, "--workload: users per tenant")
	fs.IntVar(&p.queries, "queries", 8, "--workload: queries per user")
	fs.IntVar(&p.queryTokens, "query-tokens", 64, "--workload: tokens (words) of each query (the user message)")
	fs.StringVar(&p.policies, "compare-policies", "least_loaded,prefix", "--workload: placement policies to compare, comma-separated (prefix, least_loaded, random; exact and approximate: prefix with that placement.index, exact with KV events from every prefill sim carried to the bus as agents do; and oracle: the bench asks every sim what it holds and picks the least expected wait, through one router per producer); each gets its own sims and routers, run in interleaved windows")
	fs.IntVar(&p.routers, "routers", 1, "--workload: routers per policy on one bus; requests go to them in turn")
	fs.StringVar(&p.shareIndex, "share-index", "both", "--workload with --routers > 1: whether prefix routers share their index over the bus: true, false or both (the prefix policy is measured both ways)")
	fs.IntVar(&p.windows, "windows", 4, "--workload: interleaved windows the trace is cut into (each policy runs every window)")
	fs.IntVar(&p.prefillSims, "prefill-sims", 4, "--workload: prefill simulators per policy")
	fs.IntVar(&p.decodeSims, "decode-sims", 2, "--workload: decode simulators per policy")
	fs.IntVar(&p.blockSize, "block-size", 16, "--workload: the simulators' KV block size in tokens")
	fs.IntVar(&p.kvCacheBlocks, "kv-cache-blocks", 416, "--workload: each simulator's prefix cache capacity in blocks")
	fs.IntVar(&p.maxNumSeqs, "max-num-seqs", 2, "--workload: requests each simulator runs at once (the rest wait)")
	fs.IntVar(&p.guardAbs, "balance-abs-threshold", 0, "--workload: the routers' placement.balance_abs_threshold (0: their default, 32)")
	fs.Float64Var(&p.guardRel, "balance-rel-threshold", 0, "--workload: the routers' placement.balance_rel_threshold (0: their default, 1.5)")
	fs.DurationVar(&p.prefillPerToken, "prefill-per-token", 500*time.Microsecond, "--workload: the simulators' prefill time per uncached prompt token")
}

// prefixOnly are the flags that mean something with --workload only.
var prefixOnly = []string{
	"tenants", "context-tokens", "users", "queries", "query-tokens", "compare-policies", "routers",
	"share-index", "windows", "prefill-sims", "decode-sims", "block-size", "kv-cache-blocks",
	"max-num-seqs", "prefill-per-token", "balance-abs-threshold", "balance-rel-threshold",
}

// setWithout returns the first of prefixOnly that was set, or "".
func (p *prefixFlags) setWithout(set map[string]bool) string {
	for _, name := range prefixOnly {
		if set[name] {
			return name
		}
	}
	return ""
}

// variants returns the policy variants the flags ask for.
func (p *prefixFlags) variants() ([]bench.PolicyVariant, error) {
	if p.routers < 1 || p.routers > 16 {
		return nil, errors.New("--routers must be between 1 and 16")
	}
	var shares []bool
	switch p.shareIndex {
	case "both":
		shares = []bool{true, false}
	case "true":
		shares = []bool{true}
	case "false":
		shares = []bool{false}
	default:
		return nil, fmt.Errorf("--share-index %q: want true, false or both", p.shareIndex)
	}
	var out []bench.PolicyVariant
	seen := map[string]bool{}
	for _, name := range strings.Split(p.policies, ",") {
		name = strings.TrimSpace(name)
		policy, index := name, ""
		switch name {
		case "prefix", "least_loaded", "random", bench.PolicyOracle:
		case bench.IndexExact, bench.IndexApproximate:
			policy, index = "prefix", name
		default:
			return nil, fmt.Errorf("--compare-policies: unknown policy %q (want prefix, exact, approximate, least_loaded, random or oracle)", name)
		}
		if seen[name] {
			return nil, fmt.Errorf("--compare-policies: %s given twice", name)
		}
		seen[name] = true
		if name == bench.PolicyOracle {
			out = append(out, bench.PolicyVariant{Policy: name, Routers: 1}) // one router per producer
			continue
		}
		if policy != "prefix" || p.routers == 1 {
			out = append(out, bench.PolicyVariant{Policy: policy, Routers: p.routers, ShareIndex: true, Index: index})
			continue
		}
		for _, s := range shares {
			out = append(out, bench.PolicyVariant{Policy: policy, Routers: p.routers, ShareIndex: s, Index: index})
		}
	}
	return out, nil
}

// policyFile is the content of `narwhal bench --workload … --json FILE`.
type policyFile struct {
	StartedAt  string                  `json:"started_at"`
	Machine    bench.Machine           `json:"machine"`
	Comparison *bench.PolicyComparison `json:"comparison"`
}

// Per-workload defaults, for the flags not given (sized so that one
// comparison of three policies takes about a minute on a 2-core machine;
// docs/performance.md).
const (
	hotTenantUsers      = 64 // 1 tenant × 64 users × 16 queries: 1,024 requests
	hotTenantQueries    = 16
	hotTenantRate       = 96.0 // warm prefills of 33 ms: the fleet queues in bursts
	cachePressureUsers  = 1    // ⌈3 × capacity / context⌉ tenants × 1 × 3
	cachePressureQuery  = 3
	cachePressureRate   = 24.0 // mostly cold prefills: beyond the fleet's ~14/s
	mixedTenants        = 16   // 16 × 2 × 8 shared requests and 256 short chats
	defaultWorkloadRate = 32.0
)

// prefixWorkload is the trace --workload and its flags ask for, each
// workload's defaults filling the flags not given.
func (f *benchFlags) prefixWorkload() (bench.PrefixWorkload, error) {
	p := &f.prefix
	rate := defaultWorkloadRate
	if f.set["rate"] {
		r, err := strconv.ParseFloat(strings.TrimSpace(f.rate), 64)
		if err != nil || r <= 0 {
			return bench.PrefixWorkload{}, fmt.Errorf("--rate %q: want one positive number with --workload", f.rate)
		}
		rate = r
	}
	mt, err := bench.ParseRange(f.maxTokens)
	if err != nil || mt.Min != mt.Max {
		return bench.PrefixWorkload{}, fmt.Errorf("--max-tokens %q: want one integer ≥ 1 with --workload", f.maxTokens)
	}
	model := f.model
	if model == "" {
		model = "narwhal-sim"
	}
	wl := bench.PrefixWorkload{
		Shape: p.workload, Model: model, Tenants: p.tenants, ContextTokens: p.contextTokens,
		UsersPerTenant: p.users, QueriesPerUser: p.queries, QueryTokens: p.queryTokens,
		MaxTokens: mt.Min, Rate: rate, Seed: f.seed,
	}
	unset := func(name string) bool { return !f.set[name] }
	switch p.workload {
	case bench.ShapeHotTenant:
		if unset("tenants") {
			wl.Tenants = 1
		}
		if unset("users") {
			wl.UsersPerTenant = hotTenantUsers
		}
		if unset("queries") {
			wl.QueriesPerUser = hotTenantQueries
		}
		if unset("rate") {
			wl.Rate = hotTenantRate
		}
	case bench.ShapeCachePressure:
		wl.FleetKVTokens = p.prefillSims * p.kvCacheBlocks * p.blockSize
		if unset("tenants") && wl.ContextTokens > 0 && wl.FleetKVTokens > 0 {
			wl.Tenants = bench.CachePressureTenants(wl.FleetKVTokens, wl.ContextTokens)
		}
		if unset("users") {
			wl.UsersPerTenant = cachePressureUsers
		}
		if unset("queries") {
			wl.QueriesPerUser = cachePressureQuery
		}
		if unset("rate") {
			wl.Rate = cachePressureRate
		}
	case bench.ShapeMixed:
		if unset("tenants") {
			wl.Tenants = mixedTenants
		}
	}
	return wl, wl.Validate()
}

// runPrefix is `narwhal bench --workload`: it draws the trace, starts one
// fleet (sims, bus, routers as child processes) per policy variant and
// compares them in interleaved windows.
func (f *benchFlags) runPrefix(ctx context.Context) error {
	p := &f.prefix
	if f.url != "" {
		return errors.New("--workload runs its own sims and routers; it excludes --url")
	}
	if f.compare || f.set["concurrency"] {
		return errors.New("--workload is an open-loop trace; it excludes --compare-floor and --concurrency")
	}
	variants, err := p.variants()
	if err != nil {
		return err
	}
	wl, err := f.prefixWorkload()
	if err != nil {
		return err
	}
	tr, err := bench.NewTrace(wl)
	if err != nil {
		return err
	}
	sims := bench.PolicySims{
		Prefill: p.prefillSims, Decode: p.decodeSims, BlockSize: p.blockSize, KVCacheBlocks: p.kvCacheBlocks,
		MaxNumSeqs: p.maxNumSeqs, PrefillPerToken: p.prefillPerToken, TTFT: f.ttft, ITL: f.itl,
	}
	if p.prefillSims < 1 || p.decodeSims < 1 || p.blockSize < 1 || p.kvCacheBlocks < 1 || p.maxNumSeqs < 0 || p.prefillPerToken < 0 {
		return errors.New("--prefill-sims, --decode-sims, --block-size and --kv-cache-blocks must be at least 1; --max-num-seqs and --prefill-per-token not negative")
	}
	if p.guardAbs < 0 || p.guardRel < 0 {
		return errors.New("--balance-abs-threshold and --balance-rel-threshold must not be negative")
	}
	if p.windows < 1 {
		return errors.New("--windows must be at least 1")
	}
	opts := bench.PolicyCompareOptions{
		Variants: variants, Sims: sims, Windows: p.windows, Timeout: f.timeout,
		GuardAbs: p.guardAbs, GuardRel: p.guardRel,
		Bus: func() (string, func(), error) {
			emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Host: "127.0.0.1", Port: -1})
			if err != nil {
				return "", nil, err
			}
			return emb.ClientURL(), emb.Shutdown, nil
		},
	}
	if !f.quiet {
		opts.Progress = os.Stderr
	}
	file := &policyFile{StartedAt: time.Now().UTC().Format(time.RFC3339Nano), Machine: bench.ThisMachine()}
	bench.WriteMachine(os.Stdout, file.Machine)
	pc, err := bench.ComparePolicies(ctx, tr, opts)
	if err != nil {
		return err
	}
	file.Comparison = pc
	if err := bench.WritePolicyTable(os.Stdout, pc); err != nil {
		return err
	}
	if f.jsonPath != "" {
		b, err := json.MarshalIndent(file, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(f.jsonPath, append(b, '\n'), 0o644); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "wrote %s\n", f.jsonPath)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	for _, r := range pc.Policies {
		if r.Run.Requests > 0 && r.Run.OK == 0 {
			return fmt.Errorf("%s: no request succeeded (%d ended in errors: %v)", r.Name, r.Run.Requests, r.Run.Errors)
		}
	}
	return nil
}
