package router

import (
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
	if fault.Kind == engines.KindRouterResources {
		return // the router's own fault blames no engine (R-FAIL-9)
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

// attempt runs one attempt (behaviour.md §0 "attempt"): it places both
// phases, has the producer's connector start the legs (which, in what
// order, with which bodies and checks is the connector's:
// engines.Client.StartAttempt), and reads the decode stream up to its
// first generated output, holding the metadata chunks before it
// (R-TMO-1). Every fault it returns is already recorded, and the
// attempt's reservations and stream are released.
func (c *call) attempt(avoid *avoidSet) *engines.Fault {
	if f := c.tracePlace(avoid); f != nil {
		return f
	}
	rt := c.rt
	c.backendID = c.id + "-" + strconv.Itoa(c.attempts) + "-" + newID()[:8]
	ereq := &engines.Request{Body: c.req, BackendRequestID: c.backendID, Producer: &c.producer.Engine, Consumer: &c.consumer.Engine,
		Traceparent: c.traceparent, Tracestate: c.tracestate}
	a, f := rt.client.StartAttempt(c.ctx, ereq, steps{c: c})
	if f != nil {
		return c.attemptFailed(a, f)
	}
	stream := a.Stream()
	c.stream = stream
	c.pending = c.pending[:0]
	held := 0
	for {
		payload, kind, err := stream.Next()
		if err != nil {
			c.closeStream()
			return c.attemptFailed(a, a.Blame(err))
		}
		if kind == schemas.ChunkOutput {
			if f := a.Commit(); f != nil {
				c.closeStream()
				return c.attemptFailed(a, f)
			}
			c.live = a
			c.first = append([]byte(nil), payload...)
			c.lastOutput = stream.FirstOutput()
			c.firstByte = c.lastOutput.Sub(c.arrival)
			return nil
		}
		if f := c.hold(&held, payload, stream.Chunk()); f != nil {
			c.closeStream()
			return c.attemptFailed(a, f)
		}
	}
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
	c.prefillAnswered.Store(false)
	c.holdPrefill.Store(true)
	c.holdDecode = true
	return nil
}

// attemptFailed ends attempt a, which failed with f before its first
// output: its open step ended with f, a handoff it left unconsumed
// released where its connector can and reported (R-OWN-6), ttft_s taken
// from a prefill that completed (R-TIME-1), both slots released
// (R-OWN-3), the fault recorded.
func (c *call) attemptFailed(a *engines.Attempt, f *engines.Fault) *engines.Fault {
	c.traceFailed(f)
	if ab, ok := a.Abandon(engines.AbandonReason(f)); ok {
		c.reportAbandoned(ab)
	}
	if t, _ := a.Finish(0); !t.IsZero() {
		c.ttft = t.Sub(c.arrival)
	} else {
		c.dropInflight() // no prefill completed: the engine may hold nothing of it (R-PLACE-4)
	}
	c.releasePrefill(false)
	c.releaseDecode()
	c.recordFault(f)
	return f
}

func noEngine(p phase) *engines.Fault {
	return engines.NewFault(engines.KindNoEngine, p.String(), "", 0, "no eligible engine for "+p.String())
}

// reportAbandoned reports a handoff an attempt left unconsumed: a release
// that failed is counted and logged, and a handoff event with outcome
// abandoned is published either way (R-OWN-6).
func (c *call) reportAbandoned(ab connector.Abandoned) {
	rt := c.rt
	if ab.ReleaseErr != nil {
		rt.metrics.releaseFailures.Inc()
		rt.log.Warn("handoff release failed", "request_id", c.id, "engine_id", ab.ProducerID, "err", ab.ReleaseErr)
	}
	c.publishAbandoned(ab.ProducerID, ab.Connector, ab.Reason, ab.Age, ab.Released)
}

// prefillGrace is how long a request whose decode succeeded waits, at its
// end, for a prefill leg still running (a connector whose legs run at
// once): its answer normally comes with the decode's first tokens, and
// ttft_s ends there (R-TIME-1).
const prefillGrace = 250 * time.Millisecond

// finishAttempt ends the committed attempt's legs when the request ends,
// after prefillGrace for a prefill still running when the request got its
// first output, and takes ttft_s from the prefill's completion.
func (c *call) finishAttempt() {
	a := c.live
	if a == nil {
		return
	}
	c.live = nil
	wait := time.Duration(0)
	if c.first != nil {
		wait = prefillGrace
	}
	if t, _ := a.Finish(wait); !t.IsZero() {
		c.ttft = t.Sub(c.arrival)
	}
}
