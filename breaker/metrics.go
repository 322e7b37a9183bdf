package breaker

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/internal/promreg"
	"github.com/narwhalmesh/narwhal/schemas"
)

// metrics are the Service's Prometheus collectors. Their engine label is
// the router's: a fleet engine id, so that the breaker's and the routers'
// series of an engine join.
type metrics struct {
	// leader is narwhal_breaker_leader{breaker_id}: 1 while this breaker
	// holds the lease (R-BRK-8).
	leader prometheus.Gauge
	// ejections is narwhal_breaker_ejections_total{engine} (R-BRK-1).
	ejections *prometheus.CounterVec
	// readmissions is narwhal_breaker_readmissions_total{engine}
	// (R-BRK-3).
	readmissions *prometheus.CounterVec
	// probes is narwhal_breaker_probes_total{engine,outcome} (R-BRK-5).
	probes *prometheus.CounterVec
	// events is narwhal_breaker_events_total{kind}: failure and request
	// events consumed.
	events *prometheus.CounterVec
	// eventsIgnored is narwhal_breaker_events_ignored_total{reason}:
	// events consumed and not applied because their payload contradicts
	// their subject (schemas.EventSubjectMismatch reasons, R-BUS-11).
	eventsIgnored *prometheus.CounterVec
	// consumerRecreated is narwhal_breaker_consumer_recreated_total: the
	// durable consumer was found gone and created again (R-BUS-9).
	consumerRecreated prometheus.Counter
	// fleetIgnored is narwhal_breaker_fleet_ignored_total: values of
	// narwhal_fleet that are not a valid entry for their key (R-BUS-9).
	fleetIgnored prometheus.Counter
	// reportsIgnored is
	// narwhal_breaker_router_reports_ignored_total{reason}: values of
	// narwhal_routers that are not a valid report (invalid) or a valid
	// one under another router's key (router_id_mismatch, R-BUS-11).
	reportsIgnored *prometheus.CounterVec
	// registrationsRefused is
	// narwhal_breaker_registrations_refused_total{reason}: registrations
	// not written to narwhal_fleet (R-FLEET-5), by the Refused* reason.
	registrationsRefused *prometheus.CounterVec
}

// newMetrics builds the collectors and registers them on reg when it is
// not nil; collectors already registered there under the same names
// (another Service on the same registry) are shared.
func newMetrics(reg prometheus.Registerer, breakerID string) *metrics {
	leader := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "narwhal_breaker_leader",
		Help: "1 while this breaker holds the leader lease, else 0.",
	}, []string{"breaker_id"})
	m := &metrics{
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_breaker_ejections_total",
			Help: "Times an engine was ejected (placed by no router) after recovery.eject_after consecutive counted failures, by engine.",
		}, []string{"engine"}),
		readmissions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_breaker_readmissions_total",
			Help: "Times an ejected engine was readmitted after a successful inference probe, by engine.",
		}, []string{"engine"}),
		probes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_breaker_probes_total",
			Help: "Inference probes of ejected engines, by engine and outcome: success (readmitted), failure (the engine's own check or leg failed), inconclusive (its partner, the bus or a shutdown cut the probe).",
		}, []string{"engine", "outcome"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_breaker_events_total",
			Help: "Failure and request events the breaker consumed from the bus, by kind.",
		}, []string{"kind"}),
		eventsIgnored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_breaker_events_ignored_total",
			Help: "Failure and request events the breaker consumed and ignored because their payload contradicts their subject, by reason: router_id_mismatch (another router's id, or a router event on a subject without one), engine_id_mismatch, subject (no event subject of its kind).",
		}, []string{"reason"}),
		consumerRecreated: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_breaker_consumer_recreated_total",
			Help: "Times the breaker found its durable consumer gone and created it again.",
		}),
		fleetIgnored: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_breaker_fleet_ignored_total",
			Help: "Values of the live fleet's bucket the breaker ignored: not a valid fleet entry for their key.",
		}),
		reportsIgnored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_breaker_router_reports_ignored_total",
			Help: "Routers' in-flight reports the breaker ignored, by reason: invalid (not a valid report), router_id_mismatch (a report under another router's key).",
		}, []string{"reason"}),
		registrationsRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_breaker_registrations_refused_total",
			Help: "Engines' registrations the breaker did not write to the live fleet, by reason: max_engines (the fleet is full), taken (the id is the operator's), invalid (not a registration), id_mismatch (its engine_id is not its subject's), api_key_env (it names a key variable other than its id's, NARWHAL_ENGINE_KEY_<ID>).",
		}, []string{"reason"}),
	}
	if reg != nil {
		leader = promreg.Register(reg, leader)
		m.ejections = promreg.Register(reg, m.ejections)
		m.readmissions = promreg.Register(reg, m.readmissions)
		m.probes = promreg.Register(reg, m.probes)
		m.events = promreg.Register(reg, m.events)
		m.eventsIgnored = promreg.Register(reg, m.eventsIgnored)
		m.consumerRecreated = promreg.Register(reg, m.consumerRecreated)
		m.fleetIgnored = promreg.Register(reg, m.fleetIgnored)
		m.reportsIgnored = promreg.Register(reg, m.reportsIgnored)
		m.registrationsRefused = promreg.Register(reg, m.registrationsRefused)
	}
	for _, r := range refusedReasons {
		m.registrationsRefused.WithLabelValues(r)
	}
	m.leader = leader.WithLabelValues(breakerID)
	for _, k := range []string{schemas.KindFailure, schemas.KindRequest} {
		m.events.WithLabelValues(k)
	}
	for _, r := range []string{schemas.MismatchRouterID, schemas.MismatchEngineID, schemas.MismatchSubject} {
		m.eventsIgnored.WithLabelValues(r)
	}
	for _, r := range []string{reportInvalid, schemas.MismatchRouterID} {
		m.reportsIgnored.WithLabelValues(r)
	}
	return m
}

