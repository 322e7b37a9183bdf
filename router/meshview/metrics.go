package meshview

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/schemas"
)

// metrics are the view's Prometheus series: what it ignored of the bus,
// the engines' credential refusals, the prefix index's size. The labels
// share the router's vocabulary (engine: a fleet engine id; reason).
type metrics struct {
	// placementIgnored is narwhal_placement_ignored_total{reason}: values
	// of narwhal_placement the view did not apply (R-BUS-9).
	placementIgnored *prometheus.CounterVec
	// fleetIgnored is narwhal_fleet_ignored_total{reason}: values of
	// narwhal_fleet the view did not apply (R-FLEET-1, R-BUS-9).
	fleetIgnored *prometheus.CounterVec
	// quarantineIgnored is
	// narwhal_quarantine_events_ignored_total{reason}: other routers'
	// quarantine events not applied because their payload contradicts
	// their subject (schemas.EventSubjectMismatch reasons, R-BUS-11).
	quarantineIgnored *prometheus.CounterVec
	// refusedCredentials counts episodes of an engine refusing the
	// router's credentials (engine label: fleet ids, bounded).
	refusedCredentials *prometheus.CounterVec
	// engineMu orders the counting of an engine's refusal against the
	// deletion of its series when it leaves the fleet (forgetEngine), so
	// that a refusal seen after it left creates no series again.
	engineMu sync.Mutex
}

// placementIgnoredReasons are the values of
// narwhal_placement_ignored_total's reason.
var placementIgnoredReasons = []string{ignoredInvalid, ignoredNotLeader, ignoredDeleted}

// newMetrics registers the view's series on reg, each labelled counter
// with its zero series (R-BUS-1: alerts see them before anything
// happened); f is the fleet as of now and index the prefix index, read
// at scrape time.
func newMetrics(reg prometheus.Registerer, f func() *Fleet, index *prefix.Index) *metrics {
	m := &metrics{
		placementIgnored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_placement_ignored_total",
			Help: "Placement values not applied, by reason: invalid (not a valid placement value), not_leader (not written by the current lease holder), deleted (a deleted key).",
		}, []string{"reason"}),
		fleetIgnored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_fleet_ignored_total",
			Help: "Values of the live fleet's bucket not applied, by reason: invalid (not a valid fleet entry for its key).",
		}, []string{"reason"}),
		quarantineIgnored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_quarantine_events_ignored_total",
			Help: "Quarantine events of other routers not applied because their payload contradicts their subject, by reason: router_id_mismatch (another router's id, or no router id in the subject), engine_id_mismatch.",
		}, []string{"reason"}),
		refusedCredentials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_engine_credentials_refused_total",
			Help: "Times an engine started refusing the router's API key (HTTP 401 or 403), by engine; it is not placeable until it accepts it again.",
		}, []string{"engine"}),
	}
	for _, r := range placementIgnoredReasons {
		m.placementIgnored.WithLabelValues(r)
	}
	m.fleetIgnored.WithLabelValues(fleetIgnoredInvalid)
	for _, r := range []string{schemas.MismatchRouterID, schemas.MismatchEngineID} {
		m.quarantineIgnored.WithLabelValues(r)
	}
	reg.MustRegister(m.refusedCredentials, m.placementIgnored, m.fleetIgnored, m.quarantineIgnored, &indexCollector{index: index, f: f})
	return m
}

// initEngine creates the zero series of engine e's labelled counters:
// its credential refusals.
func (m *metrics) initEngine(e *Member) {
	m.engineMu.Lock()
	defer m.engineMu.Unlock()
	m.refusedCredentials.WithLabelValues(e.ID)
}

// refused counts one credential refusal of engine id when in reports it
// still in the fleet; one that left has its series deleted (R-FLEET-5).
func (m *metrics) refused(id string, in func() bool) {
	m.engineMu.Lock()
	defer m.engineMu.Unlock()
	if in() {
		m.refusedCredentials.WithLabelValues(id).Inc()
	}
}

// forgetEngine deletes the series of engine id, which left the fleet
// (behaviour.md R-FLEET-5); narwhal_prefix_index_blocks goes with the
// index's entries of it.
func (m *metrics) forgetEngine(id string) {
	m.engineMu.Lock()
	defer m.engineMu.Unlock()
	m.refusedCredentials.DeleteLabelValues(id)
}

// indexCollector exports narwhal_prefix_index_blocks{engine}: the block
// hashes the prefix index holds per engine (each bounded by
// placement.prefix_index_blocks), for every fleet member and every
// other engine the index still holds blocks for.
type indexCollector struct {
	index *prefix.Index
	f     func() *Fleet
}

var indexBlocksDesc = prometheus.NewDesc("narwhal_prefix_index_blocks",
	"Block hashes the prefix placement index holds per engine (bounded by placement.prefix_index_blocks).", []string{"engine"}, nil)

func (c *indexCollector) Describe(ch chan<- *prometheus.Desc) { ch <- indexBlocksDesc }

func (c *indexCollector) Collect(ch chan<- prometheus.Metric) {
	seen := map[string]bool{}
	c.index.Engines(func(id string, n int) {
		seen[id] = true
		ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, float64(n), id)
	})
	if fl := c.f(); fl != nil {
		for _, m := range fl.members {
			if !seen[m.ID] {
				ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, 0, m.ID)
			}
		}
	}
}
