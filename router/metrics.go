package router

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// metrics are the router's Prometheus series. Their labels share one
// vocabulary with the breaker's: engine (a fleet engine id), phase
// (prefill or decode), model (a model of the fleet, else "other"), kind
// (a fault kind) and router (the router id). Per-engine reservations are
// read from the fleet's atomics at scrape time, so the request path pays
// nothing for them.
type metrics struct {
	requests    requestCounter
	duration    *prometheus.HistogramVec // endpoint, model
	ttft        *prometheus.HistogramVec // model
	firstByte   *prometheus.HistogramVec // model
	interToken  *prometheus.HistogramVec // model
	prompt      *prometheus.CounterVec   // model
	generation  *prometheus.CounterVec   // model
	leg         *prometheus.HistogramVec // phase, model
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
	// kvRecomputed counts decode engines' silent recomputes of a
	// handed-off prompt, by producer and consumer (R-FAIL-8; fleet ids,
	// bounded).
	kvRecomputed *prometheus.CounterVec

	// models holds each model label's series, resolved once per request
	// (modelSeries): the relay observes through them without a lookup.
	modelsMu sync.Mutex
	models   atomic.Pointer[map[string]*modelSeries]
	other    *modelSeries
	// keys are the configured API key names (config.NoKeyName on an open
	// router), for the request counter's initial series.
	keys atomic.Pointer[[]string]
	// engineMu orders the counting of an engine's fault or recompute
	// against the deletion of its series when it leaves the fleet
	// (forgetEngine, behaviour.md R-FLEET-5): a fault counted after it
	// left would create its series again. Faults are off the relay's path.
	engineMu sync.Mutex
}

// otherModel is the model label of a request for a model no engine of the
// fleet has served (or with no model at all): the label's values stay
// bounded by the fleet's models.
const otherModel = "other"

// maxModelLabels bounds the model label's values on one router; models
// beyond it are counted as otherModel.
const maxModelLabels = 512

// maxModelLabelBytes bounds a model label value: an engine listing a
// longer model id (its /v1/models may hold one id of up to a megabyte)
// has that model counted as otherModel, so that the label cannot blow up
// every scrape.
const maxModelLabelBytes = 256

// modelSeries are the per-request series of one model label value,
// resolved once so that the relay's per-chunk observation is one
// Observe, with no label lookup and no allocation.
type modelSeries struct {
	label      string
	ttft       prometheus.Observer
	firstByte  prometheus.Observer
	interToken prometheus.Observer
	prompt     prometheus.Counter
	generation prometheus.Counter
}

// latencyBuckets returns the latency histograms' bucket bounds: 0.5 ms
// doubling up to the request deadline, which is the last bound (600 s by
// default), so no request that ends within it falls beyond the top bucket.
func latencyBuckets(deadline time.Duration) []float64 {
	top := deadline.Seconds()
	if top <= 0.0005 {
		top = 600
	}
	var b []float64
	for v := 0.0005; v < top; v *= 2 {
		b = append(b, v)
	}
	return append(b, top)
}

// engineFaultKinds are the fault kinds narwhal_engine_faults_total counts
// (engines.Fault.EngineFault): its series are created at zero for every
// engine and phase it serves, so alerts see them before the first fault.
var engineFaultKinds = []engines.FaultKind{
	engines.KindConnectError, engines.KindPrefillTimeout, engines.KindPrefillStatus, engines.KindPrefillResponse,
	engines.KindDescriptorRejected, engines.KindHandoffExpired, engines.KindFirstTokenTimeout,
	engines.KindMidStreamSilence, engines.KindClosedBeforeDone, engines.KindDoneBeforeToken,
	engines.KindErrorObject, engines.KindInvalidStream, engines.KindUpstreamStatus,
	engines.KindEngineUnauthorized, engines.KindOverload,
	engines.KindHandoffRefused,
}

// retryDenials are the values of narwhal_retries_denied_total's reason.
var retryDenials = []retryDenial{denyDeadline, denyBudget}

