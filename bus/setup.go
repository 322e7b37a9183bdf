package bus

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/internal/pause"
	"github.com/narwhalmesh/narwhal/schemas"
)

// The buckets besides narwhal_placement (behaviour.md R-BRK-8, R-CHAOS-1). They
// are named here, with the stream and the placement bucket, because one
// process — the admin (`narwhal bus`, `narwhal bus setup`, an embedded
// server) — creates all of them and everyone else only binds (R-BUS-8).
const (
	// LeaseBucket is the KV bucket of the breaker's leader lease (key
	// "leader"); its TTL is the lease TTL.
	LeaseBucket = "narwhal_breaker"
	// ChaosBucket is the KV bucket of armed chaos faults, key
	// <engine_id>.<fault_id>.
	ChaosBucket = "narwhal_chaos"
	// FleetBucket is the KV bucket of the live fleet (behaviour.md R-FLEET-1):
	// key = engine id, value = a schemas.FleetEntry as JSON
	// (narwhal.engine.v1). Per-key TTLs are allowed, for registrations
	// (R-FLEET-4).
	FleetBucket = "narwhal_fleet"
	// RoutersBucket is the KV bucket of the routers' in-flight reports
	// (behaviour.md R-FLEET-3): key = router id, value = a schemas.RouterReport
	// (narwhal.router.v1), rewritten every second; its TTL
	// (RouterReportTTL) removes a stopped router's key.
	RoutersBucket = "narwhal_routers"
	// SchemasBucket is the KV bucket of the JSON Schemas of every bus
	// event and bucket value (behaviour.md R-BUS-3): key = schema name (e.g.
	// "narwhal.request.v1"), value = the schema file of schemas.SchemaFS,
	// byte for byte. Setup writes them, so that a dashboard on the bus
	// finds the schema a message's "schema" field names; the viewer role
	// reads them.
	SchemasBucket = "narwhal_schemas"
	// ChaosProxyService is the NATS service (nats.go's micro protocol)
	// every chaos proxy answers as, naming its engine in its metadata.
	ChaosProxyService = "narwhal-chaos-proxy"
)

// Settings of the buckets Setup creates.
const (
	// DefaultLeaseTTL is the lease bucket's TTL when SetupOptions.LeaseTTL
	// is 0: the default of breaker.lease_ttl_s.
	DefaultLeaseTTL = 5 * time.Second
	// ChaosMaxAge is the chaos bucket's TTL, the longest a fault may stay
	// armed.
	ChaosMaxAge = 24 * time.Hour
	// RouterReportTTL is the TTL of bucket narwhal_routers: a router's
	// report older than this is gone, and with it the router from the
	// drain's count (its legs died with it).
	RouterReportTTL = 5 * time.Second
	// fleetLimitMarkerTTL is how long the fleet bucket keeps the marker a
	// key leaves when its own TTL ends (a lapsed registration), so that
	// watchers see the key go.
	fleetLimitMarkerTTL = time.Minute
	// chaosLimitMarkerTTL is how long the chaos bucket keeps the marker a
	// key leaves when its own TTL ends (per-key TTLs, NATS >= 2.11).
	chaosLimitMarkerTTL = time.Minute
)

// setupAttemptTimeout bounds one attempt of Setup; setupLogEvery is how
// often a waiting Setup says what it waits for.
const (
	setupAttemptTimeout = 5 * time.Second
	setupLogEvery       = 3 * time.Second
)

// SetupOptions are the admin's choices for the stream and the buckets
// (behaviour.md R-BUS-8).
type SetupOptions struct {
	// Replicas applies to a stream or bucket that Setup creates; one that
	// exists keeps its replicas (logged as found versus wanted). 0 means 1.
	Replicas int
	// LeaseTTL is the TTL of bucket narwhal_breaker, i.e. the breaker's
	// lease (breaker.lease_ttl_s); 0 means DefaultLeaseTTL.
	LeaseTTL time.Duration
	// Log receives one line per stream or bucket created or updated, each
	// replica count kept, and what a waiting Setup waits for; nil: silent.
	Log *slog.Logger
}

// NotSetUpError says that a stream or bucket a process binds to does not
// exist, and which command creates it (behaviour.md R-BUS-8).
type NotSetUpError struct {
	// What is "stream" or "bucket".
	What string
	// Name is the stream's or bucket's name.
	Name string
}

