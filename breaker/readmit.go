package breaker

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// probe is one engine's probe in a readmission round.
type probe struct {
	e       *engine
	phase   string // the role probed: prefill or decode
	model   string // the model the transfer uses
	checked bool   // the health and contract checks passed
	outcome string // schemas.Probe* once decided
	message string
	// producer and consumer ran the transfer, when there was one.
	producer, consumer string
	// prodE and consE are their engines, taken under Service.mu (the
	// live fleet may change meanwhile).
	prodE, consE *engine
	// joining: the engine is joining the fleet (R-FLEET-2), as of the
	// round's start.
	joining bool
	// span is the probe's span; nil when probes are not traced (trace.go).
	span trace.Span
	// unpaired: the engine passed its checks but had no partner in this
	// round (its partner phase is ejected and not due, R-BRK-7).
	unpaired bool
}

// readmitLoop runs a readmission round every recovery.readmit_interval_s
// while ctx lasts (the lease is held) (R-BRK-3…7).
func (s *Service) readmitLoop(ctx context.Context) {
	pause.Every(ctx, s.interval, func(time.Time) { s.round(ctx) })
}

// round probes every ejected engine whose backoff has passed, and every
// engine of a phase that no eligible engine serves, all in parallel, so
// that a whole wave of ejected engines is probed together each round
// (R-BRK-7), in two steps: first each engine's GET /health and, with an
// engine contract, its lifecycle validation (R-BRK-6); then an inference
// probe through its role (R-BRK-3, R-BRK-4). A prefill or decode engine is
// paired with an eligible partner, else — when a whole phase is ejected —
// with an ejected partner that passed its checks in this round. Each
// engine is then readmitted on its own success, kept out with a longer
// backoff on its own failure, or left as it was when the probe was
// inconclusive (R-BRK-5).
func (s *Service) round(ctx context.Context) {
	now := time.Now()
	s.mu.Lock()
	var due []*probe
	eligible := map[string]bool{}
	var canPrefill, canDecode bool // an eligible engine serves the phase
	for _, e := range s.fleet {
		// Only an active engine partners a probe: a draining one takes
		// no new work (R-FLEET-3).
		if e.entry.State == schemas.StateEligible && e.fleetEntry.State == schemas.FleetActive {
			eligible[e.ID] = true
			canPrefill = canPrefill || e.Role.CanPrefill()
			canDecode = canDecode || e.Role.CanDecode()
		}
	}
	for _, e := range s.fleet {
		if e.entry.State == schemas.StateEligible {
			continue
		}
		// A phase that no eligible engine serves is a whole wave out: each
		// of its engines is probed every round, backoff or not, so that
		// they are probed together and the phase comes back as soon as
		// one of them can serve it (R-BRK-7).
		wave := (e.Role.CanPrefill() && !canPrefill) || (e.Role.CanDecode() && !canDecode)
		if wave || now.Add(s.interval/2).After(e.nextProbe) {
			due = append(due, &probe{e: e, phase: s.probePhase(e), joining: e.fleetEntry.State == schemas.FleetJoining})
		}
	}
	s.mu.Unlock()
	if len(due) == 0 {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, s.probeBudget)
	defer cancel()
	for _, p := range due {
		s.startProbeSpan(p)
	}

	parallel(due, func(p *probe) { s.check(ctx, pctx, p) })
	checked := map[string]bool{}
	for _, p := range due {
		if p.checked {
			checked[p.e.ID] = true
		}
	}
	s.mu.Lock()
	for _, p := range due {
		if p.checked {
			s.pair(p, eligible, checked)
		}
	}
	s.mu.Unlock()
	parallel(due, func(p *probe) {
		if p.checked && p.outcome == "" {
			s.transfer(ctx, pctx, p)
		}
	})
	for _, p := range due {
		s.conclude(ctx, p, now)
		p.endSpan()
	}
}

// parallel runs fn for every probe at once and waits for all.
func parallel(ps []*probe, fn func(*probe)) {
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Go(func() { fn(p) })
	}
	wg.Wait()
}

// probePhase is the role an engine's probe exercises: its only one, or
// for a `both` engine the phase of its latest counted failure (decode when
// unknown). Called with s.mu held.
func (s *Service) probePhase(e *engine) string {
	switch {
	case e.Role == connector.RolePrefill:
		return schemas.PhasePrefill
	case e.Role == connector.RoleDecode:
		return schemas.PhaseDecode
	case e.phase != "":
		return e.phase
	}
	return schemas.PhaseDecode
}

