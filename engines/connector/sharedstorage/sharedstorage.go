// Package sharedstorage is the connector of engines that share a KV store
// (behaviour.md R-DESC-8; docs/connectors.md): vLLM's
// SharedStorageConnector, and LMCache-style prefill/decode
// disaggregation. The producer writes the prompt's KV blocks to the store
// both engines reach; the consumer finds them there by the prompt's
// prefix. No descriptor travels through the router: the prefill leg is
// the one-token prefill without kv_transfer_params, and the decode leg is
// the client's request as a same-worker decode sends it (R-LEG-4). What
// the router verifies is afterwards: the consumer's
// usage.prompt_tokens_details.cached_tokens (R-FAIL-8). The package
// registers the connector as "shared-storage".
package sharedstorage

import (
	"context"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
)

// SharedStorage is the shared-storage connector. It implements
// connector.Connector.
type SharedStorage struct{}

// Name is the configuration name of the shared-storage connector.
const Name = "shared-storage"

func init() { connector.Register(SharedStorage{}) }

// Name returns "shared-storage".
func (SharedStorage) Name() string { return Name }

// Fields returns none: the connector writes nothing into a request.
func (SharedStorage) Fields() []string { return nil }

// CheckEngine accepts every role; a shared-storage engine has no
// bootstrap port.
func (SharedStorage) CheckEngine(_ connector.Role, bootstrapPort int) (field, problem string) {
	return connector.NoBootstrapPort(Name, bootstrapPort)
}

// Start runs the prefill leg (no transfer parameters; whatever the
// producer returns in kv_transfer_params is not used) and then opens the
// decode leg with the client's request, unchanged but for streaming with
// usage (R-LEG-5). A consumer of another connector is refused before any
// leg starts (R-DESC-8). There is no handoff to check, release or
// abandon.
func (SharedStorage) Start(ctx context.Context, legs connector.Legs) (connector.Run, error) {
	if rej := connector.Mismatch(legs.Producer(), legs.Consumer()); rej != nil {
		return nil, rej
	}
	req := legs.Request()
	body := req.AppendPrefillBody(make([]byte, 0, req.Size()+96), nil)
	legs.Begin(connector.StepPrefill, connector.StepDetail{})
	ans, err := legs.Prefill(ctx, body)
	legs.PrefillEnded(nil)
	legs.End(connector.StepPrefill, err)
	if err != nil {
		return nil, err
	}
	r := &run{completed: ans.Completed}
	body = req.AppendDecodeBody(body[:0], nil)
	legs.Begin(connector.StepDecode, connector.StepDetail{})
	if err := legs.Decode(ctx, body); err != nil {
		return r, err
	}
	return r, nil
}

// run is a shared-storage attempt after its prefill: nothing is held for
// it anywhere but in the store, which the engines manage.
type run struct{ completed time.Time }

// Blame returns err: the decode fails on its own.
func (*run) Blame(err error) error { return err }

// Commit accepts: the KV is the consumer's once it streams.
func (*run) Commit() error { return nil }

// Abandon reports nothing: no descriptor was handed off (R-DESC-8).
func (*run) Abandon(string) (connector.Abandoned, bool) { return connector.Abandoned{}, false }

// Finish returns when the prefill completed.
func (r *run) Finish(time.Duration) (time.Time, error) { return r.completed, nil }