// Error names the missing stream or bucket and the commands that create it.
func (e *NotSetUpError) Error() string {
	return fmt.Sprintf("bus: %s %s does not exist: create it with `narwhal bus setup` (admin credential) "+
		"against this NATS, or run the bus with `narwhal bus`", e.What, e.Name)
}

// Problem is what is missing and the command that creates it, in the
// words a router's /readyz uses: "stream NARWHAL_EVENTS does not exist:
// run narwhal bus setup" (docs/mesh.md, "Start-up: what a process waits
// for").
func (e *NotSetUpError) Problem() string {
	return fmt.Sprintf("%s %s does not exist: run narwhal bus setup", e.What, e.Name)
}

// Is makes errors.Is(err, ErrNotSetUp) true for every NotSetUpError.
func (e *NotSetUpError) Is(target error) bool { return target == ErrNotSetUp }

// ErrNotSetUp matches every *NotSetUpError with errors.Is.
var ErrNotSetUp = errors.New("bus: not set up")

// streamConfig is stream NARWHAL_EVENTS as Setup creates it.
func streamConfig(replicas int) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        StreamName,
		Description: "Narwhal events (failure, quarantine, handoff, request, probe, eligibility)",
		Subjects:    []string{SubjectPrefix + ">"},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		Storage:     jetstream.FileStorage,
		MaxAge:      StreamMaxAge,
		MaxBytes:    StreamMaxBytes,
		Duplicates:  StreamDuplicates,
		MaxMsgSize:  StreamMaxMsgSize,
		Replicas:    replicas,
		// No rollup (behaviour.md R-BUS-11): a publish with a
		// Nats-Rollup header would wipe the subject or the stream. Purges
		// take the admin's credential; the admin may purge this stream.
		AllowRollup: false,
		// Direct gets (behaviour.md R-BUS-11): the role credentials'
		// processes read it without a consumer (StartReader).
		AllowDirect: true,
	}
}

// historyConfig is stream NARWHAL_HISTORY as Setup creates it: no
// subjects of its own, sourced from NARWHAL_EVENTS with one filter per
// HistoryKinds kind, limits by age (30 days) and size (512 MiB).
func historyConfig(replicas int) jetstream.StreamConfig {
	src := &jetstream.StreamSource{Name: StreamName}
	for _, k := range HistoryKinds {
		f := SubjectPrefix + k + ".>"
		src.SubjectTransforms = append(src.SubjectTransforms, jetstream.SubjectTransformConfig{Source: f, Destination: f})
	}
	return jetstream.StreamConfig{
		Name:        HistoryStream,
		Description: "Narwhal history: every event but request events, kept apart from them",
		Sources:     []*jetstream.StreamSource{src},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		Storage:     jetstream.FileStorage,
		MaxAge:      HistoryMaxAge,
		MaxBytes:    HistoryMaxBytes,
		MaxMsgSize:  StreamMaxMsgSize,
		Replicas:    replicas,
		// No rollup and no purge (behaviour.md R-BUS-11): nothing of
		// Narwhal purges the history.
		AllowRollup: false,
		DenyPurge:   true,
		AllowDirect: true, // read without a consumer, as NARWHAL_EVENTS
	}
}

// streamConfigs are the streams as Setup creates them, in that order:
// NARWHAL_EVENTS, NARWHAL_HISTORY, NARWHAL_PREFIX, NARWHAL_REGISTRATIONS.
func streamConfigs(replicas int) []jetstream.StreamConfig {
	return []jetstream.StreamConfig{streamConfig(replicas), historyConfig(replicas),
		prefixStreamConfig(replicas), registrationsStreamConfig(replicas)}
}

