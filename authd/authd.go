// Package authd is the bus's auth callout for Kubernetes identities
// (`narwhal bus authd`; behaviour.md R-BUS-11, docs/security.md): every
// pod of a Deployment mounts the same Secrets, so an engine's or a
// router's own identity cannot come from a credential file there. The
// bus (`narwhal bus --auth DIR`, DIR with `narwhal bus creds --authd`)
// hands a client that presents only a token to this service, which
// verifies the pod's projected service-account token against the
// cluster's signing keys (Verifier) and answers with a short-lived user
// JWT of account NARWHAL for the identity the token names — the pod name,
// of the role its service account has (--roles) — with exactly that
// identity's permissions (bus.RouterPermissions, bus.EnginePermissions),
// its consumer names keyed by the pod's UID (bus.PodConsumerKey).
package authd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/bus"
)

// DefaultTTL is how long an issued user JWT is valid by default; never
// past the token's own exp.
const DefaultTTL = 10 * time.Minute

// QueueGroup is the queue group of the service's subscription: the
// replicas of authd share the bus's requests.
const QueueGroup = "narwhal-authd"

// refusalLogEvery bounds the refusal log: one line per reason per
// interval, with the count of those not logged since.
const refusalLogEvery = 10 * time.Second

// Options configures a Service.
type Options struct {
	// URL is the bus, e.g. "nats://narwhal-bus:4222".
	URL string
	// CredsFile is the callout service's credential (bus.AuthdCredsFile).
	CredsFile string
	// SigningKeyFile is the seed it signs with
	// (keys/bus.AuthdSigningKeyFile).
	SigningKeyFile string
	// Verifier verifies the tokens.
	Verifier *Verifier
	// TTL is an issued user JWT's lifetime, at most the token's exp; 0
	// means DefaultTTL.
	TTL time.Duration
	// Log receives issues (debug), refusals (warn, at a bounded rate)
	// and connection events; nil discards them.
	Log *slog.Logger
	// Registry, when set, gets the service's metrics.
	Registry prometheus.Registerer
	// Now is the clock; nil: time.Now.
	Now func() time.Time
	// TLSCA is a PEM file of CAs for the bus's certificate, or "".
	TLSCA string
}

// Service answers the bus's authorization requests.
type Service struct {
	opts    Options
	signing nkeys.KeyPair
	target  string // account NARWHAL: the users' issuer account
	own     string // account NARWHAL_AUTH: the answers' issuer account
	nc      *nats.Conn
	sub     *nats.Subscription

	subscribed atomic.Bool
	closing    atomic.Bool
	lost       chan struct{} // closed when the bus closed the connection for good
	lostErr    atomic.Pointer[error]
	lastDial   atomic.Int64 // unix nanoseconds of the last dial error logged
	issued     *prometheus.CounterVec
	refused    *prometheus.CounterVec

	logMu      sync.Mutex
	lastLog    map[string]time.Time
	suppressed map[string]int
}

