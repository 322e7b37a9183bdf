// Package breaker is Narwhal's breaker service (behaviour.md §8): it consumes the
// routers' failure and request events from JetStream with a durable
// consumer, counts each engine's consecutive counted failures, ejects an
// engine after recovery.eject_after of them, probes ejected engines with a
// real KV transfer through their role, readmits them on success, and keeps
// every engine's placement eligibility in KV bucket narwhal_placement.
//
// Several breakers may run; one leads, through a lease in KV bucket
// narwhal_breaker (R-BRK-8). Only the leader consumes events, writes
// placement and probes; the others stand by and take over once the lease
// lapses. Every decision lives on the bus (the streak and state in the
// engine's placement entry, the position in the durable consumer), so a new
// leader continues where the old one stopped.
//
// ProbeTransfer is also what `narwhal preflight` runs (R-PRE-1), after
// engines.CheckHealth and probe.CheckContract.
package breaker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	kvprobe "github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/internal/promreg"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Names on the bus (behaviour.md R-BRK-1, R-BRK-8, R-BUS-7).
const (
	// LeaseBucket is the KV bucket that holds the leader lease. Its TTL is
	// the lease TTL; the admin creates it (bus.Setup, R-BUS-8) and the
	// breaker only binds to it.
	LeaseBucket = bus.LeaseBucket
	// LeaseKey is the lease's key in LeaseBucket; its value is a Lease.
	LeaseKey = bus.LeaseKey
	// ConsumerName is the durable consumer on stream NARWHAL_EVENTS that
	// every breaker shares; only the leader pulls from it. It is created or
	// updated, never deleted.
	ConsumerName = "narwhal-breaker"
)

// FilterSubjects are the subjects ConsumerName reads: failure events and
// request-completed events (R-BRK-1).
var FilterSubjects = []string{
	bus.SubjectPrefix + schemas.KindFailure + ".>",
	bus.SubjectPrefix + schemas.KindRequest + ".>",
}

// MaxBackoff caps the per-engine probe backoff: after failed probes an
// ejected engine is probed every readmit_interval_s × 1, 2, 4, then at most
// × MaxBackoff (R-BRK-5).
const MaxBackoff = 8

// Tuning.
const (
	// consumerAckWait is how long an event delivered to a leader that died
	// before acknowledging it waits before it is delivered again.
	consumerAckWait = 10 * time.Second
	// consumerMaxAckPending bounds events delivered but not acknowledged.
	consumerMaxAckPending = 1024
	// fetchBatch is how many events one pull asks for.
	fetchBatch = 128
	// maxFetchWait bounds how long one pull waits for events.
	maxFetchWait = time.Second
	// setupRetry is the pause between attempts to set up the bucket and the
	// consumer while the bus is unreachable.
	setupRetry = 250 * time.Millisecond
	// opTimeout bounds one KV operation.
	opTimeout = 5 * time.Second
	// eventBuffer is the breaker's publisher buffer.
	eventBuffer = 1024
	// mismatchLogEvery rate-limits the log lines of events ignored because
	// their payload contradicts their subject (R-BUS-11).
	mismatchLogEvery = 10 * time.Second
)

// Lease is the value of LeaseKey: who holds the lease, since when, and in
// which term (see bus.Lease).
type Lease = bus.Lease

// Options configures a Service.
type Options struct {
	// Config is the validated configuration: its Fleet lists the engines,
	// Recovery the ejection and readmission settings, Breaker the lease,
	// Engine the probe timeouts and EngineContract the lifecycle checks.
	Config *config.Config
	// Bus is the connection to NATS; the Service does not close it.
	Bus *bus.Bus
	// ID is the breaker_id of the Service's events and lease, e.g.
	// "breaker-<host>-<pid>": letters, digits, '-' and '_'.
	ID string
	// Logger receives the Service's logs; nil means slog.Default().
	Logger *slog.Logger
	// Client runs the probes; nil means kvprobe.NewClient(Config), whose idle
	// connections the Service closes when Run returns.
	Client *engines.Client
	// Registry receives the Service's metrics (narwhal_breaker_*) and its
	// publisher's; nil means none are registered.
	Registry prometheus.Registerer
	// TracerProvider, when set, traces every probe: one span per probe
	// with the engine ids and the outcome, whose traceparent both probe
	// legs carry (docs/observability.md). Nil means no spans.
	TracerProvider trace.TracerProvider
}