// reportInvalid is the reason of
// narwhal_breaker_router_reports_ignored_total for a value that is no
// valid router report.
const reportInvalid = "invalid"

// ejectedDesc is narwhal_breaker_engine_ejected{engine,phase}.
var ejectedDesc = prometheus.NewDesc("narwhal_breaker_engine_ejected",
	"1 while the engine is ejected (no router places on it until a probe readmits it), 0 while it is eligible, by engine and phase it serves (an engine serving both phases has a series for each); only the leading breaker reports it.",
	[]string{"engine", "phase"}, nil)

// ejectedCollector exports narwhal_breaker_engine_ejected from the
// leader's placement entries at scrape time (its min by phase is 1 when a
// whole phase is ejected); a standby breaker, whose entries are not kept,
// exports none.
type ejectedCollector struct{ s *Service }

func (c ejectedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- ejectedDesc }

func (c ejectedCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.s
	if !s.leader.Load() {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.fleet {
		if e.rev == 0 && e.entry.State == "" {
			continue // no placement entry read or written yet
		}
		v := 0.0
		if e.entry.State == schemas.StateEjected {
			v = 1
		}
		if e.Role.CanPrefill() {
			ch <- prometheus.MustNewConstMetric(ejectedDesc, prometheus.GaugeValue, v, e.ID, schemas.PhasePrefill)
		}
		if e.Role.CanDecode() {
			ch <- prometheus.MustNewConstMetric(ejectedDesc, prometheus.GaugeValue, v, e.ID, schemas.PhaseDecode)
		}
	}
}

// initEngine creates engine id's series at zero, so that alerts and
// dashboards see an engine that was never ejected.
func (m *metrics) initEngine(id string) {
	m.ejections.WithLabelValues(id)
	m.readmissions.WithLabelValues(id)
	for _, o := range []string{schemas.ProbeSuccess, schemas.ProbeFailure, schemas.ProbeInconclusive} {
		m.probes.WithLabelValues(id, o)
	}
}

// dropEngine deletes every series labelled with engine id, when it left
// the fleet (behaviour.md R-FLEET-5: a fleet of changing ids leaves no
// series behind).
func (m *metrics) dropEngine(id string) {
	m.ejections.DeleteLabelValues(id)
	m.readmissions.DeleteLabelValues(id)
	m.probes.DeletePartialMatch(prometheus.Labels{"engine": id})
}