// check runs the engine's own checks: the bus must be up (a decision that
// cannot be recorded is no decision), GET /health must answer 200 and,
// with an engine contract, kvprobe.CheckContract must pass (R-BRK-6), as
// kvprobe.CheckLifecycle runs them; it also picks the model the transfer
// will use. ctx is the lease's context (its
// end means shutdown or a lost lease), pctx the round's.
func (s *Service) check(ctx, pctx context.Context, p *probe) {
	if !s.bus.Connected() {
		p.outcome, p.message = schemas.ProbeInconclusive, "bus unavailable"
		return
	}
	httpc := s.client.HTTPClient()
	ftt := s.cfg.Engine.FirstTokenTimeout()
	own := func(err error) {
		if ctx.Err() != nil {
			p.outcome, p.message = schemas.ProbeInconclusive, "probe cut short: "+context.Cause(ctx).Error()
			return
		}
		if r := ownResources(err); r != "" {
			p.outcome, p.message = schemas.ProbeInconclusive, r
			return
		}
		p.outcome, p.message = schemas.ProbeFailure, err.Error()
	}
	model, err := kvprobe.CheckLifecycle(pctx, httpc, &p.e.Engine, s.cfg.EngineContract, ftt)
	if err != nil {
		own(err)
		return
	}
	p.model = model
	p.checked = true
}

// ownResources is the message of an inconclusive probe when err says the
// breaker itself ran out of something (file descriptors, local ports,
// memory: engines.RouterResource, or a leg's router_resources fault), so
// that it blames neither engine (behaviour.md R-FAIL-9, R-BRK-5); "" for
// any other err.
func ownResources(err error) string {
	var f *engines.Fault
	r := engines.RouterResource(err)
	if r == "" && errors.As(err, &f) && f.Kind == engines.KindRouterResources {
		r = f.Resource
	}
	if r == "" {
		return ""
	}
	return "breaker out of local resources (" + r + "): " + err.Error()
}

// pair chooses the probe's producer and consumer (R-BRK-3, R-BRK-4): a
// `both` engine probes same-worker; a prefill engine prefills for a
// decode-capable partner; a decode engine decodes a new handoff from the
// producer of its latest crossed-decode failure when that engine is
// eligible or passed its checks in this round, else from another
// prefill-capable engine. Partners are taken eligible first, then among
// the ejected engines that passed their checks in this round, in fleet
// order starting at the engine's rotation (advanced by each inconclusive
// probe). With no partner the probe is inconclusive. Called with s.mu held.
func (s *Service) pair(p *probe, eligible, checked map[string]bool) {
	e := p.e
	defer func() {
		if p.producer != "" {
			p.prodE, p.consE = s.byID[p.producer], s.byID[p.consumer]
		}
	}()
	if e.Role == connector.RoleBoth {
		p.producer, p.consumer = e.ID, e.ID
		return
	}
	wantProducer := e.Role == connector.RoleDecode
	can := func(c *engine) bool {
		if c.Connector.Name() != e.Connector.Name() {
			return false // engines of different connectors cannot hand off KV
		}
		if wantProducer {
			return c.Role.CanPrefill()
		}
		return c.Role.CanDecode()
	}
	var partner string
	if wantProducer && e.crossed != "" {
		if c := s.byID[e.crossed]; c != nil && can(c) && (eligible[c.ID] || checked[c.ID]) {
			partner = c.ID
		}
	}
	for _, pool := range []map[string]bool{eligible, checked} {
		if partner != "" {
			break
		}
		n := len(s.fleet)
		for i := range n {
			c := s.fleet[(e.rotate+i)%n]
			if c != e && can(c) && pool[c.ID] {
				partner = c.ID
				break
			}
		}
	}
	if partner == "" {
		p.outcome, p.unpaired = schemas.ProbeInconclusive, true
		if wantProducer {
			p.message = "no eligible prefill engine to pair the decode probe with"
		} else {
			p.message = "no eligible decode engine to pair the prefill probe with"
		}
		return
	}
	if wantProducer {
		p.producer, p.consumer = partner, e.ID
	} else {
		p.producer, p.consumer = e.ID, partner
	}
}

// transfer runs the probe's KV transfer and judges it: success; failure
// when the probed engine's own leg failed; inconclusive when the partner's
// leg failed or ctx (the lease) ended meanwhile (R-BRK-5).
func (s *Service) transfer(ctx, pctx context.Context, p *probe) {
	if p.prodE == nil || p.consE == nil {
		p.outcome, p.message = schemas.ProbeInconclusive, "a probe engine left the fleet"
		return
	}
	producer, consumer := &p.prodE.Engine, &p.consE.Engine
	err := kvprobe.Transfer(p.traced(pctx), s.client, producer, consumer, p.model)
	switch {
	case err == nil:
		p.outcome = schemas.ProbeSuccess
		return
	case ctx.Err() != nil:
		p.outcome, p.message = schemas.ProbeInconclusive, "probe cut short: "+context.Cause(ctx).Error()
		return
	}
	if r := ownResources(err); r != "" {
		p.outcome, p.message = schemas.ProbeInconclusive, r
		return
	}
	var f *engines.Fault
	if p.joining && errors.As(err, &f) && f.EngineID != "" && f.EngineID != p.e.ID && f.UpstreamStatus == http.StatusNotFound {
		// A joining engine whose model its partner does not know: the
		// newcomer is what is wrong, not the partner (R-FLEET-2).
		p.outcome = schemas.ProbeFailure
		p.message = fmt.Sprintf("engine %s serves model %q, which its partner %s does not serve (HTTP 404): %v", p.e.ID, p.model, f.EngineID, err)
		return
	}
	if errors.As(err, &f) && f.EngineID != "" && f.EngineID != p.e.ID {
		p.outcome, p.message = schemas.ProbeInconclusive, "partner "+f.EngineID+" failed its leg: "+err.Error()
		return
	}
	p.outcome, p.message = schemas.ProbeFailure, err.Error()
}