// Service is one breaker (behaviour.md §8). Create it with New and run it with Run;
// it campaigns for the lease and, while it holds it, consumes events,
// ejects, probes and readmits. Its methods are safe for concurrent use.
type Service struct {
	cfg        *config.Config
	bus        *bus.Bus
	id         string
	log        *slog.Logger
	client     *engines.Client
	ownsClient bool
	tracer     trace.Tracer // nil: probes are not traced
	reg        prometheus.Registerer
	metrics    *metrics

	leaseTTL    time.Duration
	renewEvery  time.Duration
	interval    time.Duration
	probeBudget time.Duration
	ejectAfter  int

	// fleet and byID are the live fleet (R-FLEET-1), guarded by mu: the
	// config file's engines at first, then what narwhal_fleet holds.
	fleet []*engine          // in fleet order
	byID  map[string]*engine // by engine id
	// fleetStore is bucket narwhal_fleet once bound by the fleet watch.
	fleetStore atomic.Pointer[fleet.Store]
	// fleetLoaded is set once the fleet watch read the whole bucket.
	fleetLoaded atomic.Bool

	// The engines' registrations (R-FLEET-5), guarded by regMu: the last
	// valid one of each engine id read from NARWHAL_REGISTRATIONS, the ids
	// the leader's applier has still to apply (regWake wakes it), the ids
	// whose refusal was announced, and when a refusal was last logged.
	regMu         sync.Mutex
	regs          map[string]seenRegistration
	regPending    map[string]struct{}
	regWake       chan struct{}
	refusedIDs    map[string]struct{}
	refusedLogged time.Time

	running atomic.Bool
	leader  atomic.Bool
	// term is the lease term while leading (the revision at which the
	// lease was taken), written into every placement value (R-BUS-9).
	term atomic.Uint64
	// position is the stream sequence up to which events were applied
	// (or the consumer's ack floor when it was last read): where a
	// recreated consumer starts (R-BUS-9).
	position atomic.Uint64
	pub      *bus.Publisher // set by Run before any goroutine uses it
	// mismatchLogged is when (UnixNano) an event whose payload
	// contradicts its subject was last logged (R-BUS-11).
	mismatchLogged atomic.Int64

	// mu guards the leader-only state of every engine: its cached
	// placement entry and probe schedule. KV writes happen under it so that
	// event application and readmission never interleave on one engine.
	mu sync.Mutex
}

// engine is one fleet engine with the leader's view of it.
type engine struct {
	engines.Engine

	// Guarded by Service.mu, valid while leading.
	entry     schemas.Eligibility // the placement entry as last read or written
	rev       uint64              // its KV revision; 0 = no entry
	crossed   string              // producer of the latest counted crossed-decode failure in the streak (R-BRK-4)
	phase     string              // phase of the latest counted failure
	backoff   int                 // probe backoff multiplier, 1…MaxBackoff
	nextProbe time.Time           // earliest next probe while ejected
	rotate    int                 // partner rotation, advanced by inconclusive probes

	// Guarded by Service.mu, kept by every breaker.
	fleetEntry schemas.FleetEntry // the engine's entry in narwhal_fleet (or its config seed)
	fleetRev   uint64             // its revision; 0 = from the config file, not read yet
	fromConfig bool               // listed in the config file: kept while the bucket has no key for it
	wasActive  bool               // seen active: its fleet changes are fleet events, not admission events (R-FLEET-5)
}

