package connector

import (
	"context"
	"net/http"
)

// SGLang is SGLang's prefill/decode disaggregation, its bootstrap
// protocol (behaviour.md R-DESC-7; docs/connectors.md). No descriptor passes
// through the router: the router writes
//
//	"bootstrap_host": "<the producer's host>",
//	"bootstrap_port": <the producer's bootstrap port>,
//	"bootstrap_room": <a fresh random 63-bit integer>
//
// (arrays of these when the request asks for several sequences) into the
// client's body and sends that same body to the producer and the consumer
// at once. The consumer meets the producer's bootstrap server in the room
// and receives the KV there; the client's answer is the consumer's; the
// producer's answer is watched, and discarded when it succeeds.
//
// The legs of an SGLang attempt run concurrently (Concurrent reports
// true), so HandoffRequest, Validate and Release, which serve
// descriptor-passing connectors, are never called on the request path;
// they answer as a connector without descriptors does.
type SGLang struct{}

// SGLangName is the configuration name of the SGLang connector.
const SGLangName = "sglang"

func init() { Register(SGLang{}) }

// Name returns "sglang".
func (SGLang) Name() string { return SGLangName }

// HandoffRequest returns nil: SGLang asks for no handoff in a transfer
// parameter; the bootstrap fields are the request's own members.
func (SGLang) HandoffRequest() []byte { return nil }

// Validate always rejects: an SGLang producer returns no descriptor, so
// one can never be checked (the attempt runs both legs at once instead).
func (SGLang) Validate([]byte) (Handoff, error) {
	return Handoff{}, reject(ReasonConnectorMismatch, "the sglang connector passes no descriptor")
}

// Release returns false with no error: SGLang frees a room's KV itself
// when the consumer never comes (its bootstrap timeout).
func (SGLang) Release(context.Context, *http.Client, string, []byte) (bool, error) {
	return false, nil
}

// ConcurrentLegs reports true: both legs of an attempt start at once with
// the same body (R-DESC-7).
func (SGLang) ConcurrentLegs() bool { return true }

// NeedsBootstrapPort reports true: a prefill-capable SGLang engine serves
// its KV on a bootstrap server whose port the fleet entry names
// (bootstrap_port).
func (SGLang) NeedsBootstrapPort() bool { return true }

// Concurrent reports whether c runs an attempt's two legs at once with the
// same body (SGLang's bootstrap protocol) instead of passing a descriptor
// from the prefill's answer to the decode (nixl).
func Concurrent(c Connector) bool {
	x, ok := c.(interface{ ConcurrentLegs() bool })
	return ok && x.ConcurrentLegs()
}

// NeedsBootstrapPort reports whether a prefill-capable engine with the
// connector registered as name must configure a bootstrap port (fleet
// entry bootstrap_port); false for an unknown name.
func NeedsBootstrapPort(name string) bool {
	c, err := Lookup(name)
	if err != nil {
		return false
	}
	x, ok := c.(interface{ NeedsBootstrapPort() bool })
	return ok && x.NeedsBootstrapPort()
}

// CheckEngine judges one engine's connector settings: the connector
// registered as name, its role and its bootstrap port (fleet entry
// bootstrap_port, 0 when absent). It returns "" when they fit together,
// else the fleet entry field at fault ("connector", "role" or
// "bootstrap_port") and what is wrong. An SGLang engine runs in one
// disaggregation mode, so its role is prefill or decode, never both; a
// prefill SGLang engine names its bootstrap port (1 to 65535); no other
// engine has one.
func CheckEngine(name string, role Role, bootstrapPort int) (field, problem string) {
	c, err := Lookup(name)
	if err != nil {
		return "connector", err.Error()
	}
	needs := NeedsBootstrapPort(name)
	switch {
	case Concurrent(c) && role == RoleBoth:
		return "role", "an " + name + " engine runs in one disaggregation mode: prefill or decode, not both"
	case bootstrapPort < 0 || bootstrapPort > 65535:
		return "bootstrap_port", "must be a port number (1 to 65535)"
	case needs && role.CanPrefill() && bootstrapPort == 0:
		return "bootstrap_port", "must be set on a prefill " + name + " engine (the port of its bootstrap server)"
	case !needs && bootstrapPort != 0:
		return "bootstrap_port", "only engines of a connector with a bootstrap server (sglang) have one, not " + name
	}
	return "", ""
}