// bucketConfigs are the KV buckets as Setup creates them.
func bucketConfigs(replicas int, leaseTTL time.Duration) []jetstream.KeyValueConfig {
	return []jetstream.KeyValueConfig{
		{
			Bucket:      PlacementBucket,
			Description: "Narwhal placement eligibility by engine id",
			History:     1,
			Storage:     jetstream.FileStorage,
			Replicas:    replicas,
		},
		{
			Bucket:      LeaseBucket,
			Description: "Narwhal breaker leader lease",
			History:     1,
			TTL:         leaseTTL,
			Storage:     jetstream.FileStorage,
			Replicas:    replicas,
		},
		{
			Bucket:         FleetBucket,
			Description:    "Narwhal live fleet: engine spec and state by engine id",
			History:        1,
			Storage:        jetstream.FileStorage,
			LimitMarkerTTL: fleetLimitMarkerTTL,
			Replicas:       replicas,
		},
		{
			Bucket:      RoutersBucket,
			Description: "Narwhal routers: legs in flight by router id",
			History:     1,
			TTL:         RouterReportTTL,
			Storage:     jetstream.FileStorage,
			Replicas:    replicas,
		},
		{
			Bucket:      SchemasBucket,
			Description: "Narwhal JSON Schemas of events and bucket values by schema name",
			History:     1,
			Storage:     jetstream.FileStorage,
			Replicas:    replicas,
		},
		{
			Bucket:         ChaosBucket,
			Description:    "Narwhal chaos: armed faults by <engine_id>.<fault_id>",
			History:        1,
			TTL:            ChaosMaxAge,
			Storage:        jetstream.FileStorage,
			LimitMarkerTTL: chaosLimitMarkerTTL,
			Replicas:       replicas,
		},
	}
}

// Setup creates streams NARWHAL_EVENTS, NARWHAL_HISTORY, NARWHAL_PREFIX
// (the routers' prefix placements) and NARWHAL_REGISTRATIONS (the
// engines' registrations, R-FLEET-5) and buckets narwhal_placement,
// narwhal_breaker, narwhal_fleet, narwhal_routers, narwhal_schemas and
// narwhal_chaos on js, or updates those whose settings
// differ from Narwhal's — never deleting or recreating any (R-BUS-7), and
// never changing the replicas of one that exists: it logs the replicas it
// found against those it wanted and keeps them (R-BUS-8). It is the admin's
// act: `narwhal bus`, `narwhal bus setup` and embedded servers run it;
// every other process binds to what it made. It writes the JSON Schemas
// into narwhal_schemas (writeSchemas).
//
// While the server cannot be reached or JetStream is not ready (e.g. a
// cluster still forming a quorum), Setup keeps trying until ctx ends,
// logging what it waits for every few seconds. It returns an error when
// ctx ends first, or at once when the server refuses a configuration or
// the credential may not make it.
func Setup(ctx context.Context, b *Bus, opts SetupOptions) error {
	replicas := max(opts.Replicas, 1)
	leaseTTL := opts.LeaseTTL
	if leaseTTL <= 0 {
		leaseTTL = DefaultLeaseTTL
	}
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var lastLog time.Time
	for {
		err := b.setupOnce(ctx, streamConfigs(replicas), bucketConfigs(replicas, leaseTTL), log)
		if err == nil {
			return nil
		}
		if perm := b.PermissionError(); perm != nil {
			return fmt.Errorf("%w (%v)", err, perm)
		}
		if !retryable(b.nc, err) {
			return err
		}
		if time.Since(lastLog) >= setupLogEvery {
			log.Warn("bus setup waiting", "url", b.URL(), "err", err)
			lastLog = time.Now()
		}
		if !pause.For(ctx, setupRetryDelay) {
			return fmt.Errorf("%w (gave up: %v)", err, context.Cause(ctx))
		}
	}
}

// setupOnce is one attempt of Setup: it adds to b.setupWrites each
// stream, bucket and schema it creates or updates.
func (b *Bus) setupOnce(ctx context.Context, streams []jetstream.StreamConfig, buckets []jetstream.KeyValueConfig, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, setupAttemptTimeout)
	defer cancel()
	for _, want := range streams {
		wrote, err := ensureStream(ctx, b.js, want, log)
		if wrote {
			b.setupWrites++
		}
		if err != nil {
			return err
		}
	}
	for _, want := range buckets {
		wrote, err := ensureBucket(ctx, b.js, want, log)
		if wrote {
			b.setupWrites++
		}
		if err != nil {
			return err
		}
	}
	written, err := writeSchemas(ctx, b.js, log)
	b.setupWrites += written
	return err
}

// SetupWrites returns how many streams, buckets and schemas the set-up of
// this connection (ConnectOptions.Setup, or Setup on it) created or
// updated: 0 when everything already was as Narwhal wants it, or when no
// set-up ran. `narwhal bus setup` says "already set up: nothing to
// change" then, so that a credential that may only read (viewer.creds)
// is not taken for the admin's (behaviour.md R-BUS-8).
func (b *Bus) SetupWrites() int { return b.setupWrites }

