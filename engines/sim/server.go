package sim

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Roles an engine advertises (behaviour.md §0). The simulator is lenient like
// vLLM: every role accepts prefill legs, decode legs and plain requests;
// the role only changes what the engine advertises (the listening line and
// narwhal_sim_info in /metrics).
const (
	RolePrefill = "prefill"
	RoleDecode  = "decode"
	RoleBoth    = "both"
)

// Defaults for Config.
const (
	// DefaultKVTimeout is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: how long a
	// producer holds unpulled KV blocks.
	DefaultKVTimeout = 480 * time.Second
	// DefaultMaxModelLen is the context length reported by /v1/models.
	DefaultMaxModelLen = 32768
	// DefaultMaxTokens is the output limit of a request that sets neither
	// max_tokens nor max_completion_tokens.
	DefaultMaxTokens = 16
	// DefaultEngineVersion and DefaultEngineKind are reported by /version.
	DefaultEngineVersion = "0.11.0"
	DefaultEngineKind    = "vllm"
	// ConnectorNixl is vLLM's NixlConnector: a descriptor from the prefill's
	// answer, pulled by the decode (the default).
	ConnectorNixl = "nixl"
	// ConnectorSGLang is SGLang's bootstrap protocol: both engines receive
	// the same body with bootstrap_host, bootstrap_port and bootstrap_room;
	// the decode meets the prefill's bootstrap server in the room (see
	// bootstrap.go).
	ConnectorSGLang = "sglang"
	// ConnectorSharedStorage is vLLM's SharedStorageConnector and
	// LMCache-style prefill/decode over a KV store both engines share
	// (Config.KVStore, see sharedstore.go): a producer writes the prompt's
	// KV blocks there, a consumer finds them by the prompt's prefix. No
	// request carries anything for it.
	ConnectorSharedStorage = "shared-storage"
)

// DefaultMaxBodyBytes is the default Config.MaxBodyBytes: 64 MiB, above
// the router's default request.max_body_bytes (32 MiB), so a body the
// router accepts reaches the simulator whole unless a test lowers it.
const DefaultMaxBodyBytes = 64 << 20

// maxChoices bounds n.
const maxChoices = 64

