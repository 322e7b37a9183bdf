package router

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Client authentication (behaviour.md R-API-9). The router keeps the SHA-256 of
// every accepted key, never a key. A request's bearer token is hashed and
// the digest looked up in a map, then compared again with
// subtle.ConstantTimeCompare. The lookup's timing depends only on the
// digest of what the client sent, which the client can compute itself and
// cannot steer towards a stored digest without a SHA-256 preimage, so it
// tells nothing about the stored keys; and it costs the same for three keys
// or three thousand, where comparing against every key would grow with
// their number. The final constant-time compare keeps the equality test
// itself free of an early exit.

// clientKey is one accepted key as the request path sees it. It is
// immutable but for inflight, which is shared by every generation of the
// keyring that has a key of the same name (a reload keeps the count of the
// requests still running).
type clientKey struct {
	name     string
	digest   [sha256.Size]byte
	models   map[string]struct{} // nil: every model
	limit    int64               // max_inflight; 0: none
	inflight *atomic.Int64
	// removed is shared, like inflight, by every generation's key of
	// this name: set when a reload drops the name, cleared when one
	// brings it back. A request of a removed key that ends after the
	// reload counts nothing on the key's series, which the reload
	// deleted.
	removed *atomic.Bool
}

// allows reports whether the key may call model.
func (k *clientKey) allows(model string) bool {
	if k.models == nil {
		return true
	}
	_, ok := k.models[model]
	return ok
}

// keyring is one generation of the accepted keys, swapped as a whole on
// reload (no lock on the request path).
type keyring struct {
	byDigest map[[sha256.Size]byte]*clientKey
}

// auth is the router's client authentication state.
type auth struct {
	ring atomic.Pointer[keyring] // nil or empty: open router

	mu       sync.Mutex               // serialises reloads
	counters map[string]*atomic.Int64 // in-flight count per key name, kept across reloads
	removals map[string]*atomic.Bool  // clientKey.removed per key name, kept as counters are
	names    map[string]bool          // names of the current generation, for metric cleanup
}

// bearerPrefix is what an Authorization header starts with (RFC 6750; the
// scheme is case-insensitive).
var bearerPrefix = []byte("bearer ")

// open reports whether no key is configured: every client is admitted.
func (a *auth) open() bool {
	r := a.ring.Load()
	return r == nil || len(r.byDigest) == 0
}

// lookup returns the key whose token is in the request's Authorization
// header, nil when there is none or it matches no key. It allocates
// nothing.
func (a *auth) lookup(fctx *fasthttp.RequestCtx) *clientKey {
	return a.lookupHeader(&fctx.Request.Header)
}

// lookupHeader is lookup on a request's headers alone.
func (a *auth) lookupHeader(rh *fasthttp.RequestHeader) *clientKey {
	h := rh.Peek(fasthttp.HeaderAuthorization)
	if len(h) <= len(bearerPrefix) || !bytes.EqualFold(h[:len(bearerPrefix)], bearerPrefix) {
		return nil
	}
	token := bytes.TrimSpace(h[len(bearerPrefix):])
	if len(token) == 0 {
		return nil
	}
	digest := sha256.Sum256(token)
	k, ok := a.ring.Load().byDigest[digest]
	if !ok || subtle.ConstantTimeCompare(k.digest[:], digest[:]) != 1 {
		return nil
	}
	return k
}

// refuses reports, from a request's headers alone, whether it will get
// 401: keys are configured, its path is under /v1/ and it carries no
// valid key. The front door then neither reads its body nor counts it
// against server.max_body_bytes_inflight, so callers without a key cannot
// take the body budget from those with one. The handler checks again on
// the normalised path.
func (a *auth) refuses(h *fasthttp.RequestHeader) bool {
	return !a.open() && bytes.HasPrefix(h.RequestURI(), apiPrefix) && (a.lookupHeader(h) == nil || duplicateAuthorization(h))
}

// duplicateAuthorization reports whether the request carries more than
// one Authorization header. fasthttp keeps every copy and Peek returns the
// first, so two headers would let whichever came first decide; with keys
// configured such a request gets 400 instead (behaviour.md R-API-9). It
// allocates nothing once the header's scratch slice has grown.
func duplicateAuthorization(h *fasthttp.RequestHeader) bool {
	return len(h.PeekAll(fasthttp.HeaderAuthorization)) > 1
}

