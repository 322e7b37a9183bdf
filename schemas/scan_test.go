package schemas

import (
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// scanCases are payloads whose usage the relay reads (R-LEG-5, R-LEG-6).
var scanCases = []string{
	vllmUsageChunk,
	vllmContentChunk,
	vllmRoleChunk,
	`{"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":1,"completion_tokens":2}}`,
	`{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":9,"total_tokens":16}}`,
	`{"choices":[],"usage":{"prompt_tokens":7,"prompt_tokens":8}}`,
	`{"choices":[],"usage":{"prompt_tokens":7},"usage":{"completion_tokens":3}}`,
	`{"choices":[],"usage":{"prompt_tokens":-1,"completion_tokens":1.5}}`,
	`{"choices":[],"usage":{"prompt_tokens":"7"}}`,
	`{"choices":[],"usage":{"\u0070rompt_tokens":4}}`,
	`{"choices":[],"usage":{"prompt_tokens":{"a":1},"completion_tokens":[2]}}`,
	`{"choices":[],"usage":{}}`,
	`{"choices":[],"usage":{"a":1},"usage":null}`,
	`{"choices":[],"usage":7}`,
	`{"choices":[],"usage":{"prompt_tokens":1}`,
	`{"error":{"message":"x"},"usage":{"prompt_tokens":1}}`,
	`[DONE]`,
	`not json`,
}

// TestScanChunkAgrees checks that the one pass of ScanChunk reports what
// ClassifyChunk, ChunkHasUsage, IsUsageOnly and UsageTokens report
// separately.
func TestScanChunkAgrees(t *testing.T) {
	for _, p := range scanCases {
		checkScan(t, []byte(p))
	}
	for _, tc := range chunkCases {
		checkScan(t, []byte(tc.payload))
	}
}

func checkScan(t *testing.T, payload []byte) {
	t.Helper()
	got := ScanChunk(payload)
	want := Chunk{Kind: ClassifyChunk(payload)}
	if want.Kind == ChunkMetadata || want.Kind == ChunkOutput {
		want.Usage, want.UsageOnly = ChunkHasUsage(payload), IsUsageOnly(payload)
		if p, c, ok := UsageTokens(payload); ok && want.Usage {
			want.PromptTokens, want.CompletionTokens = p, c
		}
	}
	if got != want {
		t.Fatalf("ScanChunk(%s) = %+v, want %+v", payload, got, want)
	}
}

func TestScanChunkZeroAllocs(t *testing.T) {
	payload := []byte(vllmUsageChunk)
	if n := testkit.LeastAllocs(100, func() { _ = ScanChunk(payload) }); n != 0 {
		t.Fatalf("ScanChunk allocates %v times per call", n)
	}
}

func FuzzScanChunk(f *testing.F) {
	for _, p := range scanCases {
		f.Add([]byte(p))
	}
	f.Fuzz(func(t *testing.T, payload []byte) { checkScan(t, payload) })
}
