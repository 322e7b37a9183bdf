package engines

import (
	"log/slog"
	"net/http"
	"strconv"
)

// Credential is an engine's API key (vLLM's --api-key) as the client sends
// it: "Authorization: Bearer <key>" on every request to the engine — both
// legs, releases, /v1/models, health checks and probes. The zero value
// sends nothing. Its String, GoString, LogValue and MarshalJSON forms are
// "[redacted]", so an Engine can be printed, logged or encoded without
// showing the key.
type Credential struct {
	header string // "Bearer <key>", or ""
}

// NewCredential returns the credential for apiKey; "" gives the zero
// Credential.
func NewCredential(apiKey string) Credential {
	if apiKey == "" {
		return Credential{}
	}
	return Credential{header: "Bearer " + apiKey}
}

// IsZero reports whether the credential sends nothing.
func (c Credential) IsZero() bool { return c.header == "" }

// Authorize sets h's Authorization header to the credential; a zero
// Credential leaves h unchanged.
func (c Credential) Authorize(h http.Header) {
	if c.header != "" {
		h["Authorization"] = []string{c.header}
	}
}

func (c Credential) shown() string {
	if c.header == "" {
		return ""
	}
	return "[redacted]"
}

// String returns "[redacted]", or "" for the zero Credential.
func (c Credential) String() string { return c.shown() }

// GoString returns the quoted String form.
func (c Credential) GoString() string { return strconv.Quote(c.shown()) }

// LogValue returns the String form for log/slog.
func (c Credential) LogValue() slog.Value { return slog.StringValue(c.shown()) }

// MarshalJSON returns the String form as a JSON string.
func (c Credential) MarshalJSON() ([]byte, error) { return []byte(strconv.Quote(c.shown())), nil }

// bearer is a RoundTripper that adds a Credential to requests that carry
// no Authorization header (for code that builds its own requests, such as
// a connector's release).
type bearer struct {
	base http.RoundTripper
	cred Credential
}

// RoundTrip sends a copy of req with the credential.
func (b bearer) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Header.Get("Authorization") == "" {
		req = req.Clone(req.Context())
		b.cred.Authorize(req.Header)
	}
	return b.base.RoundTrip(req)
}

// HTTPClientFor returns an *http.Client on the client's decode transport
// that sends e's credential on every request (the client's own
// HTTPClient when e has none), for requests built outside this package.
func (c *Client) HTTPClientFor(e *Engine) *http.Client {
	if e == nil || e.Credential.IsZero() {
		return c.http
	}
	base := c.http.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	return &http.Client{Transport: bearer{base: base, cred: e.Credential}}
}