// Config configures a Server. Durations are time.Duration; zero values
// take the defaults given per field.
type Config struct {
	// Role is "prefill", "decode" or "both" (default "both").
	Role string
	// EngineID is the fleet-unique engine id, also the remote_engine_id
	// of the descriptors this engine hands off. Required.
	EngineID string
	// Model is the served model name. Required.
	Model string
	// TTFT is the delay before the first generated token of a decode or
	// plain request (not of a prefill leg). 0 is fine.
	TTFT time.Duration
	// ITL is the delay between two generated tokens. 0 is fine.
	ITL time.Duration
	// PrefillPerToken is the prefill compute time per uncached prompt
	// token, spent by prefill legs and by plain requests (every request
	// but a decode leg whose KV pull succeeded) on the tokens the prefix
	// cache did not hold. It is the engine's, as one GPU's: the prompts
	// computing at once share it, so N of them each progress at 1/N of
	// the speed (docs/simulator.md "Prefill compute"). 0 is fine.
	PrefillPerToken time.Duration
	// NoPromptTokensDetails leaves usage.prompt_tokens_details out, as
	// vLLM does without --enable-prompt-tokens-details: nothing tells then
	// whether a decode loaded its KV.
	NoPromptTokensDetails bool
	// BlockSize is the number of prompt tokens per KV block (default
	// BlockSize, 16, vLLM's default --block-size): the prefix cache's
	// unit, and ceil(prompt_tokens/BlockSize) blocks are held per handoff.
	BlockSize int
	// KVCacheBlocks bounds the prefix cache (default
	// DefaultKVCacheBlocks): beyond it the least recently used block is
	// evicted.
	KVCacheBlocks int
	// MaxNumSeqs, when positive, is how many inference requests run at
	// once, like vLLM's --max-num-seqs: the others wait in arrival order
	// (vllm:num_requests_waiting) until one ends. 0 = unbounded.
	MaxNumSeqs int
	// KVListen is the address of the KV side channel listener (default
	// "127.0.0.1:0").
	KVListen string
	// KVHost is the host advertised as remote_host in descriptors (default:
	// the side channel listener's IP, or 127.0.0.1 when it listens on all
	// interfaces).
	KVHost string
	// KVTimeout is how long a producer holds unpulled blocks before it
	// releases them (default DefaultKVTimeout, vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT). With the sglang connector it is
	// also how long a decode waits for its room's KV before it fails the
	// request, as SGLang's decode does (SGLANG_DISAGGREGATION_WAITING_TIMEOUT).
	KVTimeout time.Duration
	// EngineVersion is reported by GET /version (default "0.11.0").
	EngineVersion string
	// EngineKind is reported by GET /version as "engine" and by
	// /v1/models as owned_by (default "vllm").
	EngineKind string
	// Connector is the KV connector: "nixl" (default), "sglang" or
	// "shared-storage". An sglang engine's role is prefill or decode, and
	// it serves only requests that carry bootstrap_room (a router's
	// pairing), as SGLang in disaggregation mode does. A shared-storage
	// engine needs KVStore; its role says what it does with the store (a
	// prefill writes, a decode reads, both does both), and it reads
	// nothing a request carries for a KV transfer (kv_transfer_params,
	// bootstrap fields), as vLLM with SharedStorageConnector does.
	Connector string
	// KVStore is, with the shared-storage connector (and only with it),
	// the directory of the KV store the engines of a pair share: a path
	// every one of them reaches, created when missing. Required then.
	KVStore string
	// KVStoreBlocks bounds the blocks one shared-storage producer keeps in
	// KVStore (default DefaultKVStoreBlocks): beyond it the file of the
	// block it used least recently is removed.
	KVStoreBlocks int
	// BootstrapPort is, with the sglang connector, the port of the
	// bootstrap server (SGLang's --disaggregation-bootstrap-port) on
	// KVListen's host; 0 keeps KVListen's port. The bootstrap server is the
	// side channel listener.
	BootstrapPort int
	// MaxModelLen is the context length (default DefaultMaxModelLen):
	// prompt_tokens + max_tokens above it is a 400, as in vLLM.
	MaxModelLen int
	// MaxBodyBytes bounds a request body in bytes (default
	// DefaultMaxBodyBytes). A larger one gets 413 with vLLM's error body:
	// at once when its Content-Length says so, without reading it, or when
	// a body of unknown length reaches the bound; the connection is then
	// closed, as a web server in front of an engine does.
	MaxBodyBytes int
	// Faults are armed when the Server is created.
	Faults []Fault
	// APIKey, when set, is required on every /v1/* request as
	// "Authorization: Bearer <APIKey>", like vLLM's --api-key: a request
	// without it gets 401 with vLLM's body {"error": "Unauthorized"}.
	// /health, /version, /metrics, the /sim/* controls and the KV side
	// channel stay open.
	APIKey string
	// TLS, when set, makes Start serve the API over HTTPS with it (the
	// base URL is then https://…); the KV side channel stays plain.
	TLS *tls.Config

	// KVEvents, when set, is the tcp://HOST:PORT endpoint Start binds a
	// ZeroMQ PUB socket on to publish the prefix cache's KV events in
	// vLLM's wire format (kvevents.go, docs/connectors.md "KV events");
	// host "*" is every interface, port 0 any free one (KVEventsAddr).
	KVEvents string
	// KVEventsConnect, when set instead, is the tcp://HOST:PORT endpoint
	// of a subscriber that binds, which the PUB socket dials (and redials
	// until Close), as llm-d's simulator does.
	KVEventsConnect string
	// KVEventsReplay, when set, is the tcp://HOST:PORT endpoint of the
	// ROUTER socket that answers vLLM's replay requests from the last
	// KVEventsBuffer batches. Needs KVEvents or KVEventsConnect.
	KVEventsReplay string
	// KVEventsTopic is the first frame of every message (default "",
	// vLLM's; llm-d's convention is kv@<host>:<port>@<model>).
	KVEventsTopic string
	// KVEventsFormat is KVEventsMap (default with the vllm flavor, current
	// vLLM's) or KVEventsArray (the older vLLM's, and SGLang's only one).
	KVEventsFormat string
	// KVEventsFlavor is KVEventsVLLM (default) or KVEventsSGLang.
	KVEventsFlavor string
	// KVEventsRank is the batches' data_parallel_rank (SGLang's
	// attn_dp_rank): 0 by default, as vLLM without data parallelism
	// sends; negative sends nil.
	KVEventsRank int
	// KVEventsBuffer is how many batches the replay socket answers from
	// (default DefaultKVEventsBuffer, vLLM's buffer_steps).
	KVEventsBuffer int
}

