// Package bench is Narwhal's load generator: it drives an OpenAI-compatible
// router (or, for comparison, the engines directly, as a router of zero
// cost would) with a closed-loop or Poisson open-loop workload of chat or
// text completions, streamed or not, and measures what a client sees:
// requests/s, output tokens/s, TTFT (time to the first generated output,
// behaviour.md §0), inter-token latency (between output chunks) and end-to-end
// latency, with errors counted by class (HTTP status, terminal SSE error
// events of R-FAIL-5 by code, transport errors, streams truncated before
// [DONE] of R-FAIL-2).
//
// Two targets exist. RouterTarget sends each request to a router over HTTP
// and reads the SSE stream with a bufio.Reader, schemas.SSEData and
// schemas.ClassifyChunk, without allocating per token. FloorTarget runs
// both legs itself with engines.Client (Prefill, then Decode on the
// handoff, producer and consumer chosen round-robin): the floor a router
// cannot beat. Compare measures one workload against both, interleaved in
// alternating slices so that drift on a shared machine cancels, and reports
// the router's added latency per percentile, the throughput ratio and, when
// the router runs as a child process (RouterProcess), its CPU time per
// request read from /proc.
//
// Results are Reports (every figure, JSON-encodable into a File), rendered
// as a table (WriteTable) and as an SVG of latency histograms (WriteSVG).
// `narwhal bench` is the command line over this package.
package bench