// SetUpName is one stream or bucket that Setup creates: What is "stream"
// or "bucket" (as in NotSetUpError), Name its name (a bucket's own, not
// the KV_<bucket> of its stream).
type SetUpName struct {
	What, Name string
}

// SetUpNames returns every stream and bucket Setup creates, in the order
// it creates them (streams first). It is the one list of them: Setup,
// Replicas and `narwhal bus setup`'s report use it (behaviour.md R-BUS-8).
func SetUpNames() []SetUpName {
	var out []SetUpName
	for _, st := range streamConfigs(1) {
		out = append(out, SetUpName{What: "stream", Name: st.Name})
	}
	for _, kv := range bucketConfigs(1, DefaultLeaseTTL) {
		out = append(out, SetUpName{What: "bucket", Name: kv.Bucket})
	}
	return out
}

// writeSchemas puts every schema of schemas.SchemaFS into bucket
// narwhal_schemas under its name, skipping those already there byte for
// byte: a newer release's setup brings its schemas, and a rerun writes
// nothing. It returns how many it wrote.
func writeSchemas(ctx context.Context, js jetstream.JetStream, log *slog.Logger) (int, error) {
	written := 0
	kv, err := js.KeyValue(ctx, SchemasBucket)
	if err != nil {
		return written, fmt.Errorf("bus: bucket %s: %w", SchemasBucket, err)
	}
	files, err := fs.Glob(schemas.SchemaFS, "*.json")
	if err != nil {
		return written, fmt.Errorf("bus: schemas: %w", err)
	}
	for _, f := range files {
		want, err := schemas.SchemaFS.ReadFile(f)
		if err != nil {
			return written, fmt.Errorf("bus: schemas: %w", err)
		}
		name := strings.TrimSuffix(f, ".json")
		if have, err := kv.Get(ctx, name); err == nil && bytes.Equal(have.Value(), want) {
			continue
		} else if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
			return written, fmt.Errorf("bus: bucket %s: %s: %w", SchemasBucket, name, err)
		}
		if _, err := kv.Put(ctx, name, want); err != nil {
			return written, fmt.Errorf("bus: bucket %s: put %s: %w", SchemasBucket, name, err)
		}
		written++
	}
	if written > 0 {
		log.Info("bus: schemas written", "bucket", SchemasBucket, "schemas", written)
	}
	return written, nil
}

// Schema returns the JSON Schema named name (e.g. "narwhal.request.v1")
// as bucket narwhal_schemas holds it. It returns a *NotSetUpError when the
// bucket does not exist, jetstream.ErrKeyNotFound for an unknown name, and
// the server's error otherwise.
func (b *Bus) Schema(ctx context.Context, name string) ([]byte, error) {
	kv, err := b.BindBucket(ctx, SchemasBucket)
	if err != nil {
		return nil, err
	}
	e, err := kv.Get(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("bus: schema %s: %w", name, err)
	}
	return e.Value(), nil
}

// ensureStream creates want, or updates the stream when the settings
// Narwhal manages differ, keeping the replicas it has. wrote is true when it created or updated it.
func ensureStream(ctx context.Context, js jetstream.JetStream, want jetstream.StreamConfig, log *slog.Logger) (wrote bool, err error) {
	st, err := js.Stream(ctx, want.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		if _, err := js.CreateStream(ctx, want); err != nil {
			if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
				return false, fmt.Errorf("bus: create stream %s: %w: %w", want.Name, errCreateRace, err)
			}
			return false, fmt.Errorf("bus: create stream %s: %w", want.Name, err)
		}
		log.Info("bus: stream created", "stream", want.Name, "replicas", want.Replicas)
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("bus: stream %s: %w", want.Name, err)
	}
	have := st.CachedInfo().Config
	if have.DenyPurge {
		want.DenyPurge = true // a server cannot take it back
	}
	if have.Replicas != want.Replicas {
		log.Warn("bus: keeping the replicas of an existing stream", "stream", want.Name,
			"found", have.Replicas, "wanted", want.Replicas)
		want.Replicas = have.Replicas
	}
	if sameStream(have, want) {
		return false, nil
	}
	if _, err := js.UpdateStream(ctx, want); err != nil {
		return false, fmt.Errorf("bus: update stream %s: %w", want.Name, err)
	}
	log.Info("bus: stream updated to Narwhal's settings", "stream", want.Name)
	return true, nil
}

