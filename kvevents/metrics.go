package kvevents

import (
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Outcomes of narwhal_agent_kv_events_total (docs/observability.md).
const (
	outApplied        = "applied"
	outUnknownParent  = "unknown_parent"
	outUnknownRemoval = "unknown_removal"
	outOverBound      = "over_bound"
	outRefused        = "refused"
	outSkippedType    = "skipped_type"
	outSkippedGroup   = "skipped_group"
)

// Outcomes of narwhal_agent_kv_messages_total.
const (
	msgApplied      = "applied"
	msgDuplicate    = "duplicate"
	msgRefused      = "refused"
	msgFrames       = "bad_frames"
	msgTopic        = "other_topic"
	msgRankMismatch = "rank_mismatch"
)

// Outcomes of narwhal_agent_kv_gaps_total.
const (
	gapReplayed  = "replayed"
	gapLost      = "lost"
	gapRestarted = "restarted"
)

// Outcomes of narwhal_agent_kv_connections_total.
const (
	connConnected = "connected"
	connEnded     = "ended"
	connRefused   = "refused"
)

// Outcomes of narwhal_agent_kv_checkpoints_total.
const (
	ckPublished   = "published"
	ckSkippedLost = "skipped_lost"
)

// metrics are the agent's KV event series (docs/observability.md, "Agent:
// KV events").
type metrics struct {
	events  *prometheus.CounterVec
	msgs    *prometheus.CounterVec
	batches *prometheus.CounterVec
	gaps    *prometheus.CounterVec
	conns   *prometheus.CounterVec
	blocks  *prometheus.GaugeVec

	checkpoints *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, ranks []int) *metrics {
	m := &metrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_agent_kv_events_total",
			Help: "KV cache events of the engine read by the agent, by data-parallel rank and outcome."}, []string{"rank", "outcome"}),
		msgs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_agent_kv_messages_total",
			Help: "ZeroMQ messages of the engine's KV event publishers read by the agent, by rank and outcome."}, []string{"rank", "outcome"}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_agent_kv_batches_total",
			Help: "KV batches the agent made for the bus, by outcome (published, dropped)."}, []string{"outcome"}),
		gaps: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_agent_kv_gaps_total",
			Help: "Breaks in a publisher's sequence, by rank and outcome (replayed, lost, restarted)."}, []string{"rank", "outcome"}),
		conns: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_agent_kv_connections_total",
			Help: "ZeroMQ connections of the agent's KV event sockets, by rank and outcome (connected, ended, refused)."}, []string{"rank", "outcome"}),
		blocks: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "narwhal_agent_kv_blocks",
			Help: "Engine blocks the agent knows the key of, by rank (bounded by --kv-events-max-blocks)."}, []string{"rank"}),
		checkpoints: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_agent_kv_checkpoints_total",
			Help: "Restatements of a rank's blocks on the bus (--kv-events-checkpoint), by rank and outcome (published, skipped_lost: events lost since the rank's last clear)."}, []string{"rank", "outcome"}),
	}
	if reg != nil {
		reg.MustRegister(m.events, m.msgs, m.batches, m.gaps, m.conns, m.blocks, m.checkpoints)
	}
	for _, o := range []string{"published", "dropped"} {
		m.batches.WithLabelValues(o)
	}
	for _, r := range ranks {
		rank := strconv.Itoa(r)
		for _, o := range []string{outApplied, outUnknownParent, outUnknownRemoval, outOverBound, outRefused, outSkippedType, outSkippedGroup} {
			m.events.WithLabelValues(rank, o)
		}
		for _, o := range []string{msgApplied, msgDuplicate, msgRefused, msgFrames, msgTopic, msgRankMismatch} {
			m.msgs.WithLabelValues(rank, o)
		}
		for _, o := range []string{gapReplayed, gapLost, gapRestarted} {
			m.gaps.WithLabelValues(rank, o)
		}
		for _, o := range []string{connConnected, connEnded, connRefused} {
			m.conns.WithLabelValues(rank, o)
		}
		for _, o := range []string{ckPublished, ckSkippedLost} {
			m.checkpoints.WithLabelValues(rank, o)
		}
		m.blocks.WithLabelValues(rank).Set(0)
	}
	return m
}

// logEvery is the least time between two log lines of one kind about one
// rank: a hostile publisher cannot flood the agent's log.
const logEvery = 10 * time.Second

// rateLog logs at most one line per kind per logEvery, saying how many it
// left out since the last.
type rateLog struct {
	log  *slog.Logger
	mu   sync.Mutex
	last map[string]time.Time
	left map[string]int
}

func newRateLog(log *slog.Logger) *rateLog {
	return &rateLog{log: log, last: map[string]time.Time{}, left: map[string]int{}}
}

func (l *rateLog) warn(kind, msg string, args ...any) {
	l.mu.Lock()
	now := time.Now()
	if t, ok := l.last[kind]; ok && now.Sub(t) < logEvery {
		l.left[kind]++
		l.mu.Unlock()
		return
	}
	n := l.left[kind]
	l.last[kind], l.left[kind] = now, 0
	l.mu.Unlock()
	if n > 0 {
		args = append(args, "left_out", n)
	}
	l.log.Warn(msg, args...)
}
