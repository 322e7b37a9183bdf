package meshview

import (
	"context"
	"encoding/json"
	"log/slog"
	"math/rand/v2"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// warmShape is the shape of the batches a warm-up benchmark reads.
type warmShape struct {
	name string
	// placements returns how many placements batch i holds; hashes how
	// many fresh block hashes its placement k holds.
	placements func(i int) int
	hashes     func(i, k int) int
}

// The shapes of batches routers publish. busy is the standard
// shared-prefix run (docs/performance.md) spread over three routers: 32
// requests/s, each router flushing every 25 ms, so a batch mostly holds
// one placement (here one in three holds two); a follow-up's fresh
// blocks are its query (about 7 blocks of 64 bytes: 8 here), a tenant's
// first request the whole prompt (about 55: 56 here, one placement in
// five): about 24 hashes, 240 bytes, per batch. full is what the stream's
// 64 MiB bound allows 30,000 batches at most, 4 placements of 64 hashes
// (2.1 KB) each.
var (
	warmBusy = warmShape{name: "busy",
		placements: func(i int) int { return 1 + btoi(i%3 == 0) },
		hashes: func(i, k int) int {
			if (i+k)%5 == 0 {
				return 56
			}
			return 8
		}}
	warmFull = warmShape{name: "full",
		placements: func(int) int { return 4 },
		hashes:     func(int, int) int { return 64 }}
)

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// fillPrefixStream publishes n batches of shape of the other routers'
// placements on p1…p3 to stream NARWHAL_PREFIX through m's peer
// connection, and returns the stream's last sequence.
func fillPrefixStream(tb testing.TB, m *meshBus, shape warmShape, n int) uint64 {
	tb.Helper()
	js := m.Peer.JetStream()
	first := prefixLastSeq(tb, m)
	rng := rand.New(rand.NewPCG(1, 2))
	routers := []string{"rt-x", "rt-y", "rt-z"}
	engines := []string{"p1", "p2", "p3"}
	hashes := make([]uint64, bus.PrefixMaxHashes)
	var batch bus.PrefixBatch
	for i := range n {
		r := routers[i%len(routers)]
		batch.Reset(r)
		for k := range shape.placements(i) {
			hs := hashes[:shape.hashes(i, k)]
			for j := range hs {
				hs[j] = rng.Uint64()
			}
			batch.Add(engines[(i+k)%len(engines)], hs)
		}
		if _, err := js.PublishAsync(bus.PrefixSubject(r), batch.Bytes()); err != nil {
			tb.Fatal(err)
		}
		if i%1000 == 999 {
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(10 * time.Second):
				tb.Fatal("the stream did not take the batches")
			}
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(10 * time.Second):
		tb.Fatal("the stream did not take the batches")
	}
	last := prefixLastSeq(tb, m)
	if last-first != uint64(n) {
		tb.Fatalf("the stream took %d batches, want %d", last-first, n)
	}
	return last
}

// prefixLastSeq returns the last sequence of stream NARWHAL_PREFIX.
func prefixLastSeq(tb testing.TB, m *meshBus) uint64 {
	tb.Helper()
	st, err := m.Peer.JetStream().Stream(context.Background(), bus.PrefixStream)
	if err != nil {
		tb.Fatal(err)
	}
	return st.CachedInfo().State.LastSeq
}

// BenchmarkPrefixWarm30000Batches: one warm-up of a router's prefix index
// from a stream NARWHAL_PREFIX holding 30,000 batches (of shape busy and
// full) on an embedded NATS over loopback TCP, every batch decoded and
// applied to the bounded index. It reports batches/s (wall), the
// process's CPU per batch (the embedded server's included) and the
// consumers the warm-up made on the server (JetStream API round trips).
func BenchmarkPrefixWarm30000Batches(b *testing.B) {
	const n = 30000
	for _, shape := range []warmShape{warmBusy, warmFull} {
		b.Run(shape.name, func(b *testing.B) {
			s := newStack(b, prefixFleet(), nil)
			s.waitModels()
			m := newMeshBus(b)
			fillPrefixStream(b, m, shape, n)
			var created atomic.Int64
			sub, err := m.Peer.Conn().Subscribe("$JS.API.CONSUMER.CREATE.>", func(*nats.Msg) { created.Add(1) })
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = sub.Unsubscribe() }()
			if err := m.Peer.Conn().Flush(); err != nil {
				b.Fatal(err)
			}
			share := newIndexShare(s.v)
			since := time.Now().Add(-bus.PrefixMaxAge)
			b.ReportAllocs()
			b.ResetTimer()
			start, cpu := time.Now(), testkit.CPUTime()
			for range b.N {
				before := testkit.GatheredSum(b, s.reg, "narwhal_prefix_batches_applied_total")
				share.warm(m.B, since, false)
				if got := testkit.GatheredSum(b, s.reg, "narwhal_prefix_batches_applied_total") - before; got != n {
					b.Fatalf("the warm-up applied %v batches, want %d", got, n)
				}
			}
			b.ReportMetric(float64(b.N*n)/time.Since(start).Seconds(), "batches/s")
			b.ReportMetric(float64(testkit.CPUTime()-cpu)/float64(b.N*n), "cpu-ns/batch")
			_ = m.Peer.Conn().Flush()
			b.ReportMetric(float64(created.Load())/float64(b.N), "consumers/op")
			b.StopTimer()
			// What stays is the bounded index (and the embedded server's
			// caches), not the stream read.
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			b.ReportMetric(float64(ms.HeapAlloc)/(1<<20), "heap-MiB")
			for _, id := range []string{"p1", "p2", "p3"} {
				if n := share.index.Blocks(id); n > share.index.Capacity() {
					b.Fatalf("the index holds %d blocks of %s, above its bound %d", n, id, share.index.Capacity())
				}
			}
		})
	}
}

