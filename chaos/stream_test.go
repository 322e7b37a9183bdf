package chaos

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// sseStream returns a chat stream of n output chunks as vLLM sends it:
// the role chunk, the tokens, the finish chunk, the usage chunk, [DONE].
func sseStream(n int) []byte {
	var b bytes.Buffer
	head := `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[`
	fmt.Fprintf(&b, "data: %s{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n", head)
	for i := range n {
		fmt.Fprintf(&b, "data: %s{\"index\":0,\"delta\":{\"content\":\" tok%d\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n", head, i)
	}
	fmt.Fprintf(&b, "data: %s{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\n", head)
	fmt.Fprintf(&b, "data: %s],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n", head, n, n+3)
	b.WriteString("data: [DONE]\n\n")
	return b.Bytes()
}

// readAllFaulted reads a faulted stream the way the proxy's copy loop
// does, into buf.
func readAllFaulted(s *streamFaults, buf []byte) (n int) {
	for {
		m, err := s.Read(buf)
		n += m
		if err != nil {
			return n
		}
	}
}

// errorObjectExchange is an exchange struck by error-object after so many
// output chunks that it strikes at [DONE].
func errorObjectExchange() *exchange {
	f := Fault{Name: FaultErrorObject, Params: map[string]string{ParamAfterTokens: "1000000"}}
	set, err := f.compile()
	if err != nil {
		panic(err)
	}
	x := &exchange{has: 1 << kindErrorObject, clientCtx: context.Background(), cancel: func() {}}
	x.set[kindErrorObject] = set
	return x
}

// TestStreamFaultsAllocateNothingPerChunk proves the stream rewriter keeps
// the hot path free of per-token allocations: a stream of 1000 tokens
// costs about as many allocations as one of 10.
//
// Each count is the least of a few measurements (testkit.LeastAllocs),
// and "about" leaves room for the rewriter's pooled buffers: the race
// detector makes sync.Pool drop a quarter of what is put back, and each
// drop costs the buffers anew, a few allocations per stream whatever its
// length. One allocation per chunk costs some 990 more; one per 60 chunks
// is still caught.
func TestStreamFaultsAllocateNothingPerChunk(t *testing.T) {
	buf := make([]byte, copyBufferSize)
	allocs := func(tokens int) float64 {
		stream := sseStream(tokens)
		x := errorObjectExchange()
		src := &rewindReader{}
		return testkit.LeastAllocs(20, func() {
			src.Reset(stream)
			s := newStreamFaults(src, x)
			readAllFaulted(s, buf)
			s.Close()
		})
	}
	few, many := allocs(10), allocs(1000)
	t.Logf("%v allocations per stream of 10 tokens, %v of 1000", few, many)
	if many > few+16 {
		t.Errorf("%v allocations for 10 tokens, %v for 1000: the rewriter allocates per chunk", few, many)
	}
}

// rewindReader is a reusable io.ReadCloser over a byte slice.
type rewindReader struct{ bytes.Reader }

func (r *rewindReader) Close() error { return nil }

// BenchmarkStreamFaults measures the stream rewriter on a 256-token
// stream (error-object striking at [DONE]), per stream.
func BenchmarkStreamFaults(b *testing.B) {
	stream := sseStream(256)
	x := errorObjectExchange()
	src := &rewindReader{}
	buf := make([]byte, copyBufferSize)
	b.SetBytes(int64(len(stream)))
	b.ReportAllocs()
	for b.Loop() {
		src.Reset(stream)
		s := newStreamFaults(src, x)
		if n := readAllFaulted(s, buf); n == 0 {
			b.Fatal("nothing read")
		}
		s.Close()
	}
}

var _ io.ReadCloser = (*rewindReader)(nil)

// streamOnlyExchange is an exchange struck by f alone, with a client that
// stays.
func streamOnlyExchange(t *testing.T, f Fault) *exchange {
	t.Helper()
	set, err := f.compile()
	if err != nil {
		t.Fatal(err)
	}
	x := &exchange{has: 1 << set.kind, clientCtx: context.Background(), cancel: func() {}}
	x.set[set.kind] = set
	return x
}

// TestStreamFaultDefaults proves what each stream fault does with no
// parameter that places it (R-CHAOS-1, docs/chaos.md): mid-stream-silence
// strikes mid-stream, after the first output chunk (a silence before it
// would be a first-token delay); close-before-done and error-object strike
// at the first output chunk, before commit, where a router may still
// retry; done-before-token replaces the first output chunk with [DONE].
// The metadata before the first output chunk (the role chunk) always
// passes.
func TestStreamFaultDefaults(t *testing.T) {
	stream := sseStream(4)
	role := string(stream[:bytes.Index(stream, []byte("\n\n"))+2])
	for _, c := range []struct {
		fault  Fault
		tokens int    // output chunks the client gets
		tail   string // what follows them ("" = nothing: the stream ends)
	}{
		{Fault{Name: FaultMidStreamSilence, Params: map[string]string{ParamDelayMS: "1"}}, 1, ""},
		{Fault{Name: FaultCloseBeforeDone}, 0, ""},
		{Fault{Name: FaultDoneBeforeToken}, 0, "data: [DONE]\n\n"},
		{Fault{Name: FaultErrorObject}, 0, "data: {\"error\":{\"message\":\"chaos: injected error object\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\ndata: [DONE]\n\n"},
	} {
		t.Run(c.fault.Name, func(t *testing.T) {
			src := &rewindReader{}
			src.Reset(stream)
			s := newStreamFaults(src, streamOnlyExchange(t, c.fault))
			defer s.Close()
			got, _ := io.ReadAll(s)
			want := role
			for i := range c.tokens {
				want += fmt.Sprintf("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok%d\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n", i)
			}
			want += c.tail
			if string(got) != want {
				t.Errorf("client got\n%s\nwant\n%s", got, want)
			}
		})
	}
	// With no parameter at all, mid-stream-silence waits for one output
	// chunk too (and then holds until the client leaves).
	set, err := (&Fault{Name: FaultMidStreamSilence}).compile()
	if err != nil || set.after != 1 || set.delay != 0 {
		t.Errorf("mid-stream-silence defaults: after_tokens %d, delay %v, %v; want 1, 0 (until the client leaves)", set.after, set.delay, err)
	}
}
