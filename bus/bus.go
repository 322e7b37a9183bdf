// Package bus is Narwhal's link to NATS JetStream (SPEC §9): an embedded
// server for single-machine use and tests, the connection with its stream
// and placement bucket, a publisher that never blocks a request, an
// ordered subscription for tools, and validation of events against their
// JSON Schemas.
//
// Routers publish failure, quarantine, handoff and request events; the
// breaker publishes eligibility and probe events; all go to stream
// NARWHAL_EVENTS on subjects narwhal.events.<kind>.<id> (R-BUS-1). Placement
// eligibility lives in KV bucket narwhal_placement (R-BUS-2). Nothing here
// ever deletes or recreates a stream, bucket or consumer (R-BUS-7).
package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Names on the bus (SPEC R-BUS-1, R-BUS-2).
const (
	// StreamName is the JetStream stream that stores every event.
	StreamName = "NARWHAL_EVENTS"
	// PlacementBucket is the KV bucket of placement eligibility: key =
	// engine id, value = a schemas.Eligibility as JSON.
	PlacementBucket = "narwhal_placement"
	// SubjectPrefix starts every event subject:
	// narwhal.events.<kind>.<engine_id|router_id>.
	SubjectPrefix = "narwhal.events."
)

// Stream limits of NARWHAL_EVENTS.
const (
	// StreamMaxAge is how long events are kept.
	StreamMaxAge = 24 * time.Hour
	// StreamMaxBytes caps the stream's size; the oldest events go first.
	StreamMaxBytes = 1 << 30
	// StreamDuplicates is the window in which a re-published event id is
	// dropped as a duplicate (R-BUS-3).
	StreamDuplicates = 2 * time.Minute
)

// Connection tuning.
const (
	reconnectWait   = 250 * time.Millisecond
	setupTimeout    = 5 * time.Second
	setupRetryDelay = 250 * time.Millisecond
)

// ConnectOptions says where the bus is (SPEC R-BUS-4).
type ConnectOptions struct {
	// URL is the NATS server URL, e.g. NARWHAL_NATS_URL
	// ("nats://h1:4222,nats://h2:4222" for a cluster). Ignored when
	// Embedded is set.
	URL string
	// Embedded, when set, connects in-process to that server (no TCP).
	Embedded *Embedded
	// Name is the client name the server shows, e.g. "narwhal-router-a".
	Name string
	// CredsFile is a NATS credentials file (JWT and seed), or "".
	CredsFile string
	// TLSCA is a PEM file of CAs to trust for the server's certificate,
	// or "".
	TLSCA string
	// TLSCert and TLSKey are the client certificate and key (PEM files)
	// for mutual TLS, or "".
	TLSCert, TLSKey string
	// Log, when set, receives disconnect, reconnect and async error
	// notices.
	Log *slog.Logger
	// Replicas is the number of replicas of the stream and of every
	// bucket Narwhal creates, for a NATS cluster (NARWHAL_NATS_REPLICAS);
	// 0 means 1. Every process of a mesh must use the same value, since
	// create-or-update applies it at each start.
	Replicas int
}

// Bus is one connection to NATS with the events stream and the placement
// bucket set up. It is safe for concurrent use.
type Bus struct {
	nc        *nats.Conn
	js        jetstream.JetStream
	placement jetstream.KeyValue
	replicas  int
}