// warmLog is the JSON log of a share's warm-ups.
type warmLog struct{ buf testkit.LockedBuffer }

// records returns the logged records whose message is msg.
func (l *warmLog) records(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range l.buf.Lines() {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if rec["msg"] == msg {
			out = append(out, rec)
		}
	}
	return out
}

// warmShare returns a share of a fresh router's index (fleet p1…p3, d1)
// that logs to the returned log, and a mesh bus for it.
func warmShare(t *testing.T, hold func(slog.Record)) (*indexShare, *meshBus, *warmLog, *prometheus.Registry) {
	t.Helper()
	s := newStack(t, prefixFleet(), nil)
	s.waitModels()
	m := newMeshBus(t)
	share := newIndexShare(s.v)
	l := new(warmLog)
	share.log = slog.New(holdingHandler{slog.NewJSONHandler(&l.buf, nil), hold})
	return share, m, l, s.reg
}

// holdingHandler passes every record to hold (when set) before handling
// it: the logging goroutine waits for hold.
type holdingHandler struct {
	slog.Handler
	hold func(slog.Record)
}

func (h holdingHandler) Handle(ctx context.Context, r slog.Record) error {
	if h.hold != nil {
		h.hold(r)
	}
	return h.Handler.Handle(ctx, r)
}

func (h holdingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return holdingHandler{h.Handler.WithAttrs(as), h.hold}
}

func (h holdingHandler) WithGroup(name string) slog.Handler {
	return holdingHandler{h.Handler.WithGroup(name), h.hold}
}

// TestPrefixWarmUpSaysWhatItReadRPLACE2: a warm-up that reads the stream
// to its last batch logs `prefix index warmed from the bus` with how
// many batches it read and how long it took, counts them as read and
// none as missed, and the index holds their placements.
func TestPrefixWarmUpSaysWhatItReadRPLACE2(t *testing.T) {
	share, m, l, reg := warmShare(t, nil)
	const n = 500
	fillPrefixStream(t, m, warmBusy, n)
	if !share.warm(m.B, time.Now().Add(-bus.PrefixMaxAge), false) {
		t.Fatal("the warm-up did not read the stream")
	}
	done := l.records(t, "prefix index warmed from the bus")
	if len(done) != 1 || done[0]["level"] != "INFO" || done[0]["batches"] != float64(n) || done[0]["took"] == nil {
		t.Fatalf("logged %v, want one INFO line with batches %d and took", done, n)
	}
	if cut := l.records(t, "prefix index warm-up cut short"); len(cut) != 0 {
		t.Fatalf("a complete warm-up logged %v", cut)
	}
	if got := testkit.GatheredSum(t, reg, "narwhal_prefix_warmup_batches_total", "outcome", "read"); got != n {
		t.Errorf("counted %v batches read, want %d", got, n)
	}
	if got := testkit.GatheredSum(t, reg, "narwhal_prefix_warmup_batches_total", "outcome", "missed"); got != 0 {
		t.Errorf("counted %v batches missed, want 0", got)
	}
	if got := testkit.GatheredSum(t, reg, "narwhal_prefix_batches_applied_total"); got != n {
		t.Errorf("applied %v batches, want %d", got, n)
	}
	for _, id := range []string{"p1", "p2", "p3"} {
		if share.index.Blocks(id) == 0 {
			t.Errorf("the index holds nothing of %s after the warm-up", id)
		}
	}
}

