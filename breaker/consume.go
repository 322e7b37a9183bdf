package breaker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

var (
	failurePrefix = bus.SubjectPrefix + schemas.KindFailure + "."
	requestPrefix = bus.SubjectPrefix + schemas.KindRequest + "."
)

// consume pulls events from the durable consumer while ctx lasts (the
// lease is held) and applies them one at a time, in stream order,
// acknowledging each after it is applied: a leader that stops mid-way
// leaves the rest to the next one, from the ack floor (R-BRK-1). Events
// fetched after the lease was lost are handed back unapplied. When the
// consumer has vanished (deleted by hand or by a hostile client) it is
// recreated, from the event after the last one applied, within half a
// readmission interval (R-BUS-9).
func (s *Service) consume(ctx context.Context, cons jetstream.Consumer) {
	wait := min(s.renewEvery, maxFetchWait)
	checkEvery := max(min(s.interval/2, maxFetchWait), 50*time.Millisecond)
	checked := time.Now()
	for ctx.Err() == nil {
		if time.Since(checked) >= checkEvery {
			checked = time.Now()
			s.checkConsumer(ctx, cons)
		}
		// FetchMaxWait, not a context deadline: a pull cut short by the
		// client's own deadline drops the messages the server had already
		// sent, and they come back only after the ack wait (seconds late).
		// The server ends the pull after at most this long; events that
		// arrive after the lease was lost are handed back below.
		batch, err := cons.Fetch(fetchBatch, jetstream.FetchMaxWait(min(wait, checkEvery)))
		if err != nil {
			if ctx.Err() == nil {
				s.log.Debug("breaker fetch", "err", err)
				if errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrConsumerDeleted) {
					checked = time.Time{}
				}
				pause.For(ctx, min(wait, checkEvery))
			}
			continue
		}
		n := 0
		for msg := range batch.Messages() {
			n++
			if ctx.Err() != nil {
				_ = msg.Nak()
				continue
			}
			s.handle(ctx, msg)
		}
		if err := batch.Error(); err != nil && ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) {
			s.log.Debug("breaker fetch", "err", err)
			if errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrConsumerDeleted) {
				checked = time.Time{}
			}
			if n == 0 {
				pause.For(ctx, min(wait, checkEvery))
			}
		}
	}
}

// checkConsumer reads the durable consumer's state; when the server says
// it does not exist, it creates it again from the event after the last
// one applied (R-BUS-9). Other errors (the bus is down) are left to the
// next check.
func (s *Service) checkConsumer(ctx context.Context, cons jetstream.Consumer) {
	octx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	info, err := cons.Info(octx)
	if err == nil {
		if f := info.AckFloor.Stream; f > s.position.Load() {
			s.position.Store(f)
		}
		return
	}
	if !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return
	}
	from := s.position.Load() + 1
	_, err = s.bus.JetStream().CreateConsumer(octx, bus.StreamName, consumerConfig(from))
	switch {
	case err == nil:
		s.metrics.consumerRecreated.Inc()
		s.log.Warn("breaker consumer was gone; recreated it", "consumer", ConsumerName, "from_stream_seq", from)
	case errors.Is(err, jetstream.ErrConsumerExists):
		// Another breaker recreated it first.
	default:
		s.log.Warn("breaker consumer is gone and could not be recreated yet", "consumer", ConsumerName, "err", err)
	}
}

// handle applies one event and settles it: acknowledged once applied (or
// when it needs nothing, or when its payload contradicts its subject:
// ignored and counted, behaviour.md R-BUS-11), terminated when it is not
// an event, handed back for a later delivery when the bus write failed.
func (s *Service) handle(ctx context.Context, msg jetstream.Msg) {
	var err error
	subject := msg.Subject()
	switch {
	case strings.HasPrefix(subject, failurePrefix):
		s.metrics.events.WithLabelValues(schemas.KindFailure).Inc()
		err = s.applyFailure(ctx, subject, msg.Data())
	case strings.HasPrefix(subject, requestPrefix):
		s.metrics.events.WithLabelValues(schemas.KindRequest).Inc()
		err = s.applyRequest(ctx, subject, msg.Data())
	}
	var bad *malformedError
	if md, merr := msg.Metadata(); merr == nil && (err == nil || errors.As(err, new(*malformedError))) {
		if seq := md.Sequence.Stream; seq > s.position.Load() {
			s.position.Store(seq)
		}
	}
	switch {
	case err == nil:
		_ = msg.Ack()
	case errors.As(err, &bad):
		s.log.Warn("breaker drops a malformed event", "subject", subject, "err", err)
		_ = msg.Term()
	default:
		if ctx.Err() == nil {
			s.log.Warn("breaker could not apply an event, will retry", "subject", subject, "err", err)
		}
		_ = msg.NakWithDelay(min(s.renewEvery, maxFetchWait))
	}
}

// mismatched reports whether an event's payload ids (engineID, routerID)
// contradict its subject (schemas.EventSubjectMismatch: another router's
// id, another engine's, a router kind's four-token subject); such an
// event is ignored, counted in narwhal_breaker_events_ignored_total{reason}
// and logged at most once per breakerLogEvery (behaviour.md R-BUS-11).
func (s *Service) mismatched(subject, engineID, routerID string) bool {
	why := schemas.EventSubjectMismatch(subject, engineID, routerID)
	if why == "" {
		return false
	}
	s.metrics.eventsIgnored.WithLabelValues(why).Inc()
	if now := time.Now().UnixNano(); now-s.mismatchLogged.Load() > int64(mismatchLogEvery) {
		s.mismatchLogged.Store(now)
		s.log.Warn("breaker ignores an event whose payload contradicts its subject", "subject", subject,
			"engine_id", engineID, "router_id", routerID, "reason", why)
	}
	return true
}

