// Package config reads Narwhal's settings (behaviour.md §11, §14): scalar settings
// from a YAML file, each overridable by an environment variable
// NARWHAL_<SECTION>_<KEY>, plus the fleet and the optional engine contract
// from the same file.
//
// The order is: Default, then the YAML file, then the environment, then
// Validate. Every error names the key it is about, as its dotted YAML path
// (e.g. "engine.first_token_timeout_s", "fleet[1].url") and, when the value
// came from the environment, the variable's name too.
package config

import (
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// EnvPrefix starts the name of every environment variable that overrides a
// setting: NARWHAL_<SECTION>_<KEY>, e.g. NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S.
const EnvPrefix = "NARWHAL_"

// Log formats, the values of Router.LogFormat.
const (
	LogFormatText = "text"
	LogFormatJSON = "json"
)

// Config is the whole configuration of one Narwhal process.
type Config struct {
	// Engine holds the engine-leg timeouts (behaviour.md §6).
	Engine Engine `yaml:"engine" envPrefix:"ENGINE_"`
	// Request holds the client-request limits (behaviour.md R-TMO-5, R-API-4).
	Request Request `yaml:"request" envPrefix:"REQUEST_"`
	// Handoff holds the KV handoff limits (behaviour.md R-OWN-2).
	Handoff Handoff `yaml:"handoff" envPrefix:"HANDOFF_"`
	// Recovery holds retries, quarantine, ejection and readmission
	// (behaviour.md §7, §8).
	Recovery Recovery `yaml:"recovery" envPrefix:"RECOVERY_"`
	// Breaker holds the breaker service's leader lease (behaviour.md R-BRK-8).
	Breaker Breaker `yaml:"breaker" envPrefix:"BREAKER_"`
	// Membership holds the live fleet's timers: registrations and drains
	// (behaviour.md R-FLEET-3, R-FLEET-4).
	Membership Membership `yaml:"membership" envPrefix:"MEMBERSHIP_"`
	// Placement holds the placement policy and its settings (behaviour.md §9b).
	Placement Placement `yaml:"placement" envPrefix:"PLACEMENT_"`
	// Router holds the router process's identity and logging.
	Router Router `yaml:"router" envPrefix:"ROUTER_"`
	// Server holds the front door: connection deadlines, caps, admission
	// limits (behaviour.md R-API-7, R-API-8, R-TMO-6) and TLS.
	Server Server `yaml:"server" envPrefix:"SERVER_"`
	// Bus says how every process reaches NATS (behaviour.md §9, R-BUS-4,
	// R-BUS-8). Its variables are NARWHAL_NATS_<KEY>, e.g.
	// NARWHAL_NATS_URL.
	Bus Bus `yaml:"bus" envPrefix:"NATS_"`
	// Auth holds client authentication (behaviour.md R-API-9).
	Auth Auth `yaml:"auth" envPrefix:"AUTH_"`
	// EngineContract pins what every engine must be (behaviour.md R-BRK-6,
	// R-PRE-1); nil when the file has no engine_contract (development
	// fleets). It is not read from the environment.
	EngineContract *Contract `yaml:"engine_contract"`
	// Fleet lists the engines. It may be empty here; the commands that need
	// engines say so. It is not read from the environment.
	Fleet []EngineSpec `yaml:"fleet"`

	// fileKeys is how many of Auth.APIKeys came from Auth.APIKeysFile (the
	// last ones), for error messages.
	fileKeys int
}

// TLS reports whether the front end serves HTTPS.
func (s Server) TLS() bool { return s.TLSCertFile != "" }

// Engine holds the timeouts of the engine legs, in seconds (behaviour.md §6).
type Engine struct {
	// FirstTokenTimeoutS bounds the decode leg from before its HTTP request
	// is opened until the first generated output (R-TMO-1), and each leg of
	// a breaker probe (R-BRK-3). Seconds, > 0.
	FirstTokenTimeoutS float64 `yaml:"first_token_timeout_s" env:"FIRST_TOKEN_TIMEOUT_S"`
	// DecodeReadTimeoutS bounds the silence between transport chunks after
	// the first generated output (R-TMO-2); 0 means no per-chunk bound
	// (R-TMO-4). Seconds, >= 0.
	DecodeReadTimeoutS float64 `yaml:"decode_read_timeout_s" env:"DECODE_READ_TIMEOUT_S"`
	// PrefillTimeoutS bounds the whole prefill leg. Seconds, > 0.
	PrefillTimeoutS float64 `yaml:"prefill_timeout_s" env:"PREFILL_TIMEOUT_S"`
	// TLSCAFile is a PEM file of the certificate authorities that sign the
	// certificates of https:// engines; empty means the system's roots.
	TLSCAFile string `yaml:"tls_ca_file" env:"TLS_CA_FILE"`

	rootCAs *x509.CertPool // TLSCAFile's certificates, read by Load
}

// RootCAs returns the certificate authorities of TLSCAFile as Load read
// them, or nil (the system's roots) when it is empty.
func (e Engine) RootCAs() *x509.CertPool { return e.rootCAs }

// FirstTokenTimeout returns FirstTokenTimeoutS as a Duration (R-TMO-1).
func (e Engine) FirstTokenTimeout() time.Duration { return Seconds(e.FirstTokenTimeoutS) }

// DecodeReadTimeout returns DecodeReadTimeoutS as a Duration; 0 means no
// per-chunk bound (R-TMO-2, R-TMO-4).
func (e Engine) DecodeReadTimeout() time.Duration { return Seconds(e.DecodeReadTimeoutS) }

// PrefillTimeout returns PrefillTimeoutS as a Duration.
func (e Engine) PrefillTimeout() time.Duration { return Seconds(e.PrefillTimeoutS) }

// defaultEngine returns the engine section of Default.
func defaultEngine() Engine {
	return Engine{FirstTokenTimeoutS: 30, DecodeReadTimeoutS: 30, PrefillTimeoutS: 60}
}

// validate checks the engine timeouts, all finite: first token and
// prefill > 0, decode read >= 0 (0: no per-chunk bound, R-TMO-4).
// tls_ca_file is checked when Load reads it.
func (e Engine) validate(p problems) {
	p.positive("first_token_timeout_s", e.FirstTokenTimeoutS)
	p.atLeast("decode_read_timeout_s", e.DecodeReadTimeoutS, 0)
	p.positive("prefill_timeout_s", e.PrefillTimeoutS)
}

// Request holds the limits of one client request.
type Request struct {
	// TimeoutS is the original request deadline that bounds both legs and
	// every retry (R-TMO-5). Seconds, > 0.
	TimeoutS float64 `yaml:"timeout_s" env:"TIMEOUT_S"`
	// MaxBodyBytes is the largest client request body accepted; a larger one
	// gets 413 (R-API-4). Bytes, > 0.
	MaxBodyBytes int `yaml:"max_body_bytes" env:"MAX_BODY_BYTES"`
	// MaxN is the largest n (choices per request) accepted; a larger one
	// gets 400 naming n (R-API-8). >= 1.
	MaxN int `yaml:"max_n" env:"MAX_N"`
	// MaxTokensLimit is the largest max_tokens or max_completion_tokens
	// accepted; a larger one gets 400 naming the field (R-API-8). Tokens,
	// >= 1.
	MaxTokensLimit int `yaml:"max_tokens_limit" env:"MAX_TOKENS_LIMIT"`
	// MaxResponseBytes bounds the output a non-streamed request may make
	// the router hold while it aggregates the decode stream (R-LEG-5,
	// R-API-8): texts, tool-call arguments and logprobs entries, as counted
	// by schemas.Aggregator.Bytes. Beyond it the decode leg is cancelled
	// and the client gets 400 (outcome response_too_large); nothing counts
	// against the engine. Streams are not bounded by it. Bytes, > 0.
	MaxResponseBytes int `yaml:"max_response_bytes" env:"MAX_RESPONSE_BYTES"`
}

// Timeout returns TimeoutS as a Duration (R-TMO-5).
func (r Request) Timeout() time.Duration { return Seconds(r.TimeoutS) }

// defaultRequest returns the request section of Default.
func defaultRequest() Request {
	return Request{TimeoutS: 600, MaxBodyBytes: 32 << 20, MaxN: 16, MaxTokensLimit: 1 << 20, MaxResponseBytes: 64 << 20}
}

// validate checks the request limits: a finite timeout > 0, body and
// response bounds > 0, max_n and max_tokens_limit >= 1.
func (r Request) validate(p problems) {
	p.positive("timeout_s", r.TimeoutS)
	p.positiveInt("max_body_bytes", r.MaxBodyBytes)
	p.atLeastInt("max_n", r.MaxN, 1)
	p.atLeastInt("max_tokens_limit", r.MaxTokensLimit, 1)
	p.positiveInt("max_response_bytes", r.MaxResponseBytes)
}

// Handoff holds the limits of a KV handoff.
type Handoff struct {
	// MaxAgeS is the oldest a handoff descriptor may be, counted from the
	// start of the producer HTTP leg, when it is sent to decode (R-OWN-2).
	// Keep it below the producer's own KV release timeout. Seconds, > 0.
	MaxAgeS float64 `yaml:"max_age_s" env:"MAX_AGE_S"`
	// OnRecompute is what a decode engine that recomputed the prompt
	// instead of loading the handed-off KV does to its pair (R-FAIL-8):
	// OnRecomputeCount publishes a kv_recomputed event and
	// counts it in narwhal_kv_recomputed_total; OnRecomputeFailPair also
	// publishes a counted failure of the decode engine (with its
	// producer), towards the pair's ejection streak.
	OnRecompute string `yaml:"on_recompute" env:"ON_RECOMPUTE"`
}

// The values of handoff.on_recompute (R-FAIL-8).
const (
	// OnRecomputeCount: seen, published and counted; never ejects.
	OnRecomputeCount = "count"
	// OnRecomputeFailPair: also a failure that counts towards the pair's
	// ejection streak.
	OnRecomputeFailPair = "fail_pair"
)

// MaxAge returns MaxAgeS as a Duration (R-OWN-2).
func (h Handoff) MaxAge() time.Duration { return Seconds(h.MaxAgeS) }

// defaultHandoff returns the handoff section of Default.
func defaultHandoff() Handoff { return Handoff{MaxAgeS: 120, OnRecompute: OnRecomputeCount} }

// validate checks the handoff limits: a finite max age > 0 and an
// on_recompute of OnRecomputeCount or OnRecomputeFailPair.
func (h Handoff) validate(p problems) {
	p.positive("max_age_s", h.MaxAgeS)
	if v := h.OnRecompute; v != OnRecomputeCount && v != OnRecomputeFailPair {
		p.bad("on_recompute", "must be %s or %s, got %q", OnRecomputeCount, OnRecomputeFailPair, v)
	}
}

// Recovery holds retries, quarantine, ejection and readmission (behaviour.md §7, §8).
type Recovery struct {
	// EjectAfter is how many consecutive failures of one engine eject it
	// (R-BRK-1). >= 1.
	EjectAfter int `yaml:"eject_after" env:"EJECT_AFTER"`
	// FailureQuarantineS is how long an engine that failed an attempt is
	// kept out of placement; 0 turns quarantine off (R-QUAR-1). Seconds,
	// >= 0.
	FailureQuarantineS float64 `yaml:"failure_quarantine_s" env:"FAILURE_QUARANTINE_S"`
	// RetryAttempts is how many extra attempts one request may get
	// (R-RETRY-1, R-RETRY-2). >= 0.
	RetryAttempts int `yaml:"retry_attempts" env:"RETRY_ATTEMPTS"`
	// RetryBudgetRatio is the router-wide share of recent requests that may
	// be retries (R-RETRY-2). In [0, 1].
	RetryBudgetRatio float64 `yaml:"retry_budget_ratio" env:"RETRY_BUDGET_RATIO"`
	// ReadmitIntervalS is the breaker's probe cadence for ejected engines,
	// before backoff (R-BRK-5, R-BRK-7). Seconds, > 0.
	ReadmitIntervalS float64 `yaml:"readmit_interval_s" env:"READMIT_INTERVAL_S"`
	// MaxQuarantineS caps the duration of a quarantine another router
	// announces on the bus: a longer one is applied for this long
	// (R-BUS-9). Seconds, > 0.
	MaxQuarantineS float64 `yaml:"max_quarantine_s" env:"MAX_QUARANTINE_S"`
}

// FailureQuarantine returns FailureQuarantineS as a Duration; 0 means
// quarantine is off (R-QUAR-1).
func (r Recovery) FailureQuarantine() time.Duration { return Seconds(r.FailureQuarantineS) }

// MaxQuarantine returns MaxQuarantineS as a Duration (R-BUS-9).
func (r Recovery) MaxQuarantine() time.Duration { return Seconds(r.MaxQuarantineS) }

// ReadmitInterval returns ReadmitIntervalS as a Duration (R-BRK-5).
func (r Recovery) ReadmitInterval() time.Duration { return Seconds(r.ReadmitIntervalS) }

// defaultRecovery returns the recovery section of Default: one attempt
// per request (R-RETRY-1) and quarantine off (R-QUAR-1).
func defaultRecovery() Recovery {
	return Recovery{EjectAfter: 3, FailureQuarantineS: 0, RetryAttempts: 0, RetryBudgetRatio: 0.2, ReadmitIntervalS: 5, MaxQuarantineS: 300}
}

// validate checks retries, quarantine, ejection and readmission:
// eject_after >= 1, failure_quarantine_s >= 0 (R-QUAR-1), retry_attempts
// >= 0, retry_budget_ratio in [0, 1], readmit and quarantine caps > 0,
// every duration finite.
func (r Recovery) validate(p problems) {
	p.atLeastInt("eject_after", r.EjectAfter, 1)
	p.atLeast("failure_quarantine_s", r.FailureQuarantineS, 0)
	p.atLeastInt("retry_attempts", r.RetryAttempts, 0)
	if v := r.RetryBudgetRatio; !(v >= 0 && v <= 1) {
		p.bad("retry_budget_ratio", "must be between 0 and 1, got %v", v)
	}
	p.positive("readmit_interval_s", r.ReadmitIntervalS)
	p.positive("max_quarantine_s", r.MaxQuarantineS)
}

// Breaker holds the breaker service's settings (behaviour.md §8).
type Breaker struct {
	// LeaseTTLS is how long the active breaker's lease (key "leader" of KV
	// bucket narwhal_breaker) lives without renewal: the leader renews it
	// every third of it, and a standby takes over at most this long after
	// the leader stopped renewing (R-BRK-8). Seconds, >= MinLeaseTTLS.
	LeaseTTLS float64 `yaml:"lease_ttl_s" env:"LEASE_TTL_S"`
}

// LeaseTTL returns LeaseTTLS as a Duration (R-BRK-8).
func (b Breaker) LeaseTTL() time.Duration { return Seconds(b.LeaseTTLS) }

// defaultBreaker returns the breaker section of Default.
func defaultBreaker() Breaker { return Breaker{LeaseTTLS: 5} }

// validate checks the lease: finite and >= MinLeaseTTLS.
func (b Breaker) validate(p problems) { p.atLeast("lease_ttl_s", b.LeaseTTLS, MinLeaseTTLS) }

// Membership holds the timers of the live fleet in KV bucket
// narwhal_fleet (behaviour.md §9a).
type Membership struct {
	// RegistrationTTLS is how long an engine's registration lasts without
	// a heartbeat; a lapsed one leaves placement like a removal
	// (R-FLEET-4). Seconds, > 0.
	RegistrationTTLS float64 `yaml:"registration_ttl_s" env:"REGISTRATION_TTL_S"`
	// DrainTimeoutS is how long a draining engine waits for every router
	// to report no leg in flight on it before the breaker declares it
	// drained anyway (R-FLEET-3). Seconds, > 0.
	DrainTimeoutS float64 `yaml:"drain_timeout_s" env:"DRAIN_TIMEOUT_S"`
	// MaxEngines bounds the live fleet (R-FLEET-5): the leading breaker
	// refuses the registration of a new engine id while narwhal_fleet
	// holds this many engines. > 0.
	MaxEngines int `yaml:"max_engines" env:"MAX_ENGINES"`
	// MaxRegistrationTTLS caps the TTL the leading breaker writes an
	// engine's fleet key with, whatever ttl_s its registration asks
	// (R-FLEET-5): an engine whose heartbeats stop — its credential
	// revoked — leaves the fleet at most this long after its last one.
	// Seconds, > 0.
	MaxRegistrationTTLS float64 `yaml:"max_registration_ttl_s" env:"MAX_REGISTRATION_TTL_S"`
}

// RegistrationTTL returns RegistrationTTLS as a Duration (R-FLEET-4).
func (m Membership) RegistrationTTL() time.Duration { return Seconds(m.RegistrationTTLS) }

// MaxRegistrationTTL returns MaxRegistrationTTLS as a Duration (R-FLEET-5).
func (m Membership) MaxRegistrationTTL() time.Duration { return Seconds(m.MaxRegistrationTTLS) }

// DrainTimeout returns DrainTimeoutS as a Duration (R-FLEET-3).
func (m Membership) DrainTimeout() time.Duration { return Seconds(m.DrainTimeoutS) }

// defaultMembership returns the membership section of Default.
func defaultMembership() Membership {
	return Membership{RegistrationTTLS: 15, DrainTimeoutS: 600, MaxEngines: 1024, MaxRegistrationTTLS: 60}
}

// validate checks the live fleet's timers: finite and > 0.
func (m Membership) validate(p problems) {
	p.positive("registration_ttl_s", m.RegistrationTTLS)
	p.positive("drain_timeout_s", m.DrainTimeoutS)
	p.positiveInt("max_engines", m.MaxEngines)
	p.positive("max_registration_ttl_s", m.MaxRegistrationTTLS)
}

// Placement policies, the values of Placement.Policy (behaviour.md R-PLACE-2).
const (
	// PolicyPrefix scores producers by the prompt's leading blocks
	// recently sent to them against their load.
	PolicyPrefix = "prefix"
	// PolicyLeastLoaded chooses the engine with the fewest attempts in
	// flight.
	PolicyLeastLoaded = "least_loaded"
	// PolicyRandom chooses uniformly among the engines that may be
	// chosen.
	PolicyRandom = "random"
)

// Policies lists the placement policies Validate accepts.
var Policies = []string{PolicyPrefix, PolicyLeastLoaded, PolicyRandom}

// Prefix indexes, the values of Placement.Index (behaviour.md R-PLACE-4).
const (
	// IndexAuto places each engine by its exact index once its KV
	// events made one (docs/placement.md#the-exact-index), by the
	// approximate index, corrected by the engines' cached_tokens, until
	// then.
	IndexAuto = "auto"
	// IndexExact places by the exact index alone: an engine without one
	// is placed as if it held nothing of any prompt.
	IndexExact = "exact"
	// IndexApproximate ignores the engines' KV events: the approximate
	// index alone (R-PLACE-2, R-PLACE-3).
	IndexApproximate = "approximate"
)

// Indexes lists the values of placement.index Validate accepts.
var Indexes = []string{IndexAuto, IndexExact, IndexApproximate}

// MaxTokenizeMinBlocks bounds placement.tokenize_min_blocks: a prompt
// of more KV blocks than the router keys (prefix.MaxBlocks) is still
// tokenized at this bound.
const MaxTokenizeMinBlocks = 4096

// MaxPrefixIndexBlocks is the largest placement.prefix_index_blocks
// (the index's slots are 32-bit; 2^24 blocks are about 640 MiB per
// engine).
const MaxPrefixIndexBlocks = 1 << 24

// Placement holds how the router chooses among the engines that may
// take a leg (behaviour.md §9b). Eligibility, quarantine, drain and slot limits
// decide which engines may (R-PLACE-1); the policy only orders them.
type Placement struct {
	// Policy is "prefix", "least_loaded" or "random"
	// (R-PLACE-2). It orders the producers; with "prefix", the decode of
	// a same-worker (role both) producer stays on it, and a crossed
	// decode goes to the least loaded consumer.
	Policy string `yaml:"policy" env:"POLICY"`
	// BalanceAbsThreshold is the imbalance guard's absolute threshold:
	// the guard chooses by load when the most and the least outstanding
	// attempts among the candidates (the mesh's) differ by more than it
	// (and the relative threshold holds too): the last resort of the
	// cost of behaviour.md R-PLACE-3. Attempts, >= 0.
	BalanceAbsThreshold int `yaml:"balance_abs_threshold" env:"BALANCE_ABS_THRESHOLD"`
	// BalanceRelThreshold is the guard's relative threshold: the most
	// outstanding must be above it times the least. A ratio, >= 1.
	BalanceRelThreshold float64 `yaml:"balance_rel_threshold" env:"BALANCE_REL_THRESHOLD"`
	// PrefixIndexBlocks bounds the prefix index per engine, in blocks of
	// 64 bytes of rendered prompt (the least recent are evicted).
	// 1…MaxPrefixIndexBlocks; 65,536 blocks are 4 MiB of prompt and about
	// 2.5 MiB of router memory per engine.
	PrefixIndexBlocks int `yaml:"prefix_index_blocks" env:"PREFIX_INDEX_BLOCKS"`
	// ShareIndex makes the router's prefix index the mesh's: it publishes
	// the placements it makes on the bus and applies those of the other
	// routers, so N routers place as one (R-PLACE-2; docs/placement.md),
	// and exchanges the work in flight per engine (R-PLACE-3). false:
	// none of it.
	ShareIndex bool `yaml:"share_index" env:"SHARE_INDEX"`
	// EngineMetricsIntervalS is how often the router reads each prefill
	// engine's GET /metrics: its queue (vllm:num_requests_waiting) for the
	// prefix scorer, and its process_start_time_seconds, whose change
	// (a restart: the engine's cache is gone) drops the engine's index
	// entries. Seconds, >= 0; 0 = off.
	EngineMetricsIntervalS float64 `yaml:"engine_metrics_interval_s" env:"ENGINE_METRICS_INTERVAL_S"`
	// Index chooses the prefix index placement matches prompts against
	// (behaviour.md R-PLACE-4): IndexAuto, IndexExact or
	// IndexApproximate (Indexes).
	Index string `yaml:"index" env:"INDEX"`
	// TokenizeTimeoutS bounds the one POST /tokenize a placement may
	// make to get a prompt's token ids for the exact index (R-PLACE-4):
	// past it the request is placed as without them. Seconds, > 0.
	TokenizeTimeoutS float64 `yaml:"tokenize_timeout_s" env:"TOKENIZE_TIMEOUT_S"`
	// TokenizeMinBlocks is the shortest prompt, in KV blocks of the
	// engines' block size (its tokens estimated from its bytes at the
	// model's learned bytes per token), that is tokenized for the exact
	// index; shorter ones are placed by the approximate index.
	// 1…MaxTokenizeMinBlocks.
	TokenizeMinBlocks int `yaml:"tokenize_min_blocks" env:"TOKENIZE_MIN_BLOCKS"`
}

// TokenizeTimeout returns TokenizeTimeoutS as a Duration (R-PLACE-4).
func (p Placement) TokenizeTimeout() time.Duration { return Seconds(p.TokenizeTimeoutS) }

// EngineMetricsInterval returns EngineMetricsIntervalS as a Duration (0:
// the engines' /metrics are not read).
func (p Placement) EngineMetricsInterval() time.Duration { return Seconds(p.EngineMetricsIntervalS) }

// defaultPlacement returns the placement section of Default.
func defaultPlacement() Placement {
	return Placement{Policy: PolicyPrefix, BalanceAbsThreshold: 32, BalanceRelThreshold: 1.5, PrefixIndexBlocks: 65536, ShareIndex: true, EngineMetricsIntervalS: 2,
		Index: IndexAuto, TokenizeTimeoutS: 0.05, TokenizeMinBlocks: DefaultTokenizeMinBlocks}
}

// validate checks the placement settings: a policy of Policies,
// balance_abs_threshold >= 0, a finite balance_rel_threshold >= 1, a
// finite engine_metrics_interval_s >= 0, prefix_index_blocks in
// [1, MaxPrefixIndexBlocks], an index of Indexes, a finite
// tokenize_timeout_s > 0 and tokenize_min_blocks in
// [1, MaxTokenizeMinBlocks].
func (pl Placement) validate(p problems) {
	p.oneOf("policy", pl.Policy, Policies)
	p.atLeastInt("balance_abs_threshold", pl.BalanceAbsThreshold, 0)
	p.atLeast("balance_rel_threshold", pl.BalanceRelThreshold, 1)
	p.atLeast("engine_metrics_interval_s", pl.EngineMetricsIntervalS, 0)
	p.betweenInt("prefix_index_blocks", pl.PrefixIndexBlocks, 1, MaxPrefixIndexBlocks)
	p.oneOf("index", pl.Index, Indexes)
	p.positive("tokenize_timeout_s", pl.TokenizeTimeoutS)
	p.betweenInt("tokenize_min_blocks", pl.TokenizeMinBlocks, 1, MaxTokenizeMinBlocks)
}

// DefaultTokenizeMinBlocks is placement.tokenize_min_blocks' default:
// 8 KV blocks, 128 tokens at vLLM's default block of 16
// (docs/placement.md#tokenization says how it was chosen).
const DefaultTokenizeMinBlocks = 8

// MinLeaseTTLS is the smallest breaker.lease_ttl_s Validate accepts, in
// seconds: the lease is renewed every third of it.
const MinLeaseTTLS = 0.5

// Server holds the front door's deadlines, caps and admission limits
// (behaviour.md R-API-7, R-API-8, R-TMO-6). docs/security.md says what each one
// defends against.
type Server struct {
	// StallTimeoutS is how long a client may accept no bytes of its
	// response before the request ends as client_stalled: the connection is
	// closed, the legs cancelled, every reservation released, nothing
	// counted against an engine (R-TMO-6). A whole non-streamed response
	// must be accepted within it too. Seconds, > 0.
	StallTimeoutS float64 `yaml:"stall_timeout_s" env:"STALL_TIMEOUT_S"`
	// HeaderTimeoutS bounds the reading of one request: its first byte must
	// arrive within it of the accept, and its headers and body within it of
	// that first byte; the connection is closed otherwise (R-API-7).
	// Seconds, > 0.
	HeaderTimeoutS float64 `yaml:"header_timeout_s" env:"HEADER_TIMEOUT_S"`
	// IdleTimeoutS is how long a kept-alive connection may wait for its
	// next request before it is closed (R-API-7). Seconds, > 0.
	IdleTimeoutS float64 `yaml:"idle_timeout_s" env:"IDLE_TIMEOUT_S"`
	// MaxHeaderBytes is the largest request line plus headers accepted;
	// larger ones get 431 (R-API-7). It is also the size of the read buffer
	// a connection holds while it reads headers. Bytes, MinHeaderBytes to
	// MaxHeaderBytes.
	MaxHeaderBytes int `yaml:"max_header_bytes" env:"MAX_HEADER_BYTES"`
	// MaxConnections is how many client connections are served at once;
	// more are answered 503 and closed at once (R-API-7). 0 (the default)
	// derives it from the process's descriptor limit at start
	// (Server.ConnectionLimit, behaviour.md R-FAIL-9); a value set must be
	// >= 1 and leave descriptors for the engine legs, or the router
	// refuses to start.
	MaxConnections int `yaml:"max_connections" env:"MAX_CONNECTIONS"`
	// MaxInflight is how many completion requests may run at once; beyond
	// it a request gets 503 with Retry-After without touching an engine
	// (R-API-8). >= 0; 0 means no limit.
	MaxInflight int `yaml:"max_inflight" env:"MAX_INFLIGHT"`
	// MaxBodyBytesInflight bounds the request bodies held at once, from the
	// moment their headers announce them until their requests end; a body
	// that does not fit gets 503 with Retry-After before it is read
	// (R-API-8). Bytes, >= request.max_body_bytes.
	MaxBodyBytesInflight int `yaml:"max_body_bytes_inflight" env:"MAX_BODY_BYTES_INFLIGHT"`
	// TLSCertFile and TLSKeyFile, both set, make the front end serve
	// HTTPS with this PEM certificate chain and private key. The pair is
	// read again when either file changes (checked at most once a second,
	// on a new connection) and on SIGHUP; a pair that does not load keeps
	// the previous one. Both empty: plain HTTP.
	TLSCertFile string `yaml:"tls_cert_file" env:"TLS_CERT_FILE"`
	TLSKeyFile  string `yaml:"tls_key_file" env:"TLS_KEY_FILE"`
	// MetricsOnAdmin moves GET /metrics from the client-facing listener to
	// the admin listener (narwhal router --admin), which it then requires.
	MetricsOnAdmin bool `yaml:"metrics_on_admin" env:"METRICS_ON_ADMIN"`
}

// StallTimeout returns StallTimeoutS as a Duration (R-TMO-6).
func (s Server) StallTimeout() time.Duration { return Seconds(s.StallTimeoutS) }

// HeaderTimeout returns HeaderTimeoutS as a Duration (R-API-7).
func (s Server) HeaderTimeout() time.Duration { return Seconds(s.HeaderTimeoutS) }

// IdleTimeout returns IdleTimeoutS as a Duration (R-API-7).
func (s Server) IdleTimeout() time.Duration { return Seconds(s.IdleTimeoutS) }

// Bounds of server.max_header_bytes: below 4 KiB ordinary clients fail,
// above 16 MiB a single connection could pin that much memory.
const (
	MinHeaderBytes = 4 << 10
	MaxHeaderBytes = 16 << 20
)

// defaultServer returns the server section of Default.
func defaultServer() Server {
	return Server{StallTimeoutS: 30, HeaderTimeoutS: 10, IdleTimeoutS: 90, MaxHeaderBytes: 64 << 10,
		MaxConnections: 0, MaxInflight: 0, MaxBodyBytesInflight: 1 << 30}
}

// validateLimits checks the front door's deadlines and caps: finite
// timeouts > 0, max_header_bytes in [MinHeaderBytes, MaxHeaderBytes],
// max_connections >= 0 (0: derived at start), max_inflight >= 0 and max_body_bytes_inflight at
// least maxBodyBytes (request.max_body_bytes), or the largest body allowed
// could never be read.
func (s Server) validateLimits(p problems, maxBodyBytes int) {
	p.positive("stall_timeout_s", s.StallTimeoutS)
	p.positive("header_timeout_s", s.HeaderTimeoutS)
	p.positive("idle_timeout_s", s.IdleTimeoutS)
	p.betweenInt("max_header_bytes", s.MaxHeaderBytes, MinHeaderBytes, MaxHeaderBytes)
	if s.MaxConnections < 0 {
		p.bad("max_connections", "must be >= 1, or 0 to derive it from the descriptor limit, got %d", s.MaxConnections)
	}
	if s.MaxInflight < 0 {
		p.bad("max_inflight", "must be >= 0 (0 = no limit), got %d", s.MaxInflight)
	}
	if v := s.MaxBodyBytesInflight; v < maxBodyBytes {
		p.bad("max_body_bytes_inflight", "must be >= request.max_body_bytes (%d), or the largest body allowed could never be read, got %d", maxBodyBytes, v)
	}
}

// The descriptor arithmetic of server.max_connections (behaviour.md
// R-API-7, R-FAIL-9; docs/configuration.md): every client connection may
// hold, besides its own descriptor, one prefill and one decode connection
// to an engine while its request runs (sequential legs keep the prefill
// connection pooled, the sglang connector runs both at once), and the
// router keeps a fixed room for everything else.
const (
	// DescriptorRoom is the descriptors kept for what is not a client
	// connection or an engine leg: standard streams, the Go runtime's
	// poller, the client and admin listeners, the bus connection, the
	// files the router reads (keys, TLS pairs, watches) and the engines'
	// model listings, load scrapes and handoff releases.
	DescriptorRoom = 64
	// DescriptorsPerConnection is what one client connection may hold:
	// itself, its prefill leg and its decode leg. Reserving per
	// connection rather than per engine keeps the room right when engines
	// join at run time.
	DescriptorsPerConnection = 3
	// DefaultMaxConnections caps the derived server.max_connections.
	DefaultMaxConnections = 10000
)

// ConnectionLimit returns the number of client connections served at once
// under a descriptor limit of nofile (the soft RLIMIT_NOFILE read at
// start; 0 means unknown): MaxConnections when it is set and at most
// (nofile − DescriptorRoom) / DescriptorsPerConnection; when it is 0,
// that quotient capped at DefaultMaxConnections (DefaultMaxConnections
// when the limit is unknown), and derived reports which. The error, for a set value that leaves no descriptors for the
// engine legs or a limit that leaves room for no client connection at
// all, gives the arithmetic (behaviour.md R-FAIL-9).
func (s Server) ConnectionLimit(nofile uint64) (n int, derived bool, err error) {
	fit := DefaultMaxConnections
	if nofile > 0 {
		left := uint64(0)
		if nofile > DescriptorRoom {
			left = nofile - DescriptorRoom
		}
		room := left / DescriptorsPerConnection
		if uint64(max(s.MaxConnections, 0)) > room || room < 1 {
			what := fmt.Sprintf("server.max_connections %d leaves no descriptors for engine legs", s.MaxConnections)
			if s.MaxConnections == 0 {
				what = fmt.Sprintf("the descriptor limit %d leaves room for no client connection", nofile)
			}
			return 0, false, fmt.Errorf("config: %s: limit %d − room %d (listeners, bus, files, engine control connections) = %d, "+
				"%d per client connection (itself, its prefill leg, its decode leg): at most %d; "+
				"raise the limit (ulimit -n, LimitNOFILE=) or lower server.max_connections",
				what, nofile, DescriptorRoom, left, DescriptorsPerConnection, room)
		}
		fit = int(min(room, uint64(DefaultMaxConnections)))
	}
	if s.MaxConnections > 0 {
		return s.MaxConnections, false, nil
	}
	return fit, true, nil
}

// validateTLS checks that tls_cert_file and tls_key_file are both set or
// both empty, naming the one missing.
func (s Server) validateTLS(p problems) {
	if (s.TLSCertFile == "") != (s.TLSKeyFile == "") {
		if s.TLSCertFile == "" {
			p.bad("tls_cert_file", "must be set when server.tls_key_file is")
		} else {
			p.bad("tls_key_file", "must be set when server.tls_cert_file is")
		}
	}
}

// Router holds the router process's identity and logging.
type Router struct {
	// ID names the router in events (router_id) and in its bus subjects
	// (R-BUS-1, R-BUS-3) and its key in narwhal_routers (R-FLEET-3).
	// Letters, digits, '-' and '_' only. By default it is the host's
	// name (defaultRouterID), so that it stays the same across restarts;
	// routers sharing a host must each set their own.
	ID string `yaml:"id" env:"ID"`
	// EventBuffer is how many bus events may wait to be published before
	// new ones are dropped and counted (R-BUS-6). > 0.
	EventBuffer int `yaml:"event_buffer" env:"EVENT_BUFFER"`
	// LogFormat is LogFormatText or LogFormatJSON.
	LogFormat string `yaml:"log_format" env:"LOG_FORMAT"`
	// LogLevel is "debug", "info", "warn" or "error".
	LogLevel string `yaml:"log_level" env:"LOG_LEVEL"`
}

// Bus says how a process reaches NATS (behaviour.md §9, R-BUS-4, R-BUS-8). It is
// read once, with the rest of the configuration, and handed to whatever
// connects. The environment variables are NARWHAL_NATS_URL,
// NARWHAL_NATS_CREDS, NARWHAL_NATS_TLS_CA, NARWHAL_NATS_TLS_CERT,
// NARWHAL_NATS_TLS_KEY, NARWHAL_NATS_REPLICAS and
// NARWHAL_NATS_CONNECT_TIMEOUT_S.
type Bus struct {
	// URL is the NATS server URL, or several separated by commas
	// ("nats://h1:4222,nats://h2:4222"). Empty: a router starts its own
	// embedded server; tools (`narwhal events`, `narwhal chaos`) use
	// nats://127.0.0.1:4222, the default of `narwhal bus`.
	URL string `yaml:"url" env:"URL"`
	// Creds is a NATS credentials file (a user JWT and its seed), the
	// credential of the process's role (router, breaker, chaos, viewer,
	// admin; R-BUS-8). Empty: no credential.
	Creds string `yaml:"creds" env:"CREDS"`
	// TokenFile is a file holding the pod's projected service-account
	// token (audience narwhal), which a router, an agent or `narwhal sim
	// --register` presents instead of a credential: the bus's auth
	// callout, `narwhal bus authd`, answers with a short-lived user of
	// the identity the token names, the pod name (R-BUS-11). The file is
	// read again at every reconnect. Empty: none. A connection refuses
	// it together with Creds.
	TokenFile string `yaml:"token_file" env:"TOKEN_FILE"`
	// TLSCA is a PEM file of CAs to trust for the server's certificate;
	// empty: the system's roots.
	TLSCA string `yaml:"tls_ca" env:"TLS_CA"`
	// TLSCert and TLSKey are the client certificate and key (PEM files)
	// for mutual TLS; both or neither.
	TLSCert string `yaml:"tls_cert" env:"TLS_CERT"`
	TLSKey  string `yaml:"tls_key" env:"TLS_KEY"`
	// Replicas is the replica count of the stream and of every bucket
	// when they are created (by `narwhal bus`, `narwhal bus setup` or an
	// embedded server); an existing stream or bucket keeps its own
	// (R-BUS-8). 1…MaxReplicas.
	Replicas int `yaml:"replicas" env:"REPLICAS"`
	// ConnectTimeoutS is how long a router, breaker or chaos proxy waits
	// at start for the bus — reachable, and set up by `narwhal bus setup`
	// — before it exits with an error, in seconds; 0
	// keeps trying for ever, logging what it waits for every
	// few seconds.
	ConnectTimeoutS float64 `yaml:"connect_timeout_s" env:"CONNECT_TIMEOUT_S"`
}

// ConnectTimeout returns ConnectTimeoutS as a Duration; 0 means no limit.
func (b Bus) ConnectTimeout() time.Duration { return Seconds(b.ConnectTimeoutS) }

// MaxReplicas is the largest bus.replicas Validate accepts: NATS keeps at
// most five replicas of a stream.
const MaxReplicas = 5

// defaultBus returns the bus section of Default.
func defaultBus() Bus { return Bus{Replicas: 1} }

// validate checks replicas in [1, MaxReplicas], a finite
// connect_timeout_s >= 0, and tls_cert and tls_key both set or both empty.
func (b Bus) validate(p problems) {
	p.betweenInt("replicas", b.Replicas, 1, MaxReplicas)
	p.atLeast("connect_timeout_s", b.ConnectTimeoutS, 0)
	if (b.TLSCert == "") != (b.TLSKey == "") {
		p.bad("tls_cert", "bus.tls_cert and bus.tls_key go together (a client certificate and its key), got only one")
	}
}

// Level returns LogLevel as a slog.Level; an invalid level (which Validate
// rejects) gives slog.LevelInfo.
func (r Router) Level() slog.Level {
	var l slog.Level
	if err := l.UnmarshalText([]byte(r.LogLevel)); err != nil {
		return slog.LevelInfo
	}
	return l
}

// logLevels are the values Router.LogLevel may take.
var logLevels = []string{"debug", "info", "warn", "error"}

// defaultRouter returns the router section of Default, its id the
// host's name (defaultRouterID).
func defaultRouter() Router {
	return Router{ID: defaultRouterID(), EventBuffer: 4096, LogFormat: LogFormatText, LogLevel: "info"}
}

// validate checks a valid id (ValidID), an event buffer > 0, and a log
// format and level of their sets.
func (r Router) validate(p problems) {
	p.id("id", r.ID)
	p.positiveInt("event_buffer", r.EventBuffer)
	if r.LogFormat != LogFormatText && r.LogFormat != LogFormatJSON {
		p.bad("log_format", "must be %q or %q, got %q", LogFormatText, LogFormatJSON, r.LogFormat)
	}
	p.oneOf("log_level", r.LogLevel, logLevels)
}

// Contract is the pinned engine contract (behaviour.md R-BRK-6, R-PRE-1): what every
// engine must still be when it is readmitted or checked by preflight. An
// empty field pins nothing.
type Contract struct {
	// Model is the served model name every engine must list in /v1/models.
	Model string `yaml:"model"`
	// Engine is the engine kind, e.g. "vllm", "sglang".
	Engine string `yaml:"engine"`
	// Version is a constraint on the engine's version, e.g. ">=0.10" or
	// ">=0.10,<0.12" (see VersionSatisfies).
	Version string `yaml:"version"`
	// Connector is the KV connector every engine must use; one of
	// connector.Names().
	Connector string `yaml:"connector"`
}

// validate checks that the version constraint, when set, parses (see
// VersionSatisfies) and the connector, when set, is registered in
// engines/connector.
func (ec Contract) validate(p problems) {
	if ec.Version != "" {
		if _, err := parseConstraint(ec.Version); err != nil {
			p.bad("version", "%v", err)
		}
	}
	if ec.Connector != "" {
		p.oneOf("connector", ec.Connector, connector.Names())
	}
}

// EngineSpec is one engine of the fleet (behaviour.md §0, §14).
type EngineSpec struct {
	// ID is the fleet-unique engine_id: it ends the engine's bus subjects
	// and is its key in the placement bucket (R-BUS-1, R-BUS-2), so it
	// holds letters, digits, '-' and '_' only.
	ID string `yaml:"id"`
	// URL is the engine's absolute http(s) base URL, e.g.
	// "http://10.0.0.11:8000".
	URL string `yaml:"url"`
	// Role is connector.RolePrefill, RoleDecode or RoleBoth.
	Role connector.Role `yaml:"role"`
	// Connector is the engine's KV connector; Load and Parse set
	// connector.DefaultName when the file names none (setDefaults).
	Connector string `yaml:"connector"`
	// BootstrapPort is the port of a prefill SGLang engine's bootstrap
	// server (SGLang's --disaggregation-bootstrap-port, 8998 by default
	// there), required on prefill engines of connector sglang and refused
	// on every other engine (behaviour.md R-DESC-7); 0 when absent.
	BootstrapPort int `yaml:"bootstrap_port"`
	// PrefillSlots and DecodeSlots are how many prefill / decode phases may
	// run on the engine at once; 0 means no limit (R-OWN-3).
	PrefillSlots int `yaml:"prefill_slots"`
	DecodeSlots  int `yaml:"decode_slots"`
	// APIKeyEnv, when set, names the environment variable that holds the
	// engine's API key (vLLM's --api-key): every request to the engine —
	// both legs, releases, /v1/models, health checks and probes — carries
	// "Authorization: Bearer <key>". Load fails when the variable is unset
	// or empty.
	APIKeyEnv string `yaml:"api_key_env"`
	// APIKey is the value of APIKeyEnv, read by Load; never in the YAML
	// file, and redacted whenever printed or encoded.
	APIKey Secret `yaml:"-"`
}

// FleetEntry returns the spec as a value of KV bucket narwhal_fleet
// (behaviour.md R-FLEET-1) in state active, seeded from the config (source
// "config"), written by by at now (UTC). The API key stays out: only
// APIKeyEnv, the variable's name, goes on the bus.
func (s EngineSpec) FleetEntry(by string, now time.Time) schemas.FleetEntry {
	now = now.UTC()
	return schemas.FleetEntry{
		Schema: schemas.SchemaFleetEntry, EngineID: s.ID, URL: s.URL, Role: string(s.Role), Connector: s.Connector,
		BootstrapPort: s.BootstrapPort, PrefillSlots: s.PrefillSlots, DecodeSlots: s.DecodeSlots, APIKeyEnv: s.APIKeyEnv,
		State: schemas.FleetActive, Since: now, At: now, Source: schemas.SourceConfig, By: by,
		Reason: "seeded from the configuration's fleet",
	}
}

// Validate checks one engine's settings, the only place they are checked
// (Config.Validate runs it on every fleet entry): an id of letters,
// digits, '-' and '_' (it ends bus subjects, behaviour.md R-BUS-1), an
// absolute http or https URL, a valid connector.Role, a connector
// registered in engines/connector (so Connector must be set: Load sets
// connector.DefaultName on entries without one), connector settings that
// fit together (an sglang engine is prefill or decode, a prefill sglang
// engine names its bootstrap port 1…65535, no other engine has one:
// behaviour.md R-DESC-7) and slots >= 0 (R-OWN-3). It returns nil or an
// error joining (errors.Join) one *KeyError per problem, in that order,
// each with Key the field's YAML key in a fleet entry ("id", "url",
// "role", "connector", "bootstrap_port", "prefill_slots" or
// "decode_slots") and the Problem Config.Validate reports for
// fleet[<i>].<field>; KeyErrors lists them. Whether ids are unique and
// connectors pair up is a matter of the whole fleet, for Config.Validate.
func (s EngineSpec) Validate() error {
	p := newProblems()
	s.validate(p, nil, 0)
	return p.err()
}

// validate reports s's problems into p (see Validate). seen, when not nil,
// maps the ids of the fleet entries before s to their index: a duplicate
// id is reported after the id's own check, and s's id is added as entry i.
func (s EngineSpec) validate(p problems, seen map[string]int, i int) {
	switch {
	case !p.id("id", s.ID): // reported; no duplicate check
	case seen != nil:
		if j, dup := seen[s.ID]; dup {
			p.bad("id", "duplicate id %q (also fleet[%d])", s.ID, j)
		} else {
			seen[s.ID] = i
		}
	}
	if u, err := url.Parse(s.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		p.bad("url", "must be an absolute http or https URL, got %q", s.URL)
	}
	if !s.Role.Valid() {
		p.bad("role", "must be %q, %q or %q, got %q", connector.RolePrefill, connector.RoleDecode, connector.RoleBoth, s.Role)
	}
	if p.oneOf("connector", s.Connector, connector.Names()) && s.Role.Valid() {
		if field, problem := connector.CheckEngine(s.Connector, s.Role, s.BootstrapPort); field != "" {
			p.bad(field, "%s", problem)
		}
	}
	p.atLeastInt("prefill_slots", s.PrefillSlots, 0)
	p.atLeastInt("decode_slots", s.DecodeSlots, 0)
}

// setDefaults gives s what a fleet entry that leaves it out gets: the
// connector connector.DefaultName.
func (s *EngineSpec) setDefaults() {
	if s.Connector == "" {
		s.Connector = connector.DefaultName
	}
}

// KeyErrors returns the *KeyError values joined in err (as Validate and
// EngineSpec.Validate return them), in order; nil for a nil err. An error
// that is not a *KeyError is left out.
func KeyErrors(err error) []*KeyError {
	if err == nil {
		return nil
	}
	var out []*KeyError
	for _, e := range unjoin(err) {
		var ke *KeyError
		if errors.As(e, &ke) {
			out = append(out, ke)
		}
	}
	return out
}

// problems collects the invalid settings one validation finds, each a
// *KeyError whose Key is prefix followed by the key the check names.
type problems struct {
	prefix string
	errs   *[]error
}

func newProblems() problems { return problems{errs: new([]error)} }

// in returns a collector into the same list for the keys under section
// ("engine", "fleet[2]").
func (p problems) in(section string) problems {
	return problems{prefix: p.prefix + section + ".", errs: p.errs}
}

// bad reports key (under p's prefix) as invalid, the problem formatted
// from format and args.
func (p problems) bad(key, format string, args ...any) {
	*p.errs = append(*p.errs, &KeyError{Key: p.prefix + key, Problem: fmt.Sprintf(format, args...)})
}

// err returns the problems joined (errors.Join), nil when there are none.
func (p problems) err() error { return errors.Join(*p.errs...) }

// positive reports v unless it is finite and > 0.
func (p problems) positive(key string, v float64) {
	if !finite(v) {
		p.bad(key, "must be a finite number, got %v", v)
	} else if v <= 0 {
		p.bad(key, "must be > 0, got %v", v)
	}
}

// atLeast reports v unless it is finite and >= min.
func (p problems) atLeast(key string, v, min float64) {
	if !finite(v) {
		p.bad(key, "must be a finite number, got %v", v)
	} else if v < min {
		p.bad(key, "must be >= %v, got %v", min, v)
	}
}

// positiveInt reports v unless it is > 0.
func (p problems) positiveInt(key string, v int) {
	if v <= 0 {
		p.bad(key, "must be > 0, got %d", v)
	}
}

// atLeastInt reports v unless it is >= min.
func (p problems) atLeastInt(key string, v, min int) {
	if v < min {
		p.bad(key, "must be >= %d, got %d", min, v)
	}
}

// betweenInt reports v unless it is in [lo, hi].
func (p problems) betweenInt(key string, v, lo, hi int) {
	if v < lo || v > hi {
		p.bad(key, "must be between %d and %d, got %d", lo, hi, v)
	}
}

// oneOf reports v unless it is one of values, and says whether it is.
func (p problems) oneOf(key, v string, values []string) bool {
	if slices.Contains(values, v) {
		return true
	}
	p.bad(key, "must be one of %s, got %q", strings.Join(values, ", "), v)
	return false
}

// id reports v unless it is a valid id (ValidID), and says whether it is.
func (p problems) id(key, v string) bool {
	if validID(v) {
		return true
	}
	p.bad(key, "must be non-empty and hold only letters, digits, '-' and '_', got %q", v)
	return false
}

// EngineSpecFromFleetEntry returns the engine a value of KV bucket
// narwhal_fleet (behaviour.md R-FLEET-1) describes, the inverse of
// FleetEntry: id, URL, role, connector, bootstrap port, slots and the API
// key variable's name. APIKey stays empty (the entry holds no key); the
// spec is not validated (Validate does that).
func EngineSpecFromFleetEntry(e schemas.FleetEntry) EngineSpec {
	return EngineSpec{
		ID: e.EngineID, URL: e.URL, Role: connector.Role(e.Role), Connector: e.Connector,
		BootstrapPort: e.BootstrapPort, PrefillSlots: e.PrefillSlots, DecodeSlots: e.DecodeSlots, APIKeyEnv: e.APIKeyEnv,
	}
}

// CanPrefill reports whether the engine's role permits the prefill leg.
func (s EngineSpec) CanPrefill() bool { return s.Role.CanPrefill() }

// CanDecode reports whether the engine's role permits the decode leg.
func (s EngineSpec) CanDecode() bool { return s.Role.CanDecode() }

// Default returns the defaults of behaviour.md §11: each section's own,
// kept beside the section's type (defaultEngine, defaultRequest, …), so
// that every default is written once; docs/configuration.md lists them
// (a test holds the two equal). The client API keys, the fleet and the
// engine contract are empty.
func Default() Config {
	return Config{
		Engine:     defaultEngine(),
		Request:    defaultRequest(),
		Handoff:    defaultHandoff(),
		Recovery:   defaultRecovery(),
		Breaker:    defaultBreaker(),
		Membership: defaultMembership(),
		Placement:  defaultPlacement(),
		Router:     defaultRouter(),
		Server:     defaultServer(),
		Bus:        defaultBus(),
	}
}

// defaultRouterID returns the host name, made safe as a subject token
// ("router" when the host has none): the same after every restart, so that
// a dashboard can follow a router by its id.
func defaultRouterID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "router"
	}
	return SanitizeID(host)
}