// Start reads the credential and the signing key, connects to the bus
// (reconnecting for ever, R-BUS-6) and subscribes to the bus's
// authorization requests; it returns at once, Ready telling when the
// subscription is in place. It returns an error when a file cannot be
// read or is not what it should be, or the options are incomplete.
func Start(opts Options) (*Service, error) {
	if opts.URL == "" || opts.CredsFile == "" || opts.SigningKeyFile == "" || opts.Verifier == nil {
		return nil, errors.New("authd: want a bus URL, a credential, a signing key and a verifier")
	}
	if opts.TTL <= 0 {
		opts.TTL = DefaultTTL
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	seed, err := os.ReadFile(opts.SigningKeyFile)
	if err != nil {
		return nil, fmt.Errorf("authd: signing key: %w", err)
	}
	signing, err := nkeys.FromSeed([]byte(strings.TrimSpace(string(seed))))
	if err != nil {
		return nil, fmt.Errorf("authd: signing key %s: %w", opts.SigningKeyFile, err)
	}
	if pub, _ := signing.PublicKey(); !nkeys.IsValidPublicAccountKey(pub) {
		return nil, fmt.Errorf("authd: %s is not an account signing key (%s)", opts.SigningKeyFile, bus.AuthdSigningKeyFile)
	}
	target, own, err := bus.AuthdTarget(opts.CredsFile)
	if err != nil {
		return nil, err
	}
	s := &Service{opts: opts, signing: signing, target: target, own: own, lost: make(chan struct{}),
		lastLog: map[string]time.Time{}, suppressed: map[string]int{},
		issued: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_authd_issued_total",
			Help: "User JWTs issued to pods' identities, by role."}, []string{"role"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "narwhal_authd_refused_total",
			Help: "Connections whose token was refused, by reason."}, []string{"reason"}),
	}
	for _, r := range []string{bus.RoleRouter, bus.RoleEngine} {
		s.issued.WithLabelValues(r)
	}
	for _, r := range Reasons {
		s.refused.WithLabelValues(r)
	}
	if opts.Registry != nil {
		if err := opts.Registry.Register(s.issued); err != nil {
			return nil, fmt.Errorf("authd: metrics: %w", err)
		}
		if err := opts.Registry.Register(s.refused); err != nil {
			return nil, fmt.Errorf("authd: metrics: %w", err)
		}
	}
	log := opts.Log
	nopts := []nats.Option{
		nats.Name(bus.AuthdUserName),
		nats.UserCredentials(opts.CredsFile),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.RetryOnFailedConnect(true),
		nats.ConnectHandler(s.confirm),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("bus reconnected", "url", nc.ConnectedUrlRedacted())
			s.confirm(nc)
		}),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("bus disconnected", "err", err)
			}
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			log.Warn("bus async error", "err", err)
		}),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) {
			// Once every refusalLogEvery at most: it retries every 250 ms.
			now := time.Now().UnixNano()
			if last := s.lastDial.Load(); err != nil && now-last >= int64(refusalLogEvery) && s.lastDial.CompareAndSwap(last, now) {
				log.Warn("connecting to the bus", "url", bus.RedactURL(opts.URL), "err", err)
			}
		}),
		// nats.go gives up after the same refusal twice (a credential
		// the bus does not take): authd can serve nothing any more.
		nats.ClosedHandler(func(nc *nats.Conn) {
			if s.closing.Load() {
				return
			}
			err := nc.LastError()
			if err == nil {
				err = errors.New("connection closed")
			}
			s.lostErr.Store(&err)
			close(s.lost)
		}),
	}
	if opts.TLSCA != "" {
		nopts = append(nopts, nats.RootCAs(opts.TLSCA))
	}
	nc, err := nats.Connect(opts.URL, nopts...)
	if err != nil {
		return nil, fmt.Errorf("authd: connect %s: %w", bus.RedactURL(opts.URL), err)
	}
	s.nc = nc
	sub, err := nc.QueueSubscribe(bus.AuthCalloutSubject, QueueGroup, s.handle)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("authd: subscribe: %w", err)
	}
	s.sub = sub
	if nc.IsConnected() {
		s.confirm(nc)
	}
	return s, nil
}

// confirm marks the subscription in place once the server of nc has it
// (a flush's round trip), in the background.
func (s *Service) confirm(nc *nats.Conn) {
	go func() {
		if nc.FlushTimeout(2*time.Second) == nil {
			s.subscribed.Store(true)
		}
	}()
}

// Ready reports whether the service is connected and its subscription is
// in place, and the cluster's keys were fetched once (its /readyz).
func (s *Service) Ready() bool {
	return s.subscribed.Load() && s.nc.IsConnected() && s.sub.IsValid() && s.opts.Verifier.Keys.Loaded()
}

// Lost is closed when the bus closed the service's connection for good
// (it refused authd.creds twice in a row); Err then says why.
func (s *Service) Lost() <-chan struct{} { return s.lost }

// Err returns why the connection was lost, or nil.
func (s *Service) Err() error {
	if err := s.lostErr.Load(); err != nil {
		return *err
	}
	return nil
}

// Close unsubscribes and closes the connection.
func (s *Service) Close() {
	s.closing.Store(true)
	_ = s.sub.Unsubscribe()
	s.nc.Close()
}

