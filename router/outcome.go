package router

import (
	"strconv"
	"time"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// This file records what happened to a request — metrics, bus events, log
// lines — and decides nothing: the attempt loop and the relay call it.

// recordFault records an engine fault: metrics, the failure event, and the
// local quarantine with its event (R-QUAR-1). Faults that are not the
// engine's (client, deadline, placement, shutdown) are not recorded; the
// router's own (router_resources) are recorded as its own only
// (resourceFault, R-FAIL-9).
func (c *call) recordFault(f *engines.Fault) {
	rt := c.rt
	if f.Kind == engines.KindRouterResources {
		c.resourceFault(f) // the router's own, nobody else's (R-FAIL-9)
		return
	}
	if !f.EngineFault() {
		return
	}
	rt.metrics.fault(rt.inFleet, f.EngineID, f.Phase, string(f.Kind))
	rt.credentialFault(f)
	if d := rt.backpressure(f); d > 0 {
		if m := rt.fleet().Member(f.EngineID); m != nil {
			m.BackOff(time.Now().Add(d).UnixNano())
		}
	}
	// An engine's message is as untrusted as a client's string: bounded in
	// the log and the event (the client still gets it whole).
	msg := schemas.BoundField(f.Message)
	// The detail (R-FAIL-10) is bounded and escaped where it is made
	// (engines.Fault.Detail): one printable line.
	detail := f.Detail
	if detail == "" {
		rt.log.Warn("engine fault", "request_id", c.id, "engine_id", f.EngineID, "phase", f.Phase, "kind", string(f.Kind), "status", f.Status, "msg", msg, "attempt", c.attempts)
	} else {
		rt.log.Warn("engine fault", "request_id", c.id, "engine_id", f.EngineID, "phase", f.Phase, "kind", string(f.Kind), "status", f.Status, "msg", msg, "attempt", c.attempts,
			"upstream_status", f.UpstreamStatus, "detail", detail)
	}
	ev := &schemas.Failure{
		Envelope:         schemas.Envelope{Schema: schemas.SchemaFailure, RouterID: rt.id, EngineID: f.EngineID, RequestID: c.id},
		Phase:            f.Phase,
		Kind:             string(f.Kind),
		Status:           f.Status,
		UpstreamStatus:   f.UpstreamStatus,
		Message:          msg,
		Timeout:          f.Timeout,
		Counts:           f.CountsTowardEjection(),
		BackendRequestID: c.backendID,
		Attempt:          c.attempts,
		Detail:           detail,
	}
	if c.producer != nil {
		ev.ProducerID = c.producer.ID
	}
	if c.consumer != nil {
		ev.ConsumerID = c.consumer.ID
	}
	rt.publish(ev)
	if q := rt.cfg.Recovery.FailureQuarantine(); q > 0 && f.CountsTowardEjection() {
		until := time.Now().Add(q)
		if rt.Quarantine(f.EngineID, until) {
			rt.metrics.quarantines.Inc()
			rt.publish(&schemas.Quarantine{
				Envelope:        schemas.Envelope{Schema: schemas.SchemaQuarantine, RouterID: rt.id, EngineID: f.EngineID, RequestID: c.id},
				DurationSeconds: q.Seconds(),
				Until:           until.UTC(),
				Reason:          string(f.Kind),
			})
		}
	}
}

// backpressure is how long this router skips the engine of an overload
// fault that carried a Retry-After (R-FAIL-7): the engine's delay capped
// at recovery.max_quarantine_s; 0 for every other fault.
func (rt *Router) backpressure(f *engines.Fault) time.Duration {
	if f.Kind != engines.KindOverload || f.RetryAfter <= 0 {
		return 0
	}
	d := f.RetryAfter
	if most := rt.cfg.Recovery.MaxQuarantine(); most > 0 && d > most {
		d = most.Truncate(time.Second)
		if d < time.Second {
			d = time.Second
		}
	}
	return d
}

// publishAbandoned counts an abandoned handoff and publishes its event
// (R-OWN-6). conn is the descriptor's connector; empty means the
// producer's.
func (c *call) publishAbandoned(producerID, conn, reason string, age time.Duration, released bool) {
	rt := c.rt
	rt.metrics.abandoned.Inc()
	if conn == "" {
		conn = c.producer.Connector.Name()
	}
	rt.publish(&schemas.Handoff{
		Envelope:         schemas.Envelope{Schema: schemas.SchemaHandoff, RouterID: rt.id, EngineID: producerID, RequestID: c.id},
		Outcome:          schemas.HandoffAbandoned,
		Reason:           reason,
		ConsumerID:       c.consumer.ID,
		BackendRequestID: c.backendID,
		Connector:        conn,
		AgeSeconds:       age.Seconds(),
		Released:         released,
	})
}

// record counts the finished request, publishes its request-completed
// event (R-BUS-1, R-TIME-1) and logs it; now is when it finished.
func (c *call) record(now time.Time) {
	rt := c.rt
	if c.chunks > 0 {
		rt.metrics.relayedChunks.Add(float64(c.chunks))
	}
	dur := now.Sub(c.arrival)
	rt.inflight.Add(-1)
	rt.metrics.inflight.Dec()
	ms := c.modelSeries()
	rt.countRequest(c.req.Endpoint, strconv.Itoa(c.status), c.outcome, c.key, ms.label)
	rt.metrics.duration.WithLabelValues(c.req.Endpoint, ms.label).Observe(dur.Seconds())
	if c.usage { // an engine's counts: a negative one would make Add panic
		if c.promptTokens > 0 {
			ms.prompt.Add(float64(c.promptTokens))
		}
		if c.completionTokens > 0 {
			ms.generation.Add(float64(c.completionTokens))
		}
	}
	ev := &schemas.RequestCompleted{
		Envelope:        schemas.Envelope{Schema: schemas.SchemaRequest, RouterID: rt.id, RequestID: c.id},
		Endpoint:        c.req.Endpoint,
		Model:           schemas.BoundField(c.req.Model), // a bounded client string
		Stream:          c.req.Stream,
		Status:          c.status,
		Attempts:        c.attempts,
		DurationSeconds: dur.Seconds(),
	}
	if c.usage { // absent, not 0, when the engine reported no usage
		prompt, completion := c.promptTokens, c.completionTokens
		ev.PromptTokens, ev.CompletionTokens = &prompt, &completion
	}
	if c.key != nil {
		ev.KeyName = c.key.name
	}
	ev.KVRecomputed = c.recomputed
	if c.outcome != "ok" {
		ev.ErrorKind = c.outcome
	}
	if c.producer != nil {
		ev.ProducerID = c.producer.ID
		ev.ConsumerID = c.consumer.ID
	}
	if c.ttft > 0 {
		s := c.ttft.Seconds()
		ev.TTFTSeconds = &s
		ms.ttft.Observe(s)
	}
	if c.firstByte > 0 {
		s := c.firstByte.Seconds()
		ev.FirstByteSeconds = &s
		ms.firstByte.Observe(s)
	}
	if c.decodeStart != (time.Time{}) {
		rt.metrics.leg.WithLabelValues(schemas.PhaseDecode, ms.label).Observe(now.Sub(c.decodeStart).Seconds())
	}
	if !c.unpublished {
		rt.publish(ev)
	}
	if c.outcome != "ok" {
		rt.log.Info("request ended", "request_id", c.id, "key", keyName(c.key), "status", c.status, "outcome", c.outcome, "attempts", c.attempts, "duration_s", dur.Seconds())
	} else {
		rt.log.Debug("request done", "request_id", c.id, "key", keyName(c.key), "status", c.status, "attempts", c.attempts, "duration_s", dur.Seconds())
	}
}

// modelSeries returns the series of the request's model label: those of
// "other" until prepare found the model among the fleet's.
func (c *call) modelSeries() *modelSeries {
	if c.series != nil {
		return c.series
	}
	return c.rt.metrics.other
}

// observeOutput observes the time since the previous generated chunk in
// narwhal_inter_token_seconds: one clock read and one Observe per
// generated chunk, no allocation (the relay's hot path). A call without
// series (built bare by a test) observes nothing.
func (c *call) observeOutput() {
	now := time.Now()
	if c.series != nil && !c.lastOutput.IsZero() {
		c.series.interToken.Observe(now.Sub(c.lastOutput).Seconds())
	}
	c.lastOutput = now
}

// publish hands ev to the router's publisher, if it has one.
func (rt *Router) publish(ev schemas.Event) {
	if rt.pub != nil {
		rt.pub.Publish(ev)
	}
}