// TestPrefixWarmUpCutShortSaysWhatItMissedRPLACE2: a warm-up its limit
// cuts short logs `prefix index warm-up cut short` at WARN with how many
// batches it read and how many it missed (the stream's last sequence
// minus the last one read), counts both, and does not claim the index
// warmed. The limit passes while the warm-up logs the refused batch
// that is the stream's 21st.
func TestPrefixWarmUpCutShortSaysWhatItMissedRPLACE2(t *testing.T) {
	const limit = 200 * time.Millisecond
	hold := func(r slog.Record) {
		if r.Message == "prefix placements ignored" {
			// The warm-up's limit began before this record was made.
			time.Sleep(limit + 50*time.Millisecond)
		}
	}
	share, m, l, reg := warmShare(t, hold)
	share.warmLimit = limit
	fillPrefixStream(t, m, warmBusy, 20)
	if _, err := m.Peer.JetStream().Publish(context.Background(), bus.PrefixSubject("rt-x"), []byte("NWP1 garbage")); err != nil {
		t.Fatal(err)
	}
	last := fillPrefixStream(t, m, warmBusy, 100)
	if !share.warm(m.B, time.Now().Add(-bus.PrefixMaxAge), false) {
		t.Fatal("the warm-up did not read the stream")
	}
	cut := l.records(t, "prefix index warm-up cut short")
	if len(cut) != 1 || cut[0]["level"] != "WARN" || cut[0]["batches"] != float64(21) || cut[0]["missed"] != float64(100) {
		t.Fatalf("logged %v, want one WARN line with batches 21 and missed 100", cut)
	}
	if cut[0]["last"] != float64(last) {
		t.Errorf("logged last %v, want the stream's last sequence %d", cut[0]["last"], last)
	}
	if done := l.records(t, "prefix index warmed from the bus"); len(done) != 0 {
		t.Fatalf("a warm-up cut short logged %v", done)
	}
	if got := testkit.GatheredSum(t, reg, "narwhal_prefix_warmup_batches_total", "outcome", "read"); got != 21 {
		t.Errorf("counted %v batches read, want 21", got)
	}
	if got := testkit.GatheredSum(t, reg, "narwhal_prefix_warmup_batches_total", "outcome", "missed"); got != 100 {
		t.Errorf("counted %v batches missed, want 100", got)
	}
}

// TestPrefixWarmUpEndsWithWhatItCanReadRPLACE2: a warm-up does not wait
// for what its consumer cannot deliver — the stream's last message on a
// subject that is not a batch's (narwhal.prefix.a.b), or nothing at all
// since the time it reads from — but ends at once, warmed.
func TestPrefixWarmUpEndsWithWhatItCanReadRPLACE2(t *testing.T) {
	share, m, l, _ := warmShare(t, nil)
	fillPrefixStream(t, m, warmBusy, 10)
	if _, err := m.Peer.JetStream().Publish(context.Background(), bus.PrefixSubjectPrefix+"a.b", []byte("x")); err != nil {
		t.Fatal(err)
	}
	for _, since := range []time.Time{time.Now().Add(-bus.PrefixMaxAge), time.Now().Add(time.Second)} {
		start := time.Now()
		if !share.warm(m.B, since, false) {
			t.Fatal("the warm-up did not read the stream")
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("the warm-up from %v took %v", since, took)
		}
	}
	done := l.records(t, "prefix index warmed from the bus")
	if len(done) != 2 || done[0]["batches"] != float64(10) || done[1]["batches"] != float64(0) {
		t.Fatalf("logged %v, want two lines: 10 batches, then 0", done)
	}
	if cut := l.records(t, "prefix index warm-up cut short"); len(cut) != 0 {
		t.Fatalf("logged %v", cut)
	}
}

// busyBatch returns a batch of router rt-x of shape busy (its batch i).
func busyBatch(i int) []byte {
	rng := rand.New(rand.NewPCG(3, uint64(i)))
	var batch bus.PrefixBatch
	batch.Reset("rt-x")
	engines := []string{"p1", "p2", "p3"}
	for k := range warmBusy.placements(i) {
		hs := make([]uint64, warmBusy.hashes(i, k))
		for j := range hs {
			hs[j] = rng.Uint64()
		}
		batch.Add(engines[(i+k)%len(engines)], hs)
	}
	return batch.Bytes()
}

// TestSharedIndexApplyAllocatesNothingRPLACE2: applying another router's
// batch (live or read back) allocates nothing once the caller's buffer of
// hashes has grown, and learns its placements.
func TestSharedIndexApplyAllocatesNothingRPLACE2(t *testing.T) {
	s := newStack(t, prefixFleet(), nil)
	s.waitModels()
	share := newIndexShare(s.v)
	data, subject := busyBatch(0), bus.PrefixSubject("rt-x")
	var hashes []uint64
	hashes = share.apply(subject, data, false, hashes)
	if share.index.Blocks("p1") == 0 || share.index.Blocks("p2") == 0 {
		t.Fatalf("the batch was not learned: p1 %d, p2 %d blocks", share.index.Blocks("p1"), share.index.Blocks("p2"))
	}
	if a := testkit.LeastAllocs(100, func() { hashes = share.apply(subject, data, false, hashes) }); a != 0 {
		t.Fatalf("applying a batch allocates %v times", a)
	}
}

// BenchmarkPrefixApply: applying one batch of shape busy (about 24
// hashes on one or two engines) to a full bounded index (65,536 blocks
// per engine) that holds none of them, as every router does for every
// batch another router publishes.
func BenchmarkPrefixApply(b *testing.B) {
	s := newStack(b, prefixFleet(), nil)
	s.waitModels()
	share := newIndexShare(s.v)
	batches := make([][]byte, 16384) // 131,000 hashes per engine: twice its bound
	for i := range batches {
		batches[i] = busyBatch(i)
	}
	subject := bus.PrefixSubject("rt-x")
	var hashes []uint64
	for _, d := range batches { // every engine's set full: each batch evicts
		hashes = share.apply(subject, d, false, hashes)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		hashes = share.apply(subject, batches[i%len(batches)], false, hashes)
	}
}