// handle answers one authorization request.
func (s *Service) handle(m *nats.Msg) {
	req, err := jwt.DecodeAuthorizationRequestClaims(string(m.Data))
	if err != nil || !nkeys.IsValidPublicServerKey(req.Issuer) || !nkeys.IsValidPublicUserKey(req.UserNkey) {
		// Not the bus's: nothing to answer for.
		s.count(&Refusal{Reason: ReasonRequest, Detail: "not an authorization request of a server"}, "", "")
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), fetchTimeout)
	defer cancel()
	id, err := s.opts.Verifier.Verify(ctx, req.ConnectOptions.Token)
	var userJWT string
	if err == nil {
		userJWT, err = s.issue(req.UserNkey, id)
	}
	if err != nil {
		var r *Refusal
		if !errors.As(err, &r) {
			r = &Refusal{Reason: ReasonRequest, Detail: err.Error()}
		}
		s.count(r, req.ClientInformation.Host, req.ConnectOptions.Name)
		s.respond(m, req, "", r.Error())
		return
	}
	s.issued.WithLabelValues(id.Role).Inc()
	s.opts.Log.Debug("identity issued", "role", id.Role, "id", id.ID, "service_account", id.ServiceAccount, "host", req.ClientInformation.Host)
	s.respond(m, req, userJWT, "")
}

// issue returns the user JWT of id for the bus's user key user: name
// bus.UserName(role, id), account NARWHAL, the identity's permissions
// with its consumers named by its pod's UID, expiring after the TTL or at
// the token's exp, whichever is first.
func (s *Service) issue(user string, id Identity) (string, error) {
	key := bus.PodConsumerKey(id.PodUID)
	var perms jwt.Permissions
	var err error
	switch id.Role {
	case bus.RoleRouter:
		perms, err = bus.RouterPermissions(id.ID, key)
	case bus.RoleEngine:
		perms, err = bus.EnginePermissions(id.ID, key)
	default:
		err = fmt.Errorf("role %q", id.Role)
	}
	if err != nil {
		return "", &Refusal{Reason: ReasonIdentity, Detail: err.Error()}
	}
	now := s.opts.Now()
	exp := now.Add(s.opts.TTL)
	if id.Expires.Before(exp) {
		exp = id.Expires
	}
	if !exp.After(now) {
		return "", &Refusal{Reason: ReasonExpired, Detail: "the token expires now"}
	}
	uc := jwt.NewUserClaims(user)
	uc.Name = bus.UserName(id.Role, id.ID)
	uc.IssuerAccount = s.target
	uc.Permissions = perms
	uc.IssuedAt = now.Unix()
	uc.Expires = exp.Unix()
	token, err := uc.Encode(s.signing)
	if err != nil {
		return "", fmt.Errorf("authd: sign %s: %w", uc.Name, err)
	}
	return token, nil
}

// respond answers req on m's reply subject with the user JWT userJWT, or
// with errText when it is set.
func (s *Service) respond(m *nats.Msg, req *jwt.AuthorizationRequestClaims, userJWT, errText string) {
	rc := jwt.NewAuthorizationResponseClaims(req.UserNkey)
	rc.Audience = req.Server.ID
	rc.IssuerAccount = s.own
	rc.Jwt = userJWT
	rc.Error = errText
	rc.Expires = s.opts.Now().Add(time.Minute).Unix()
	token, err := rc.Encode(s.signing)
	if err != nil {
		s.opts.Log.Error("authd: signing an answer", "err", err)
		return
	}
	if err := m.Respond([]byte(token)); err != nil {
		s.opts.Log.Warn("authd: answering the bus", "err", err)
	}
}

// count counts a refusal and logs it, at most once per reason per
// refusalLogEvery.
func (s *Service) count(r *Refusal, host, name string) {
	s.refused.WithLabelValues(r.Reason).Inc()
	s.logMu.Lock()
	now := s.opts.Now()
	if now.Sub(s.lastLog[r.Reason]) < refusalLogEvery {
		s.suppressed[r.Reason]++
		s.logMu.Unlock()
		return
	}
	n := s.suppressed[r.Reason]
	s.lastLog[r.Reason], s.suppressed[r.Reason] = now, 0
	s.logMu.Unlock()
	s.opts.Log.Warn("token refused", "reason", r.Reason, "detail", r.Detail, "host", host, "client", name, "refused_unlogged", n)
}

// Handler serves /metrics (gatherer's), /healthz (200 while the process
// runs) and /readyz (200 once Ready, else 503).
func (s *Service) Handler(metrics http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", metrics)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !s.Ready() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("not ready: connecting to the bus, subscribing or fetching the cluster's keys\n"))
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	return mux
}
