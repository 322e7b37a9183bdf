package router

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the router's Prometheus series. Per-engine reservations are
// read from the fleet's atomics at scrape time, so the request path pays
// nothing for them.
type metrics struct {
	requests    requestCounter
	duration    *prometheus.HistogramVec // endpoint
	ttft        prometheus.Histogram
	firstByte   prometheus.Histogram
	leg         *prometheus.HistogramVec // phase
	faults      *prometheus.CounterVec   // engine, phase, kind
	retries     prometheus.Counter
	retryDenied *prometheus.CounterVec // reason
	disconnects prometheus.Counter
	inflight    prometheus.Gauge
	abandoned   prometheus.Counter
	// releaseFailures counts releases of abandoned handoffs the producer
	// did not confirm (R-OWN-6): the handoff event says released=false,
	// though the producer may have freed the blocks.
	releaseFailures prometheus.Counter
	quarantines     prometheus.Counter
	relayedChunks   prometheus.Counter
	// placementIgnored is narwhal_placement_ignored_total{reason}: values
	// of narwhal_placement the router did not apply (R-BUS-9).
	placementIgnored *prometheus.CounterVec
	// fleetIgnored is narwhal_fleet_ignored_total{reason}: values of
	// narwhal_fleet the router did not apply (R-FLEET-1, R-BUS-9).
	fleetIgnored *prometheus.CounterVec
	// refusedCredentials counts episodes of an engine refusing the
	// router's credentials (engine label: fleet ids, bounded).
	refusedCredentials *prometheus.CounterVec
}

// latencyBuckets span 0.5 ms to ~2 min.
var latencyBuckets = prometheus.ExponentialBuckets(0.0005, 2, 18)

func newMetrics(reg prometheus.Registerer, f func() *fleet) *metrics {
	m := &metrics{
		requests: requestCounter{vec: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_requests_total",
			Help: "Client requests by endpoint, HTTP status, outcome (ok or the fault kind that ended them) and API key name (\"none\" without a valid key).",
		}, []string{"endpoint", "code", "outcome", "key"})},
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "narwhal_request_duration_seconds", Help: "Seconds from arrival to the end of the response.", Buckets: latencyBuckets,
		}, []string{"endpoint"}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "narwhal_ttft_seconds", Help: "Seconds from arrival until the producer HTTP leg completed (ttft_s of the request event).", Buckets: latencyBuckets,
		}),
		firstByte: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "narwhal_first_byte_seconds", Help: "Seconds from arrival until the first generated decode output (first_byte_s of the request event).", Buckets: latencyBuckets,
		}),
		leg: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "narwhal_leg_seconds", Help: "Seconds each engine leg took: prefill to its response, decode to the end of its stream.", Buckets: latencyBuckets,
		}, []string{"phase"}),
		faults: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_engine_faults_total", Help: "Engine faults by engine, phase and kind (docs/failures.md).",
		}, []string{"engine", "phase", "kind"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_retries_total", Help: "Fresh attempts started after a transient fault, before any output reached the client.",
		}),
		retryDenied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_retries_denied_total", Help: "Retries not started although the fault was transient, by reason.",
		}, []string{"reason"}),
		disconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_client_disconnects_total", Help: "Requests whose client went away before the response ended.",
		}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "narwhal_inflight_requests", Help: "Client requests in progress.",
		}),
		abandoned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_handoffs_abandoned_total", Help: "KV handoffs that were not consumed by a decode leg (client gone, decode failed before pulling, retry).",
		}),
		releaseFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_handoff_release_failures_total", Help: "Releases of abandoned KV handoffs that the producer did not confirm (an error, or no answer within 1 s): the producer may or may not have freed the blocks.",
		}),
		quarantines: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_quarantines_total", Help: "Local quarantines started after a failed attempt.",
		}),
		relayedChunks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_relayed_chunks_total", Help: "Decode SSE events relayed to clients.",
		}),
		placementIgnored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_placement_ignored_total",
			Help: "Placement values not applied, by reason: invalid (not a valid placement value), not_leader (not written by the current lease holder), deleted (a deleted key).",
		}, []string{"reason"}),
		fleetIgnored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_fleet_ignored_total",
			Help: "Values of the live fleet's bucket not applied, by reason: invalid (not a valid fleet entry for its key).",
		}, []string{"reason"}),
	}
	m.refusedCredentials = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "narwhal_engine_credentials_refused_total",
		Help: "Times an engine started refusing the router's API key (HTTP 401 or 403); it is not placeable until it accepts it again.",
	}, []string{"engine"})
	reg.MustRegister(m.refusedCredentials)
	reg.MustRegister(m.requests.vec, m.duration, m.ttft, m.firstByte, m.leg, m.faults, m.retries, m.retryDenied,
		m.disconnects, m.inflight, m.abandoned, m.releaseFailures, m.quarantines, m.relayedChunks, m.placementIgnored, m.fleetIgnored, &reservationCollector{f: f})
	return m
}

// requestCounter is narwhal_requests_total{endpoint,code,outcome,key}. The
// key label holds a configured key's name or config.NoKeyName, so its
// values are bounded by the configured keys (SPEC R-API-9); the series of
// a key removed by a reload are deleted.
type requestCounter struct{ vec *prometheus.CounterVec }

// inc counts one request.
func (r requestCounter) inc(endpoint, code, outcome, key string) {
	r.vec.WithLabelValues(endpoint, code, outcome, key).Inc()
}

// reservationCollector exports narwhal_reservations{engine,phase} and
// narwhal_engine_eligible{engine} from the fleet's atomics.
type reservationCollector struct{ f func() *fleet }

var (
	reservationsDesc = prometheus.NewDesc("narwhal_reservations", "Reserved phase slots (in-flight legs) per engine and phase.", []string{"engine", "phase"}, nil)
	eligibleDesc     = prometheus.NewDesc("narwhal_engine_available", "1 when the engine is eligible and not quarantined on this router.", []string{"engine"}, nil)
)

func (c *reservationCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- reservationsDesc
	ch <- eligibleDesc
}

func (c *reservationCollector) Collect(ch chan<- prometheus.Metric) {
	now := nowNano()
	for _, m := range c.f().members {
		ch <- prometheus.MustNewConstMetric(reservationsDesc, prometheus.GaugeValue, float64(m.reserved[prefillPhase].Load()), m.ID, "prefill")
		ch <- prometheus.MustNewConstMetric(reservationsDesc, prometheus.GaugeValue, float64(m.reserved[decodePhase].Load()), m.ID, "decode")
		v := 0.0
		if m.available(now) {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(eligibleDesc, prometheus.GaugeValue, v, m.ID)
	}
}