// Server is one simulated engine: the OpenAI-compatible API and the KV
// side channel. It plays the engine's side of the two legs (behaviour.md R-LEG-1…4:
// a prefill leg hands off a descriptor, a decode leg pulls and streams),
// of the descriptors the router validates (R-DESC-0…5), of early release
// (R-OWN-6) and, through faults, of the failures of behaviour.md §5 and §6.
// Create it with New, serve it with Start (or mount Handler yourself:
// descriptors then advertise no side channel and cannot be pulled), and
// stop it with Close. Its methods are safe for concurrent use.
type Server struct {
	cfg       Config
	handler   http.Handler
	kvHandler http.Handler

	baseCtx context.Context
	cancel  context.CancelFunc

	mu       sync.Mutex // guards the fields below
	closed   bool
	started  bool
	api      *http.Server
	kvServer *http.Server
	kvHost   string
	kvPort   int
	baseURL  string

	inflight sync.WaitGroup // handlers running
	bg       sync.WaitGroup // Serve loops and the expiry loop

	pullTransport *http.Transport
	pullClient    *http.Client
	bootClient    *http.Client

	kv       kvStore
	store    *sharedStore // shared-storage connector only
	cache    prefixCache
	events   *kvEventQueue     // KV event batches waiting for the publisher, nil without KV events
	kvPub    *kvEventPublisher // set by Start with KV events
	seqs     chan struct{}     // running sequences, nil when unbounded
	born     time.Time         // process_start_time_seconds
	faults   faultSet
	recorder recorder
	count    counters
	work     *prefillCompute // the prefill compute its prompts share

	exchanges sync.Pool
}