// malformedError marks an event that can never be applied.
type malformedError struct{ err error }

func (e *malformedError) Error() string { return "malformed event: " + e.err.Error() }

// applyFailure counts a failure event towards its engine's streak
// (R-BRK-1, R-BRK-2) when the router marked it as counting: the streak is
// stored in the engine's placement entry, and at recovery.eject_after the
// engine is ejected ({eligible:false,state:"ejected"} plus an eligibility
// event). A crossed-decode failure remembers its producer for the probe
// (R-BRK-4). Events of engines outside the fleet, of ejected engines,
// that do not count, and whose payload contradicts subject (R-BUS-11) are
// acknowledged without effect.
func (s *Service) applyFailure(ctx context.Context, subject string, data []byte) error {
	var f schemas.Failure
	if err := json.Unmarshal(data, &f); err != nil {
		return &malformedError{err}
	}
	if s.mismatched(subject, f.EngineID, f.RouterID) || !f.Counts {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.byID[f.EngineID]
	if e == nil {
		return nil
	}
	crossed := f.Phase == schemas.PhaseDecode && f.ConsumerID == e.ID && f.ProducerID != "" && f.ProducerID != e.ID
	var ejected bool
	entry, err := s.update(ctx, e, false, func(cur schemas.Eligibility) (schemas.Eligibility, error) {
		if cur.State == schemas.StateEjected {
			return cur, errNoChange
		}
		next := schemas.Eligibility{State: schemas.StateEligible, Streak: cur.Streak + 1}
		ejected = next.Streak >= s.ejectAfter
		if ejected {
			next.State = schemas.StateEjected
			next.Reason = fmt.Sprintf("ejected after %d consecutive failures (last: %s %s)", next.Streak, f.Phase, f.Kind)
		} else {
			next.Reason = fmt.Sprintf("%d consecutive failures (last: %s %s)", next.Streak, f.Phase, f.Kind)
		}
		return next, nil
	})
	if errors.Is(err, errNoChange) {
		return nil
	}
	if err != nil {
		return err
	}
	if crossed {
		e.crossed = f.ProducerID
	}
	if f.Phase == schemas.PhasePrefill || f.Phase == schemas.PhaseDecode {
		e.phase = f.Phase
	}
	if ejected {
		s.publish(cloneEligibility(entry))
		e.backoff, e.nextProbe = 1, time.Now().Add(s.interval)
		s.metrics.ejections.WithLabelValues(e.ID).Inc()
		s.log.Warn("engine ejected", "engine_id", e.ID, "streak", entry.Streak, "reason", entry.Reason)
	}
	return nil
}

// requestOutcome is the part of a request-completed event the breaker
// reads.
type requestOutcome struct {
	// RouterID is the publishing router, the subject's last token
	// (R-BUS-11).
	RouterID   string `json:"router_id"`
	Status     int    `json:"status"`
	ErrorKind  string `json:"error_kind"`
	ProducerID string `json:"producer_id"`
	ConsumerID string `json:"consumer_id"`
	// KVRecomputed: the consumer recomputed the prompt (R-FAIL-8).
	KVRecomputed bool `json:"kv_recomputed"`
}

// applyRequest resets the streaks of the producer and consumer of a
// successful request (status 200, no error kind) (R-BRK-1). A consumer
// that recomputed the prompt instead of loading the KV (kv_recomputed,
// R-FAIL-8) keeps its streak: the request proves nothing of the pair. An
// ejected engine keeps its state: only a probe readmits (R-BRK-3). An
// event whose router_id is not its subject's (R-BUS-11) is ignored.
func (s *Service) applyRequest(ctx context.Context, subject string, data []byte) error {
	var r requestOutcome
	if err := json.Unmarshal(data, &r); err != nil {
		return &malformedError{err}
	}
	if s.mismatched(subject, "", r.RouterID) || r.Status != 200 || r.ErrorKind != "" {
		return nil
	}
	if err := s.resetStreak(ctx, r.ProducerID); err != nil {
		return err
	}
	if r.ConsumerID != r.ProducerID && !r.KVRecomputed {
		return s.resetStreak(ctx, r.ConsumerID)
	}
	return nil
}

// resetStreak sets an eligible engine's streak to 0 after a success.
func (s *Service) resetStreak(ctx context.Context, id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.byID[id]
	if e == nil {
		return nil
	}
	if e.entry.Streak == 0 || e.entry.State != schemas.StateEligible {
		return nil // the common case: nothing to write
	}
	_, err := s.update(ctx, e, false, func(cur schemas.Eligibility) (schemas.Eligibility, error) {
		if cur.Streak == 0 || cur.State != schemas.StateEligible {
			return cur, errNoChange
		}
		return schemas.Eligibility{State: schemas.StateEligible, Reason: "streak reset by a successful request"}, nil
	})
	if errors.Is(err, errNoChange) {
		err = nil
	}
	if err == nil {
		e.crossed = ""
	}
	return err
}
