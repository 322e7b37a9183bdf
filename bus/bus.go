// Package bus is Narwhal's link to NATS JetStream (behaviour.md §9): an embedded
// server for single-machine use and tests, the connection with its stream
// and placement bucket, a publisher that never blocks a request, an
// ordered subscription for tools, and validation of events against their
// JSON Schemas.
//
// Every event goes to stream NARWHAL_EVENTS on subjects
// narwhal.events.<kind>.<id>, a router's events about an engine on
// narwhal.events.<kind>.<engine_id>.<router_id> (R-BUS-1, R-BUS-11).
// The kinds are the rows of
// schemas.EventKinds, which this package reads for the credentials'
// permissions (who publishes and subscribes to each kind), the history
// stream's sources and the publisher's drop counter: a new kind changes
// nothing here. Placement eligibility lives in KV bucket narwhal_placement
// (R-BUS-2). Nothing here ever deletes or recreates a stream, bucket or
// consumer (R-BUS-7).
package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Names on the bus (behaviour.md R-BUS-1, R-BUS-2).
const (
	// StreamName is the JetStream stream that stores every event.
	StreamName = "NARWHAL_EVENTS"
	// PlacementBucket is the KV bucket of placement eligibility: key =
	// engine id, value = a schemas.Eligibility as JSON.
	PlacementBucket = "narwhal_placement"
	// HistoryStream is the stream that keeps the mesh's history — every
	// event except request events — sourced from StreamName, with limits
	// of its own, so that a flood of request events cannot evict it.
	HistoryStream = "NARWHAL_HISTORY"
	// SubjectPrefix starts every event subject:
	// narwhal.events.<kind>.<engine_id|router_id>[.<router_id>] (it is
	// schemas.EventSubjectPrefix).
	SubjectPrefix = schemas.EventSubjectPrefix
)

// Stream limits of NARWHAL_EVENTS.
const (
	// StreamMaxAge is how long events are kept.
	StreamMaxAge = 24 * time.Hour
	// StreamMaxBytes caps the stream's size; the oldest events go first.
	StreamMaxBytes = 1 << 30
	// StreamDuplicates is the window in which a re-published event id is
	// dropped as a duplicate (R-BUS-3). Publishers retry an event for
	// RetryHorizon, a minute less, so every retry falls inside it
	// (R-BUS-10).
	StreamDuplicates = 5 * time.Minute
	// StreamMaxMsgSize is the largest event either stream stores; a
	// larger one is refused (and counted as invalid by the publisher).
	StreamMaxMsgSize = 256 << 10
)

// Limits of NARWHAL_HISTORY.
const (
	// HistoryMaxAge is how long the history keeps an event.
	HistoryMaxAge = 30 * 24 * time.Hour
	// HistoryMaxBytes caps the history's size; the oldest events go first.
	HistoryMaxBytes = 512 << 20
)

// HistoryKinds are the event kinds NARWHAL_HISTORY keeps, in the order
// of schemas.EventKinds: those whose row sets History (every kind but
// request events today).
var HistoryKinds = historyKinds()

// historyKinds returns the names of the rows of schemas.EventKinds that
// set History.
func historyKinds() []string {
	var out []string
	for _, k := range schemas.EventKinds() {
		if k.History {
			out = append(out, k.Name)
		}
	}
	return out
}

// jsErrCodeClusterNoPeers is JetStream's "no suitable peers for
// placement": a cluster still forming, or fewer servers than replicas.
const jsErrCodeClusterNoPeers jetstream.ErrorCode = 10005

// Connection tuning.
const (
	reconnectWait   = 250 * time.Millisecond
	bindTimeout     = 5 * time.Second
	setupRetryDelay = 250 * time.Millisecond
	// waitLogEvery is how often a Connect that waits for the bus says so.
	waitLogEvery = 5 * time.Second
)