// conclude records a probe's outcome: a success readmits the engine
// ({eligible:true,state:"eligible",streak:0} plus an eligibility event);
// a failure doubles its backoff up to MaxBackoff; an inconclusive probe
// changes nothing but the partner rotation (R-BRK-5). A readmission that
// cannot be written makes the probe inconclusive. Every probe is published
// as a probe event, before the eligibility event of the readmission it
// caused, so that the stream tells the story in order.
func (s *Service) conclude(ctx context.Context, p *probe, roundStart time.Time) {
	e := p.e
	probedAt := time.Now().UTC() // the probe is over; what follows records it
	var readmitted *schemas.Eligibility
	s.mu.Lock()
	switch p.outcome {
	case schemas.ProbeSuccess:
		entry, err := s.update(ctx, e, false, func(cur schemas.Eligibility) (schemas.Eligibility, error) {
			if cur.State != schemas.StateEjected {
				return cur, errNoChange
			}
			return schemas.Eligibility{
				State:  schemas.StateEligible,
				Reason: fmt.Sprintf("readmitted after a successful inference probe (prefill on %s, decode on %s)", p.producer, p.consumer),
			}, nil
		})
		if errors.Is(err, errNoChange) && e.fleetEntry.State == schemas.FleetJoining && s.byID[e.ID] == e {
			err = nil // already eligible (a seed); the fleet state still needs the probe's word
			entry = &e.entry
		}
		switch {
		case err == nil:
			readmitted = cloneEligibility(entry)
			e.backoff, e.crossed = 1, ""
			s.metrics.readmissions.WithLabelValues(e.ID).Inc()
			s.log.Info("engine readmitted", "engine_id", e.ID, "producer_id", p.producer, "consumer_id", p.consumer, "reason", entry.Reason)
		case errors.Is(err, errNoChange):
		default:
			p.outcome, p.message = schemas.ProbeInconclusive, "bus unavailable: readmission not recorded: "+err.Error()
		}
	case schemas.ProbeFailure:
		e.backoff = min(2*max(e.backoff, 1), MaxBackoff)
		s.log.Info("engine probe failed", "engine_id", e.ID, "phase", p.phase, "producer_id", p.producer, "consumer_id", p.consumer, "backoff", e.backoff, "msg", p.message)
	default:
		p.outcome = schemas.ProbeInconclusive
		e.rotate++
		s.log.Info("engine probe inconclusive", "engine_id", e.ID, "phase", p.phase, "producer_id", p.producer, "consumer_id", p.consumer, "msg", p.message)
	}
	e.nextProbe = roundStart.Add(time.Duration(max(e.backoff, 1)) * s.interval)
	if p.unpaired {
		// Healthy but alone: probed again next round, not after its
		// backoff, so that engines of both phases ejected in different
		// rounds (their backoffs out of step) meet in one round instead of
		// taking turns forever (R-BRK-7).
		e.nextProbe = roundStart.Add(s.interval)
	}
	// Published under s.mu, so that no later decision on this engine can
	// overtake the readmission's eligibility event.
	s.publish(&schemas.Probe{
		Envelope:   schemas.Envelope{Schema: schemas.SchemaProbe, ID: schemas.NewEventID(), At: probedAt, BreakerID: s.id, EngineID: e.ID},
		Outcome:    p.outcome,
		Phase:      p.phase,
		ProducerID: p.producer,
		ConsumerID: p.consumer,
		Message:    p.message,
	})
	if readmitted != nil {
		s.publish(readmitted)
		if e.fleetEntry.State == schemas.FleetJoining && s.byID[e.ID] == e {
			// A joining engine becomes placeable only now (R-FLEET-2).
			if err := s.setFleetState(ctx, e, fleet.Admit, fmt.Sprintf("readmission checks passed (prefill on %s, decode on %s)", p.producer, p.consumer)); err != nil {
				s.log.Warn("breaker could not make a joining engine active; probing it again", "engine_id", e.ID, "err", err)
				e.nextProbe = time.Now()
			}
		}
	}
	s.mu.Unlock()
	s.metrics.probes.WithLabelValues(e.ID, p.outcome).Inc()
}