// duplicateAuthorizationMessage is the 400's message for a request with
// more than one Authorization header.
const duplicateAuthorizationMessage = "the request carries more than one Authorization header: send exactly one, Authorization: Bearer <key>"

// set installs keys as the new generation and returns the names that left
// (whose metric series the caller removes).
func (a *auth) set(keys []config.APIKey) (removed []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.counters == nil {
		a.counters = map[string]*atomic.Int64{}
		a.removals = map[string]*atomic.Bool{}
	}
	ring := &keyring{byDigest: make(map[[sha256.Size]byte]*clientKey, len(keys))}
	names := make(map[string]bool, len(keys))
	for _, ck := range keys {
		var digest [sha256.Size]byte
		if n, err := hex.Decode(digest[:], []byte(ck.KeySHA256)); err != nil || n != sha256.Size {
			continue // config.Validate rejects these
		}
		ctr := a.counters[ck.Name]
		if ctr == nil {
			ctr = new(atomic.Int64)
			a.counters[ck.Name] = ctr
		}
		gone := a.removals[ck.Name]
		if gone == nil {
			gone = new(atomic.Bool)
			a.removals[ck.Name] = gone
		}
		gone.Store(false)
		k := &clientKey{name: ck.Name, digest: digest, limit: int64(ck.MaxInflight), inflight: ctr, removed: gone}
		if len(ck.Models) > 0 {
			k.models = make(map[string]struct{}, len(ck.Models))
			for _, m := range ck.Models {
				k.models[m] = struct{}{}
			}
		}
		ring.byDigest[digest] = k
		names[ck.Name] = true
	}
	for n := range a.names {
		if !names[n] {
			removed = append(removed, n)
			if gone := a.removals[n]; gone != nil {
				gone.Store(true) // before the caller deletes the series
			}
		}
	}
	// Counters of keys gone for good are dropped once idle; a key that
	// comes back later starts from the requests still running, if any.
	for n, ctr := range a.counters {
		if !names[n] && ctr.Load() == 0 {
			delete(a.counters, n)
			delete(a.removals, n)
		}
	}
	a.names = names
	a.ring.Store(ring)
	return removed
}

// SetAPIKeys replaces the accepted client keys (behaviour.md R-API-9), e.g. after
// SIGHUP re-read the configuration; keys must be validated (config.Load
// does). Requests in flight keep running, also those of a key that is
// gone, and a key that stays keeps its in-flight count towards
// max_inflight. An empty list opens the router, with a warning.
func (rt *Router) SetAPIKeys(keys []config.APIKey) {
	removed := rt.auth.set(keys)
	for _, name := range removed {
		rt.metrics.requests.vec.DeletePartialMatch(prometheus.Labels{"key": name})
	}
	names := make([]string, 0, len(keys))
	for _, k := range keys {
		names = append(names, k.Name)
	}
	if len(keys) == 0 {
		rt.metrics.initKeys([]string{config.NoKeyName})
	} else {
		rt.metrics.initKeys(names)
	}
	if len(keys) == 0 {
		rt.log.Warn("client authentication is off: no auth.api_keys are configured, so any client may call /v1/*")
		return
	}
	rt.log.Info("client authentication on", "api_keys", len(keys), "names", names)
}

// authenticate admits a /v1/* request: on an open router it returns (nil,
// true); otherwise the request's key, or (nil, false) after answering 401
// (behaviour.md R-API-9) — or 400 naming the header when the request
// carries more than one Authorization header, whatever they hold. Both
// are counted with the key label "none" and publish no event, so a flood
// of them costs the bus nothing.
func (rt *Router) authenticate(fctx *fasthttp.RequestCtx) (*clientKey, bool) {
	if rt.auth.open() {
		return nil, true
	}
	if duplicateAuthorization(&fctx.Request.Header) {
		// Two credentials that may disagree: neither is believed, and the
		// answer says which header is wrong. Counted, no event, as a 401.
		if len(fctx.Response.Header.Peek("X-Request-Id")) == 0 {
			requestID(fctx)
		}
		fctx.SetConnectionClose() // the body may be on the wire, unread
		writeError(fctx, 400, duplicateAuthorizationMessage)
		rt.metrics.requests.inc(completionEndpoint(fctx), "400", "client_error", config.NoKeyName, otherModel)
		if rt.log.Enabled(context.Background(), slog.LevelDebug) {
			rt.log.Debug("request refused: "+duplicateAuthorizationMessage, "remote", fctx.RemoteAddr().String())
		}
		return nil, false
	}
	if k := rt.auth.lookup(fctx); k != nil {
		return k, true
	}
	msg := "invalid API key"
	if len(fctx.Request.Header.Peek(fasthttp.HeaderAuthorization)) == 0 {
		msg = "missing API key: send it as Authorization: Bearer <key>"
	}
	if len(fctx.Response.Header.Peek("X-Request-Id")) == 0 {
		requestID(fctx) // R-API-6: the completion handler, which sets it, does not run
	}
	fctx.Response.Header.Set(fasthttp.HeaderWWWAuthenticate, `Bearer realm="narwhal"`)
	writeError(fctx, 401, msg)
	rt.metrics.requests.inc(completionEndpoint(fctx), "401", "unauthenticated", config.NoKeyName, otherModel)
	if rt.log.Enabled(context.Background(), slog.LevelDebug) {
		rt.log.Debug("request refused: "+msg, "remote", fctx.RemoteAddr().String())
	}
	return nil, false
}

