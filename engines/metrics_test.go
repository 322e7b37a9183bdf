package engines

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
)

// TestParseLoad reads the queue, the start time and the prompt-token
// counter as vLLM and SGLang print them — several series summed, labels
// with braces and escaped quotes, timestamps — and refuses what is not
// Prometheus text (the engine is not trusted).
func TestParseLoad(t *testing.T) {
	text := `# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="a \"}\" b"} 2.0 1700000000000
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 7.0
process_start_time_seconds 1.7000000123e+09
`
	l, err := ParseLoad(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	if !l.HasWaiting || l.Waiting != 5 || !l.HasStartTime || l.StartTime != 1.7000000123e9 || !l.HasPromptTokens || l.PromptTokens != 1234 {
		t.Fatalf("%+v", l)
	}
	l, err = ParseLoad(strings.NewReader("sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:prompt_tokens_total 9\n"))
	if err != nil || l.Waiting != 4 || !l.HasWaiting || l.PromptTokens != 9 || l.HasStartTime {
		t.Fatalf("sglang: %+v %v", l, err)
	}
	if l, err := ParseLoad(strings.NewReader("other_metric 1\n")); err != nil || l.HasWaiting || l.HasStartTime || l.HasPromptTokens {
		t.Fatalf("no load metrics: %+v %v", l, err)
	}
	for _, bad := range []string{
		`vllm:num_requests_waiting{model_name="m" 3`,
		"vllm:num_requests_waiting lots",
		"{x=\"1\"} 2",
		"vllm:num_requests_waiting 1 2 3",
		"process_start_time_seconds " + strings.Repeat("9", maxMetricsLine),
	} {
		if _, err := ParseLoad(strings.NewReader(bad)); !errors.Is(err, ErrNotMetrics) {
			t.Errorf("%.60q: %v, want ErrNotMetrics", bad, err)
		}
	}
}

// TestParseLoadCacheAndRunningRPLACE3 reads what the cost and the index's
// bound need of vLLM's and SGLang's /metrics: the running requests
// summed, and the KV cache's size from cache_config_info's labels
// (written as vLLM writes them, strings among them); a malformed or
// absent size is 0.
func TestParseLoadCacheAndRunningRPLACE3(t *testing.T) {
	text := `# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27197",prefix_caching_hash_algo="builtin"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
`
	l, err := ParseLoad(strings.NewReader(text))
	if err != nil || !l.HasRunning || l.Running != 7 || l.KVBlocks != 27197 || l.KVBlockTokens != 16 {
		t.Fatalf("%+v %v", l, err)
	}
	l, err = ParseLoad(strings.NewReader("sglang:num_running_reqs{model_name=\"m\"} 5\n"))
	if err != nil || !l.HasRunning || l.Running != 5 {
		t.Fatalf("sglang: %+v %v", l, err)
	}
	for _, bad := range []string{
		`vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1`,
		`vllm:cache_config_info{block_size="0",num_gpu_blocks="100"} 1`,
		`vllm:cache_config_info{num_gpu_blocks="1e300",block_size="16"} 1`,
		`vllm:cache_config_info 1`,
	} {
		if l, err := ParseLoad(strings.NewReader(bad + "\n")); err != nil || l.KVBlocks != 0 {
			t.Errorf("%s: %+v %v, want no size", bad, l, err)
		}
	}
}

// TestReadLoadFromTheSimulator: the simulator's /metrics has everything
// placement reads, and a new simulator (a restart) a new start time.
func TestReadLoadFromTheSimulator(t *testing.T) {
	srv := simtest.Start(t, sim.Config{EngineID: "p1", Model: "m"})
	e := &Engine{ID: "p1", URL: srv.URL()}
	httpc := &http.Client{Timeout: 5 * time.Second}
	l, err := ReadLoad(context.Background(), httpc, e)
	if err != nil {
		t.Fatal(err)
	}
	if !l.HasWaiting || l.Waiting != 0 || !l.HasStartTime || !l.HasPromptTokens {
		t.Fatalf("%+v", l)
	}
	if want := float64(srv.StartTime().UnixMicro()) / 1e6; l.StartTime != want {
		t.Fatalf("start time %v, want %v", l.StartTime, want)
	}
	if _, err := ReadLoad(context.Background(), httpc, &Engine{ID: "x", URL: srv.URL() + "/nothing"}); err == nil {
		t.Fatal("a 404 /metrics read as a load")
	}
}
