package bus

import (
	"encoding/json"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// LeaseKey is the key of the breakers' leader lease in LeaseBucket; its
// value is a Lease (behaviour.md R-BRK-8, R-BUS-9).
const LeaseKey = "leader"

// Lease is the value of LeaseKey: who holds the lease, since when, and in
// which term.
type Lease struct {
	// BreakerID is the leader's breaker_id.
	BreakerID string `json:"breaker_id"`
	// Since is when it took the lease (UTC).
	Since time.Time `json:"since"`
	// Term is the KV revision at which the leader created the key: unique
	// per lease taken, increasing from one leader to the next. The
	// creating write cannot know it and omits it (0); every renewal
	// carries it. Placement values carry it as lease_term (R-BUS-9).
	Term uint64 `json:"term,omitempty"`
}

// LeaseOf decodes a lease entry and returns the lease with its Term filled
// in (the entry's revision for the creating write). ok is false for a
// deleted key or a value that is not a lease.
func LeaseOf(e jetstream.KeyValueEntry) (l Lease, ok bool) {
	if e == nil || e.Operation() != jetstream.KeyValuePut {
		return l, false
	}
	if err := json.Unmarshal(e.Value(), &l); err != nil || l.BreakerID == "" {
		return Lease{}, false
	}
	if l.Term == 0 {
		l.Term = e.Revision()
	}
	return l, true
}
