package breaker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Reasons of narwhal_breaker_registrations_refused_total (behaviour.md
// R-FLEET-5): why a registration was not written to narwhal_fleet.
const (
	// RefusedMaxEngines: a new engine id while the fleet holds
	// membership.max_engines engines.
	RefusedMaxEngines = "max_engines"
	// RefusedTaken: the id belongs to an entry of the operator (a config
	// file's, `narwhal fleet add`'s), which a registration never takes
	// over.
	RefusedTaken = "taken"
	// RefusedInvalid: the payload is not a registration
	// (bus.ParseRegistration: too large, not schema-valid, a subject that
	// is no registration subject, or an id no engine can have).
	RefusedInvalid = "invalid"
	// RefusedIDMismatch: the payload's engine_id is not its subject's:
	// one engine speaking for another.
	RefusedIDMismatch = "id_mismatch"
	// RefusedKeyEnv: the payload's api_key_env is neither empty nor
	// schemas.EngineKeyEnv of its id (bus.ErrRegistrationKeyEnv): an
	// engine asking routers and the breaker to send it another variable
	// of theirs, e.g. NARWHAL_NATS_CREDS or another engine's key, as a
	// bearer token. Nothing is written and its URL gets no request.
	RefusedKeyEnv = "api_key_env"
)

// refusedReasons are the reasons, each series created at zero.
var refusedReasons = []string{RefusedMaxEngines, RefusedTaken, RefusedInvalid, RefusedIDMismatch, RefusedKeyEnv}

// refusedLogEvery bounds the breaker's log of refused registrations to
// one line per interval, however many arrive.
const refusedLogEvery = time.Second

// seenRegistration is the last registration of one engine read from the
// stream, with the time the stream stored it.
type seenRegistration struct {
	reg    schemas.Registration
	stored time.Time
}

// watchRegistrations reads stream NARWHAL_REGISTRATIONS while ctx lasts
// with an ordered consumer — the last registration of each engine, then
// every new one (R-FLEET-5) — keeping the last valid one per engine id, so
// that a breaker that takes the lease over starts from them. Every
// breaker reads, leading or not. A payload that is not a registration, or
// whose engine_id is not its subject's, is ignored and counted. The
// consumer is set up again after it fails.
func (s *Service) watchRegistrations(ctx context.Context) {
	warned := false
	for ctx.Err() == nil {
		err := s.readRegistrations(ctx)
		if ctx.Err() != nil {
			return
		}
		if !warned && !errors.Is(err, jetstream.ErrMsgIteratorClosed) {
			s.log.Warn("breaker: engines' registrations unread; trying again", "stream", bus.RegistrationsStream, "err", err)
			warned = true
		} else {
			s.log.Debug("breaker: registrations' consumer ended; setting it up again", "err", err)
		}
		if !pause.For(ctx, setupRetry) {
			return
		}
	}
}

// readRegistrations is one reader's life of watchRegistrations: a
// bus.Reader (behaviour.md R-BUS-11: by direct gets, no consumer, with the
// breaker's credential, which two breakers share), from the last
// registration of every engine, until ctx ends or the reader does.
func (s *Service) readRegistrations(ctx context.Context) error {
	r, err := bus.StartReader(ctx, s.bus, bus.ReaderOptions{
		Stream:  bus.RegistrationsStream,
		Filter:  bus.RegistrationSubjectPrefix + "*",
		Name:    s.bus.ConsumerName(bus.PurposeRegistrations),
		Deliver: jetstream.DeliverLastPerSubjectPolicy,
	}, func(msg jetstream.Msg) {
		stored := time.Now()
		if md, err := msg.Metadata(); err == nil {
			stored = md.Timestamp
		}
		s.noteRegistration(msg.Subject(), msg.Data(), stored)
	})
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, r.Stop)
	defer stop()
	<-r.Done()
	return jetstream.ErrMsgIteratorClosed
}

// noteRegistration judges one message of the stream and keeps it as its
// engine's last registration, marking the engine for the leader's
// applier.
func (s *Service) noteRegistration(subject string, data []byte, stored time.Time) {
	reg, err := bus.ParseRegistration(subject, data)
	if err != nil {
		reason, id := RefusedInvalid, ""
		switch {
		case errors.Is(err, bus.ErrRegistrationSubject):
			reason = RefusedIDMismatch
		case errors.Is(err, bus.ErrRegistrationKeyEnv):
			// The id is the subject's: announced, so the operator sees it.
			reason, id = RefusedKeyEnv, reg.EngineID
		}
		s.refuse(id, reason, fmt.Sprintf("%s: %v", subject, err))
		return
	}
	s.regMu.Lock()
	s.regs[reg.EngineID] = seenRegistration{reg: reg, stored: stored}
	s.regPending[reg.EngineID] = struct{}{}
	s.regMu.Unlock()
	select {
	case s.regWake <- struct{}{}:
	default:
	}
}