// sameStream reports whether the settings Narwhal manages are as wanted.
// A duplicate window Narwhal leaves to the server (0: its default) is as
// wanted whatever the server made of it.
func sameStream(have, want jetstream.StreamConfig) bool {
	return slices.Equal(have.Subjects, want.Subjects) && sameSources(have.Sources, want.Sources) &&
		have.MaxMsgSize == want.MaxMsgSize && have.Retention == want.Retention &&
		have.Discard == want.Discard && have.Storage == want.Storage && have.MaxAge == want.MaxAge &&
		have.MaxBytes == want.MaxBytes && (want.Duplicates == 0 || have.Duplicates == want.Duplicates) && have.Replicas == want.Replicas &&
		have.Description == want.Description &&
		unlimited(have.MaxMsgsPerSubject) == unlimited(want.MaxMsgsPerSubject) && have.AllowRollup == want.AllowRollup &&
		have.DenyDelete == want.DenyDelete && have.DenyPurge == want.DenyPurge &&
		have.AllowDirect == want.AllowDirect
}

// unlimited returns a stream limit with 0 (unset) as the server stores
// it, -1.
func unlimited(v int64) int64 {
	if v == 0 {
		return -1
	}
	return v
}

// sameSources reports whether two source lists name the same streams
// with the same filters.
func sameSources(have, want []*jetstream.StreamSource) bool {
	return slices.EqualFunc(have, want, func(a, b *jetstream.StreamSource) bool {
		return a.Name == b.Name && a.FilterSubject == b.FilterSubject &&
			slices.Equal(a.SubjectTransforms, b.SubjectTransforms)
	})
}

// ensureBucket creates want, or updates the bucket when the settings
// Narwhal manages differ, keeping the replicas it has. A server without
// per-key TTLs (NATS < 2.11) gets the bucket without limit markers. wrote is true when it created or
// updated it.
func ensureBucket(ctx context.Context, js jetstream.JetStream, want jetstream.KeyValueConfig, log *slog.Logger) (wrote bool, err error) {
	kv, err := js.KeyValue(ctx, want.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		_, err = js.CreateKeyValue(ctx, want)
		if errors.Is(err, jetstream.ErrLimitMarkerTTLNotSupported) {
			want.LimitMarkerTTL = 0
			_, err = js.CreateKeyValue(ctx, want)
		}
		if errors.Is(err, jetstream.ErrBucketExists) || errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return false, fmt.Errorf("bus: create bucket %s: %w: %w", want.Bucket, errCreateRace, err)
		}
		if err != nil {
			return false, fmt.Errorf("bus: create bucket %s: %w", want.Bucket, err)
		}
		if noRollupBucket(want.Bucket) {
			// nats.go makes every bucket with rollups allowed: take them
			// away at once (a set-up cut here does it on its next run).
			st, err := js.Stream(ctx, "KV_"+want.Bucket)
			if err != nil {
				return true, fmt.Errorf("bus: bucket %s: %w", want.Bucket, notReadyYet(err))
			}
			if err := updateNoRollupBucket(ctx, js, st.CachedInfo().Config, want); err != nil {
				return true, err
			}
		}
		log.Info("bus: bucket created", "bucket", want.Bucket, "replicas", want.Replicas)
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("bus: bucket %s: %w", want.Bucket, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return false, fmt.Errorf("bus: bucket %s: %w", want.Bucket, notReadyYet(err))
	}
	info := st.(*jetstream.KeyValueBucketStatus).StreamInfo()
	if have := info.Config.Replicas; have != want.Replicas {
		log.Warn("bus: keeping the replicas of an existing bucket", "bucket", want.Bucket,
			"found", have, "wanted", want.Replicas)
		want.Replicas = have
	}
	if want.LimitMarkerTTL != 0 && st.LimitMarkerTTL() == 0 && !info.Config.AllowMsgTTL {
		// Made by a server without per-key TTLs: leave it so.
		want.LimitMarkerTTL = 0
	}
	rollupsAsWanted := !noRollupBucket(want.Bucket) || !info.Config.AllowRollup && info.Config.DenyPurge
	if st.History() == int64(want.History) && st.TTL() == want.TTL && info.Config.Storage == want.Storage &&
		info.Config.Description == want.Description && st.LimitMarkerTTL() == want.LimitMarkerTTL && rollupsAsWanted &&
		info.Config.AllowDirect {
		return false, nil
	}
	if noRollupBucket(want.Bucket) {
		if err := updateNoRollupBucket(ctx, js, info.Config, want); err != nil {
			return false, err
		}
		log.Info("bus: bucket updated to Narwhal's settings", "bucket", want.Bucket)
		return true, nil
	}
	if _, err := js.UpdateKeyValue(ctx, want); err != nil {
		return false, fmt.Errorf("bus: update bucket %s: %w", want.Bucket, err)
	}
	log.Info("bus: bucket updated to Narwhal's settings", "bucket", want.Bucket)
	return true, nil
}