func newMetrics(reg prometheus.Registerer, f func() *fleet, routerID string, deadline time.Duration) *metrics {
	buckets := latencyBuckets(deadline)
	m := &metrics{
		requests: requestCounter{vec: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_requests_total",
			Help: "Client requests that ended, by endpoint, HTTP status code, outcome (ok, or the fault kind that ended them), API key name (\"none\" without a valid key) and model (a model of the fleet, else \"other\").",
		}, []string{"endpoint", "code", "outcome", "key", "model"})},
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "narwhal_request_duration_seconds", Buckets: buckets,
			Help: "Seconds from a request's arrival at the router to the end of its response, by endpoint and model.",
		}, []string{"endpoint", "model"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "narwhal_ttft_seconds", Buckets: buckets,
			Help: "Seconds from a request's arrival at the router until its prefill leg completed (the prefill engine answered with the KV handoff), by model. This is not the time to the first generated token: that is narwhal_first_byte_seconds.",
		}, []string{"model"}),
		firstByte: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "narwhal_first_byte_seconds", Buckets: buckets,
			Help: "Seconds from a request's arrival at the router until the first generated token came from the decode engine, by model: the time to first token (TTFT) as vLLM reports it in vllm:time_to_first_token_seconds.",
		}, []string{"model"}),
		interToken: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "narwhal_inter_token_seconds", Buckets: buckets,
			Help: "Seconds between two generated chunks of a decode stream as the router read them (inter-token latency), by model; chunks the engine sent together are observed near zero.",
		}, []string{"model"}),
		prompt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_prompt_tokens_total",
			Help: "Prompt tokens of completed requests, as the decode engine reported them in its usage, by model.",
		}, []string{"model"}),
		generation: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_generation_tokens_total",
			Help: "Generated tokens of requests, as the decode engine reported them in its usage, by model.",
		}, []string{"model"}),
		leg: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "narwhal_leg_seconds", Buckets: buckets,
			Help: "Seconds each engine leg took, by phase and model: prefill from the request's arrival to the prefill engine's answer, decode from the decode request to the end of its stream.",
		}, []string{"phase", "model"}),
		faults: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_engine_faults_total",
			Help: "Engine faults seen by the router, by engine, phase and kind of fault (docs/failures.md lists the kinds).",
		}, []string{"engine", "phase", "kind"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_retries_total", Help: "Fresh attempts started after a transient fault, before any output reached the client.",
		}),
		retryDenied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "narwhal_retries_denied_total",
			Help: "Retries not started although the fault was transient and attempts were left, by reason: budget (the retry budget, recovery.retry_budget_ratio, was spent) or deadline (too little of the request's deadline was left).",
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
			Name: "narwhal_quarantines_total", Help: "Local quarantines of an engine started by this router after a failed attempt.",
		}),
		relayedChunks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "narwhal_relayed_chunks_total", Help: "Decode stream events (server-sent events) relayed to clients.",
		}),
	}
	m.kvRecomputed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "narwhal_kv_recomputed_total",
		Help: "Requests whose decode engine recomputed the prompt instead of loading the KV its producer handed off (it reported fewer than half of the prompt tokens as cached), by producer and consumer engine.",
	}, []string{"producer", "consumer"})
	info := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "narwhal_router_info",
		Help: "Always 1; its router label is the router id that names this router in bus events (router_id).",
	}, []string{"router"})
	info.WithLabelValues(routerID).Set(1)
	for _, d := range retryDenials {
		m.retryDenied.WithLabelValues(string(d))
	}
	empty := map[string]*modelSeries{}
	m.models.Store(&empty)
	m.other = m.newModelSeries(otherModel)
	reg.MustRegister(m.kvRecomputed, info, m.interToken, m.prompt, m.generation)
	reg.MustRegister(m.requests.vec, m.duration, m.ttft, m.firstByte, m.leg, m.faults, m.retries, m.retryDenied,
		m.disconnects, m.inflight, m.abandoned, m.releaseFailures, m.quarantines, m.relayedChunks, &reservationCollector{f: f})
	return m
}

func (m *metrics) newModelSeries(label string) *modelSeries {
	ms := &modelSeries{
		label:      label,
		ttft:       m.ttft.WithLabelValues(label),
		firstByte:  m.firstByte.WithLabelValues(label),
		interToken: m.interToken.WithLabelValues(label),
		prompt:     m.prompt.WithLabelValues(label),
		generation: m.generation.WithLabelValues(label),
	}
	for _, p := range []string{schemas.PhasePrefill, schemas.PhaseDecode} {
		m.leg.WithLabelValues(p, label)
	}
	for _, e := range []string{schemas.EndpointChat, schemas.EndpointCompletions} {
		m.duration.WithLabelValues(e, label)
		if keys := m.keys.Load(); keys != nil {
			for _, k := range *keys {
				m.requests.vec.WithLabelValues(e, "200", "ok", k, label)
			}
		}
	}
	return ms
}

// series returns model's series, creating them for a model seen for the
// first time: the caller has checked that the fleet serves model (or has
// served it), which bounds the label's values; past maxModelLabels, for
// an empty model or one longer than maxModelLabelBytes, the series of
// otherModel.
func (m *metrics) series(model string) *modelSeries {
	if ms := (*m.models.Load())[model]; ms != nil {
		return ms
	}
	if model == "" || model == otherModel || len(model) > maxModelLabelBytes {
		return m.other
	}
	m.modelsMu.Lock()
	defer m.modelsMu.Unlock()
	cur := *m.models.Load()
	if ms := cur[model]; ms != nil {
		return ms
	}
	if len(cur) >= maxModelLabels {
		return m.other
	}
	next := make(map[string]*modelSeries, len(cur)+1)
	for k, v := range cur {
		next[k] = v
	}
	ms := m.newModelSeries(model)
	next[model] = ms
	m.models.Store(&next)
	return ms
}

