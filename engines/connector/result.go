package connector

import (
	"encoding/json"
	"time"
)

// PrefillResult is the outcome of one prefill leg: the handoff descriptor
// the producer returned, bound to where and when it came from (behaviour.md
// R-LEG-2). engines.Client.Prefill builds it; pass it unchanged to
// engines.Client.Decode. It is immutable once built and safe to share.
type PrefillResult struct {
	// ProducerID is the producer's engine id.
	ProducerID string
	// ProducerURL is the producer's base URL, e.g. "http://10.0.0.11:8000".
	ProducerURL string
	// Endpoint is the path the prefill ran on, "/v1/chat/completions" or
	// "/v1/completions"; the decode must use the same (R-DESC-4).
	Endpoint string
	// RequestID is the attempt's backend request id, sent as X-Request-Id
	// on both legs (R-OWN-4).
	RequestID string
	// Connector is the producer's connector name, e.g. "nixl".
	Connector string
	// Started is when the producer HTTP leg started; handoff age counts
	// from here (R-OWN-2).
	Started time.Time
	// Completed is when the producer HTTP leg completed.
	Completed time.Time
	// Handoff is the identity the descriptor names; zero for same-worker.
	Handoff Handoff

	// descriptor is the validated kv_transfer_params, byte-for-byte as the
	// producer sent it (R-DESC-5); nil for a same-worker attempt.
	descriptor []byte
}

// NewPrefillResult returns a PrefillResult holding a private copy of
// descriptor (nil for a same-worker attempt, whose decode carries no
// transfer parameters, R-LEG-4). The other fields are copied from meta.
func NewPrefillResult(meta PrefillResult, descriptor []byte) *PrefillResult {
	r := meta
	if descriptor != nil {
		r.descriptor = append([]byte(nil), descriptor...)
	} else {
		r.descriptor = nil
	}
	return &r
}

// HasDescriptor reports whether the result carries a descriptor (false for
// a same-worker attempt).
func (r *PrefillResult) HasDescriptor() bool { return r.descriptor != nil }

// Parameters returns a detached copy of the descriptor as a JSON object
// (map of field name to decoded value; numbers are float64 as
// encoding/json decodes them), or nil when there is none. Changing the
// returned map changes nothing inside r (behaviour.md §12).
func (r *PrefillResult) Parameters() map[string]any {
	if r.descriptor == nil {
		return nil
	}
	var m map[string]any
	if err := json.Unmarshal(r.descriptor, &m); err != nil {
		return nil // cannot happen: the descriptor was validated as an object
	}
	return m
}

// AppendDescriptor appends the descriptor's JSON, byte-for-byte as the
// producer sent it, to dst and returns the extended slice. With no
// descriptor it returns dst unchanged.
func (r *PrefillResult) AppendDescriptor(dst []byte) []byte {
	return append(dst, r.descriptor...)
}

// Age returns how long ago the producer HTTP leg started, as of now
// (R-OWN-2).
func (r *PrefillResult) Age(now time.Time) time.Duration { return now.Sub(r.Started) }
