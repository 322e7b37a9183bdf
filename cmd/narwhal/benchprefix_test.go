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
	for _, bad := range []prefixFlags{
		{policies: "prefix,fastest", routers: 1, shareIndex: "both"},
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