// ConnectOptions says where the bus is and who connects (behaviour.md R-BUS-4,
// R-BUS-8).
type ConnectOptions struct {
	// URL is the NATS server URL, e.g. NARWHAL_NATS_URL
	// ("nats://h1:4222,nats://h2:4222" for a cluster). Ignored when
	// Embedded is set.
	URL string
	// Embedded, when set, connects in-process to that server (no TCP).
	Embedded *Embedded
	// Name is the client name the server shows, e.g. "narwhal-router-a".
	Name string
	// CredsFile is a NATS credentials file (JWT and seed): the role's
	// credential (R-BUS-8), an engine's or router's own (R-BUS-11), or "".
	// Connect asks every reply on the inbox prefix _INBOX.<the JWT's user
	// name>, the only one the credential may subscribe to.
	CredsFile string
	// TokenFile is a file holding the pod's projected service-account
	// token (NARWHAL_NATS_TOKEN_FILE), or "": the connection presents it,
	// read from the file afresh at every connect and reconnect (the
	// kubelet replaces it before it expires), and the bus's auth callout
	// (`narwhal bus authd`) answers with a short-lived user of the
	// identity the token names — Role's identity whose id is the pod
	// name. Replies come to that identity's inbox prefix and its
	// consumers' names derive from the pod's UID (PodConsumerKey), as
	// authd derives them. Role must be RoleRouter or RoleEngine, ID empty
	// or the pod name, CredsFile empty.
	TokenFile string
	// TLSCA is a PEM file of CAs to trust for the server's certificate,
	// or "".
	TLSCA string
	// TLSCert and TLSKey are the client certificate and key (PEM files)
	// for mutual TLS, or "".
	TLSCert, TLSKey string
	// Log, when set, receives what a waiting Connect waits for (at once,
	// then every 5 s), and disconnect, reconnect and async error notices.
	Log *slog.Logger
	// Role is the role whose credential this connection needs (RoleRouter,
	// RoleViewer, …; R-BUS-8), or "" when the caller does not say. When the
	// server refuses the connection's credential (nats: Authorization
	// Violation), Connect's error names NARWHAL_NATS_CREDS and this role's
	// file of `narwhal bus creds` (breaker.creds, …; for RoleRouter and
	// RoleEngine the identity's file of ID, router-<ID>.creds, R-BUS-11).
	Role string
	// ID is the engine's or router's id when Role is RoleEngine or
	// RoleRouter, so that a refused credential's error names the
	// identity's file (IdentityCredsFile) and the command that writes it;
	// "" otherwise.
	ID string
	// Setup, when set, makes this connection the admin's: Connect runs
	// Setup with it (creating or updating the stream and every bucket)
	// before binding. Nil for every other role, which only binds.
	Setup *SetupOptions
	// Buckets are the buckets besides narwhal_placement that the process
	// binds to (e.g. LeaseBucket, FleetBucket): Connect returns only once
	// each exists, so that a process does not start on half a set-up.
	Buckets []string
	// Streams are the streams besides NARWHAL_EVENTS that the process
	// reads or writes (e.g. RegistrationsStream): Connect returns only
	// once each exists, as with Buckets.
	Streams []string
	// WaitSetUp, when set, makes Connect wait while the stream or a bucket
	// it binds to does not exist — a bus whose `narwhal bus setup` has not
	// run yet — instead of returning a *NotSetUpError at once: the process
	// starts in any order and goes on by itself once the set-up has run
	// (docs/mesh.md, "Start-up: what a process waits for"). Nil: a missing
	// stream or bucket is an error at once.
	WaitSetUp *SetUpWait
	// ReadDirect, when set, makes the connection's readers read by
	// direct gets, without consumers, whatever its credential
	// (ReadsDirect; behaviour.md R-BUS-11). A role's credential reads so
	// anyway; set it to read so on a dev bus.
	ReadDirect bool
	// ReachTimeout, when > 0, bounds the wait for a server to answer: past
	// it Connect gives up with ErrUnreachable even though ctx has not
	// ended. The wait for the set-up that follows is bounded by ctx alone.
	// 0: ctx bounds both.
	ReachTimeout time.Duration
	// PermissionDenied, when set, is called with each permissions
	// violation the server reports on the connection (an act the
	// credential does not allow, R-BUS-8; nats.go's error handler
	// goroutine calls it), instead of logging it: a command that says the
	// denial itself stops at once rather than waiting for the act's
	// timeout, as NATS drops what it denies. Bus.PermissionError records
	// it either way.
	PermissionDenied func(error)
}

