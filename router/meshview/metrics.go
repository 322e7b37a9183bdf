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
// happened); f is the fleet as of now, index the prefix index and exact
// the exact index (nil when none), read at scrape time.
func newMetrics(reg prometheus.Registerer, f func() *Fleet, index *prefix.Index, exact *prefix.ExactIndex) *metrics {
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
	reg.MustRegister(m.refusedCredentials, m.placementIgnored, m.fleetIgnored, m.quarantineIgnored, &indexCollector{index: index, exact: exact, f: f})
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

// indexCollector exports narwhal_prefix_index_blocks{engine,index}: the
// blocks each index holds per engine — index="approximate", the block
// hashes of the prefix index (each bounded by
// placement.prefix_index_blocks), and index="exact", the KV blocks the
// exact index holds (R-PLACE-4; bounded by the engine's KV cache, else
// placement.prefix_index_blocks) — for every fleet member and every other
// engine an index still holds blocks for; with the exact index also
// narwhal_prefix_exact_engines (engines whose exact index is exact) and
// narwhal_prefix_exact_blocks_refused (blocks an engine stored while its
// exact index was full, not kept).
type indexCollector struct {
	index *prefix.Index
	exact *prefix.ExactIndex
	f     func() *Fleet
}

var (
	indexBlocksDesc = prometheus.NewDesc("narwhal_prefix_index_blocks",
		"Blocks a prefix index holds per engine: index=approximate the block hashes of the placement index (bounded by placement.prefix_index_blocks), index=exact the KV blocks the engine reported it holds (bounded by its KV cache size, else placement.prefix_index_blocks).", []string{"engine", "index"}, nil)
	exactEnginesDesc = prometheus.NewDesc("narwhal_prefix_exact_engines",
		"Engines whose exact prefix index is exact (their KV events read without a gap since an agent run's first batch or a KVCleared): placed by it under placement.index auto.", nil, nil)
	exactRefusedDesc = prometheus.NewDesc("narwhal_prefix_exact_blocks_refused",
		"KV blocks engines reported stored while their exact index held its bound, not kept (the index then holds less than the engine), since the router started.", nil, nil)
)

func (c *indexCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- indexBlocksDesc
	if c.exact != nil {
		ch <- exactEnginesDesc
		ch <- exactRefusedDesc
	}
}

func (c *indexCollector) Collect(ch chan<- prometheus.Metric) {
	fl := c.f()
	approx := map[string]bool{}
	c.index.Engines(func(id string, n int) {
		approx[id] = true
		ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, float64(n), id, "approximate")
	})
	exact := map[string]bool{}
	if c.exact != nil {
		var refused int64
		c.exact.Engines(func(id string, e *prefix.ExactEngine) {
			exact[id] = true
			refused += e.Refused()
			ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, float64(e.Blocks()), id, "exact")
		})
		ch <- prometheus.MustNewConstMetric(exactEnginesDesc, prometheus.GaugeValue, float64(c.exact.ExactCount()))
		ch <- prometheus.MustNewConstMetric(exactRefusedDesc, prometheus.GaugeValue, float64(refused))
	}
	if fl == nil {
		return
	}
	for _, m := range fl.members {
		if !approx[m.ID] {
			ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, 0, m.ID, "approximate")
		}
		if c.exact != nil && !exact[m.ID] && m.Can(Prefill) {
			ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, 0, m.ID, "exact")
		}
	}
}
