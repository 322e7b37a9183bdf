package bustest

import (
	"context"
	"encoding/json"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Mesh is an embedded, set-up bus on a fixed free port of 127.0.0.1, so
// that a test can stop it (Emb.Shutdown) and start it again at the same
// address (Start), with two connections: B, the process under test's,
// and Peer, another process's, which writes buckets and publishes as a
// breaker or another router would. Breaker "test-breaker" holds the
// leader lease in term Term (behaviour.md R-BUS-9). Everything is closed
// when the test ends.
type Mesh struct {
	t    testing.TB
	dir  string
	port int
	// Emb is the running server.
	Emb *bus.Embedded
	// B is the connection of the process under test.
	B *bus.Bus
	// Peer is another process's connection.
	Peer *bus.Bus
	// Term is the lease term of "test-breaker", which writes placement.
	Term uint64
}

// NewMesh starts the bus, connects B (named name) and Peer, and makes
// "test-breaker" the lease holder.
func NewMesh(t testing.TB, name string) *Mesh {
	m := &Mesh{t: t, dir: t.TempDir(), port: freePort(t)}
	m.Start()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var err error
	if m.B, err = bus.Connect(ctx, bus.ConnectOptions{URL: m.URL(), Name: name}); err != nil {
		t.Fatal(err)
	}
	if m.Peer, err = bus.Connect(ctx, bus.ConnectOptions{URL: m.URL(), Name: "peer"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.B.Close()
		m.Peer.Close()
		m.Emb.Shutdown()
	})
	m.Term = m.TakeLease("test-breaker")
	return m
}

func freePort(t testing.TB) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Start starts the server (again) on the mesh's port and store.
func (m *Mesh) Start() {
	emb, err := bus.StartEmbedded(bus.EmbeddedOptions{Dir: m.dir, Host: "127.0.0.1", Port: m.port})
	if err != nil {
		m.t.Fatal(err)
	}
	m.Emb = emb
}

// URL is the server's client URL, nats://127.0.0.1:<port>.
func (m *Mesh) URL() string { return "nats://127.0.0.1:" + strconv.Itoa(m.port) }

// TakeLease makes breaker id the holder of the leader lease (R-BUS-9)
// and returns its term.
func (m *Mesh) TakeLease(id string) uint64 {
	m.t.Helper()
	ctx := context.Background()
	kv, err := m.Peer.JetStream().CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bus.LeaseBucket, History: 1})
	if err != nil {
		m.t.Fatal(err)
	}
	_ = kv.Delete(ctx, bus.LeaseKey)
	v, _ := json.Marshal(bus.Lease{BreakerID: id, Since: time.Now().UTC()})
	rev, err := kv.Create(ctx, bus.LeaseKey, v)
	if err != nil {
		m.t.Fatal(err)
	}
	return rev
}

// SetEligible writes engine's placement value as the lease holder does:
// eligible, or ejected.
func (m *Mesh) SetEligible(engine string, eligible bool) {
	m.t.Helper()
	state := "eligible"
	if !eligible {
		state = "ejected"
	}
	ev := schemas.Eligibility{Envelope: schemas.Envelope{Schema: schemas.SchemaEligibility, ID: schemas.NewEventID(), At: time.Now().UTC(), BreakerID: "test-breaker", EngineID: engine},
		Eligible: eligible, State: state, LeaseTerm: m.Term}
	b, _ := json.Marshal(ev)
	if _, err := m.Peer.Placement().Put(context.Background(), engine, b); err != nil {
		m.t.Fatal(err)
	}
}

// PutFleet writes e as key's value of narwhal_fleet, as another process
// would: the schema and the times filled in, connector nixl and source
// command ("test") unless e names others.
func (m *Mesh) PutFleet(key string, e schemas.FleetEntry) {
	m.t.Helper()
	now := time.Now().UTC()
	e.Schema, e.At, e.Since = schemas.SchemaFleetEntry, now, now
	if e.Connector == "" {
		e.Connector = "nixl"
	}
	if e.Source == "" {
		e.Source, e.By = schemas.SourceCommand, "test"
	}
	b, _ := json.Marshal(e)
	m.PutFleetRaw(key, b)
}

// PutFleetRaw writes value, as it is, as key's value of narwhal_fleet.
func (m *Mesh) PutFleetRaw(key string, value []byte) {
	m.t.Helper()
	kv, err := m.Peer.BindBucket(context.Background(), bus.FleetBucket)
	if err != nil {
		m.t.Fatal(err)
	}
	if _, err := kv.Put(context.Background(), key, value); err != nil {
		m.t.Fatal(err)
	}
}