// SanitizeID returns s with every character other than ASCII letters,
// digits, '-' and '_' replaced by '-', so that it is a valid router or
// engine id (a single NATS subject token and a KV key). An empty s stays
// empty.
func SanitizeID(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !idByte(c) {
			b[i] = '-'
		}
	}
	return string(b)
}

func idByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

// ValidID reports whether s may be an engine or router id: non-empty,
// letters, digits, '-' and '_' only (one subject token, R-BUS-1).
func ValidID(s string) bool { return validID(s) }

func validID(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !idByte(s[i]) {
			return false
		}
	}
	return true
}

// Seconds converts a number of seconds (a `_s` setting) to a Duration,
// rounded to the nearest nanosecond. Values beyond the Duration range
// saturate; NaN gives 0.
func Seconds(s float64) time.Duration {
	ns := s * float64(time.Second)
	switch {
	case math.IsNaN(ns):
		return 0
	case ns >= math.MaxInt64:
		return math.MaxInt64
	case ns <= math.MinInt64:
		return math.MinInt64
	}
	return time.Duration(math.Round(ns))
}

// KeyError is one invalid setting. Its message is
// "config: <key>: <problem>", or "config: <env> (<key>): <problem>" when the
// value came from the environment variable Env.
type KeyError struct {
	// Key is the dotted YAML path, e.g. "engine.first_token_timeout_s" or
	// "fleet[1].url".
	Key string
	// Env is the environment variable that supplied the value, or "".
	Env string
	// Problem says what is wrong, e.g. "must be > 0, got -1".
	Problem string
}

