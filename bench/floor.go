package bench

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// FloorTarget runs both legs of every request itself, directly against
// the engines, with engines.Client: Prefill on a producer, then Decode on a
// consumer with the handoff (behaviour.md R-LEG-1…5), producer and consumer each
// chosen round-robin. It is what a router of zero cost would do, so its
// latencies and throughput are the floor the router is compared with.
// Latencies are measured as RouterTarget measures them: TTFT at the first
// generated output of the decode stream, end-to-end at [DONE].
type FloorTarget struct {
	client          *engines.Client
	prefill, decode []engines.Engine
	nextP, nextD    atomic.Uint64
	ids             atomic.Uint64
	idPrefix        string
}

// NewFloorTarget returns a floor target over the given producers (role
// prefill or both) and consumers (decode or both). The engine client uses
// the behaviour.md §11 default timeouts and engines.NewTransport, as the router's
// does. It fails when either list is empty.
func NewFloorTarget(prefill, decode []engines.Engine) (*FloorTarget, error) {
	if len(prefill) == 0 || len(decode) == 0 {
		return nil, errors.New("floor: need at least one prefill and one decode engine")
	}
	return &FloorTarget{
		client:   engines.NewClient(defaultEngineOptions()),
		prefill:  append([]engines.Engine(nil), prefill...),
		decode:   append([]engines.Engine(nil), decode...),
		idPrefix: "bench-floor-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-",
	}, nil
}

// defaultEngineOptions are the engine client options of config.Default:
// the router's timeouts when nothing is configured (behaviour.md §11).
func defaultEngineOptions() engines.Options {
	cfg := config.Default()
	return engines.Options{
		PrefillTimeout:    cfg.Engine.PrefillTimeout(),
		FirstTokenTimeout: cfg.Engine.FirstTokenTimeout(),
		DecodeReadTimeout: cfg.Engine.DecodeReadTimeout(),
		HandoffMaxAge:     cfg.Handoff.MaxAge(),
	}
}

// Name returns "floor".
func (t *FloorTarget) Name() string { return "floor" }

// Close closes the engine client's idle connections.
func (t *FloorTarget) Close() { t.client.CloseIdleConnections() }

// do implements Target: one whole attempt through the producer's
// connector, as a router runs it (engines.Client.Transfer), the decode
// stream read to its end. A non-streaming workload still reads the decode
// stream (the decode leg always streams, R-LEG-5) but records no ITL and
// a TTFT equal to its end-to-end latency, as the router's aggregated
// answer gives a client.
func (t *FloorTarget) do(ctx context.Context, w *worker, start time.Time) {
	body := w.newBody()
	rctx, cancel := context.WithTimeout(ctx, w.timeout)
	defer cancel()
	parsed, err := schemas.ParseRequest(w.shape.endpoint, body)
	if err != nil {
		w.fail(ctx, rctx, HTTPClass(400))
		return
	}
	p := &t.prefill[(t.nextP.Add(1)-1)%uint64(len(t.prefill))]
	c := &t.decode[(t.nextD.Add(1)-1)%uint64(len(t.decode))]
	req := &engines.Request{
		Body:             parsed,
		BackendRequestID: t.idPrefix + strconv.FormatUint(t.ids.Add(1), 10),
		Producer:         p,
		Consumer:         c,
	}
	mark := len(w.rec.itl)
	out := newOutputTally()
	err = t.client.Transfer(rctx, req, func(payload []byte, kind schemas.ChunkKind) {
		if w.onPayload != nil {
			w.onPayload(payload)
		}
		if gap, ok := out.see(kind, payload); ok && w.stream {
			w.rec.itl = append(w.rec.itl, gap)
		}
	})
	if err != nil {
		w.rec.itl = w.rec.itl[:mark]
		w.fail(ctx, rctx, faultClass(err))
		return
	}
	end := time.Now()
	first := out.first
	if !w.stream {
		first = end
	}
	w.succeed(start, first, end, out.tokens())
}

// faultClass maps an engine client error to the error class a client of
// the router would see for the same engine behaviour: connect errors are
// transport, a stream closed before [DONE] is truncated, an error object
// is sse_error_<code>, a refused leg is http_<engine status>; the rest is
// "engine_<fault kind>".
func faultClass(err error) string {
	var f *engines.Fault
	if !errors.As(err, &f) {
		return ClassTransport
	}
	switch f.Kind {
	case engines.KindConnectError:
		return ClassTransport
	case engines.KindClosedBeforeDone:
		return ClassTruncated
	case engines.KindDoneBeforeToken:
		return ClassDoneBeforeOutput
	case engines.KindInvalidStream:
		return ClassInvalidChunk
	case engines.KindRequestTimeout:
		return ClassTimeout
	case engines.KindErrorObject:
		return SSEErrorClass(f.UpstreamStatus)
	case engines.KindPrefillStatus, engines.KindUpstreamStatus, engines.KindClientFault, engines.KindOverload:
		if f.UpstreamStatus != 0 {
			return HTTPClass(f.UpstreamStatus)
		}
		return HTTPClass(f.Status)
	}
	return "engine_" + string(f.Kind)
}
