package main

import (
	"context"
	"reflect"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/bench"
)

// TestBenchPolicyVariants: --compare-policies and --routers give one
// variant per policy, the prefix policy both shared and isolated with
// several routers (unless --share-index says which).
func TestBenchPolicyVariants(t *testing.T) {
	p := prefixFlags{policies: "least_loaded, prefix", routers: 3, shareIndex: "both"}
	got, err := p.variants()
	if err != nil {
		t.Fatal(err)
	}
	want := []bench.PolicyVariant{
		{Policy: "least_loaded", Routers: 3, ShareIndex: true},
		{Policy: "prefix", Routers: 3, ShareIndex: true},
		{Policy: "prefix", Routers: 3, ShareIndex: false},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("variants %+v, want %+v", got, want)
	}
	p = prefixFlags{policies: "prefix,random", routers: 1, shareIndex: "both"}
	if got, _ := p.variants(); len(got) != 2 || got[0].Policy != "prefix" || got[1].Policy != "random" {
		t.Fatalf("one router: %+v", got)
	}
	p = prefixFlags{policies: "least_loaded,prefix,oracle", routers: 3, shareIndex: "true"}
	got, err = p.variants()
	if err != nil || len(got) != 3 || got[2] != (bench.PolicyVariant{Policy: bench.PolicyOracle, Routers: 1}) {
		t.Fatalf("with the oracle: %+v, %v", got, err)
	}
	p = prefixFlags{policies: "exact,approximate,oracle", routers: 3, shareIndex: "true"}
	got, err = p.variants()
	want = []bench.PolicyVariant{
		{Policy: "prefix", Routers: 3, ShareIndex: true, Index: bench.IndexExact},
		{Policy: "prefix", Routers: 3, ShareIndex: true, Index: bench.IndexApproximate},
		{Policy: bench.PolicyOracle, Routers: 1},
	}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("exact and approximate: %+v, %v", got, err)
	}
	for _, bad := range []prefixFlags{
		{policies: "prefix,fastest", routers: 1, shareIndex: "both"},
		{policies: "exact,exact", routers: 1, shareIndex: "both"},
		{policies: "prefix,prefix", routers: 1, shareIndex: "both"},
		{policies: "prefix", routers: 0, shareIndex: "both"},
		{policies: "prefix", routers: 2, shareIndex: "maybe"},
	} {
		if _, err := bad.variants(); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

// TestBenchWorkloadFlagsNeedWorkload: the trace's flags are refused
// without --workload, and --workload refuses --url.
func TestBenchWorkloadFlagsNeedWorkload(t *testing.T) {
	err := runBench(context.Background(), []string{"--tenants", "3", "--url", "http://127.0.0.1:9"})
	if err == nil || !strings.Contains(err.Error(), "--tenants applies to --workload only") {
		t.Fatalf("got %v", err)
	}
	err = runBench(context.Background(), []string{"--workload", "shared-prefix", "--url", "http://127.0.0.1:9"})
	if err == nil || !strings.Contains(err.Error(), "excludes --url") {
		t.Fatalf("got %v", err)
	}
	err = runBench(context.Background(), []string{"--workload", "zipf"})
	if err == nil || !strings.Contains(err.Error(), "zipf") {
		t.Fatalf("got %v", err)
	}
}

// TestBenchWorkloadDefaults: each named workload fills the flags not
// given with its own shape (one tenant for hot-tenant; for
// cache-pressure the tenants whose contexts hold 3× the sims' KV
// capacity), flags given win, and --seed reaches the trace.
func TestBenchWorkloadDefaults(t *testing.T) {
	base := func(workload string, set ...string) *benchFlags {
		f := &benchFlags{maxTokens: "16", seed: 9, rate: "", set: map[string]bool{}}
		f.prefix = prefixFlags{workload: workload, tenants: 32, contextTokens: 512, users: 2, queries: 8, queryTokens: 64,
			prefillSims: 4, blockSize: 16, kvCacheBlocks: 416}
		for _, s := range set {
			f.set[s] = true
		}
		return f
	}
	wl, err := base(bench.ShapeHotTenant).prefixWorkload()
	if err != nil || wl.Tenants != 1 || wl.UsersPerTenant != 64 || wl.Requests() != 1024 || wl.Rate != hotTenantRate || wl.Seed != 9 {
		t.Fatalf("hot-tenant %+v, %v", wl, err)
	}
	wl, err = base(bench.ShapeCachePressure).prefixWorkload()
	if err != nil || wl.FleetKVTokens != 4*416*16 || wl.Tenants*wl.ContextTokens < 3*wl.FleetKVTokens || wl.Rate != cachePressureRate {
		t.Fatalf("cache-pressure %+v, %v", wl, err)
	}
	f := base(bench.ShapeCachePressure, "tenants")
	if _, err := f.prefixWorkload(); err == nil {
		t.Fatal("cache-pressure with --tenants 32 (less than 3× the capacity) accepted")
	}
	wl, err = base(bench.ShapeMixed).prefixWorkload()
	if err != nil || wl.Tenants != mixedTenants || wl.Requests() != 512 {
		t.Fatalf("mixed %+v (%d requests), %v", wl, wl.Requests(), err)
	}
	wl, err = base(bench.ShapeSharedPrefix).prefixWorkload()
	if err != nil || wl.Tenants != 32 || wl.Requests() != 512 || wl.Rate != 32 {
		t.Fatalf("shared-prefix %+v, %v", wl, err)
	}
}
