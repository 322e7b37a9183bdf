// Package bustest starts embedded NATS buses for tests, as
// engines/sim/simtest starts simulators: set up, on a free port of
// 127.0.0.1, shut down when the test ends. It connects to them, records
// the events a subscription delivers, makes sample events and publishes
// events as the services do, and writes role credentials. It lives
// beside the bus rather than in internal/testkit so that testkit imports
// no package of the module; only tests import it.
package bustest

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
)

// callBound bounds each call to the bus (Connect, Publish): generous
// next to the milliseconds an embedded server takes.
const callBound = 10 * time.Second

// Start starts an embedded NATS server with JetStream listening on a free
// port of 127.0.0.1 (its ClientURL), set up in-process with the stream
// and every bucket at one replica (behaviour.md R-BUS-4, R-BUS-8), its
// store in a temporary directory removed when it stops. It is shut down
// when the test ends; a server that does not start fails the test.
func Start(t testing.TB) *bus.Embedded {
	t.Helper()
	return StartWith(t, bus.EmbeddedOptions{Port: -1})
}

// StartWith is Start with opts exactly as bus.StartEmbedded takes them:
// Port -1 is a free port and 0 no TCP listener at all (in-process
// connections only), an empty Dir a temporary store, AuthDir a
// credential set the server enforces (see Credentials), NoSetup a server
// without the stream and the buckets, and so on.
func StartWith(t testing.TB, opts bus.EmbeddedOptions) *bus.Embedded {
	t.Helper()
	e, err := bus.StartEmbedded(opts)
	if err != nil {
		t.Fatalf("embedded bus: %v", err)
	}
	t.Cleanup(e.Shutdown)
	return e
}

// Connect connects to e with opts — over TCP at e's ClientURL, or
// in-process when e has no listener; opts' URL and Embedded are set so,
// and an empty Name becomes the test's name — within 10 s, and closes the
// connection when the test ends (before e stops, when e was started
// first). A connection that fails fails the test.
func Connect(t testing.TB, e *bus.Embedded, opts bus.ConnectOptions) *bus.Bus {
	t.Helper()
	opts.URL, opts.Embedded = e.ClientURL(), nil
	if opts.URL == "" {
		opts.Embedded = e
	}
	if opts.Name == "" {
		opts.Name = t.Name()
	}
	ctx, cancel := context.WithTimeout(context.Background(), callBound)
	defer cancel()
	b, err := bus.Connect(ctx, opts)
	if err != nil {
		t.Fatalf("connecting to the embedded bus: %v", err)
	}
	t.Cleanup(b.Close)
	return b
}

// Credentials writes a new set of role credentials (bus.WriteCredentials:
// the operator, the accounts, a .creds file per role, behaviour.md
// R-BUS-8) into a new temporary directory of the test and returns the
// directory, for EmbeddedOptions.AuthDir. A failure fails the test.
func Credentials(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	if err := bus.WriteCredentials(dir); err != nil {
		t.Fatalf("credentials: %v", err)
	}
	return dir
}

// CredsFile is the path of role's credential (bus.RoleAdmin,
// bus.RoleViewer, …) in dir, a directory Credentials wrote, for
// ConnectOptions.CredsFile.
func CredsFile(dir, role string) string { return filepath.Join(dir, bus.CredsFile(role)) }

// Identity returns the path of engine or router id's own credential (kind
// bus.RoleEngine or bus.RoleRouter, behaviour.md R-BUS-11) in dir, a
// directory Credentials wrote, issuing it (bus.IssueIdentity) unless it is
// there already. A failure fails the test.
func Identity(t testing.TB, dir, kind, id string) string {
	t.Helper()
	path := filepath.Join(dir, bus.IdentityCredsFile(kind, id))
	if _, err := os.Stat(path); err == nil {
		return path
	}
	if _, err := bus.IssueIdentity(dir, kind, id); err != nil {
		t.Fatalf("identity: %v", err)
	}
	return path
}

// Event is one message of stream NARWHAL_EVENTS as a subscription
// delivers it: its subject (narwhal.events.<kind>.<id>, with a fifth
// token, the router's id, for a router's events about an engine) and JSON
// payload.
type Event struct {
	Subject string
	Payload []byte
}

// Events is what a subscription delivered so far, in stream order; it is
// safe to read while the subscription adds to it. The zero value is empty
// and ready to use, its Add the subscription's handler (Record does both).
type Events struct {
	mu  sync.Mutex
	all []Event
}

// Record subscribes to b's events that filter selects (bus.Subscribe: ""
// is every event; with deliverAll from the oldest stored, else from now)
// and records them until the test ends. A subscription that cannot start
// fails the test.
func Record(t testing.TB, b *bus.Bus, filter string, deliverAll bool) *Events {
	t.Helper()
	e := &Events{}
	stop, err := bus.Subscribe(context.Background(), b, filter, deliverAll, e.Add)
	if err != nil {
		t.Fatalf("subscribing to the events: %v", err)
	}
	t.Cleanup(stop)
	return e
}

// Add records one delivered event; it keeps payload (bus.Subscribe lets
// its handler keep it).
func (e *Events) Add(subject string, payload []byte) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.all = append(e.all, Event{Subject: subject, Payload: payload})
}

// Len returns how many events were recorded.
func (e *Events) Len() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.all)
}

// At returns the i-th event recorded, from 0; i must be below Len.
func (e *Events) At(i int) Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.all[i]
}

// All returns the events recorded so far, a copy.
func (e *Events) All() []Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]Event(nil), e.all...)
}

// Of returns the payloads recorded on narwhal.events.<kind>.<id> or
// narwhal.events.<kind>.<id>.<router_id> (kind one of schemas' Kind
// values, id the engine's or router's: the token after the kind), in
// stream order.
func (e *Events) Of(kind, id string) [][]byte {
	subject := bus.SubjectPrefix + kind + "." + id
	e.mu.Lock()
	defer e.mu.Unlock()
	var out [][]byte
	for _, ev := range e.all {
		if rest, ok := strings.CutPrefix(ev.Subject, subject); ok && (rest == "" || rest[0] == '.') {
			out = append(out, ev.Payload)
		}
	}
	return out
}

// FreePorts returns n TCP ports of 127.0.0.1 that were free when asked
// (each listened on and closed again), for a cluster's route ports that
// must be known before its servers start. Another process may take one
// in between; a server that then cannot listen fails its test. An error
// listening fails the test.
func FreePorts(t testing.TB, n int) []int {
	t.Helper()
	ports := make([]int, n)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ports[i] = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	return ports
}