// refuse counts a refused registration of engine id (empty for one that
// names none) for reason, logging at most once per refusedLogEvery, and
// publishes an admission event "refused" for a refusal the leader
// decided (max_engines, taken) or of a named id (api_key_env) once per
// id.
func (s *Service) refuse(id, reason, why string) {
	s.metrics.registrationsRefused.WithLabelValues(reason).Inc()
	s.regMu.Lock()
	logNow := time.Since(s.refusedLogged) >= refusedLogEvery
	if logNow {
		s.refusedLogged = time.Now()
	}
	announce := false
	if id != "" {
		if _, ok := s.refusedIDs[id]; !ok {
			if len(s.refusedIDs) >= max(s.cfg.Membership.MaxEngines, 1) {
				clear(s.refusedIDs) // bounded: forget and announce again
			}
			s.refusedIDs[id] = struct{}{}
			announce = true
		}
	}
	s.regMu.Unlock()
	if logNow {
		s.log.Warn("breaker refuses a registration (logged at most once a second; narwhal_breaker_registrations_refused_total counts all)",
			"engine_id", id, "reason", reason, "why", why)
	}
	if announce && s.leader.Load() {
		s.publish(&schemas.Admission{
			Envelope: schemas.Envelope{Schema: schemas.SchemaAdmission, ID: schemas.NewEventID(), At: time.Now().UTC(), BreakerID: s.id, EngineID: id},
			State:    schemas.AdmissionRefused, Reason: why,
		})
	}
}

// applyRegistrations is the leader's applier (R-FLEET-5): once the fleet
// watch has read the whole bucket it applies the last registration of
// every engine the stream holds — one stored longer ago than its TTL has
// lapsed and is passed over — and from then on each registration as it
// arrives, until ctx ends (the lease is lost).
func (s *Service) applyRegistrations(ctx context.Context) {
	for !s.fleetLoaded.Load() {
		if !pause.For(ctx, 10*time.Millisecond) {
			return
		}
	}
	s.regMu.Lock()
	for id := range s.regs {
		s.regPending[id] = struct{}{}
	}
	s.regMu.Unlock()
	for {
		s.regMu.Lock()
		batch := make([]seenRegistration, 0, len(s.regPending))
		for id := range s.regPending {
			if r, ok := s.regs[id]; ok {
				batch = append(batch, r)
			}
		}
		clear(s.regPending)
		s.regMu.Unlock()
		for _, r := range batch {
			if ctx.Err() != nil {
				return
			}
			if time.Since(r.stored) > s.registrationTTL(r.reg) {
				continue // lapsed: its key lapses too
			}
			s.mu.Lock()
			s.applyRegistration(ctx, r.reg)
			s.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return
		case <-s.regWake:
		}
	}
}

