package router

import (
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// fasthttp's header hook (Server.HeaderReceived) sees a request's headers
// and nothing else: no RequestCtx, no place to leave a value for the
// handler. What the front door decides there — the request will get 401
// (R-API-9), or its body holds a reservation under
// server.max_body_bytes_inflight, or found no room (R-API-8) — travels to
// the handler, or to the error handler, in two headers of the request
// itself, and doorTickets is the one place that writes and reads them.

// Headers that carry the hook's decisions; a client's own copies are
// deleted by doorTickets.receive before anything is decided.
const (
	// authRefusedHeader marks a request the hook found without a valid
	// API key (R-API-9).
	authRefusedHeader = "X-Narwhal-Auth-Refused"
	// bodyHeader names a request's body ticket, or is bodyFull when no
	// reservation could be taken.
	bodyHeader = "X-Narwhal-Body-Ticket"
	bodyFull   = "full"
)

// ticketMargin is how long after its read deadline a body ticket nobody
// claimed is swept, and how often the sweep runs.
const ticketMargin = 250 * time.Millisecond

// doorTickets hands the header hook's decisions about a request to
// whichever handler ends it. A body reservation is a ticket: a random
// 64-bit number named in bodyHeader and recorded here with its bytes;
// the handler (or the error handler) claims it, once. A ticket nobody
// claimed within hold — the body's read deadline plus ticketMargin: the
// connection died, or the body never came — is swept, and sweep returns
// its bytes for the caller to give back, so no path leaks them. A
// client's own bodyHeader is deleted on arrival and, not knowing the
// numbers drawn, could not name an open ticket anyway. Safe for
// concurrent use.
type doorTickets struct {
	hold time.Duration
	open sync.Map // uint64 → *bodyTicket
}

// bodyTicket is one unclaimed body reservation.
type bodyTicket struct {
	bytes   int64
	expires int64 // unix nanoseconds
}

// receive starts a request without tickets: it deletes any copy of the
// ticket headers the client sent. The header hook calls it first.
func (t *doorTickets) receive(h *fasthttp.RequestHeader) {
	h.Del(bodyHeader)
	h.Del(authRefusedHeader)
}

// refuseAuth marks h as a request that will get 401 (R-API-9).
func (t *doorTickets) refuseAuth(h *fasthttp.RequestHeader) { h.Set(authRefusedHeader, "1") }

// authRefused reports whether h was marked by refuseAuth.
func (t *doorTickets) authRefused(h *fasthttp.RequestHeader) bool {
	return len(h.Peek(authRefusedHeader)) > 0
}

// issue records a ticket for n reserved body bytes and names it in h.
func (t *doorTickets) issue(h *fasthttp.RequestHeader, n int64) {
	tk := &bodyTicket{bytes: n, expires: time.Now().Add(t.hold).UnixNano()}
	id := rand.Uint64()
	for _, taken := t.open.LoadOrStore(id, tk); taken; _, taken = t.open.LoadOrStore(id, tk) {
		id = rand.Uint64()
	}
	var buf [16]byte
	h.SetBytesV(bodyHeader, strconv.AppendUint(buf[:0], id, 16))
}

// issueFull marks h as a request whose body found no room under the
// bound: it holds no ticket, and its body is not read.
func (t *doorTickets) issueFull(h *fasthttp.RequestHeader) { h.Set(bodyHeader, bodyFull) }

// full reports whether h was marked by issueFull, claiming nothing.
func (t *doorTickets) full(h *fasthttp.RequestHeader) bool {
	return string(h.Peek(bodyHeader)) == bodyFull
}

// claim takes the ticket named in h and removes the header: it returns
// the ticket's bytes, now the caller's to release (0 when h names none,
// or the ticket was swept or claimed before), and whether h was marked by
// issueFull.
func (t *doorTickets) claim(h *fasthttp.RequestHeader) (bytes int64, full bool) {
	v := h.Peek(bodyHeader)
	if len(v) == 0 {
		return 0, false
	}
	defer h.Del(bodyHeader)
	if string(v) == bodyFull {
		return 0, true
	}
	id, err := strconv.ParseUint(string(v), 16, 64)
	if err != nil {
		return 0, false
	}
	if tk, ok := t.open.LoadAndDelete(id); ok {
		return tk.(*bodyTicket).bytes, false
	}
	return 0, false
}

// sweep removes the tickets that expired before now (unix nanoseconds)
// and returns the sum of their bytes, now the caller's to release.
func (t *doorTickets) sweep(now int64) (bytes int64) {
	t.open.Range(func(k, v any) bool {
		if v.(*bodyTicket).expires < now {
			if tk, ok := t.open.LoadAndDelete(k); ok {
				bytes += tk.(*bodyTicket).bytes
			}
		}
		return true
	})
	return bytes
}