// Connect connects to NATS and makes sure stream NARWHAL_EVENTS (subjects
// narwhal.events.>, file storage, max age 24 h, max 1 GiB, duplicate window
// 2 min) and KV bucket narwhal_placement exist, with CreateOrUpdate only:
// an existing stream or bucket is updated in place, never deleted or
// recreated (R-BUS-7).
//
// The connection reconnects forever after a disconnect (R-BUS-6). While the
// server cannot be reached, or answers that JetStream is not ready, Connect
// keeps trying until ctx ends; it returns an error at once for bad options
// (missing URL, unreadable credentials or TLS files) or when the server
// rejects the stream or bucket configuration. The caller owns the Bus and
// must Close it.
func Connect(ctx context.Context, opts ConnectOptions) (*Bus, error) {
	nopts := []nats.Option{
		nats.MaxReconnects(-1),
		nats.ReconnectWait(reconnectWait),
		nats.RetryOnFailedConnect(true),
	}
	if opts.Name != "" {
		nopts = append(nopts, nats.Name(opts.Name))
	}
	if opts.CredsFile != "" {
		nopts = append(nopts, nats.UserCredentials(opts.CredsFile))
	}
	if opts.TLSCA != "" {
		nopts = append(nopts, nats.RootCAs(opts.TLSCA))
	}
	if opts.TLSCert != "" || opts.TLSKey != "" {
		nopts = append(nopts, nats.ClientCert(opts.TLSCert, opts.TLSKey))
	}
	if log := opts.Log; log != nil {
		nopts = append(nopts,
			nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
				log.Warn("bus disconnected", "err", err)
			}),
			nats.ReconnectHandler(func(nc *nats.Conn) {
				log.Info("bus reconnected", "url", nc.ConnectedUrlRedacted())
			}),
			nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
				subject := ""
				if sub != nil {
					subject = sub.Subject
				}
				log.Warn("bus async error", "subject", subject, "err", err)
			}),
		)
	}
	url := opts.URL
	if opts.Embedded != nil {
		nopts = append(nopts, nats.InProcessServer(opts.Embedded.Server()))
		url = ""
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
	b := &Bus{nc: nc, js: js, replicas: max(opts.Replicas, 1)}
	for {
		err := b.setup(ctx)
		if err == nil {
			return b, nil
		}
		if !retryable(nc, err) {
			nc.Close()
			return nil, err
		}
		t := time.NewTimer(setupRetryDelay)
		select {
		case <-ctx.Done():
			t.Stop()
			nc.Close()
			return nil, fmt.Errorf("%w (gave up: %v)", err, context.Cause(ctx))
		case <-t.C:
		}
	}
}

// setup creates or updates the stream and the bucket.
func (b *Bus) setup(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, setupTimeout)
	defer cancel()
	want := jetstream.StreamConfig{
		Name:        StreamName,
		Description: "Narwhal events (failure, quarantine, handoff, request, probe, eligibility)",
		Subjects:    []string{SubjectPrefix + ">"},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		Storage:     jetstream.FileStorage,
		MaxAge:      StreamMaxAge,
		MaxBytes:    StreamMaxBytes,
		Duplicates:  StreamDuplicates,
		Replicas:    b.replicas,
	}
	// Update only what differs: every process starts with this, and a
	// stream update that races other processes' consumer creation is
	// needless churn on the server.
	if st, err := b.js.Stream(ctx, StreamName); err != nil || !sameStream(st.CachedInfo().Config, want) {
		if _, err := b.js.CreateOrUpdateStream(ctx, want); err != nil {
			return fmt.Errorf("bus: stream %s: %w", StreamName, err)
		}
	}
	kvWant := jetstream.KeyValueConfig{
		Bucket:      PlacementBucket,
		Description: "Narwhal placement eligibility by engine id",
		History:     1,
		Storage:     jetstream.FileStorage,
		Replicas:    b.replicas,
	}
	kv, err := b.js.KeyValue(ctx, PlacementBucket)
	if err == nil {
		if st, serr := kv.Status(ctx); serr != nil || st.History() != 1 || st.BackingStore() != "JetStream" {
			err = errors.New("bucket settings differ")
		} else if info, ierr := b.js.Stream(ctx, "KV_"+PlacementBucket); ierr != nil || info.CachedInfo().Config.Replicas != b.replicas {
			err = errors.New("bucket settings differ")
		}
	}
	if err != nil {
		if kv, err = b.js.CreateOrUpdateKeyValue(ctx, kvWant); err != nil {
			return fmt.Errorf("bus: bucket %s: %w", PlacementBucket, err)
		}
	}
	b.placement = kv
	return nil
}

// sameStream reports whether the settings Narwhal manages are as wanted.
func sameStream(have, want jetstream.StreamConfig) bool {
	return slices.Equal(have.Subjects, want.Subjects) && have.Retention == want.Retention &&
		have.Discard == want.Discard && have.Storage == want.Storage && have.MaxAge == want.MaxAge &&
		have.MaxBytes == want.MaxBytes && have.Duplicates == want.Duplicates && have.Replicas == want.Replicas &&
		have.Description == want.Description
}

// retryable reports whether a setup error may go away by waiting: the
// connection is down, or JetStream did not answer (yet).
func retryable(nc *nats.Conn, err error) bool {
	return !nc.IsConnected() ||
		errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, nats.ErrNoResponders) ||
		errors.Is(err, jetstream.ErrJetStreamNotEnabled) ||
		errors.Is(err, nats.ErrConnectionReconnecting) ||
		errors.Is(err, nats.ErrDisconnected)
}

// Replicas returns the replica count for streams and buckets (at least 1);
// other buckets a process creates use it too.
func (b *Bus) Replicas() int { return b.replicas }

// JetStream returns the Bus's JetStream context, for durable consumers,
// watches and other buckets (use CreateOrUpdate only, R-BUS-7).
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
func (b *Bus) Close() { b.nc.Close() }