// Error returns "config: <key>: <problem>" or
// "config: <env> (<key>): <problem>".
func (e *KeyError) Error() string {
	if e.Env != "" {
		return "config: " + e.Env + " (" + e.Key + "): " + e.Problem
	}
	return "config: " + e.Key + ": " + e.Problem
}

// Validate checks every setting and returns nil or an error joining one
// *KeyError per invalid key (errors.Join; each line names its key): each
// section's rules, kept beside the section's type (its validate method),
// then every fleet entry's (EngineSpec.Validate), unique fleet ids and
// connectors that pair up (checkConnectorPairs). An empty fleet is valid.
func (c *Config) Validate() error {
	p := newProblems()
	// The sections in the order of their messages.
	c.Engine.validate(p.in("engine"))
	c.Request.validate(p.in("request"))
	c.Server.validateLimits(p.in("server"), c.Request.MaxBodyBytes)
	c.Handoff.validate(p.in("handoff"))
	c.Recovery.validate(p.in("recovery"))
	c.Membership.validate(p.in("membership"))
	c.Placement.validate(p.in("placement"))
	c.Breaker.validate(p.in("breaker"))
	c.Router.validate(p.in("router"))
	c.Bus.validate(p.in("bus"))
	c.Server.validateTLS(p.in("server"))
	c.Auth.validate(p, c.fileKeys)
	if c.EngineContract != nil {
		c.EngineContract.validate(p.in("engine_contract"))
	}
	seen := make(map[string]int, len(c.Fleet))
	for i, s := range c.Fleet {
		s.validate(p.in("fleet["+strconv.Itoa(i)+"]"), seen, i)
	}
	checkConnectorPairs(c.Fleet, p)
	return p.err()
}

