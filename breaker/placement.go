package breaker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// maxCASAttempts bounds the re-read-and-retry loop of a placement write
// that lost a revision race.
const maxCASAttempts = 4

// takeOver prepares placement for a new leader (R-BRK-8): every fleet
// engine without an entry in narwhal_placement gets {eligible:true,
// state:"eligible"} (and an eligibility event); existing entries — the
// previous leader's decisions and streaks — are kept, loaded and written
// again in this leader's name and lease term, since routers apply only
// values of the current lease holder (R-BUS-9). Ejected
// engines are due for a probe at the first readmission round. It retries
// until it succeeds or ctx ends, and reports whether it succeeded.
func (s *Service) takeOver(ctx context.Context) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	for _, e := range s.fleet {
		for {
			err := s.seed(ctx, e)
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return false
			}
			s.log.Warn("breaker placement takeover", "engine_id", e.ID, "err", err)
			if !pause.For(ctx, setupRetry) {
				return false
			}
		}
		e.crossed, e.phase = "", ""
		e.backoff, e.nextProbe, e.rotate = 1, now, 0
		if e.fleetEntry.State == schemas.FleetJoining {
			s.holdJoining(ctx, e)
		}
	}
	return true
}

// seed creates e's entry when it has none, or loads it. Called with s.mu
// held.
func (s *Service) seed(ctx context.Context, e *engine) error {
	entry := s.eligibility(e.ID, schemas.Eligibility{Eligible: true, State: schemas.StateEligible, Reason: "engine joined the fleet"})
	data, err := json.Marshal(entry)
	if err != nil {
		return err
	}
	octx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	rev, err := s.bus.Placement().Create(octx, e.ID, data)
	switch {
	case err == nil:
		e.entry, e.rev = *entry, rev
		s.publish(cloneEligibility(entry))
		return nil
	case errors.Is(err, jetstream.ErrKeyExists):
		if err := s.reload(octx, e); err != nil {
			return err
		}
		if e.entry.BreakerID == s.id && e.entry.LeaseTerm == s.term.Load() {
			return nil
		}
		_, err = s.update(ctx, e, false, func(cur schemas.Eligibility) (schemas.Eligibility, error) { return cur, nil })
		return err
	}
	return err
}

// reload reads e's entry from narwhal_placement into the cache. A missing
// or deleted key reads as eligible with streak 0 and revision 0 (the next
// write then creates it). A value that is not a placement value for e
// (narwhal.placement.v1, its engine_id e's) — which no breaker writes, so
// a forgery or a fault — reads as ejected, so that e is probed before it
// is placed again: garbage can neither readmit a failing engine nor keep
// a healthy one out for longer than a probe (R-BUS-9). Called with s.mu
// held.
func (s *Service) reload(ctx context.Context, e *engine) error {
	kve, err := s.bus.Placement().Get(ctx, e.ID)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
		e.entry = schemas.Eligibility{Eligible: true, State: schemas.StateEligible}
		e.rev = 0
		return nil
	}
	if err != nil {
		return err
	}
	var entry schemas.Eligibility
	bad := bus.ValidatePlacement(kve.Value())
	if bad == nil && (json.Unmarshal(kve.Value(), &entry) != nil || entry.EngineID != e.ID) {
		bad = errors.New("engine_id is not the key")
	}
	if bad != nil {
		s.log.Warn("breaker ignores an unreadable placement entry; the engine is probed before it is placed again", "engine_id", e.ID, "revision", kve.Revision(), "err", bad)
		entry = schemas.Eligibility{State: schemas.StateEjected, Reason: "placement entry unreadable; probing the engine before placing it again"}
	}
	entry.Eligible = entry.State == schemas.StateEligible
	if entry.Streak < 0 {
		entry.Streak = 0
	}
	e.entry, e.rev = entry, kve.Revision()
	return nil
}

// eligibility returns a complete placement entry for engine id: next's
// decision with a fresh envelope (schema, id, now, this breaker).
func (s *Service) eligibility(id string, next schemas.Eligibility) *schemas.Eligibility {
	next.Envelope = schemas.Envelope{
		Schema:    schemas.SchemaEligibility,
		ID:        schemas.NewEventID(),
		At:        time.Now().UTC(),
		BreakerID: s.id,
		EngineID:  id,
	}
	next.LeaseTerm = s.term.Load()
	next.Eligible = next.State == schemas.StateEligible
	return &next
}

func cloneEligibility(e *schemas.Eligibility) *schemas.Eligibility {
	c := *e
	return &c
}

// errNoChange is returned by a mutation that leaves the entry as it is.
var errNoChange = errors.New("breaker: no change")

// update applies mutate to e's cached entry and writes the result to
// narwhal_placement with a revision check (R-BRK-1, R-BRK-8); when another
// writer got there first it re-reads the entry and applies mutate again.
// mutate returns errNoChange to leave the entry alone. With announce the
// new entry is also published as an eligibility event. It returns the
// entry written, or errNoChange, or the bus error. Called with s.mu held.
func (s *Service) update(ctx context.Context, e *engine, announce bool, mutate func(cur schemas.Eligibility) (schemas.Eligibility, error)) (*schemas.Eligibility, error) {
	kv := s.bus.Placement()
	for range maxCASAttempts {
		next, err := mutate(e.entry)
		if err != nil {
			return nil, err
		}
		entry := s.eligibility(e.ID, next)
		data, err := json.Marshal(entry)
		if err != nil {
			return nil, err
		}
		octx, cancel := context.WithTimeout(ctx, opTimeout)
		var rev uint64
		if e.rev == 0 {
			rev, err = kv.Create(octx, e.ID, data)
		} else {
			rev, err = kv.Update(octx, e.ID, data, e.rev)
		}
		if err == nil {
			cancel()
			e.entry, e.rev = *entry, rev
			if announce {
				s.publish(cloneEligibility(entry))
			}
			return entry, nil
		}
		if !errors.Is(err, jetstream.ErrKeyRevisionMismatch) && !errors.Is(err, jetstream.ErrKeyExists) {
			cancel()
			return nil, err
		}
		// Someone else wrote the entry (a previous leader finishing its
		// last write): start again from what is stored.
		s.log.Info("breaker placement entry changed underneath, re-reading", "engine_id", e.ID)
		err = s.reload(octx, e)
		cancel()
		if err != nil {
			return nil, err
		}
	}
	return nil, fmt.Errorf("breaker: placement entry %s keeps changing underneath", e.ID)
}