// completionEndpoint is the endpoint label of a request answered before
// its handler ran: its path when that is a completion endpoint, else "".
func completionEndpoint(fctx *fasthttp.RequestCtx) string {
	if endpoint := string(fctx.Path()); isCompletion(endpoint) {
		return endpoint
	}
	return ""
}

// isCompletion reports whether path is one of the two completion endpoints
// (a bounded endpoint label).
func isCompletion(path string) bool {
	return path == "/v1/chat/completions" || path == "/v1/completions"
}

// countRequest counts one ended request in narwhal_requests_total under
// its key's name — or under config.NoKeyName when a reload removed the key
// while the request ran, so that the series the reload deleted stay
// deleted (behaviour.md R-API-9: the key label's values are the configured
// names). The flag is checked again after the count: a reload that
// deleted the series between the check and the count is undone here.
func (rt *Router) countRequest(endpoint, code, outcome string, k *clientKey, model string) {
	if k == nil || k.removed.Load() {
		rt.metrics.requests.inc(endpoint, code, outcome, config.NoKeyName, model)
		return
	}
	rt.metrics.requests.inc(endpoint, code, outcome, k.name, model)
	if k.removed.Load() {
		rt.metrics.requests.vec.DeletePartialMatch(prometheus.Labels{"key": k.name})
	}
}

// keyName returns the name of k, or config.NoKeyName for nil.
func keyName(k *clientKey) string {
	if k == nil {
		return config.NoKeyName
	}
	return k.name
}

// admitKey applies the key's own rules to a parsed request (behaviour.md R-API-9):
// a model outside the key's list gets 403, a key at its max_inflight 429
// with Retry-After. On success the key's in-flight slot is taken; finish
// gives it back. It returns false after answering.
func (c *call) admitKey(fctx *fasthttp.RequestCtx) bool {
	k := c.key
	if k == nil {
		return true
	}
	if !k.allows(c.req.Model) {
		c.reject(fctx, 403, "the API key `"+k.name+"` may not use the model `"+schemas.BoundField(c.req.Model)+"`", "permission_denied")
		return false
	}
	if n := k.inflight.Add(1); k.limit > 0 && n > k.limit {
		k.inflight.Add(-1)
		fctx.Response.Header.Set(fasthttp.HeaderRetryAfter, "1")
		c.reject(fctx, 429, "the API key `"+k.name+"` already has "+strconv.FormatInt(k.limit, 10)+
			" requests in flight, its limit (max_inflight)", "key_limit")
		return false
	}
	c.holdKey = true
	return true
}

// releaseKey gives back the key's in-flight slot, once.
func (c *call) releaseKey() {
	if c.holdKey {
		c.holdKey = false
		c.key.inflight.Add(-1)
	}
}

// modelsFor filters the fleet's models to those key may call.
func modelsFor(k *clientKey, models []string) []string {
	if k == nil || k.models == nil {
		return models
	}
	out := models[:0:0]
	for _, m := range models {
		if k.allows(m) {
			out = append(out, m)
		}
	}
	return out
}

// lookupName returns the current key named name, nil when there is none
// (for tests and diagnostics).
func (a *auth) lookupName(name string) *clientKey {
	r := a.ring.Load()
	if r == nil {
		return nil
	}
	for _, k := range r.byDigest {
		if k.name == name {
			return k
		}
	}
	return nil
}