// New validates cfg, fills its defaults and returns a Server that is not
// yet listening. It fails on a missing EngineID or Model, an unknown Role,
// an unknown Connector or settings it does not take (a bootstrap port
// without sglang, an sglang engine of role both, a KVStore without
// shared-storage or a shared-storage engine without one, a KVStore that
// cannot be created as a directory), negative durations, sizes or counts,
// or an invalid Fault.
func New(cfg Config) (*Server, error) {
	if cfg.EngineID == "" {
		return nil, errors.New("sim: engine id is required")
	}
	if cfg.Model == "" {
		return nil, errors.New("sim: model is required")
	}
	switch cfg.Role {
	case "":
		cfg.Role = RoleBoth
	case RolePrefill, RoleDecode, RoleBoth:
	default:
		return nil, fmt.Errorf("sim: unknown role %q (want prefill, decode or both)", cfg.Role)
	}
	if cfg.Connector == "" {
		cfg.Connector = ConnectorNixl
	}
	if cfg.KVStore != "" && cfg.Connector != ConnectorSharedStorage {
		return nil, errors.New("sim: a KV store needs the shared-storage connector")
	}
	switch cfg.Connector {
	case ConnectorNixl, ConnectorSharedStorage:
		if cfg.BootstrapPort != 0 {
			return nil, errors.New("sim: a bootstrap port needs the sglang connector")
		}
		if cfg.Connector == ConnectorSharedStorage && cfg.KVStore == "" {
			return nil, errors.New("sim: the shared-storage connector needs a KV store directory both engines reach")
		}
	case ConnectorSGLang:
		if cfg.Role == RoleBoth {
			return nil, errors.New("sim: an sglang engine runs in one disaggregation mode: role prefill or decode")
		}
		if cfg.BootstrapPort < 0 || cfg.BootstrapPort > 65535 {
			return nil, fmt.Errorf("sim: bootstrap port %d is not a port number", cfg.BootstrapPort)
		}
	default:
		return nil, fmt.Errorf("sim: unsupported connector %q (the simulator speaks nixl, sglang and shared-storage)", cfg.Connector)
	}
	if cfg.TTFT < 0 || cfg.ITL < 0 || cfg.PrefillPerToken < 0 || cfg.KVTimeout < 0 {
		return nil, errors.New("sim: durations must not be negative")
	}
	if cfg.BlockSize < 0 || cfg.KVCacheBlocks < 0 || cfg.MaxNumSeqs < 0 || cfg.KVStoreBlocks < 0 {
		return nil, errors.New("sim: block size, KV cache blocks, KV store blocks and max num seqs must not be negative")
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = BlockSize
	}
	if cfg.KVCacheBlocks == 0 {
		cfg.KVCacheBlocks = DefaultKVCacheBlocks
	}
	if cfg.KVStoreBlocks == 0 {
		cfg.KVStoreBlocks = DefaultKVStoreBlocks
	}
	if cfg.KVListen == "" {
		cfg.KVListen = "127.0.0.1:0"
	}
	if cfg.BootstrapPort != 0 {
		host, _, err := net.SplitHostPort(cfg.KVListen)
		if err != nil {
			return nil, fmt.Errorf("sim: kv listen %q: %w", cfg.KVListen, err)
		}
		cfg.KVListen = net.JoinHostPort(host, strconv.Itoa(cfg.BootstrapPort))
	}
	if cfg.KVTimeout == 0 {
		cfg.KVTimeout = DefaultKVTimeout
	}
	if cfg.EngineVersion == "" {
		cfg.EngineVersion = DefaultEngineVersion
	}
	if cfg.EngineKind == "" {
		cfg.EngineKind = DefaultEngineKind
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.MaxModelLen <= 0 {
		cfg.MaxModelLen = DefaultMaxModelLen
	}
	for _, f := range cfg.Faults {
		if err := f.Validate(); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	cfg.Faults = append([]Fault(nil), cfg.Faults...)
	if err := checkKVEvents(&cfg); err != nil {
		return nil, err
	}

	s := &Server{cfg: cfg, born: startTime(), work: newPrefillCompute()}
	if cfg.Connector == ConnectorSharedStorage {
		store, err := openSharedStore(cfg.KVStore, cfg.Model, cfg.BlockSize, cfg.KVStoreBlocks)
		if err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
		s.store = store
	}
	s.baseCtx, s.cancel = context.WithCancel(context.Background())
	s.kv.init()
	s.cache.init(cfg.KVCacheBlocks)
	if cfg.KVEvents != "" || cfg.KVEventsConnect != "" {
		s.events = newKVEventQueue(kvEventsQueue)
		s.cache.events = s.events
		s.cache.enc = newKVEventEncoder(cfg.KVEventsFormat, cfg.KVEventsFlavor, cfg.KVEventsRank)
	}
	if cfg.MaxNumSeqs > 0 {
		s.seqs = make(chan struct{}, cfg.MaxNumSeqs)
	}
	s.pullTransport = &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}
	s.pullClient = &http.Client{Transport: s.pullTransport, Timeout: 30 * time.Second}
	s.bootClient = &http.Client{Transport: s.pullTransport} // bounded by KVTimeout per request
	s.exchanges.New = func() any { return new(exchange) }

	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.serveInference(w, r, kindChat) })
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.serveInference(w, r, kindCompletions) })
	mux.HandleFunc("GET /v1/models", s.serveModels)
	mux.HandleFunc("GET /health", s.serveHealth)
	mux.HandleFunc("GET /version", s.serveVersion)
	mux.HandleFunc("GET /metrics", s.serveMetrics)
	mux.HandleFunc("POST /v1/kv/release", s.serveRelease)
	mux.HandleFunc("GET /sim/faults", s.serveFaultsGet)
	mux.HandleFunc("POST /sim/faults", s.serveFaultsPost)
	mux.HandleFunc("DELETE /sim/faults", func(w http.ResponseWriter, r *http.Request) {
		s.Disarm()
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET /sim/requests", func(w http.ResponseWriter, r *http.Request) { writeJSON(w, s.Requests()) })
	mux.HandleFunc("DELETE /sim/requests", func(w http.ResponseWriter, r *http.Request) {
		s.recorder.reset()
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET /sim/stats", func(w http.ResponseWriter, r *http.Request) { writeJSON(w, s.Stats()) })
	mux.HandleFunc("POST /sim/cached", s.serveCached)
	mux.HandleFunc("POST /tokenize", s.serveTokenize)
	mux.HandleFunc("POST /reset_prefix_cache", s.serveResetPrefixCache)
	s.handler = s.track(s.requireKey(mux))

	kvMux := http.NewServeMux()
	kvMux.HandleFunc("POST /kv/pull", s.servePull)
	kvMux.HandleFunc("POST /bootstrap/pull", s.serveBootstrap)
	s.kvHandler = s.track(kvMux)

	for _, f := range cfg.Faults {
		s.Arm(f)
	}
	return s, nil
}

// Config returns the Server's configuration with defaults filled in.
func (s *Server) Config() Config {
	c := s.cfg
	c.Faults = append([]Fault(nil), c.Faults...)
	return c
}

// Handler returns the main API handler (everything but the KV side
// channel). Requests that arrive after Close get 503.
func (s *Server) Handler() http.Handler { return s.handler }

// Start listens on addr (e.g. "127.0.0.1:0") for the API and on
// Config.KVListen for the KV side channel, serves both in the background
// and starts the expiry of unpulled KV blocks. It returns the API's base
// URL, "http://host:port". It fails if the Server was started or closed
// already or a listener cannot be opened.
func (s *Server) Start(addr string) (baseURL string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return "", errors.New("sim: server is closed")
	}
	if s.started {
		return "", errors.New("sim: server already started")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", fmt.Errorf("sim: listen %s: %w", addr, err)
	}
	scheme := "http://"
	if s.cfg.TLS != nil {
		ln = tls.NewListener(ln, s.cfg.TLS)
		scheme = "https://"
	}
	kvLn, err := net.Listen("tcp", s.cfg.KVListen)
	if err != nil {
		ln.Close()
		return "", fmt.Errorf("sim: kv listen %s: %w", s.cfg.KVListen, err)
	}
	if s.events != nil {
		if s.kvPub, err = startKVEventPublisher(&s.cfg, s.events); err != nil {
			ln.Close()
			kvLn.Close()
			return "", err
		}
	}
	kvAddr := kvLn.Addr().(*net.TCPAddr)
	s.kvPort = kvAddr.Port
	s.kvHost = s.cfg.KVHost
	if s.kvHost == "" {
		s.kvHost = kvAddr.IP.String()
		if kvAddr.IP.IsUnspecified() {
			s.kvHost = "127.0.0.1"
		}
	}
	apiAddr := ln.Addr().(*net.TCPAddr)
	host := apiAddr.IP.String()
	if apiAddr.IP.IsUnspecified() {
		host = "127.0.0.1"
	}
	s.baseURL = scheme + net.JoinHostPort(host, strconv.Itoa(apiAddr.Port))

	base := func(net.Listener) context.Context { return s.baseCtx }
	s.api = &http.Server{Handler: s.handler, ReadHeaderTimeout: 30 * time.Second, BaseContext: base}
	s.kvServer = &http.Server{Handler: s.kvHandler, ReadHeaderTimeout: 30 * time.Second, BaseContext: base}
	s.started = true
	s.bg.Add(3)
	go func() { defer s.bg.Done(); _ = s.api.Serve(ln) }()
	go func() { defer s.bg.Done(); _ = s.kvServer.Serve(kvLn) }()
	go func() { defer s.bg.Done(); s.expiryLoop(s.baseCtx) }()
	return s.baseURL, nil
}

// lastStart is the latest start time handed out by startTime, in Unix
// nanoseconds.
var lastStart atomic.Int64

// startTime returns now, or a microsecond past the previous Server's start
// time when that is not earlier, so every Server of a process has its own
// process_start_time_seconds (microsecond precision) and a restarted one a
// new one.
func startTime() time.Time {
	for {
		prev := lastStart.Load()
		now := time.Now().UnixNano() / 1000 * 1000
		if now <= prev {
			now = prev + 1000
		}
		if lastStart.CompareAndSwap(prev, now) {
			return time.Unix(0, now)
		}
	}
}

// StartTime returns when the Server was created, as /metrics reports it
// in process_start_time_seconds: unique per Server of a process, so a
// router that sees it change knows the engine restarted and lost its
// prefix cache.
func (s *Server) StartTime() time.Time { return s.born }

// URL returns the API base URL, empty before Start.
func (s *Server) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.baseURL
}

// KVAddr returns the side channel address advertised in descriptors,
// "remote_host:remote_port", empty before Start.
func (s *Server) KVAddr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.started {
		return ""
	}
	return net.JoinHostPort(s.kvHost, strconv.Itoa(s.kvPort))
}