// NotSetUpLogEvery is how often a Connect waiting for the set-up
// (ConnectOptions.WaitSetUp) repeats its log line while what is missing
// stays the same: once at first, then at this interval, not per retry.
const NotSetUpLogEvery = 30 * time.Second

// SetUpWait says how a Connect waits for a bus that is not set up yet
// (ConnectOptions.WaitSetUp).
type SetUpWait struct {
	// LogEvery is how often the log line "waiting for the bus to be set
	// up" is repeated while the same stream or bucket is missing; 0 means
	// NotSetUpLogEvery. A different missing one is logged at once.
	LogEvery time.Duration
	// Now is the clock of LogEvery; nil: time.Now.
	Now func() time.Time
	// Missing, when set, is called with the stream or bucket found missing
	// each time that changes, and once with nil when everything exists
	// (e.g. to update what a router's /readyz says, NotSetUpError.Problem).
	Missing func(*NotSetUpError)
}

// setUpLog decides when a Connect waiting for the set-up logs: the first
// time, whenever what is missing changes, and then every interval.
type setUpLog struct {
	every time.Duration
	now   func() time.Time
	last  time.Time
	said  string // the problem last logged; "" before the first
}

// newSetUpLog is the setUpLog of w.
func newSetUpLog(w SetUpWait) *setUpLog {
	l := &setUpLog{every: w.LogEvery, now: w.Now}
	if l.every <= 0 {
		l.every = NotSetUpLogEvery
	}
	if l.now == nil {
		l.now = time.Now
	}
	return l
}

// due reports whether problem is to be logged now, and if so notes it.
func (l *setUpLog) due(problem string) bool {
	t := l.now()
	if problem == l.said && t.Sub(l.last) < l.every {
		return false
	}
	l.said, l.last = problem, t
	return true
}

// Bus is one connection to NATS bound to the events stream and the
// placement bucket. It is safe for concurrent use.
type Bus struct {
	nc        *nats.Conn
	js        jetstream.JetStream
	placement jetstream.KeyValue
	// denied is the last permissions violation the server reported for
	// this connection, or nil.
	denied atomic.Pointer[error]
	// dialErr is the last failed connection attempt, or nil.
	dialErr atomic.Pointer[error]
	// closing is set by Close, so that its own disconnect is not logged.
	closing atomic.Bool
	// refused is set once the server revoked or refused the credential
	// (CredentialRefused).
	refused refusal
	// log is ConnectOptions.Log (nil: no logs), also the publishers'.
	log *slog.Logger
	// inProcess is the embedded server's client URL when the connection
	// is in-process (where nats.Conn reports the library's default URL),
	// empty otherwise.
	inProcess string
	// setupWrites counts what Setup created or updated (SetupWrites).
	setupWrites int
	// consumerKey names this connection's consumers (ConsumerName).
	consumerKey []byte
	// direct is set when the connection's readers make no consumer and
	// read by direct gets (ReadsDirect).
	direct bool
}

// ReadsDirect reports whether this connection's readers (StartReader,
// WatchBucket, ReadBucket, WatchKeys, SubscribeResuming) read by direct
// gets and make no consumer (behaviour.md R-BUS-11): with a role's
// credential (breaker, chaos, viewer, admin), or ConnectOptions.ReadDirect.
// An engine's or a router's identity, and a connection without a
// credential (a dev bus), read through consumers of its own names.
func (b *Bus) ReadsDirect() bool { return b.direct }

