package engines

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
)

// MaxMetricsBytes bounds the /metrics body ReadLoad reads; the rest is
// not read. vLLM's is some hundred KiB with every histogram.
const MaxMetricsBytes = 8 << 20

// maxMetricsLine bounds one line of /metrics; a longer line fails the
// read.
const maxMetricsLine = 1 << 20

// Load is what an engine's Prometheus /metrics says about its queue and
// its life, for placement (behaviour.md R-PLACE-2): the queue is a load signal,
// and a new start time (or a counter that went back) says the engine
// restarted and lost its prefix cache. Each Has… field says whether the
// metric was there.
type Load struct {
	// StartTime is process_start_time_seconds, Unix seconds: vLLM exposes
	// it through the Prometheus client's process collector (not in its
	// multi-process mode), the simulator per simulated engine.
	StartTime    float64
	HasStartTime bool
	// Waiting is the requests queued in the engine: vllm:num_requests_waiting
	// summed over its series, or SGLang's sglang:num_queue_reqs.
	Waiting    int64
	HasWaiting bool
	// PromptTokens is the prompt-token counter (vllm:prompt_tokens_total,
	// or SGLang's sglang:prompt_tokens_total) summed over its series: a
	// counter lower than at the last read means the engine restarted.
	PromptTokens    float64
	HasPromptTokens bool
	// Running is the requests the engine runs now:
	// vllm:num_requests_running summed over its series, or SGLang's
	// sglang:num_running_reqs (behaviour.md R-PLACE-3).
	Running    int64
	HasRunning bool
	// KVBlocks and KVBlockTokens are the size of the engine's KV cache,
	// from the labels num_gpu_blocks and block_size of vLLM's
	// vllm:cache_config_info (its first series with both positive): the
	// prefix index of the engine is bounded by it (R-PLACE-3). 0 when
	// absent.
	KVBlocks, KVBlockTokens int64
}

// ReadLoad reads e's GET /metrics (with e's credential) and returns its
// Load. It fails when the engine cannot be reached, answers other than
// 200, or the body is not Prometheus text; a metric that is absent is
// not an error (see Load's Has… fields).
func ReadLoad(ctx context.Context, httpc *http.Client, e *Engine) (Load, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(e.URL, "/")+"/metrics", nil)
	if err != nil {
		return Load{}, err
	}
	req.Header.Set("Accept", "text/plain")
	e.Credential.Authorize(req.Header)
	resp, err := httpc.Do(req)
	if err != nil {
		return Load{}, fmt.Errorf("engine %s: /metrics: %w", e.ID, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return Load{}, fmt.Errorf("engine %s: /metrics: %s", e.ID, statusText(resp))
	}
	l, err := ParseLoad(io.LimitReader(resp.Body, MaxMetricsBytes))
	if err != nil {
		return Load{}, fmt.Errorf("engine %s: /metrics: %w", e.ID, err)
	}
	return l, nil
}

// ErrNotMetrics means a /metrics body is not Prometheus text.
var ErrNotMetrics = errors.New("not Prometheus text")