// noRollupBucket reports whether bucket allows no rollup and no purge
// (behaviour.md R-BUS-11): narwhal_routers, where every router writes its
// own key and a rollup on one key would wipe the others' reports. Nothing
// of Narwhal purges it (a router's report lapses by the bucket's TTL;
// nats.go's Delete writes a marker without a rollup, its Purge would need
// one). The buckets with limit markers (narwhal_fleet, narwhal_chaos) get
// rollups forced on by the server; they, narwhal_placement and
// narwhal_breaker each have a single writing role instead.
func noRollupBucket(bucket string) bool { return bucket == RoutersBucket }

// updateNoRollupBucket updates the stream of bucket want, whose config is
// have, to want's settings with no rollup and no purge. It goes to the
// stream, not through nats.go's UpdateKeyValue, which would ask for rollups
// and for purges again (the server refuses to take a purge ban back).
func updateNoRollupBucket(ctx context.Context, js jetstream.JetStream, have jetstream.StreamConfig, want jetstream.KeyValueConfig) error {
	cfg := have
	cfg.Description = want.Description
	cfg.MaxMsgsPerSubject = int64(max(want.History, 1))
	cfg.MaxAge = want.TTL
	cfg.Replicas = want.Replicas
	cfg.AllowRollup = false
	cfg.DenyPurge = true
	cfg.AllowDirect = true // as nats.go makes every bucket (R-BUS-11)
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		return fmt.Errorf("bus: update bucket %s: %w", want.Bucket, err)
	}
	return nil
}

// BindBucket returns KV bucket name as it exists on b, without creating or
// changing it (behaviour.md R-BUS-8). It returns a *NotSetUpError when the bucket
// does not exist, and the server's error (or the permission the
// credential lacks) otherwise.
func (b *Bus) BindBucket(ctx context.Context, name string) (jetstream.KeyValue, error) {
	kv, err := b.js.KeyValue(ctx, name)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, &NotSetUpError{What: "bucket", Name: name}
	}
	if err != nil {
		if perm := b.PermissionError(); perm != nil {
			return nil, fmt.Errorf("bus: bucket %s: %w (%v)", name, err, perm)
		}
		return nil, fmt.Errorf("bus: bucket %s: %w", name, err)
	}
	return kv, nil
}

// errCreateRace marks a create that another admin (e.g. another server of
// a cluster starting at the same time) won: the next attempt finds it.
var errCreateRace = errors.New("created meanwhile by another admin")

// notReadyYet returns err marked as errCreateRace when it says "stream
// not found" about a bucket's stream that was just found or created: on a
// cluster whose servers run set-up at once, the stream of a bucket just
// created answers "not found" for a moment (its replicas are still being
// placed), and the next attempt finds it. Any other error is returned as
// it is.
func notReadyYet(err error) error {
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("%w: %w", errCreateRace, err)
	}
	return err
}

// Replicas returns the replica count of each stream and bucket of
// SetUpNames as they are on the server, keyed by the stream's or
// bucket's name (e.g. "NARWHAL_EVENTS", "narwhal_placement"); a missing
// one is absent. It reads only (R-BUS-8) and returns the server's error
// for anything but a missing stream or bucket.
func (b *Bus) Replicas(ctx context.Context) (map[string]int, error) {
	out := map[string]int{}
	for _, n := range SetUpNames() {
		stream := n.Name
		if n.What == "bucket" {
			stream = "KV_" + n.Name
		}
		st, err := b.js.Stream(ctx, stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("bus: stream %s: %w", stream, err)
		}
		out[n.Name] = st.CachedInfo().Config.Replicas
	}
	return out, nil
}