// URL returns the server this connection is on, for logs: the connected
// server's URL with any password redacted, or for an in-process connection
// the embedded server's client URL ("in-process" when it has no TCP
// listener).
func (b *Bus) URL() string {
	if b.inProcess != "" {
		return b.inProcess
	}
	return b.nc.ConnectedUrlRedacted()
}

// Connect connects to NATS and binds to stream NARWHAL_EVENTS and KV
// bucket narwhal_placement (and checks opts.Buckets) as they exist: it creates and changes nothing
// unless opts.Setup is set (the admin, R-BUS-8). A stream or bucket that
// does not exist is a *NotSetUpError naming it and the command that
// creates it.
//
// The connection reconnects forever after a disconnect (R-BUS-6). While
// the server cannot be reached, or answers that JetStream is not ready,
// Connect keeps trying until ctx ends (logging what it waits for at once
// and every 5 s when opts.Log is set); it returns an error at once for bad
// options (missing URL, unreadable credentials or TLS files), when the
// server refuses the credential (authorization violation) or a permission
// the role lacks, or when the stream or a bucket is missing — unless
// opts.WaitSetUp is set: then it waits for the set-up too, and when ctx
// ends first its error is the *NotSetUpError of what was still missing.
// With opts.CredsFile, every reply (requests, JetStream API calls, KV
// gets, consumers' deliveries) comes to the inbox prefix the credential's
// user name names (behaviour.md R-BUS-11); a file that holds no user JWT
// is an error at once. The caller owns the Bus and must Close it.
func Connect(ctx context.Context, opts ConnectOptions) (*Bus, error) {
	b := &Bus{log: opts.Log, refused: refusal{done: make(chan struct{})}}
	log := opts.Log
	nopts := []nats.Option{
		nats.MaxReconnects(-1),
		nats.ReconnectWait(reconnectWait),
		// No reconnect buffer: what is published while the connection is
		// down fails at once instead of going out after the reconnect.
		// Buffered, the tail of an event window that the outage cut would
		// be stored before its head, which the Publisher sends again only
		// then (R-BUS-10: each publisher's order is kept); a buffered lease
		// or placement write would arrive late. Every writer retries or
		// gives up on an error already.
		nats.ReconnectBufSize(-1),
		nats.RetryOnFailedConnect(true),
		// nats.go closes the connection when a server refused the
		// credential twice in a row (R-BUS-11: a revoked one is refused
		// for good): record why, so that the process says it.
		nats.ClosedHandler(func(nc *nats.Conn) {
			if err := nc.LastError(); !b.closing.Load() && authRefusal(err) {
				b.refuse(err, opts)
			}
		}),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				b.dialErr.Store(&err)
			}
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrPermissionViolation) {
				b.denied.Store(&err)
			}
			if revokedErr(err) {
				// The server closes a revoked user's connection and
				// refuses its new ones: the connection is lost for good.
				b.refuse(err, opts)
			}
			if opts.PermissionDenied != nil && errors.Is(err, nats.ErrPermissionViolation) {
				opts.PermissionDenied(err)
				return
			}
			if log == nil {
				return
			}
			subject := ""
			if sub != nil {
				subject = sub.Subject
			}
			log.Warn("bus async error", "subject", subject, "err", err)
		}),
	}
	if opts.Name != "" {
		nopts = append(nopts, nats.Name(opts.Name))
	}
	if opts.TokenFile != "" && opts.CredsFile != "" {
		return nil, fmt.Errorf("bus: NARWHAL_NATS_TOKEN_FILE=%s and NARWHAL_NATS_CREDS=%s: set one, not both (a token's identity comes from narwhal bus authd)", opts.TokenFile, opts.CredsFile)
	}
	if opts.CredsFile != "" {
		if _, err := os.Stat(opts.CredsFile); err != nil {
			return nil, fmt.Errorf("bus: the credential NARWHAL_NATS_CREDS=%s cannot be read (%w): set it to %s (written by %s, docs/mesh.md)", opts.CredsFile, err, roleFile(opts), writtenBy(opts))
		}
		nopts = append(nopts, nats.UserCredentials(opts.CredsFile))
		// The credential may subscribe to its own inbox prefix only
		// (behaviour.md R-BUS-11): every reply comes there.
		name, err := credsUserName(opts.CredsFile)
		if err != nil {
			return nil, fmt.Errorf("bus: the credential NARWHAL_NATS_CREDS=%s: %w: set it to %s (written by %s, docs/mesh.md)", opts.CredsFile, err, roleFile(opts), writtenBy(opts))
		}
		if name != "" {
			nopts = append(nopts, nats.CustomInboxPrefix("_INBOX."+name))
		}
	}
	// The names of its consumers (behaviour.md R-BUS-11): an identity's
	// come from its credential's seed, or from its pod's UID.
	key, identity, err := consumerKey(opts.CredsFile)
	if err != nil {
		return nil, fmt.Errorf("bus: the credential NARWHAL_NATS_CREDS=%s: %w: set it to %s (written by %s, docs/mesh.md)", opts.CredsFile, err, roleFile(opts), writtenBy(opts))
	}
	if opts.TokenFile != "" {
		tokenOpts, tokenKey, err := tokenOptions(opts)
		if err != nil {
			return nil, err
		}
		nopts = append(nopts, tokenOpts...)
		key, identity = tokenKey, true
	}
	b.consumerKey = key
	// A role's credential (breaker, chaos, viewer, admin) is shared by
	// several processes and owns no consumer: its readers read by direct
	// gets (behaviour.md R-BUS-11, StartReader).
	b.direct = opts.ReadDirect || opts.CredsFile != "" && !identity
	if opts.TLSCA != "" {
		nopts = append(nopts, nats.RootCAs(opts.TLSCA))
	}
	if opts.TLSCert != "" || opts.TLSKey != "" {
		nopts = append(nopts, nats.ClientCert(opts.TLSCert, opts.TLSKey))
	}
	if log != nil {
		nopts = append(nopts,
			nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
				if !b.closing.Load() { // closing on purpose is no news
					log.Warn("bus disconnected", "err", err)
				}
			}),
			nats.ReconnectHandler(func(nc *nats.Conn) {
				log.Info("bus reconnected", "url", nc.ConnectedUrlRedacted())
			}),
		)
	}
	url := opts.URL
	if opts.Embedded != nil {
		nopts = append(nopts, nats.InProcessServer(opts.Embedded.Server()))
		url = ""
		if b.inProcess = opts.Embedded.ClientURL(); b.inProcess == "" {
			b.inProcess = "in-process"
		}
	} else if url == "" {
		return nil, errors.New("bus: no NATS URL and no embedded server")
	}

	nc, err := nats.Connect(url, nopts...)
	if err != nil {
		return nil, fmt.Errorf("bus: connect: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("bus: jetstream: %w", err)
	}
	b.nc, b.js = nc, js
	reachCtx := ctx
	if opts.ReachTimeout > 0 {
		var cancel context.CancelFunc
		reachCtx, cancel = context.WithTimeout(ctx, opts.ReachTimeout)
		defer cancel()
	}
	if err := b.waitConnected(reachCtx, url, log); err != nil {
		nc.Close()
		return nil, credentialHint(err, opts)
	}
	if opts.Setup != nil {
		if err := Setup(ctx, b, *opts.Setup); err != nil {
			nc.Close()
			return nil, err
		}
	}
	var lastLog time.Time
	var setUp *setUpLog // set once a Connect with WaitSetUp found something missing
	var lastMissing *NotSetUpError
	for {
		err := b.bind(ctx, opts.Streams, opts.Buckets)
		if err == nil {
			if setUp != nil {
				if log != nil {
					log.Info("bus set up", "url", b.URL())
				}
				if opts.WaitSetUp.Missing != nil {
					opts.WaitSetUp.Missing(nil)
				}
			}
			return b, nil
		}
		var missing *NotSetUpError
		if opts.WaitSetUp != nil && errors.As(err, &missing) {
			if setUp == nil {
				setUp = newSetUpLog(*opts.WaitSetUp)
			}
			lastMissing = missing
			if changed := missing.Problem() != setUp.said; setUp.due(missing.Problem()) {
				if log != nil {
					log.Warn("waiting for the bus to be set up", "url", b.URL(), "problem", missing.Problem())
				}
				if changed && opts.WaitSetUp.Missing != nil {
					opts.WaitSetUp.Missing(missing)
				}
			}
			if !pause.For(ctx, setupRetryDelay) {
				nc.Close()
				return nil, fmt.Errorf("%w (gave up: %v)", err, context.Cause(ctx))
			}
			continue
		}
		if log != nil && retryable(nc, err) && time.Since(lastLog) >= waitLogEvery {
			log.Warn("waiting for the bus's JetStream", "url", b.URL(), "err", err)
			lastLog = time.Now()
		}
		if perm := b.PermissionError(); perm != nil {
			nc.Close()
			return nil, fmt.Errorf("%w (%v)", err, perm)
		}
		if ref := b.CredentialRefused(); ref != nil {
			nc.Close()
			return nil, ref
		}
		if !retryable(nc, err) {
			nc.Close()
			return nil, err
		}
		if !pause.For(ctx, setupRetryDelay) {
			connected := nc.IsConnected()
			nc.Close()
			if lastMissing != nil && ctx.Err() != nil {
				err = lastMissing // the last attempt was cut by ctx: say what was missing
			} else if connected {
				return nil, fmt.Errorf("%w (JetStream did not answer in time: no leader — a cluster without a quorum, "+
					"or still electing one; gave up: %v)", err, context.Cause(ctx))
			}
			return nil, fmt.Errorf("%w (gave up: %v)", err, context.Cause(ctx))
		}
	}
}