// initEngine creates the zero series of engine e's labelled counters:
// its faults for every phase it serves and kind (the mesh view creates
// those of its credential refusals).
func (m *metrics) initEngine(e *member) {
	m.engineMu.Lock()
	defer m.engineMu.Unlock()
	for _, p := range []phase{prefillPhase, decodePhase} {
		if !e.Can(p) {
			continue
		}
		for _, k := range engineFaultKinds {
			m.faults.WithLabelValues(e.ID, p.String(), string(k))
		}
	}
}

// fault counts one fault of engine id (narwhal_engine_faults_total) on
// phase of kind when in reports the engine still in the fleet; one that
// left had its series deleted, and they stay so (R-FLEET-5).
func (m *metrics) fault(in func(id string) bool, id, phase, kind string) {
	m.engineMu.Lock()
	defer m.engineMu.Unlock()
	if in(id) {
		m.faults.WithLabelValues(id, phase, kind).Inc()
	}
}

// recomputed counts one recompute of the KV producer handed off to
// consumer (narwhal_kv_recomputed_total) when in reports both still in
// the fleet (R-FLEET-5).
func (m *metrics) recomputed(in func(id string) bool, producer, consumer string) {
	m.engineMu.Lock()
	defer m.engineMu.Unlock()
	if in(producer) && in(consumer) {
		m.kvRecomputed.WithLabelValues(producer, consumer).Inc()
	}
}

// forgetEngine deletes every series labelled with engine id, which left
// the fleet (behaviour.md R-FLEET-5): its faults, and the recomputes where
// it was the producer or the consumer. narwhal_reservations and
// narwhal_engine_available are read from the fleet at scrape time and go
// with it.
func (m *metrics) forgetEngine(id string) {
	m.engineMu.Lock()
	defer m.engineMu.Unlock()
	m.faults.DeletePartialMatch(prometheus.Labels{"engine": id})
	m.kvRecomputed.DeletePartialMatch(prometheus.Labels{"producer": id})
	m.kvRecomputed.DeletePartialMatch(prometheus.Labels{"consumer": id})
}

// initKeys records the configured API key names and creates the zero
// series of narwhal_requests_total's successes for each key, endpoint and
// known model.
func (m *metrics) initKeys(names []string) {
	m.keys.Store(&names)
	models := *m.models.Load()
	for _, e := range []string{schemas.EndpointChat, schemas.EndpointCompletions} {
		for _, k := range names {
			m.requests.vec.WithLabelValues(e, "200", "ok", k, otherModel)
			for label := range models {
				m.requests.vec.WithLabelValues(e, "200", "ok", k, label)
			}
		}
	}
}

// requestCounter is narwhal_requests_total{endpoint,code,outcome,key,model}.
// The key label holds a configured key's name or config.NoKeyName, so its
// values are bounded by the configured keys (behaviour.md R-API-9); the series of
// a key removed by a reload are deleted. The model label is bounded by the
// fleet's models (metrics.series).
type requestCounter struct{ vec *prometheus.CounterVec }

// inc counts one request.
func (r requestCounter) inc(endpoint, code, outcome, key, model string) {
	r.vec.WithLabelValues(endpoint, code, outcome, key, model).Inc()
}

// reservationCollector exports narwhal_reservations{engine,phase} and
// narwhal_engine_eligible{engine} from the fleet's atomics.
type reservationCollector struct{ f func() *fleet }

var (
	reservationsDesc = prometheus.NewDesc("narwhal_reservations", "Reserved phase slots (legs in flight) of this router, by engine and phase.", []string{"engine", "phase"}, nil)
	eligibleDesc     = prometheus.NewDesc("narwhal_engine_available", "1 when this router may place legs on the engine (eligible, not quarantined, its credentials accepted), else 0, by engine.", []string{"engine"}, nil)
)

func (c *reservationCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- reservationsDesc
	ch <- eligibleDesc
}

func (c *reservationCollector) Collect(ch chan<- prometheus.Metric) {
	now := nowNano()
	for _, m := range c.f().Members() {
		ch <- prometheus.MustNewConstMetric(reservationsDesc, prometheus.GaugeValue, float64(m.Reserved(prefillPhase)), m.ID, "prefill")
		ch <- prometheus.MustNewConstMetric(reservationsDesc, prometheus.GaugeValue, float64(m.Reserved(decodePhase)), m.ID, "decode")
		v := 0.0
		if m.Available(now) {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(eligibleDesc, prometheus.GaugeValue, v, m.ID)
	}
}
