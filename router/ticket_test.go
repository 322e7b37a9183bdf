package router

import (
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// openTickets counts the tickets not yet claimed or swept.
func openTickets(tk *doorTickets) int {
	n := 0
	tk.open.Range(func(any, any) bool { n++; return true })
	return n
}

// TestTicketIssueClaim proves a body ticket's round trip (R-API-8): issue
// names it in the request's header, claim returns its bytes once and
// removes the header; a request without a ticket claims nothing.
func TestTicketIssueClaim(t *testing.T) {
	tk := &doorTickets{hold: time.Minute}
	var h fasthttp.RequestHeader
	tk.receive(&h)
	tk.issue(&h, 1000)
	if len(h.Peek(bodyHeader)) == 0 || tk.full(&h) || tk.authRefused(&h) {
		t.Fatalf("after issue: %s %q, full %v, auth refused %v", bodyHeader, h.Peek(bodyHeader), tk.full(&h), tk.authRefused(&h))
	}
	if n, full := tk.claim(&h); n != 1000 || full {
		t.Fatalf("claim: %d %v, want 1000 false", n, full)
	}
	if v := h.Peek(bodyHeader); len(v) != 0 {
		t.Errorf("the ticket header is left after its claim: %q", v)
	}
	if n, full := tk.claim(&h); n != 0 || full {
		t.Errorf("a second claim: %d %v, want 0 false", n, full)
	}
	if n := openTickets(tk); n != 0 {
		t.Errorf("%d tickets open after the claim", n)
	}

	// Two requests, two tickets, each its own.
	var a, b fasthttp.RequestHeader
	tk.issue(&a, 10)
	tk.issue(&b, 20)
	if string(a.Peek(bodyHeader)) == string(b.Peek(bodyHeader)) {
		t.Fatalf("two requests got the same ticket %q", a.Peek(bodyHeader))
	}
	if n, _ := tk.claim(&b); n != 20 {
		t.Errorf("b claimed %d, want 20", n)
	}
	if n, _ := tk.claim(&a); n != 10 {
		t.Errorf("a claimed %d, want 10", n)
	}

	var none fasthttp.RequestHeader
	tk.receive(&none)
	if n, full := tk.claim(&none); n != 0 || full {
		t.Errorf("no ticket: claim %d %v, want 0 false", n, full)
	}
}

// TestTicketMarks proves the two marks that are not tickets: a body
// without room (full, claimed as full with no bytes) and a request that
// will get 401 (R-API-8, R-API-9).
func TestTicketMarks(t *testing.T) {
	tk := &doorTickets{hold: time.Minute}
	var h fasthttp.RequestHeader
	tk.receive(&h)
	tk.issueFull(&h)
	for range 2 { // looking claims nothing
		if !tk.full(&h) {
			t.Fatal("full does not see issueFull")
		}
	}
	if n, full := tk.claim(&h); n != 0 || !full {
		t.Errorf("claim of a full mark: %d %v, want 0 true", n, full)
	}
	if tk.full(&h) {
		t.Error("the full mark is left after its claim")
	}

	var a fasthttp.RequestHeader
	tk.receive(&a)
	if tk.authRefused(&a) {
		t.Fatal("a received request is marked refused")
	}
	tk.refuseAuth(&a)
	if !tk.authRefused(&a) {
		t.Error("refuseAuth not seen")
	}
}

// TestForgedTicketNeverMatches proves that a client cannot name another
// request's reservation or mark itself: receive deletes the client's own
// ticket headers, and a value a client writes in bodyHeader, even one
// copied from an open ticket, or any of the small numbers a counter
// would give, claims nothing and leaves the open tickets as they were.
func TestForgedTicketNeverMatches(t *testing.T) {
	tk := &doorTickets{hold: time.Minute}
	owners := make([]*fasthttp.RequestHeader, 100)
	for i := range owners {
		owners[i] = &fasthttp.RequestHeader{}
		tk.receive(owners[i])
		tk.issue(owners[i], int64(i+1))
	}

	// A client's copy of both headers, the body ticket an open one's.
	var forged fasthttp.RequestHeader
	forged.SetBytesV(bodyHeader, owners[7].Peek(bodyHeader))
	forged.Set(authRefusedHeader, "1")
	tk.receive(&forged)
	if v := forged.Peek(bodyHeader); len(v) != 0 {
		t.Errorf("receive left the client's %s: %q", bodyHeader, v)
	}
	if tk.authRefused(&forged) {
		t.Errorf("receive left the client's %s", authRefusedHeader)
	}
	tk.issue(&forged, 5) // the forger's own body
	if n, _ := tk.claim(&forged); n != 5 {
		t.Errorf("the forger claimed %d, want only its own 5", n)
	}

	// Guesses that bypass receive: counters, in decimal and hex, and junk.
	guesses := []string{"", "-1", "x", "0x1", "18446744073709551616", " 1"}
	for i := 0; i <= 2000; i++ {
		guesses = append(guesses, strconv.Itoa(i), strconv.FormatUint(uint64(i), 16))
	}
	for _, g := range guesses {
		var h fasthttp.RequestHeader
		h.Set(bodyHeader, g)
		if n, full := tk.claim(&h); n != 0 || full {
			t.Fatalf("a guessed ticket %q claimed %d (full %v)", g, n, full)
		}
	}
	if n := openTickets(tk); n != len(owners) {
		t.Fatalf("%d tickets open after the forgeries, want %d", n, len(owners))
	}
	for i, h := range owners {
		if n, _ := tk.claim(h); n != int64(i+1) {
			t.Errorf("owner %d claimed %d, want %d", i, n, i+1)
		}
	}
}

// TestTicketSweep proves that a ticket nobody claimed within hold is
// swept, its bytes returned once, and cannot be claimed after; a ticket
// claimed in time is not swept; the budget sweeps when it looks full, so
// an abandoned reservation does not refuse the next body (R-API-8).
func TestTicketSweep(t *testing.T) {
	const hold = time.Second
	tk := &doorTickets{hold: hold}
	var claimed, abandoned, fresh fasthttp.RequestHeader
	tk.issue(&claimed, 100)
	tk.issue(&abandoned, 200)
	issued := time.Now()
	if n := tk.sweep(issued.UnixNano()); n != 0 {
		t.Fatalf("a sweep before the hold ended returned %d bytes", n)
	}
	if n, _ := tk.claim(&claimed); n != 100 {
		t.Fatalf("claim %d, want 100", n)
	}
	later := issued.Add(hold + time.Millisecond).UnixNano()
	tk.hold = 2 * hold
	tk.issue(&fresh, 400) // held twice as long: expires after later
	if n := tk.sweep(later); n != 200 {
		t.Errorf("sweep returned %d bytes, want the abandoned ticket's 200", n)
	}
	if n := tk.sweep(later); n != 0 {
		t.Errorf("a second sweep returned %d bytes", n)
	}
	if n, _ := tk.claim(&abandoned); n != 0 {
		t.Errorf("a swept ticket claimed %d bytes", n)
	}
	if n, _ := tk.claim(&fresh); n != 400 {
		t.Errorf("a ticket within its hold claimed %d, want 400", n)
	}

	// The budget: full of one abandoned reservation whose hold is over.
	// A negative hold: the ticket has expired the moment it is issued.
	tickets := &doorTickets{hold: -time.Second}
	b := &bodyBudget{limit: 1000, tickets: tickets}
	var dead fasthttp.RequestHeader
	if !b.reserve(1000) {
		t.Fatal("an empty budget refused 1000 bytes")
	}
	tickets.issue(&dead, 1000)
	if !b.reserve(600) {
		t.Fatal("a budget full of an expired ticket refused 600 bytes")
	}
	if u := b.used.Load(); u != 600 {
		t.Errorf("used %d after the sweep, want 600", u)
	}
	if n, _ := tickets.claim(&dead); n != 0 {
		t.Errorf("the swept ticket claimed %d", n)
	}
}

// TestTicketsConcurrent proves, under -race, that with tickets issued,
// claimed and swept at once, every ticket's bytes come back exactly once:
// by its claim or by the sweep, never both, never neither.
func TestTicketsConcurrent(t *testing.T) {
	tk := &doorTickets{hold: time.Millisecond}
	const workers, each = 8, 500
	var issued, returned atomic.Int64
	stop := make(chan struct{})
	var sweeps sync.WaitGroup
	sweeps.Add(1)
	go func() {
		defer sweeps.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			returned.Add(tk.sweep(time.Now().UnixNano()))
			// Pacing, not a wait: sweeps interleave with issues and
			// claims without spinning a core.
			time.Sleep(100 * time.Microsecond)
		}
	}()
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				var h fasthttp.RequestHeader
				tk.receive(&h)
				n := int64(i%7 + 1)
				tk.issue(&h, n)
				issued.Add(n)
				if i%3 == 0 {
					// Pacing, not a wait: past the 1 ms hold, so that
					// the sweep races this claim for some tickets.
					time.Sleep(2 * time.Millisecond)
				}
				c, _ := tk.claim(&h)
				returned.Add(c)
			}
		}()
	}
	wg.Wait()
	close(stop)
	sweeps.Wait()
	if n := openTickets(tk); n != 0 {
		t.Fatalf("%d tickets open after every claim", n)
	}
	if issued.Load() != returned.Load() {
		t.Errorf("issued %d bytes, returned %d", issued.Load(), returned.Load())
	}
}