// ParseLoad reads Prometheus text format from r and returns the Load
// metrics it holds (see Load). It fails with ErrNotMetrics on a sample
// line it cannot read (an unterminated label set, a value that is not a
// number) or a line longer than 1 MiB; comments and other metrics are
// skipped.
func ParseLoad(r io.Reader) (Load, error) {
	var l Load
	var waitingSGLang float64
	var hasSGLangWaiting bool
	var promptSGLang float64
	var hasSGLangPrompt bool
	var runningSGLang float64
	var hasSGLangRunning bool
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxMetricsLine)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		name, value, err := sample(line)
		if err != nil {
			return Load{}, err
		}
		switch name {
		case "process_start_time_seconds":
			l.StartTime, l.HasStartTime = value, true
		case "vllm:num_requests_waiting":
			l.Waiting += int64(value)
			l.HasWaiting = true
		case "sglang:num_queue_reqs":
			waitingSGLang += value
			hasSGLangWaiting = true
		case "vllm:prompt_tokens_total":
			l.PromptTokens += value
			l.HasPromptTokens = true
		case "sglang:prompt_tokens_total":
			promptSGLang += value
			hasSGLangPrompt = true
		case "vllm:num_requests_running":
			l.Running += int64(value)
			l.HasRunning = true
		case "sglang:num_running_reqs":
			runningSGLang += value
			hasSGLangRunning = true
		case "vllm:cache_config_info":
			if l.KVBlocks == 0 {
				b, bt := labelInt(line, "num_gpu_blocks"), labelInt(line, "block_size")
				if b > 0 && bt > 0 {
					l.KVBlocks, l.KVBlockTokens = b, bt
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		return Load{}, fmt.Errorf("%w: %v", ErrNotMetrics, err)
	}
	if !l.HasWaiting && hasSGLangWaiting {
		l.Waiting, l.HasWaiting = int64(waitingSGLang), true
	}
	if !l.HasPromptTokens && hasSGLangPrompt {
		l.PromptTokens, l.HasPromptTokens = promptSGLang, true
	}
	if !l.HasRunning && hasSGLangRunning {
		l.Running, l.HasRunning = int64(runningSGLang), true
	}
	l.Waiting = max(l.Waiting, 0)
	l.Running = max(l.Running, 0)
	return l, nil
}

// sample splits one Prometheus text sample line, `name{labels} value
// [timestamp]`, into its name and value.
func sample(line string) (string, float64, error) {
	end := strings.IndexAny(line, "{ \t")
	if end <= 0 {
		return "", 0, fmt.Errorf("%w: sample %q", ErrNotMetrics, clip(line))
	}
	name, rest := line[:end], line[end:]
	if rest[0] == '{' {
		i, quoted := 1, false
		for ; i < len(rest); i++ {
			switch c := rest[i]; {
			case quoted && c == '\\':
				i++
			case c == '"':
				quoted = !quoted
			case !quoted && c == '}':
				goto closed
			}
		}
		return "", 0, fmt.Errorf("%w: unterminated labels in %q", ErrNotMetrics, clip(line))
	closed:
		rest = rest[i+1:]
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 || len(fields) > 2 {
		return "", 0, fmt.Errorf("%w: sample %q", ErrNotMetrics, clip(line))
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil || math.IsNaN(v) {
		if err == nil && math.IsNaN(v) {
			return name, 0, nil // a NaN gauge says nothing
		}
		return "", 0, fmt.Errorf("%w: value of %q", ErrNotMetrics, clip(line))
	}
	if math.IsInf(v, 0) {
		v = 0
	}
	return name, v, nil
}

// maxLabelInt bounds what labelInt returns: a KV cache of 2^40 blocks
// is beyond any engine.
const maxLabelInt = 1 << 40

// labelInt returns the value of label name of a sample line
// (`name{a="1",b="2"} v`) as a positive integer, 0 when absent or not
// one. A value written as a float ("1024.0") is taken too.
func labelInt(line, name string) int64 {
	open := strings.IndexByte(line, '{')
	if open < 0 {
		return 0
	}
	rest := line[open+1:]
	for len(rest) > 0 {
		eq := strings.IndexByte(rest, '=')
		if eq < 0 || eq+1 >= len(rest) || rest[eq+1] != '"' {
			return 0
		}
		key := strings.TrimSpace(strings.TrimLeft(rest[:eq], ", "))
		val := rest[eq+2:]
		end := strings.IndexByte(val, '"')
		if end < 0 {
			return 0
		}
		if key == name {
			v, err := strconv.ParseFloat(val[:end], 64)
			if err != nil || !(v >= 1) || v > maxLabelInt {
				return 0
			}
			return int64(v)
		}
		rest = val[end+1:]
		if strings.HasPrefix(rest, "}") {
			return 0
		}
	}
	return 0
}

// clip shortens s for an error message.
func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