// applyRegistration turns one registration into the engine's entry of
// narwhal_fleet (R-FLEET-5), against the entry the fleet watch last
// delivered: a new id → joining with the registration's spec (refused
// while the fleet holds membership.max_engines engines); the same spec →
// the key renewed with the registration's TTL, the breaker's state kept;
// a changed spec → joining again (held out of placement and probed);
// draining → draining; leaving → the key deleted. An entry of another
// source is never taken over. Called with s.mu held, while leading.
func (s *Service) applyRegistration(ctx context.Context, reg schemas.Registration) {
	st := s.fleetStore.Load()
	if st == nil || !s.leader.Load() {
		return
	}
	id := reg.EngineID
	ttl := s.registrationTTL(reg)
	reg.TTLS = ttl.Seconds()
	e := s.byID[id]
	if e != nil && e.fleetEntry.Source != schemas.SourceRegistration {
		s.refuse(id, RefusedTaken, fmt.Sprintf("engine %s is the operator's (source %s): a registration never takes it over", id, e.fleetEntry.Source))
		return
	}
	octx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	now := time.Now()
	switch {
	case reg.State == schemas.AskLeaving:
		if e == nil {
			return
		}
		if err := st.Delete(octx, id, 0); err != nil {
			s.log.Warn("breaker could not remove a leaving engine; its key lapses after its TTL", "engine_id", id, "err", err)
		}
		return
	case e == nil && reg.State == schemas.AskDraining:
		return // not in the fleet: nothing to drain
	case e == nil:
		if len(s.fleet) >= s.cfg.Membership.MaxEngines {
			s.refuse(id, RefusedMaxEngines, fmt.Sprintf("the fleet holds membership.max_engines (%d) engines", s.cfg.Membership.MaxEngines))
			return
		}
		next := reg.Spec(s.id, "registered by "+reg.By+": placeable once the breaker's checks pass", now)
		rev, err := st.Put(octx, next, ttl)
		if err != nil {
			s.log.Warn("breaker could not write a registration to the fleet", "engine_id", id, "err", err)
			return
		}
		s.adopt(ctx, next, rev, "")
		return
	}
	cur := e.fleetEntry
	next := cur
	if spec := reg.Spec(s.id, "", now); !engines.SameSpec(cur, spec) {
		next = reg.Spec(s.id, "its registration's spec changed: placeable once the breaker's checks pass again", now)
	}
	changed := next.State != cur.State || !engines.SameSpec(cur, next)
	next.At, next.By, next.TTLS = now.UTC(), s.id, reg.TTLS
	if reg.State == schemas.AskDraining {
		if drained, err := fleet.Apply(next, fleet.Drain, s.id, "the engine asked to drain ("+reg.By+")", now); err == nil {
			next, changed = drained, true
		}
	}
	rev, err := st.Update(octx, next, e.fleetRev, ttl)
	if err != nil {
		s.log.Debug("breaker could not renew a registration; the next heartbeat tries again", "engine_id", id, "err", err)
		return
	}
	if !changed {
		e.fleetEntry, e.fleetRev = next, rev
		return
	}
	if !engines.SameSpec(cur, next) {
		s.adopt(ctx, next, rev, cur.State)
		return
	}
	e.fleetEntry, e.fleetRev = next, rev
	s.publishFleet(e, next.State, cur.State, next.Reason)
}

// registrationTTL returns the TTL the breaker writes reg's fleet key with:
// the registration's, capped at membership.max_registration_ttl_s
// (behaviour.md R-FLEET-5), so that an engine whose heartbeats stop — a
// revoked credential — leaves the fleet within the cap whatever it asked.
func (s *Service) registrationTTL(reg schemas.Registration) time.Duration {
	return min(config.Seconds(reg.TTLS), s.cfg.Membership.MaxRegistrationTTL())
}

// adopt puts entry, just written at revision rev, into the breaker's
// fleet as the fleet watch would on seeing it — a new engine, or one
// whose spec changed (its placement entry and schedule kept) — holds it
// out of placement while it is joining and publishes its change (prev:
// the state before, empty for a new engine). Called with s.mu held, while
// leading.
func (s *Service) adopt(ctx context.Context, entry schemas.FleetEntry, rev uint64, prev string) {
	eng, err := engines.FromFleetEntry(entry)
	if err != nil {
		s.log.Warn("breaker wrote an entry no engine can be built from", "engine_id", entry.EngineID, "err", err)
		return
	}
	old := s.byID[entry.EngineID]
	ne := &engine{Engine: eng, fleetEntry: entry, fleetRev: rev, backoff: 1, nextProbe: time.Now()}
	if old != nil {
		ne.wasActive = old.wasActive
	}
	s.replaceEngine(ne)
	s.clearRefused(entry.EngineID)
	if old == nil {
		octx, cancel := context.WithTimeout(ctx, opTimeout)
		if err := s.reload(octx, ne); err != nil {
			s.log.Warn("breaker could not read a new engine's placement entry", "engine_id", ne.ID, "err", err)
		}
		cancel()
	}
	if entry.State == schemas.FleetJoining {
		s.holdJoining(ctx, ne)
	}
	s.log.Info("breaker: engine in the live fleet", "engine_id", ne.ID, "state", entry.State, "url", entry.URL)
	s.publishFleet(ne, entry.State, prev, entry.Reason)
}

// clearRefused forgets that engine id's registration was refused, so
// that a later refusal is announced again.
func (s *Service) clearRefused(id string) {
	s.regMu.Lock()
	delete(s.refusedIDs, id)
	s.regMu.Unlock()
}