// credentialHint wraps err, when the server refused the connection's
// credential (an authorization violation: none was sent, or one of
// another mesh), with what to set: NARWHAL_NATS_CREDS and the file of
// opts.Role among those `narwhal bus creds` writes (docs/mesh.md,
// R-BUS-8). Any other err is returned as it is.
func credentialHint(err error, opts ConnectOptions) error {
	if !errors.Is(err, nats.ErrAuthorization) && !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
		return err
	}
	file := roleFile(opts)
	if opts.TokenFile != "" {
		return fmt.Errorf("%w: the bus's auth callout (narwhal bus authd) refused the token of NARWHAL_NATS_TOKEN_FILE=%s: "+
			"authd's log and its narwhal_authd_refused_total{reason} say why (an expired token, another audience or issuer, "+
			"a service account without a role; docs/kubernetes.md)", err, opts.TokenFile)
	}
	if opts.CredsFile == "" {
		return fmt.Errorf("%w: the bus requires a credential and none was given: set NARWHAL_NATS_CREDS to %s (written by %s, docs/mesh.md)", err, file, writtenBy(opts))
	}
	if revokedErr(err) || RevokedLocally(opts.CredsFile) {
		// Revoked by `narwhal bus revoke`: another file of this mesh
		// will not do, only a new credential (R-BUS-11).
		return fmt.Errorf("%w: the bus refused the credential NARWHAL_NATS_CREDS=%s: it was revoked (the account JWT in %s revokes its user): issue a new one with %s and start the process with it (docs/security.md, \"Revoking a credential\")", err, opts.CredsFile, filepath.Join(filepath.Dir(opts.CredsFile), AuthConfFile), writtenBy(opts))
	}
	return fmt.Errorf("%w: the bus refused the credential NARWHAL_NATS_CREDS=%s: set it to %s of this mesh (written by %s for the bus's --auth DIR, docs/mesh.md); a credential revoked by narwhal bus revoke needs a new one from that command", err, opts.CredsFile, file, writtenBy(opts))
}

