// Package connector defines how Narwhal asks a producer engine for a KV
// handoff, checks the handoff descriptor it returns, and binds that
// descriptor to the attempt that produced it (behaviour.md §2, §3).
//
// A connector is one KV transfer mechanism (vLLM's NixlConnector first).
// Adding another (LMCache, Mooncake, …) is one type that implements
// Connector and one line in the registry (see Register).
package connector

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"sync"
)

// Connector is one KV transfer mechanism. Implementations are stateless and
// safe for concurrent use.
type Connector interface {
	// Name is the connector's configuration name, e.g. "nixl".
	Name() string
	// HandoffRequest returns the kv_transfer_params JSON object that asks a
	// producer to keep the prompt's KV blocks for a remote consumer
	// (behaviour.md R-LEG-1). The returned slice is shared: callers must not
	// modify it.
	HandoffRequest() []byte
	// Validate checks the kv_transfer_params value of a prefill response
	// (raw JSON; nil, "null" or "{}" when the producer returned none) for a
	// crossed decode, following R-DESC-0, R-DESC-1, R-DESC-2 and the
	// connector-shape half of R-DESC-3. It returns the identity the
	// descriptor names, or a *RejectError.
	Validate(descriptor []byte) (Handoff, error)
	// Release frees a handoff's KV blocks at the producer when the
	// descriptor will not be consumed (behaviour.md R-OWN-6). It returns
	// released=false with a nil error when the producer has no way to
	// release early (the blocks then wait for the producer's own timeout);
	// an error means the attempt to release failed.
	Release(ctx context.Context, client *http.Client, producerURL string, descriptor []byte) (released bool, err error)
}

// Handoff is the identity a validated descriptor names.
type Handoff struct {
	// EngineID is the producer's engine identity inside the descriptor
	// (nixl: remote_engine_id).
	EngineID string
	// RequestID is the producer-side request id when the descriptor has
	// one (nixl: remote_request_id; older engines omit it).
	RequestID string
	// Blocks is the number of KV block ids the descriptor lists (summed
	// over KV-cache groups).
	Blocks int
}

// Rejection reasons, the suffixes of R-DESC-6's messages.
const (
	ReasonMissingDescriptor = "missing descriptor"
	ReasonMissingIdentity   = "missing engine identity"
	ReasonMalformedBlocks   = "malformed block ids"
	ReasonConnectorMismatch = "connector mismatch"
	ReasonEndpointMismatch  = "endpoint mismatch"
)

// RejectError is a rejected handoff descriptor (behaviour.md R-DESC-6). Its Error
// text is the client-facing message "handoff descriptor rejected: <reason>"
// followed, where useful, by a detail after " (".
type RejectError struct {
	// Reason is one of the Reason* constants.
	Reason string
	// Detail says what exactly was wrong; it may be empty.
	Detail string
}

// Error returns "handoff descriptor rejected: <reason>" with the detail in
// parentheses when there is one.
func (e *RejectError) Error() string {
	if e.Detail == "" {
		return "handoff descriptor rejected: " + e.Reason
	}
	return "handoff descriptor rejected: " + e.Reason + " (" + e.Detail + ")"
}

func reject(reason, format string, args ...any) *RejectError {
	d := ""
	if format != "" {
		d = fmt.Sprintf(format, args...)
	}
	return &RejectError{Reason: reason, Detail: d}
}

var (
	registryMu sync.RWMutex
	registry   = map[string]Connector{}
)

// Register makes c available under c.Name(). It panics if the name is
// taken, as registering twice is a programming error.
func Register(c Connector) {
	registryMu.Lock()
	defer registryMu.Unlock()
	if _, dup := registry[c.Name()]; dup {
		panic("connector: Register called twice for " + c.Name())
	}
	registry[c.Name()] = c
}

// Lookup returns the connector registered as name, or an error naming the
// known ones.
func Lookup(name string) (Connector, error) {
	registryMu.RLock()
	c, ok := registry[name]
	registryMu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("connector: unknown connector %q (known: %v)", name, Names())
	}
	return c, nil
}

// Names lists the registered connectors, sorted.
func Names() []string {
	registryMu.RLock()
	defer registryMu.RUnlock()
	out := make([]string, 0, len(registry))
	for n := range registry {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
