package router

import (
	"time"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// concurrentAttempt runs an attempt of a connector whose legs start at
// once (SGLang's bootstrap protocol, R-DESC-7): fresh bootstrap fields
// (R-OWN-4: new rooms for every attempt), one body sent to the producer
// and the consumer together, the decode read up to its first generated
// output under the usual first-token budget (R-TMO-1), and the prefill
// watched meanwhile: its failure before that output cancels the decode at
// once and is the attempt's fault, the producer's (R-FAIL-1, retryable by
// R-RETRY-2); a failure after it is recorded and the stream goes on. The
// prefill's slot is released when its leg ends, the decode's when the
// attempt fails or the request finishes (R-OWN-3).
func (c *call) concurrentAttempt(ereq *engines.Request) *engines.Fault {
	rt := c.rt
	b, err := engines.NewBootstrap(ereq)
	if err != nil {
		f := engines.NewFault(engines.KindPrefillResponse, schemas.PhasePrefill, c.producer.ID, 0, err.Error())
		c.releasePrefill()
		c.releaseDecode()
		c.recordFault(f)
		return f
	}
	c.decodeStart = time.Now()
	prod, arrival, model := c.producer, c.arrival, c.modelSeries().label
	legs, stream, err := rt.client.StartSGLang(c.ctx, ereq, b, func(late *engines.Fault) {
		// The prefill's goroutine: only atomics and the recorder, which
		// reads fields of c that no longer change once the attempt runs.
		prod.Release(prefillPhase)
		rt.metrics.leg.WithLabelValues(schemas.PhasePrefill, model).Observe(time.Since(arrival).Seconds())
		if late != nil {
			// The KV had arrived: the client's stream goes on.
			c.recordFault(late)
		}
	})
	if legs == nil {
		// Refused before any leg started.
		f := engines.AsFault(err, schemas.PhasePrefill, prod.ID)
		c.releasePrefill()
		c.releaseDecode()
		c.recordFault(f)
		return f
	}
	c.holdPrefill = false // the prefill's leg releases its own slot
	c.legs = legs
	if err != nil {
		return c.concurrentFault(engines.AsFault(err, schemas.PhaseDecode, c.consumer.ID))
	}
	c.stream = stream
	c.pending = c.pending[:0]
	held := 0
	for {
		payload, kind, err := stream.Next()
		if err != nil {
			c.closeStream()
			return c.concurrentFault(legs.Blame(err, c.consumer.ID))
		}
		if kind == schemas.ChunkOutput {
			if !legs.Commit() {
				c.closeStream()
				return c.concurrentFault(legs.Failed())
			}
			c.first = append([]byte(nil), payload...)
			c.firstByte = stream.FirstOutput().Sub(c.arrival)
			return nil
		}
		if f := c.hold(&held, payload, stream.Chunk()); f != nil {
			c.closeStream()
			return c.concurrentFault(f)
		}
	}
}

// concurrentFault ends a concurrent attempt that failed before the
// decode's first output: both legs are stopped and waited for, the
// consumer's slot released, the fault — the prefill's when it failed
// first — recorded. When the prefill had completed, its KV waits in the
// room for a consumer that will not come: a handoff event with outcome
// abandoned makes it visible (R-OWN-6; SGLang frees the room itself,
// nothing is released early).
func (c *call) concurrentFault(f *engines.Fault) *engines.Fault {
	if c.closeLegs(false) {
		c.publishAbandoned(c.producer.ID, "", abandonReason(f), time.Since(c.decodeStart), false)
	}
	c.releaseDecode()
	c.recordFault(f)
	return f
}

// prefillGrace is how long a request whose decode succeeded waits, at its
// end, for its prefill's answer before cancelling it: the answer normally
// comes with the decode's first tokens, and ttft_s ends there (R-TIME-1).
const prefillGrace = 250 * time.Millisecond

// closeLegs ends a concurrent attempt's prefill leg — after prefillGrace
// when wait is set — and takes ttft_s from its completion (R-TIME-1). It
// reports whether the prefill had completed successfully.
func (c *call) closeLegs(wait bool) bool {
	l := c.legs
	if l == nil {
		return false
	}
	c.legs = nil
	if wait {
		l.WaitFor(prefillGrace)
	}
	l.Close()
	t := l.Completed()
	if !t.IsZero() {
		c.ttft = t.Sub(c.arrival)
	}
	return !t.IsZero()
}