func (s *Server) kvEndpoint() (string, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.kvHost, s.kvPort
}

// Close stops both listeners, ends in-flight streams and requests at once
// (their clients see the connection end), and waits for every goroutine
// the Server started. It is idempotent and returns the first error from
// closing the listeners.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	api, kvServer := s.api, s.kvServer
	s.mu.Unlock()

	s.cancel()
	var err error
	if api != nil {
		err = api.Close()
	}
	if kvServer != nil {
		if e := kvServer.Close(); err == nil {
			err = e
		}
	}
	s.inflight.Wait()
	s.bg.Wait()
	if s.kvPub != nil {
		s.kvPub.close()
	}
	s.pullTransport.CloseIdleConnections()
	return err
}

// track counts handlers in flight so Close can wait for them, and refuses
// requests once Close has begun.
func (s *Server) track(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			writeError(w, http.StatusServiceUnavailable, "engine is shutting down")
			return
		}
		s.inflight.Add(1)
		s.mu.Unlock()
		defer s.inflight.Done()
		next.ServeHTTP(w, r)
	})
}

// requireKey enforces Config.APIKey on /v1/* (vLLM's AuthenticationMiddleware:
// the whole Authorization header must equal "Bearer <key>", compared on
// SHA-256 digests in constant time).
func (s *Server) requireKey(next http.Handler) http.Handler {
	if s.cfg.APIKey == "" {
		return next
	}
	want := sha256.Sum256([]byte("Bearer " + s.cfg.APIKey))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1") {
			got := sha256.Sum256([]byte(r.Header.Get("Authorization")))
			if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
				s.count.unauthorized.Add(1)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				_, _ = io.WriteString(w, `{"error":"Unauthorized"}`)
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// Arm adds a fault; it strikes matching requests until its Count is spent
// or Disarm is called. A fault that fails Validate is ignored.
func (s *Server) Arm(f Fault) {
	if f.Validate() != nil {
		return
	}
	s.faults.arm(f)
}

// Disarm clears every armed fault.
func (s *Server) Disarm() { s.faults.disarm() }

// Faults returns the armed faults, earliest first, each with its remaining
// Count (0 = until disarmed).
func (s *Server) Faults() []Fault { return s.faults.snapshot() }

// Stats returns a snapshot of the Server's counters.
func (s *Server) Stats() Stats {
	st := Stats{
		Prefills:       s.count.prefills.Load(),
		Decodes:        s.count.decodes.Load(),
		KVPulled:       s.count.kvPulled.Load(),
		KVPullFailures: s.count.kvPullFailures.Load(),
		ActiveStreams:  s.count.active.Load(),
		Aborted:        s.count.aborted.Load(),
		Completed:      s.count.completed.Load(),
		Unauthorized:   s.count.unauthorized.Load(),
		Running:        s.count.running.Load(),
		Waiting:        s.count.waiting.Load(),
	}
	cs := s.cache.stats()
	st.PrefixCacheQueries, st.PrefixCacheHits = cs.queries, cs.hits
	st.ExternalPrefixCacheQueries, st.ExternalPrefixCacheHits = cs.extQueries, cs.extHits
	st.PrefixCacheBlocks, st.PrefixCacheEvicted = cs.blocks, cs.evicted
	if s.store != nil {
		st.KVStoreWritten, st.KVStoreLoaded, st.KVStoreEvicted, st.KVStoreErrors = s.store.stats()
	}
	s.kv.mu.Lock()
	st.KVHeld = int64(len(s.kv.holds) + s.kv.roomsHeld)
	st.KVServed = s.kv.served
	st.KVReleased = s.kv.released
	st.KVExpired = s.kv.expired
	s.kv.mu.Unlock()
	return st
}

// Requests returns the last 1000 inference and release requests, oldest
// first.
func (s *Server) Requests() []RecordedRequest { return s.recorder.list() }

// ResetRequests empties the request log, as DELETE /sim/requests does.
func (s *Server) ResetRequests() { s.recorder.reset() }

// record keeps a copy of a request for Requests; checked says body is
// already known to be valid JSON.
func (s *Server) record(r *http.Request, phase string, body []byte, checked bool) {
	raw := json.RawMessage(append([]byte(nil), body...))
	if !checked && !json.Valid(raw) {
		raw, _ = json.Marshal(string(body))
	}
	s.recorder.add(RecordedRequest{Path: r.URL.Path, RequestID: r.Header.Get("X-Request-Id"), Phase: phase, Body: raw,
		Traceparent: recordedHeader(r, "Traceparent"), Tracestate: recordedHeader(r, "Tracestate")})
}

// maxRecordedHeader bounds each header value the request log keeps.
const maxRecordedHeader = 1024

// recordedHeader is r's header name as the request log keeps it: the
// first value, cut to maxRecordedHeader bytes.
func recordedHeader(r *http.Request, name string) string {
	v := r.Header.Get(name)
	if len(v) > maxRecordedHeader {
		v = v[:maxRecordedHeader]
	}
	return v
}

var (
	jsonContentType = []string{"application/json"}
	sseContentType  = []string{"text/event-stream; charset=utf-8"}
	textContentType = []string{"text/plain; version=0.0.4; charset=utf-8"}
)

// writeError writes a vLLM error body {"error":{"message","type","param",
// "code"}} with status (behaviour.md R-API-3).
func writeError(w http.ResponseWriter, status int, msg string) {
	body := schemas.AppendErrorJSON(make([]byte, 0, 96+len(msg)), status, msg)
	w.Header()["Content-Type"] = jsonContentType
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

func writeJSON(w http.ResponseWriter, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	w.Header()["Content-Type"] = jsonContentType
	_, _ = w.Write(body)
}

// serveHealth is GET /health: 200 with an empty body, or the
// health-status fault's Status (default 503).
func (s *Server) serveHealth(w http.ResponseWriter, r *http.Request) {
	var af activeFaults
	s.faults.take(&af, targetHealth, "", false, false, false)
	if f, ok := af.get(fkHealthStatus); ok {
		status := f.statusOr(http.StatusServiceUnavailable)
		if status == http.StatusOK {
			w.WriteHeader(status)
			return
		}
		writeError(w, status, f.messageOr("simulated unhealthy engine"))
		return
	}
	w.WriteHeader(http.StatusOK)
}

// serveVersion is GET /version: {"version":…,"engine":…}.
func (s *Server) serveVersion(w http.ResponseWriter, r *http.Request) {
	b := []byte(`{"version":`)
	b = appendJSONString(b, s.cfg.EngineVersion)
	b = append(b, `,"engine":`...)
	b = appendJSONString(b, s.cfg.EngineKind)
	b = append(b, '}')
	w.Header()["Content-Type"] = jsonContentType
	_, _ = w.Write(b)
}

// serveModels is GET /v1/models in vLLM's shape:
// {"object":"list","data":[{"id","object":"model","created","owned_by",
// "root","parent":null,"max_model_len","permission":[]}]}. The wrong-model
// fault lists another model.
func (s *Server) serveModels(w http.ResponseWriter, r *http.Request) {
	var af activeFaults
	s.faults.take(&af, targetModels, "", false, false, false)
	model := s.cfg.Model
	if f, ok := af.get(fkWrongModel); ok {
		model = f.Message
		if model == "" {
			model = s.cfg.Model + "-other"
		}
	}
	b := []byte(`{"object":"list","data":[{"id":`)
	b = appendJSONString(b, model)
	b = append(b, `,"object":"model","created":`...)
	b = strconv.AppendInt(b, time.Now().Unix(), 10)
	b = append(b, `,"owned_by":`...)
	b = appendJSONString(b, s.cfg.EngineKind)
	b = append(b, `,"root":`...)
	b = appendJSONString(b, model)
	b = append(b, `,"parent":null,"max_model_len":`...)
	b = strconv.AppendInt(b, int64(s.cfg.MaxModelLen), 10)
	b = append(b, `,"permission":[]}]}`...)
	w.Header()["Content-Type"] = jsonContentType
	_, _ = w.Write(b)
}

// serveMetrics is GET /metrics: Prometheus text with vLLM's metric names
// (vllm:num_requests_running, vllm:num_requests_waiting,
// vllm:kv_cache_usage_perc (the KV blocks of the running requests' prompts
// and of the handoffs held, over Config.KVCacheBlocks, at most 1: cached
// blocks nobody uses count as free, as in vLLM), vllm:cache_config_info
// with labels block_size and num_gpu_blocks (Config.BlockSize and
// Config.KVCacheBlocks; value 1, vLLM's info metric),
// vllm:prefix_cache_queries_total and
// vllm:prefix_cache_hits_total (tokens looked up in and found in the
// engine's own prefix cache), vllm:external_prefix_cache_queries_total and
// vllm:external_prefix_cache_hits_total (tokens of KV pulled from a
// producer), vllm:prompt_tokens_total, vllm:generation_tokens_total,
// vllm:request_success_total), process_start_time_seconds (the Server's
// StartTime, as the Prometheus client's process collector reports it on
// vLLM), narwhal_sim_kv_events_published_total and
// narwhal_sim_kv_events_dropped_total (KV event batches sent, and
// dropped from the full queue; 0 without KV events) and
// narwhal_sim_info{engine_id,role,connector} 1.
func (s *Server) serveMetrics(w http.ResponseWriter, r *http.Request) {
	s.kv.mu.Lock()
	held := s.kv.heldBlock
	s.kv.mu.Unlock()
	used := min(float64(held+s.count.runningBlocks.Load())/float64(s.cfg.KVCacheBlocks), 1)
	cs := s.cache.stats()
	var b strings.Builder
	label := `{model_name="` + promLabel(s.cfg.Model) + `"}`
	metric := func(name, typ, help, labels string, value string) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n%s%s %s\n", name, help, name, typ, name, labels, value)
	}
	itoa := func(v int64) string { return strconv.FormatInt(v, 10) }
	metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", label, itoa(s.count.running.Load()))
	metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", label, itoa(s.count.waiting.Load()))
	metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", label,
		strconv.FormatFloat(used, 'g', -1, 64))
	metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
		`{block_size="`+strconv.Itoa(s.cfg.BlockSize)+`",enable_prefix_caching="True",num_gpu_blocks="`+strconv.Itoa(s.cfg.KVCacheBlocks)+`"}`, "1")
	metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", label, itoa(cs.queries))
	metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", label, itoa(cs.hits))
	metric("vllm:external_prefix_cache_queries_total", "counter", "External prefix cache queries from the KV connector, in terms of number of queried tokens.", label, itoa(cs.extQueries))
	metric("vllm:external_prefix_cache_hits_total", "counter", "External prefix cache hits from the KV connector, in terms of number of cached tokens.", label, itoa(cs.extHits))
	metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", label, itoa(s.count.promptTokens.Load()))
	metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", label, itoa(s.count.genTokens.Load()))
	fmt.Fprintf(&b, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\n")
	m := promLabel(s.cfg.Model)
	fmt.Fprintf(&b, "vllm:request_success_total{model_name=\"%s\",finished_reason=\"stop\"} %d\n", m, s.count.finishedStop.Load())
	fmt.Fprintf(&b, "vllm:request_success_total{model_name=\"%s\",finished_reason=\"length\"} %d\n", m, s.count.finishedLen.Load())
	fmt.Fprintf(&b, "vllm:request_success_total{model_name=\"%s\",finished_reason=\"abort\"} %d\n", m, s.count.aborted.Load())
	var published, dropped int64
	if s.events != nil {
		dropped = s.events.dropped.Load()
	}
	if p := s.publisher(); p != nil {
		published = p.published.Load()
	}
	metric("narwhal_sim_kv_events_published_total", "counter", "KV event batches sent on the PUB socket.", "", itoa(published))
	metric("narwhal_sim_kv_events_dropped_total", "counter", "KV event batches dropped because the PUB socket fell behind.", "", itoa(dropped))
	metric("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.", "",
		strconv.FormatFloat(float64(s.born.UnixMicro())/1e6, 'f', 6, 64))
	metric("narwhal_sim_info", "gauge", "Simulated engine identity.",
		`{engine_id="`+promLabel(s.cfg.EngineID)+`",role="`+s.cfg.Role+`",connector="`+s.cfg.Connector+`"}`, "1")
	w.Header()["Content-Type"] = textContentType
	_, _ = io.WriteString(w, b.String())
}

// promLabel escapes a Prometheus label value.
func promLabel(v string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(v)
}

// serveFaultsGet is GET /sim/faults: the armed faults as a JSON array.
func (s *Server) serveFaultsGet(w http.ResponseWriter, r *http.Request) { writeJSON(w, s.Faults()) }

// serveFaultsPost is POST /sim/faults: arm a Fault object or an array of
// them; 400 if any is invalid (none is armed then). Answers the armed
// faults.
func (s *Server) serveFaultsPost(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
	if err != nil {
		writeError(w, http.StatusBadRequest, "cannot read faults: "+err.Error())
		return
	}
	faults, err := ParseFaults(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	for _, f := range faults {
		s.Arm(f)
	}
	writeJSON(w, s.Faults())
}