// New checks opts and returns a Service that is not yet running. It
// returns an error when Config or Bus is missing, ID is empty, or a fleet
// engine names an unknown connector.
func New(opts Options) (*Service, error) {
	if opts.Config == nil {
		return nil, errors.New("breaker: no config")
	}
	if opts.Bus == nil {
		return nil, errors.New("breaker: no bus")
	}
	if opts.ID == "" {
		return nil, errors.New("breaker: no breaker id")
	}
	cfg := opts.Config
	s := &Service{
		cfg:        cfg,
		bus:        opts.Bus,
		id:         opts.ID,
		log:        opts.Logger,
		client:     opts.Client,
		reg:        opts.Registry,
		leaseTTL:   cfg.Breaker.LeaseTTL(),
		interval:   cfg.Recovery.ReadmitInterval(),
		ejectAfter: cfg.Recovery.EjectAfter,
		byID:       make(map[string]*engine, len(cfg.Fleet)),
		regs:       map[string]seenRegistration{},
		regPending: map[string]struct{}{},
		regWake:    make(chan struct{}, 1),
		refusedIDs: map[string]struct{}{},
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	s.log = s.log.With("breaker_id", s.id)
	if opts.TracerProvider != nil {
		s.tracer = opts.TracerProvider.Tracer(TracerName)
	}
	if s.client == nil {
		s.client = kvprobe.NewClient(cfg)
		s.ownsClient = true
	}
	if s.leaseTTL <= 0 {
		s.leaseTTL = config.Seconds(config.Default().Breaker.LeaseTTLS)
	}
	if s.interval <= 0 {
		s.interval = config.Seconds(config.Default().Recovery.ReadmitIntervalS)
	}
	if s.ejectAfter < 1 {
		s.ejectAfter = 1
	}
	s.renewEvery = s.leaseTTL / 3
	// Health, contract and the two legs, each bounded by the first-token
	// timeout (R-BRK-3), plus the decode's tail after its first token.
	s.probeBudget = 4*cfg.Engine.FirstTokenTimeout() + cfg.Engine.DecodeReadTimeout()
	configured, err := fleet.Engines(cfg.Fleet)
	if err != nil {
		return nil, fmt.Errorf("breaker: %w", err)
	}
	for i, ee := range configured {
		spec := cfg.Fleet[i]
		e := &engine{Engine: ee, fleetEntry: spec.FleetEntry(opts.ID, time.Now()), fromConfig: true, wasActive: true}
		s.fleet = append(s.fleet, e)
		s.byID[spec.ID] = e
	}
	s.metrics = newMetrics(opts.Registry, s.id)
	if opts.Registry != nil {
		promreg.Register(opts.Registry, prometheus.Collector(ejectedCollector{s: s}))
	}
	for _, e := range s.fleet {
		s.metrics.initEngine(e.ID)
	}
	return s, nil
}

// Leader reports whether the Service holds the lease right now (R-BRK-8).
// It turns false at once when a renewal fails.
func (s *Service) Leader() bool { return s.leader.Load() }

// ID returns the Service's breaker_id.
func (s *Service) ID() string { return s.id }

// Run binds to KV bucket narwhal_breaker (whose TTL, when it differs from
// breaker.lease_ttl_s, becomes the lease TTL: logged; R-BUS-8) and sets up
// the durable consumer narwhal-breaker with CreateOrUpdate only (R-BUS-7),
// then campaigns for the lease every lease_ttl_s/3: while it holds the
// lease it leads (consumes events, ejects, probes, readmits); when a
// renewal fails it stops leading at once and campaigns again (R-BRK-8).
//
// Run blocks until ctx ends and then returns nil, after releasing the lease
// it holds (so a standby takes over without waiting for it to lapse) and
// stopping every goroutine it started. It returns an error when the
// bucket is missing (a *bus.NotSetUpError) or the consumer cannot be set up
// for a reason waiting cannot fix, or when called a second time.
func (s *Service) Run(ctx context.Context) error {
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("breaker: Run called twice")
	}
	if s.ownsClient {
		defer s.client.CloseIdleConnections()
	}
	lease, cons, err := s.setup(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	s.pub = bus.NewPublisher(s.bus, eventBuffer, s.reg)
	defer s.pub.Close()
	fctx, fcancel := context.WithCancel(ctx)
	fdone := make(chan struct{})
	rdone := make(chan struct{})
	go func() { defer close(fdone); s.watchFleet(fctx) }()
	go func() { defer close(rdone); s.watchRegistrations(fctx) }()
	defer func() { fcancel(); <-fdone; <-rdone }()

	// A standby campaigns ten times per lease TTL, so it takes over within
	// a tenth of the TTL of the lease lapsing (R-BRK-8).
	t := time.NewTicker(max(s.leaseTTL/10, 20*time.Millisecond))
	defer t.Stop()
	for {
		value, _ := json.Marshal(Lease{BreakerID: s.id, Since: time.Now().UTC()})
		cctx, cancel := context.WithTimeout(ctx, s.renewEvery)
		rev, err := lease.Create(cctx, LeaseKey, value)
		cancel()
		switch {
		case err == nil:
			s.lead(ctx, lease, cons, rev)
		case errors.Is(err, jetstream.ErrKeyExists):
			// Another breaker leads: stand by.
		case ctx.Err() == nil:
			s.log.Debug("breaker campaign", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// setup binds to the lease bucket as the admin made it (R-BUS-8) and
// creates or updates the durable consumer, retrying while the bus is
// unreachable. When the bucket's TTL differs from breaker.lease_ttl_s the
// bucket wins — its TTL is when the lease lapses — and the difference is
// logged.
func (s *Service) setup(ctx context.Context) (jetstream.KeyValue, jetstream.Consumer, error) {
	js := s.bus.JetStream()
	for {
		octx, cancel := context.WithTimeout(ctx, opTimeout)
		lease, err := s.bus.BindBucket(octx, LeaseBucket)
		if err == nil {
			err = s.adoptLeaseTTL(octx, lease)
		}
		var cons jetstream.Consumer
		if err == nil {
			// An existing consumer is used as it is: it may have been
			// recreated at a position (see recreateConsumer), a setting
			// an update could not change.
			cons, err = js.Consumer(octx, bus.StreamName, ConsumerName)
			if errors.Is(err, jetstream.ErrConsumerNotFound) {
				cons, err = js.CreateOrUpdateConsumer(octx, bus.StreamName, consumerConfig(0))
			}
			if err != nil {
				err = fmt.Errorf("breaker: consumer %s: %w", ConsumerName, err)
			} else {
				s.position.Store(cons.CachedInfo().AckFloor.Stream)
			}
		}
		cancel()
		if err == nil {
			return lease, cons, nil
		}
		if !s.transient(err) {
			return nil, nil, err
		}
		s.log.Warn("breaker setup waiting for the bus", "err", err)
		if !pause.For(ctx, setupRetry) {
			return nil, nil, ctx.Err()
		}
	}
}

// adoptLeaseTTL makes the lease bucket's TTL the Service's lease TTL.
func (s *Service) adoptLeaseTTL(ctx context.Context, lease jetstream.KeyValue) error {
	st, err := lease.Status(ctx)
	if err != nil {
		return fmt.Errorf("breaker: bucket %s: %w", LeaseBucket, err)
	}
	if ttl := st.TTL(); ttl > 0 && ttl != s.leaseTTL {
		s.log.Warn("breaker: the lease bucket's TTL differs from breaker.lease_ttl_s; using the bucket's",
			"bucket", LeaseBucket, "found", ttl, "wanted", s.leaseTTL)
		s.leaseTTL = ttl
		s.renewEvery = ttl / 3
	}
	return nil
}

// consumerConfig is the durable consumer's configuration: from the
// events published after its creation, or — recreated after it vanished —
// from stream sequence start (R-BRK-1, R-BUS-9).
func consumerConfig(start uint64) jetstream.ConsumerConfig {
	cfg := jetstream.ConsumerConfig{
		Durable:        ConsumerName,
		Description:    "Narwhal breaker: failure and request events",
		FilterSubjects: FilterSubjects,
		DeliverPolicy:  jetstream.DeliverNewPolicy,
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        consumerAckWait,
		MaxAckPending:  consumerMaxAckPending,
		MaxDeliver:     -1,
	}
	if start > 0 {
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = start
	}
	return cfg
}

// transient reports whether a bus error may go away by waiting.
func (s *Service) transient(err error) bool {
	return !s.bus.Connected() || bus.Temporary(err)
}

// errLeaseLost cancels the leading context when a renewal fails.
var errLeaseLost = errors.New("breaker: lease lost")

// renewRetry is the pause between attempts of a failed lease renewal.
const renewRetry = 50 * time.Millisecond

// lead runs the leader's work while the lease (taken at revision rev, the
// lease term) is held: it renews the lease every lease_ttl_s/3, takes over
// placement, consumes events and runs readmission rounds. A renewal that
// fails for a reason other than another breaker's lease (a leader election
// of the bucket, a reconnect) is retried until the lease would lapse, less
// a tenth of the TTL; only then, or when another breaker holds the lease,
// does it stop leading (R-BRK-8). It returns when ctx ends (releasing the
// lease) or the lease is lost.
func (s *Service) lead(ctx context.Context, lease jetstream.KeyValue, cons jetstream.Consumer, rev uint64) {
	lctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s.term.Store(rev)
	s.leader.Store(true)
	s.metrics.leader.Set(1)
	s.log.Info("breaker leading", "lease_ttl", s.leaseTTL, "lease_term", rev)
	value, _ := json.Marshal(Lease{BreakerID: s.id, Since: time.Now().UTC(), Term: rev})

	var held atomic.Uint64
	held.Store(rev)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(s.renewEvery)
		defer t.Stop()
		renewed := time.Now()
		for {
			select {
			case <-lctx.Done():
				return
			case <-t.C:
			}
			next, err := s.renew(lctx, lease, value, held.Load(), renewed.Add(s.leaseTTL-s.leaseTTL/10))
			if err != nil {
				if lctx.Err() != nil {
					return
				}
				// Stop leading at once: another breaker may hold the
				// lease from now on (R-BRK-8).
				s.leader.Store(false)
				s.metrics.leader.Set(0)
				s.log.Warn("breaker lease lost", "err", err)
				cancel(errLeaseLost)
				return
			}
			held.Store(next)
			renewed = time.Now()
		}
	}()

	if s.takeOver(lctx) {
		wg.Add(4)
		go func() { defer wg.Done(); s.applyRegistrations(lctx) }()
		go func() { defer wg.Done(); s.consume(lctx, cons) }()
		go func() { defer wg.Done(); s.readmitLoop(lctx) }()
		go func() { defer wg.Done(); s.drainLoop(lctx) }()
	}
	<-lctx.Done()
	wg.Wait()
	s.leader.Store(false)
	s.metrics.leader.Set(0)
	if context.Cause(lctx) != errLeaseLost {
		// Shutting down: hand the lease over now instead of letting it
		// lapse. Revision-checked, so a lease taken by another breaker in
		// the meantime is left alone. A renewal cut short by the shutdown
		// may still have been stored, leaving held one revision behind:
		// when the stored lease is still this breaker's term, its own
		// revision is used instead.
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), s.renewEvery)
		err := lease.Delete(rctx, LeaseKey, jetstream.LastRevision(held.Load()))
		if err != nil && errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
			if e, gerr := lease.Get(rctx, LeaseKey); gerr == nil {
				if l, ok := bus.LeaseOf(e); ok && l.BreakerID == s.id && l.Term == rev {
					err = lease.Delete(rctx, LeaseKey, jetstream.LastRevision(e.Revision()))
				}
			}
		}
		if err != nil {
			s.log.Debug("breaker lease release", "err", err)
		}
		rcancel()
		s.log.Info("breaker stopped leading")
	}
}

// renew renews the lease held at revision rev with value, retrying every
// renewRetry until deadline (shortly before the lease would lapse). A
// revision mismatch after a failed attempt may be that attempt's own
// write: when the stored lease is still this breaker's term, its revision
// is taken. It returns the new revision, or why the lease is lost.
func (s *Service) renew(ctx context.Context, lease jetstream.KeyValue, value []byte, rev uint64, deadline time.Time) (uint64, error) {
	retried := false
	for {
		rctx, rcancel := context.WithTimeout(ctx, min(s.renewEvery, max(time.Until(deadline), time.Millisecond)))
		next, err := lease.Update(rctx, LeaseKey, value, rev)
		if err != nil && errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
			if e, gerr := lease.Get(rctx, LeaseKey); gerr == nil {
				if l, ok := bus.LeaseOf(e); ok && l.BreakerID == s.id && l.Term == s.term.Load() {
					next, err = e.Revision(), nil
				}
			}
		}
		rcancel()
		if err == nil {
			if retried {
				s.log.Info("breaker lease renewed after a failed attempt")
			}
			return next, nil
		}
		if errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyNotFound) ||
			errors.Is(err, jetstream.ErrKeyDeleted) || ctx.Err() != nil || time.Now().After(deadline) {
			return 0, err
		}
		if !retried {
			s.log.Warn("breaker lease renewal failed; retrying until the lease would lapse", "err", err)
		}
		retried = true
		if !pause.For(ctx, renewRetry) {
			return 0, ctx.Err()
		}
	}
}

// publish hands ev to the Service's publisher.
func (s *Service) publish(ev schemas.Event) { s.pub.Publish(ev) }