// roleFile is the file of opts.Role among those `narwhal bus creds`
// writes (breaker.creds, …, router-<id>.creds for a router's or an
// engine's identity, R-BUS-11), or words for it when the role is not known.
func roleFile(opts ConnectOptions) string {
	switch {
	case opts.Role == "":
		return "the file of this process's role"
	case (opts.Role == RoleRouter || opts.Role == RoleEngine) && opts.ID != "":
		return IdentityCredsFile(opts.Role, opts.ID)
	case opts.Role == RoleRouter || opts.Role == RoleEngine:
		return IdentityCredsFile(opts.Role, "<id>") + " of this " + opts.Role
	}
	return CredsFile(opts.Role)
}

// writtenBy is the command that writes roleFile(opts).
func writtenBy(opts ConnectOptions) string {
	if opts.Role == RoleRouter || opts.Role == RoleEngine {
		id := opts.ID
		if id == "" {
			id = "ID"
		}
		return "`narwhal bus creds --out DIR --" + opts.Role + " " + id + "`"
	}
	return "`narwhal bus creds --out DIR`"
}

// credsUserName returns the user name in the JWT of NATS credentials file
// path ("" when the JWT names none, or one that is not a single subject
// token), or an error when the file holds no user JWT.
func credsUserName(path string) (string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	token, err := jwt.ParseDecoratedJWT(raw)
	if err != nil {
		return "", fmt.Errorf("no user JWT in it: %w", err)
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		return "", fmt.Errorf("no user JWT in it: %w", err)
	}
	if strings.ContainsAny(uc.Name, " \t\r\n.*>") {
		// Not one subject token (a user of one's own, say): the replies
		// keep nats.go's own inbox prefix, as the credential allows or not.
		return "", nil
	}
	return uc.Name, nil
}