// checkConnectorPairs refuses a fleet whose producers of one connector
// have consumers only of another (behaviour.md R-DESC-3, R-DESC-7): a prefill and
// a decode of different connectors cannot hand KV to each other, so such
// an engine could never serve. A fleet of one connector, or one whose
// every connector has both phases, passes (several models may each run on
// their own connector), as does a fleet without one of the phases at all.
func checkConnectorPairs(fleet []EngineSpec, p problems) {
	prefill, decode := map[string]bool{}, map[string]bool{}
	known := func(s EngineSpec) bool { return slices.Contains(connector.Names(), s.Connector) }
	for _, s := range fleet {
		if !known(s) {
			continue // refused on its own
		}
		if s.Role.CanPrefill() {
			prefill[s.Connector] = true
		}
		if s.Role.CanDecode() {
			decode[s.Connector] = true
		}
	}
	if len(prefill) == 0 || len(decode) == 0 {
		return
	}
	for i, s := range fleet {
		key := "fleet[" + strconv.Itoa(i) + "].connector"
		switch {
		case !known(s):
		case s.Role.CanPrefill() && !decode[s.Connector]:
			p.bad(key, "prefill engine %s uses %s, but no decode engine does (a producer and a consumer of different connectors cannot hand off KV)", s.ID, s.Connector)
		case s.Role.CanDecode() && !prefill[s.Connector]:
			p.bad(key, "decode engine %s uses %s, but no prefill engine does (a producer and a consumer of different connectors cannot hand off KV)", s.ID, s.Connector)
		}
	}
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// EngineByID returns the fleet entry with the given id, and whether there
// is one.
func (c *Config) EngineByID(id string) (EngineSpec, bool) {
	for _, s := range c.Fleet {
		if s.ID == id {
			return s, true
		}
	}
	return EngineSpec{}, false
}

// DataDirEnv names the variable of the embedded NATS server's JetStream
// store (behaviour.md R-BUS-4): a router without bus.url, and `narwhal dev`, keep
// their bus there; unset means a temporary folder removed at exit.
const DataDirEnv = "NARWHAL_DATA_DIR"

// EmbeddedDataDir returns the embedded server's store directory from
// NARWHAL_DATA_DIR, or "" when it is unset. It is the one place that reads
// it, so that commands take it from here.
func EmbeddedDataDir() string { return os.Getenv(DataDirEnv) }
