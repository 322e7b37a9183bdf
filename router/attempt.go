package router

import (
	"context"
	"strconv"
	"time"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// run makes attempts until one has produced its first generated output
// (c.stream open, c.first set), or returns the fault that ends the request.
// Whether a failed attempt is followed by another is the retry policy's
// decision (R-RETRY-1, R-RETRY-2); each retry avoids every engine that
// failed an earlier attempt in the phase it failed (R-RETRY-3).
func (c *call) run() *engines.Fault {
	rt := c.rt
	var avoid avoidSet
	defer c.releasePlacement()
	for {
		c.attempts++
		f := c.attempt(&avoid)
		if f == nil {
			return nil
		}
		if f.Kind == engines.KindClientGone {
			rt.metrics.disconnects.Inc()
			return f
		}
		retry, denial := rt.retry.tryAgain(c.ctx, f, c.attempts)
		if !retry {
			if denial.counted() {
				rt.metrics.retryDenied.WithLabelValues(string(denial)).Inc()
			}
			return f
		}
		rt.metrics.retries.Inc()
		avoid.blame(rt.fleet(), f)
	}
}

// avoidSet is, per phase, the engines that failed an earlier attempt of
// the request in that phase: placement skips them while another engine is
// eligible (R-RETRY-3).
type avoidSet [2][]*member

// blame adds the engine f blames to the set. An expired handoff blames
// neither engine (it measures the router's wait); an engine no longer in
// the fleet is not added.
func (a *avoidSet) blame(f *fleet, fault *engines.Fault) {
	if fault.Kind == engines.KindHandoffExpired {
		return
	}
	m := f.Member(fault.EngineID)
	if m == nil {
		return
	}
	p := decodePhase
	if fault.Phase == schemas.PhasePrefill {
		p = prefillPhase
	}
	for _, x := range a[p] {
		if x == m {
			return
		}
	}
	a[p] = append(a[p], m)
}

// attempt runs one prefill and the start of one decode (behaviour.md §0 attempt):
// it places both phases, runs the prefill leg, and reads the decode stream
// up to its first generated output. Every fault it returns is already
// recorded, and the attempt's reservations and stream are released.
func (c *call) attempt(avoid *avoidSet) *engines.Fault {
	if f := c.tracePlace(avoid); f != nil {
		return f
	}
	c.backendID = c.id + "-" + strconv.Itoa(c.attempts) + "-" + newID()[:8]
	ereq := &engines.Request{Body: c.req, BackendRequestID: c.backendID, Producer: &c.producer.Engine, Consumer: &c.consumer.Engine}
	if connector.Concurrent(c.producer.Connector) {
		// Both legs at once (sglang.go), in one span.
		return c.traceConcurrent(ereq)
	}
	if f := c.tracePrefill(ereq); f != nil {
		return f
	}
	return c.traceDecode(ereq)
}

// place reserves a prefill slot and a decode slot for the attempt
// (R-OWN-3) on the engines the placement policy chooses (placeLegs,
// R-PLACE-1, R-PLACE-2), avoiding the engines in avoid (R-RETRY-3), or
// returns the no_engine fault of the phase that has no eligible engine.
func (c *call) place(avoid *avoidSet) *engines.Fault {
	prod, cons, f := c.placeLegs(avoid)
	if f != nil {
		return f
	}
	c.producer, c.consumer = prod, cons
	c.holdPrefill, c.holdDecode = true, true
	return nil
}

// prefill runs the prefill leg and keeps its result (R-LEG-2). The
// producer's slot is released when the leg ends (R-OWN-3); on a fault the
// consumer's too.
func (c *call) prefill(ereq *engines.Request) *engines.Fault {
	rt := c.rt
	res, err := rt.client.Prefill(c.ctx, ereq)
	rt.metrics.leg.WithLabelValues(schemas.PhasePrefill, c.modelSeries().label).Observe(time.Since(c.arrival).Seconds())
	c.releasePrefill()
	if err != nil {
		f := engines.AsFault(err, schemas.PhasePrefill, c.producer.ID)
		c.releaseDecode()
		if f.Kind == engines.KindDescriptorRejected && !f.MissingDescriptor() {
			// The producer may hold blocks for a descriptor nobody can
			// use: make the stranded KV visible (R-OWN-6). Without a
			// descriptor there is no handoff to abandon.
			c.publishAbandoned(c.producer.ID, "", "descriptor_rejected", 0, false)
		}
		c.recordFault(f)
		return f
	}
	c.result = res
	c.ttft = res.Completed.Sub(c.arrival)
	return nil
}

// decodeUntilOutput opens the decode leg with the prefill's descriptor and
// reads it up to the first generated output, holding the metadata chunks
// before it (R-TMO-1). On a fault the handoff is abandoned (R-OWN-6).
func (c *call) decodeUntilOutput(ereq *engines.Request) *engines.Fault {
	rt := c.rt
	c.decodeStart = time.Now()
	stream, err := rt.client.Decode(c.ctx, ereq, c.result)
	if err != nil {
		return c.decodeFault(engines.AsFault(err, schemas.PhaseDecode, c.consumer.ID))
	}
	c.stream = stream
	c.pending = c.pending[:0]
	held := 0
	for {
		payload, kind, err := stream.Next()
		if err != nil {
			c.closeStream()
			return c.decodeFault(engines.AsFault(err, schemas.PhaseDecode, c.consumer.ID))
		}
		if kind == schemas.ChunkOutput {
			c.first = append([]byte(nil), payload...)
			c.lastOutput = stream.FirstOutput()
			c.firstByte = c.lastOutput.Sub(c.arrival)
			c.result = nil // consumed
			return nil
		}
		if f := c.hold(&held, payload, stream.Chunk()); f != nil {
			c.closeStream()
			return c.decodeFault(f)
		}
	}
}

// decodeFault ends a decode leg that failed before its first output: the
// handoff is abandoned, the consumer's slot released, the fault recorded.
func (c *call) decodeFault(f *engines.Fault) *engines.Fault {
	c.abandon(abandonReason(f))
	c.releaseDecode()
	c.recordFault(f)
	return f
}

func noEngine(p phase) *engines.Fault {
	return engines.NewFault(engines.KindNoEngine, p.String(), "", 0, "no eligible engine for "+p.String())
}

// abandonReason is the reason of the handoff event for a handoff that f
// left unconsumed (R-OWN-6).
func abandonReason(f *engines.Fault) string {
	switch f.Kind {
	case engines.KindClientGone:
		return "client_disconnected"
	case engines.KindDescriptorRejected:
		return "descriptor_rejected"
	case engines.KindHandoffExpired:
		return "handoff_expired"
	case engines.KindShutdown:
		return "router_shutdown"
	case engines.KindRequestTimeout:
		return "request_timeout"
	}
	return "decode_failed"
}

// abandon releases an unconsumed handoff at the producer where the
// connector can and publishes a handoff event with outcome abandoned
// either way (R-OWN-6). It runs synchronously, bounded to one second, so
// nothing outlives the request.
func (c *call) abandon(reason string) {
	res := c.result
	c.result = nil
	if res == nil || !res.HasDescriptor() {
		return
	}
	rt := c.rt
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	released, err := rt.client.Release(ctx, &c.producer.Engine, res)
	cancel()
	if err != nil {
		rt.metrics.releaseFailures.Inc()
		rt.log.Warn("handoff release failed", "request_id", c.id, "engine_id", res.ProducerID, "err", err)
	}
	c.publishAbandoned(res.ProducerID, res.Connector, reason, res.Age(time.Now()), released)
}