// ErrUnreachable is wrapped by Connect's error when no server of the URL
// could be reached before its context ended.
var ErrUnreachable = errors.New("unreachable")

// waitConnected waits until the connection is up, logging what it waits
// for at once and every waitLogEvery. It fails when ctx ends first or the
// client gave up (an authorization violation closes it).
func (b *Bus) waitConnected(ctx context.Context, url string, log *slog.Logger) error {
	var lastLog time.Time
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for !b.nc.IsConnected() {
		if b.nc.IsClosed() {
			return fmt.Errorf("bus: connect %s: %w", RedactURL(url), b.lastDialError())
		}
		if log != nil && time.Since(lastLog) >= waitLogEvery && b.lastDialError() != nil {
			log.Warn("waiting for the bus", "url", RedactURL(url), "err", b.lastDialError())
			lastLog = time.Now()
		}
		select {
		case <-ctx.Done():
			err := b.lastDialError()
			if err == nil {
				err = nats.ErrNoServers
			}
			return fmt.Errorf("bus: connect %s: %w: %w (gave up: %v)", RedactURL(url), ErrUnreachable, err, context.Cause(ctx))
		case <-t.C:
		}
	}
	if !lastLog.IsZero() {
		log.Info("bus reachable", "url", b.URL())
	}
	return nil
}

// lastDialError is the last failed connection attempt's error, the
// connection's own last error, or nil.
func (b *Bus) lastDialError() error {
	if err := b.dialErr.Load(); err != nil {
		return *err
	}
	return b.nc.LastError()
}

