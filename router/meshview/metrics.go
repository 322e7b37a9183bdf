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
	// predictedTokens and cachedTokens are
	// narwhal_prefix_predicted_tokens_total{engine} and
	// narwhal_prefix_cached_tokens_total{engine}: what the prefix index
	// predicted each producer held of the prompts placed there, and what
	// it said it had cached (R-PLACE-3).
	predictedTokens, cachedTokens *prometheus.CounterVec
	// predictionError is narwhal_prefix_prediction_error_tokens: predicted
	// − cached per prefill answer with cached_tokens.
	predictionError prometheus.Histogram
	// uncorrected is narwhal_prefix_uncorrected_total: prefill answers
	// without cached_tokens (the index not corrected by them).
	uncorrected prometheus.Counter
	// cuts is narwhal_prefix_index_cuts_total: chains cut from the index
	// because the engine had not cached what it predicted.
	cuts prometheus.Counter
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
		predictedTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_prefix_predicted_tokens_total",
			Help: "Prompt tokens the prefix index predicted the producer held of the prompts placed there (matched blocks in tokens), by engine, over the prefill answers that reported cached_tokens.",
		}, []string{"engine"}),
		cachedTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_prefix_cached_tokens_total",
			Help: "Prompt tokens the producers reported cached in their prefill answers (usage.prompt_tokens_details.cached_tokens), by engine.",
		}, []string{"engine"}),
		predictionError: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "narwhal_prefix_prediction_error_tokens",
			Help:    "Per prefill answer with cached_tokens: the tokens the prefix index predicted the producer held minus those it reported cached (positive: the index over-predicted).",
			Buckets: []float64{-4096, -1024, -256, -64, -16, 0, 16, 64, 256, 1024, 4096, 16384, 65536},
		}),
		uncorrected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_prefix_uncorrected_total",
			Help: "Prefill answers without usage.prompt_tokens_details.cached_tokens: the prefix index is not corrected by them.",
		}),
		cuts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_prefix_index_cuts_total",
			Help: "Chains cut from the prefix index because the producer reported fewer cached tokens than the index predicted.",
		}),
	}
	for _, r := range placementIgnoredReasons {
		m.placementIgnored.WithLabelValues(r)
	}
	m.fleetIgnored.WithLabelValues(fleetIgnoredInvalid)
	for _, r := range []string{schemas.MismatchRouterID, schemas.MismatchEngineID} {
		m.quarantineIgnored.WithLabelValues(r)
	}
	reg.MustRegister(m.predictedTokens, m.cachedTokens, m.predictionError, m.uncorrected, m.cuts)
	reg.MustRegister(m.refusedCredentials, m.placementIgnored, m.fleetIgnored, m.quarantineIgnored, &indexCollector{index: index, f: f})
	return m
}

// initEngine creates the zero series of engine e's labelled counters:
// its credential refusals.
func (m *metrics) initEngine(e *Member) {
	m.engineMu.Lock()
	defer m.engineMu.Unlock()
	m.refusedCredentials.WithLabelValues(e.ID)
	if e.Can(Prefill) {
		e.series.Store(&engineSeries{predicted: m.predictedTokens.WithLabelValues(e.ID), cached: m.cachedTokens.WithLabelValues(e.ID)})
	}
}

// engineSeries is a member's own series of the request path, looked up
// once when it joins: counting takes no lock. Once the engine left and
// its series were deleted (forgetEngine), what is still counted on them
// is exported nowhere.
type engineSeries struct {
	predicted, cached prometheus.Counter
}

// prediction counts one prefill answer's predicted and cached tokens on
// engine e (R-PLACE-3).
func (m *metrics) prediction(e *Member, predicted, cached int64) {
	if s := e.series.Load(); s != nil {
		s.predicted.Add(float64(predicted))
		s.cached.Add(float64(cached))
	}
	m.predictionError.Observe(float64(predicted - cached))
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
	m.predictedTokens.DeleteLabelValues(id)
	m.cachedTokens.DeleteLabelValues(id)
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