// PermissionError returns the last permissions violation the server
// reported on this connection — an act the role's credential does not
// allow, e.g. "nats: permissions violation: Permissions Violation for
// Publish to "$KV.narwhal_placement.d1"" (R-BUS-8) — or nil. The act itself
// fails with no reply (a timeout), since NATS drops what it denies.
func (b *Bus) PermissionError() error {
	if err := b.denied.Load(); err != nil {
		return *err
	}
	return nil
}

// bind binds to the stream and the placement bucket, and checks that each
// of buckets exists.
func (b *Bus) bind(ctx context.Context, streams, buckets []string) error {
	ctx, cancel := context.WithTimeout(ctx, bindTimeout)
	defer cancel()
	for _, name := range append([]string{StreamName}, streams...) {
		if _, err := b.js.Stream(ctx, name); err != nil {
			if errors.Is(err, jetstream.ErrStreamNotFound) {
				return &NotSetUpError{What: "stream", Name: name}
			}
			return fmt.Errorf("bus: stream %s: %w", name, err)
		}
	}
	kv, err := b.BindBucket(ctx, PlacementBucket)
	if err != nil {
		return err
	}
	for _, name := range buckets {
		if _, err := b.BindBucket(ctx, name); err != nil {
			return err
		}
	}
	b.placement = kv
	return nil
}

// retryable reports whether a setup error may go away by waiting: the
// connection is down (not closed), or JetStream did not answer (yet), or a
// cluster is still placing replicas.
func retryable(nc *nats.Conn, err error) bool {
	if nc.IsClosed() || errors.Is(err, ErrNotSetUp) {
		return false
	}
	if errors.Is(err, errCreateRace) {
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && (apiErr.Code == 503 || apiErr.ErrorCode == jsErrCodeClusterNoPeers) {
		return true
	}
	return !nc.IsConnected() || Temporary(err)
}

// Temporary reports whether err, from a request to NATS or JetStream, may
// go away by waiting: a deadline or timeout, no responders (no stream
// answering a publish among them), JetStream not enabled (yet), or a connection that is down or reconnecting. Whether the
// connection itself is up is the caller's to add.
func Temporary(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, nats.ErrNoResponders) ||
		// A JetStream publish no stream answered: nobody leads the
		// stream yet (a cluster electing one, or without a quorum).
		errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, jetstream.ErrJetStreamNotEnabled) ||
		errors.Is(err, nats.ErrConnectionReconnecting) ||
		errors.Is(err, nats.ErrDisconnected)
}

// JetStream returns the Bus's JetStream context, for durable consumers and
// watches; bind buckets with BindBucket (R-BUS-7, R-BUS-8).
func (b *Bus) JetStream() jetstream.JetStream { return b.js }

// Conn returns the underlying NATS connection.
func (b *Bus) Conn() *nats.Conn { return b.nc }

// Placement returns KV bucket narwhal_placement (R-BUS-2): key = engine
// id, value = a schemas.Eligibility as JSON.
func (b *Bus) Placement() jetstream.KeyValue { return b.placement }

// Connected reports whether the connection is up right now. It is false
// while reconnecting (R-BUS-6) and after Close.
func (b *Bus) Connected() bool { return b.nc.IsConnected() }

// Close closes the connection; close every Publisher of the Bus first so
// they can drain. Safe to call more than once.
func (b *Bus) Close() {
	b.closing.Store(true)
	b.nc.Close()
}

// redactedSecret is what stands for a URL's password or token in logs and
// messages.
const redactedSecret = "xxxxx"

// RedactURL returns a NATS URL (or a comma-separated list) with any
// password or token replaced by redactedSecret, for logs and messages.
func RedactURL(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		u, err := url.Parse(strings.TrimSpace(p))
		if err != nil || u.User == nil {
			continue
		}
		if _, hasPassword := u.User.Password(); hasPassword {
			u.User = url.UserPassword(u.User.Username(), redactedSecret)
		} else {
			u.User = url.User(redactedSecret) // a token
		}
		parts[i] = u.String()
	}
	return strings.Join(parts, ",")
}
