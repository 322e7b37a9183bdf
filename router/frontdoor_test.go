package router

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// addr returns the router's host:port.
func (s *stack) addr() string { return strings.TrimPrefix(s.url, "http://") }

// dial opens a raw TCP connection to the router.
func (s *stack) dial() net.Conn {
	s.t.Helper()
	c, err := net.Dial("tcp", s.addr())
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { c.Close() })
	return c
}

// readResponse reads one HTTP response from c, failing the test after d.
func readResponse(t *testing.T, c net.Conn, d time.Duration) (*http.Response, []byte) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(d))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// errorObject decodes an OpenAI-shaped error body (R-API-3).
func errorObject(t *testing.T, b []byte) schemas.ErrorObject {
	t.Helper()
	var e struct {
		Error *schemas.ErrorObject `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil || e.Error == nil {
		t.Fatalf("not an OpenAI error body: %q (%v)", b, err)
	}
	return *e.Error
}

const doorChat = `{"model":"sim-model","messages":[{"role":"user","content":"hello"}],"max_tokens":4}`

// TestHeadersOverLimit431RAPI7 proves R-API-7's header cap: headers over
// server.max_header_bytes get 431 with an OpenAI-shaped error that quotes
// nothing of the request, and the connection is closed; headers just
// under the cap are served.
func TestHeadersOverLimit431RAPI7(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) { c.Server.MaxHeaderBytes = 8192 })
	s.waitModels()
	secret := "SECRET-" + strings.Repeat("x", 9000)
	c := s.dial()
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", secret, len(doorChat), doorChat)
	resp, b := readResponse(t, c, 5*time.Second)
	if resp.StatusCode != 431 {
		t.Fatalf("status %d, want 431: %s", resp.StatusCode, b)
	}
	e := errorObject(t, b)
	if !strings.Contains(e.Message, "server.max_header_bytes") || e.Code != 431 {
		t.Fatalf("error %+v", e)
	}
	if bytes.Contains(b, []byte("SECRET")) || bytes.Contains(b, []byte("xxxx")) {
		t.Fatalf("the 431 quotes the request: %s", b)
	}
	if !resp.Close {
		t.Error("431 without Connection: close")
	}
	if got := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_front_door_refused_total", "reason", refusedHeaderTooLarge); got != 1 {
		t.Errorf("header_too_large refusals %v, want 1", got)
	}
	// Under the cap: served.
	resp, b = s.post(schemas.EndpointChat, doorChat, "X-Big", strings.Repeat("y", 6000))
	if resp.StatusCode != 200 {
		t.Fatalf("headers under the cap: %d %s", resp.StatusCode, b)
	}
	if st := s.sims["p1"].Stats().Prefills + s.sims["p2"].Stats().Prefills; st != 1 {
		t.Errorf("prefills %d, want 1 (the 431 touched no engine)", st)
	}
}

// TestMalformedRequestNotEchoedRAPI7 proves a malformed request gets an
// OpenAI-shaped 400 that quotes none of its bytes.
func TestMalformedRequestNotEchoedRAPI7(t *testing.T) {
	s := newStack(t, pd(), nil)
	c := s.dial()
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nBad Header With Spaces SECRET\r\nContent-Length: notanumber-SECRET\r\n\r\n")
	resp, b := readResponse(t, c, 5*time.Second)
	if resp.StatusCode != 400 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if e := errorObject(t, b); e.Message != "malformed HTTP request" {
		t.Fatalf("message %q", e.Message)
	}
	if bytes.Contains(b, []byte("SECRET")) {
		t.Fatalf("the 400 quotes the request: %s", b)
	}
}

// slowClient is one hostile connection of the slowloris test.
type slowClient struct {
	c        net.Conn
	trickle  bool // sends headers one byte at a time; else sends nothing
	opened   time.Time
	closedIn time.Duration
	err      error
}

// run trickles (or not) and waits for the router to close the connection.
func (sc *slowClient) run(stop <-chan struct{}) {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		_, _ = io.Copy(io.Discard, sc.c) // until the router closes it
		sc.closedIn = time.Since(sc.opened)
	}()
	if sc.trickle {
		req := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + strings.Repeat("p", 1000) + "\r\n\r\n"
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
	send:
		for i := 0; i < len(req); i++ {
			select {
			case <-closed:
				break send
			case <-stop:
				break send
			case <-t.C:
			}
			if _, err := sc.c.Write([]byte{req[i]}); err != nil {
				break
			}
		}
	}
	select {
	case <-closed:
	case <-stop:
		sc.err = fmt.Errorf("still open after %v", time.Since(sc.opened))
	}
}

// TestSlowlorisClosedWithinHeaderTimeoutRAPI7 proves R-API-7's read
// deadline: connections that send headers one byte every 20 ms and
// connections that send nothing are each closed within
// server.header_timeout_s plus a margin, while normal requests keep
// succeeding on other connections meanwhile.
func TestSlowlorisClosedWithinHeaderTimeoutRAPI7(t *testing.T) {
	const headerTimeout = 500 * time.Millisecond
	const margin = 700 * time.Millisecond
	s := newStack(t, pd(), func(c *config.Config) { c.Server.HeaderTimeoutS = headerTimeout.Seconds() })
	s.waitModels()
	var clients []*slowClient
	for i := 0; i < 40; i++ {
		clients = append(clients, &slowClient{c: s.dial(), trickle: i%2 == 0, opened: time.Now()})
	}
	stop := make(chan struct{})
	time.AfterFunc(headerTimeout+margin, func() { close(stop) })
	var wg sync.WaitGroup
	for _, sc := range clients {
		wg.Add(1)
		go func() { defer wg.Done(); sc.run(stop) }()
	}
	// Normal requests meanwhile, each on a fresh connection.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	served := 0
	for deadline := time.Now().Add(headerTimeout); time.Now().Before(deadline); served++ {
		req, _ := http.NewRequest("POST", s.url+schemas.EndpointChat, strings.NewReader(doorChat))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("normal request during the attack: %v", err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("normal request during the attack: %d %s", resp.StatusCode, b)
		}
	}
	wg.Wait()
	for i, sc := range clients {
		if sc.err != nil {
			t.Errorf("slow connection %d (trickle %v): %v", i, sc.trickle, sc.err)
		}
	}
	if served == 0 {
		t.Fatal("no normal request was served during the attack")
	}
	t.Logf("%d normal requests served while 40 slow connections were held and closed", served)
	if got := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_front_door_refused_total", "reason", refusedHeaderTimeout); got < 20 {
		t.Errorf("header_timeout refusals %v, want >= 20 (the trickling connections)", got)
	}
}

// TestIdleKeepAliveClosedRAPI7 proves the keep-alive idle deadline: a
// connection that served a request and then sends nothing is closed once
// server.idle_timeout_s has passed.
func TestIdleKeepAliveClosedRAPI7(t *testing.T) {
	const idle = 300 * time.Millisecond
	s := newStack(t, pd(), func(c *config.Config) { c.Server.IdleTimeoutS = idle.Seconds() })
	s.waitModels()
	c := s.dial()
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(doorChat), doorChat)
	br := bufio.NewReader(c)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Close {
		t.Fatalf("status %d close %v", resp.StatusCode, resp.Close)
	}
	start := time.Now()
	_ = c.SetReadDeadline(time.Now().Add(idle + time.Second))
	n, err := br.Read(make([]byte, 1))
	if n != 0 || err != io.EOF {
		t.Fatalf("idle connection: read %d %v, want EOF", n, err)
	}
	if el := time.Since(start); el < idle-50*time.Millisecond || el > idle+700*time.Millisecond {
		t.Fatalf("closed after %v, want about %v", el, idle)
	}
}

// TestMaxConnectionsRefusedAtOnceRAPI7 proves the connection cap: with
// server.max_connections open, a new connection gets 503 and is closed at
// once; once one closes, new connections are served again.
func TestMaxConnectionsRefusedAtOnceRAPI7(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) { c.Server.MaxConnections = 4 })
	s.waitModels()
	var held []net.Conn
	for i := 0; i < 4; i++ {
		held = append(held, s.dial())
	}
	testkit.WaitFor(t, 2*time.Second, "4 connections open", func() bool { return s.rt.server.GetOpenConnectionsCount() >= 4 })
	extra := s.dial()
	start := time.Now()
	resp, _ := readResponse(t, extra, 2*time.Second)
	if resp.StatusCode != 503 {
		t.Fatalf("connection over the cap: status %d, want 503", resp.StatusCode)
	}
	if n, err := extra.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("connection over the cap not closed: %d %v", n, err)
	}
	if el := time.Since(start); el > time.Second {
		t.Errorf("refused after %v, want at once", el)
	}
	if got := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_connections_refused_total"); got < 1 {
		t.Errorf("narwhal_connections_refused_total %v", got)
	}
	held[0].Close()
	// The freed place is taken again once the router has seen the close.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	testkit.WaitFor(t, 2*time.Second, "a request served after a connection closed", func() bool {
		resp, err := client.Post(s.url+schemas.EndpointChat, "application/json", strings.NewReader(doorChat))
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode == 200
	})
}

// TestCapsOnNAndMaxTokensRAPI8 proves R-API-8's caps through the router: n
// above request.max_n and max_tokens / max_completion_tokens above
// request.max_tokens_limit (2^63 included) get 400 naming the field, with
// no engine touched.
func TestCapsOnNAndMaxTokensRAPI8(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) { c.Request.MaxN = 4; c.Request.MaxTokensLimit = 1000 })
	s.waitModels()
	cases := []struct{ extra, want string }{
		{`"n":5`, "n must be at most 4"},
		{`"max_tokens":1001`, "max_tokens must be at most 1000"},
		{`"max_tokens":9223372036854775808`, "max_tokens must be at most 1000"},
		{`"max_completion_tokens":18446744073709551616`, "max_completion_tokens must be at most 1000"},
	}
	for _, tc := range cases {
		resp, b := s.post(schemas.EndpointChat, `{"model":"sim-model","messages":[{"role":"user","content":"x"}],`+tc.extra+`}`)
		if resp.StatusCode != 400 {
			t.Fatalf("%s: status %d %s", tc.extra, resp.StatusCode, b)
		}
		if e := errorObject(t, b); e.Message != tc.want {
			t.Errorf("%s: message %q, want %q", tc.extra, e.Message, tc.want)
		}
	}
	resp, b := s.post(schemas.EndpointChat, `{"model":"sim-model","messages":[{"role":"user","content":"x"}],"n":4,"max_tokens":3}`)
	if resp.StatusCode != 200 {
		t.Fatalf("at the caps: %d %s", resp.StatusCode, b)
	}
	if st := s.sims["p1"].Stats().Prefills + s.sims["p2"].Stats().Prefills; st != 1 {
		t.Errorf("prefills %d, want 1: the refused requests touched an engine", st)
	}
}

// holdStreams starts n streaming requests that wait for their first token
// (the decode engines' TTFT is long) and returns a cancel that ends them.
func (s *stack) holdStreams(n int, body string) func() {
	s.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, "POST", s.url+schemas.EndpointChat, strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	return func() { cancel(); wg.Wait() }
}

// slowDecode is pd() with decode engines whose first token takes 10 s, so
// requests stay in flight.
func slowDecode() []engineDef {
	defs := pd()
	for i := range defs {
		if defs[i].role == "decode" {
			defs[i].cfg.TTFT = 10 * time.Second
		}
	}
	return defs
}

// TestMaxInflightAdmissionRAPI8 proves R-API-8's admission: with
// server.max_inflight requests running, the next one gets 503 with
// Retry-After at once, no engine touched and no event published; once
// they end, requests are admitted again.
func TestMaxInflightAdmissionRAPI8(t *testing.T) {
	s := newStack(t, slowDecode(), func(c *config.Config) { c.Server.MaxInflight = 2 })
	s.waitModels()
	release := s.holdStreams(2, `{"model":"sim-model","messages":[{"role":"user","content":"x"}],"stream":true}`)
	testkit.WaitFor(t, 3*time.Second, "2 requests in flight", func() bool { return s.rt.InFlight() == 2 })
	testkit.WaitFor(t, 3*time.Second, "both decodes started", func() bool {
		return s.sims["d1"].Stats().ActiveStreams+s.sims["d2"].Stats().ActiveStreams == 2
	})
	prefills := s.sims["p1"].Stats().Prefills + s.sims["p2"].Stats().Prefills
	events := len(s.events.requests())
	start := time.Now()
	resp, b := s.post(schemas.EndpointChat, doorChat)
	el := time.Since(start)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" {
		t.Fatalf("over max_inflight: %d Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), b)
	}
	if e := errorObject(t, b); !strings.Contains(e.Message, "server.max_inflight") || e.Code != 503 {
		t.Fatalf("error %+v", e)
	}
	if resp.Header.Get("X-Request-Id") == "" {
		t.Error("no X-Request-Id on the 503")
	}
	t.Logf("refused in %v (client round trip on loopback)", el)
	if got := s.sims["p1"].Stats().Prefills + s.sims["p2"].Stats().Prefills; got != prefills {
		t.Errorf("prefills %d → %d: the refused request touched an engine", prefills, got)
	}
	if got := len(s.events.requests()); got != events {
		t.Errorf("request events %d → %d: a refusal at the door published one", events, got)
	}
	if got := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_front_door_refused_total", "reason", refusedInflight); got != 1 {
		t.Errorf("max_inflight refusals %v, want 1", got)
	}
	if s.rt.InFlight() != 2 {
		t.Errorf("in flight %d after the refusal, want 2", s.rt.InFlight())
	}
	release()
	s.idle()
	// Admitted again: it reaches the engines and runs into its own short
	// deadline instead of a 503.
	resp, b = s.post(schemas.EndpointChat, doorChat, "X-Request-Timeout", "0.2")
	if resp.StatusCode != 504 {
		t.Fatalf("after the others ended: %d %s, want the request's own 504", resp.StatusCode, b)
	}
	if got := s.sims["p1"].Stats().Prefills + s.sims["p2"].Stats().Prefills; got != prefills+1 {
		t.Errorf("prefills %d, want %d", got, prefills+1)
	}
}

// bigChat returns a streaming chat body of about size bytes whose prompt
// is short: the bulk is the "user" member, which engines ignore.
func bigChat(size int) string {
	pad := size - 120
	if pad < 1 {
		pad = 1
	}
	return `{"model":"sim-model","messages":[{"role":"user","content":"x"}],"stream":true,"max_tokens":2,"user":"` + strings.Repeat("u", pad) + `"}`
}

// TestBodyBytesInflightBoundRAPI8 proves the in-flight body bound: while
// requests whose bodies fill server.max_body_bytes_inflight are running,
// another body waits unread for room, up to server.header_timeout_s, and
// is then refused with 503 and Retry-After; a body waiting when room frees
// is read and served. The bound's gauge returns to 0 when requests end,
// and a client that dies in the middle of its body, or never sends it,
// gives its reservation back too.
func TestBodyBytesInflightBoundRAPI8(t *testing.T) {
	const mib = 1 << 20
	const headerTimeout = 700 * time.Millisecond
	s := newStack(t, slowDecode(), func(c *config.Config) {
		c.Request.MaxBodyBytes = mib
		c.Server.MaxBodyBytesInflight = 2 * mib
		c.Server.HeaderTimeoutS = headerTimeout.Seconds()
	})
	s.waitModels()
	gauge := func() float64 { return testkit.GatheredSum(t, s.rt.Registry(), "narwhal_body_bytes_inflight") }
	body := bigChat(mib - 1000)
	head := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", len(body))
	release := s.holdStreams(2, body)
	testkit.WaitFor(t, 5*time.Second, "2 large requests waiting for their first token", func() bool {
		return s.sims["d1"].Stats().ActiveStreams+s.sims["d2"].Stats().ActiveStreams == 2
	})
	if g := gauge(); g != float64(2*len(body)) {
		t.Fatalf("body bytes in flight %v, want %d", g, 2*len(body))
	}

	// No room: the body waits, then is refused without being read.
	c := s.dial()
	start := time.Now()
	fmt.Fprint(c, head)
	resp, b := readResponse(t, c, 5*time.Second)
	waited := time.Since(start)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" {
		t.Fatalf("a body over the bound: %d Retry-After %q %s", resp.StatusCode, resp.Header.Get("Retry-After"), b)
	}
	if e := errorObject(t, b); !strings.Contains(e.Message, "server.max_body_bytes_inflight") {
		t.Fatalf("error %+v", e)
	}
	if waited < headerTimeout-50*time.Millisecond {
		t.Errorf("refused after %v, want a wait of about %v for room", waited, headerTimeout)
	}
	if got := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_front_door_refused_total", "reason", refusedBodyMemory); got != 1 {
		t.Errorf("body_memory refusals %v, want 1", got)
	}
	// Requests without a body are not held back.
	if resp, b := s.get("/v1/models"); resp.StatusCode != 200 {
		t.Fatalf("/v1/models while the bound is full: %d %s", resp.StatusCode, b)
	}

	// Room frees while a body waits: it is read and served.
	w := s.dial()
	go func() { fmt.Fprint(w, head+body) }()
	testkit.WaitFor(t, 2*time.Second, "the third body waiting", func() bool { return s.rt.front.bodies.waiters.Load() == 1 })
	release()
	testkit.WaitFor(t, 3*time.Second, "the waiting body admitted", func() bool {
		return s.rt.InFlight() == 1 && gauge() == float64(len(body))
	})
	w.Close()
	s.idle()
	testkit.WaitFor(t, 2*time.Second, "body bytes back to 0", func() bool { return gauge() == 0 })

	// A client announcing a body and dying halfway through it.
	d := s.dial()
	fmt.Fprint(d, head+body[:len(body)/2])
	testkit.WaitFor(t, 2*time.Second, "the half body reserved", func() bool { return gauge() == float64(len(body)) })
	d.Close()
	testkit.WaitFor(t, 2*headerTimeout+2*time.Second, "the dead client's reservation back", func() bool { return gauge() == 0 })
	// A client announcing a body and sending none of it: the header
	// timeout ends it with a 408 and the reservation returns.
	q := s.dial()
	fmt.Fprint(q, head)
	testkit.WaitFor(t, 2*time.Second, "the silent body reserved", func() bool { return gauge() == float64(len(body)) })
	resp, _ = readResponse(t, q, 3*time.Second)
	if resp.StatusCode != 408 {
		t.Fatalf("silent body: status %d, want 408", resp.StatusCode)
	}
	testkit.WaitFor(t, 2*time.Second, "the silent client's reservation back", func() bool { return gauge() == 0 })
}

// TestModelNameBoundedInEvents proves that a client's model name reaches
// the request event and the 404 message bounded to MaxFieldBytes plus the
// marker, however long it was.
func TestModelNameBoundedInEvents(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	long := strings.Repeat("m", 100000)
	resp, b := s.post(schemas.EndpointChat, `{"model":"`+long+`","messages":[{"role":"user","content":"x"}]}`)
	if resp.StatusCode != 404 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if len(b) > 1024 {
		t.Errorf("404 body of %d bytes for a long model name", len(b))
	}
	var ev *schemas.RequestCompleted
	testkit.WaitFor(t, 2*time.Second, "the request event", func() bool {
		evs := s.events.requests()
		if len(evs) > 0 {
			ev = evs[len(evs)-1]
		}
		return ev != nil
	})
	if want := strings.Repeat("m", schemas.MaxFieldBytes) + schemas.TruncatedMarker; ev.Model != want {
		t.Fatalf("event model of %d bytes, want %d", len(ev.Model), len(want))
	}
}

// TestUnknownPathBoundedIn404 proves that the 404 of an unknown path
// quotes the path bounded to MaxFieldBytes plus the marker: a client
// cannot have a request line of up to server.max_header_bytes echoed.
func TestUnknownPathBoundedIn404(t *testing.T) {
	s := newStack(t, pd(), nil)
	for _, path := range []string{"/v1/" + strings.Repeat("p", 20000), "/" + strings.Repeat("q", 20000)} {
		resp, b := s.get(path)
		if resp.StatusCode != 404 {
			t.Fatalf("status %d for a long unknown path", resp.StatusCode)
		}
		var e struct {
			Error struct{ Message string } `json:"error"`
		}
		if err := json.Unmarshal(b, &e); err != nil {
			t.Fatalf("404 body %.200q: %v", b, err)
		}
		if want := "Not Found: " + schemas.BoundField(path); e.Error.Message != want || len(b) > 1024 {
			t.Errorf("404 of %d bytes, message of %d bytes, want %d", len(b), len(e.Error.Message), len(want))
		}
	}
}

// TestStreamOutlivesStallTimeout proves that server.stall_timeout_s bounds
// the client's writes, not the stream: a healthy stream that lasts several
// times the stall bound ends with [DONE].
func TestStreamOutlivesStallTimeout(t *testing.T) {
	defs := pd()
	for i := range defs {
		if defs[i].role == "decode" {
			defs[i].cfg.ITL = 20 * time.Millisecond
		}
	}
	s := newStack(t, defs, func(c *config.Config) { c.Server.StallTimeoutS = 0.2 })
	s.waitModels()
	start := time.Now()
	resp, b := s.post(schemas.EndpointChat, `{"model":"sim-model","messages":[{"role":"user","content":"x"}],"stream":true,"max_tokens":40,"ignore_eos":true}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d %s", resp.StatusCode, b)
	}
	if _, done, errObj := streamText(t, b); !done || errObj != nil {
		t.Fatalf("stream of %v did not end with [DONE] (error %v)", time.Since(start), errObj)
	}
	if el := time.Since(start); el < 600*time.Millisecond {
		t.Fatalf("the stream took %v, not several stall bounds", el)
	}
}

// TestEngineMessageBoundedInFailureEvent proves that an engine's error
// message, as untrusted as a client's string, reaches the failure event
// bounded to MaxFieldBytes plus the marker, whatever its size.
func TestEngineMessageBoundedInFailureEvent(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	long := strings.Repeat("e", 100000)
	for _, id := range []string{"d1", "d2"} {
		s.sims[id].Arm(sim.Fault{Kind: sim.FaultErrorObject, Phase: "decode", Status: 500, Message: long})
	}
	resp, b := s.post(schemas.EndpointChat, doorChat)
	if resp.StatusCode != 500 {
		t.Fatalf("status %d, want the error object's 500 (R-FAIL-4)", resp.StatusCode)
	}
	if e := errorObject(t, b); len(e.Message) != len(long) {
		t.Errorf("the client got %d bytes of the engine's message, want it whole", len(e.Message))
	}
	var fs []*schemas.Failure
	testkit.WaitFor(t, 2*time.Second, "the failure event", func() bool {
		fs = s.events.failures()
		return len(fs) > 0
	})
	for _, f := range fs {
		if len(f.Message) > schemas.MaxFieldBytes+len(schemas.TruncatedMarker) || !strings.HasSuffix(f.Message, schemas.TruncatedMarker) {
			t.Fatalf("failure event message of %d bytes: %.60q…", len(f.Message), f.Message)
		}
	}
}

// TestNonStreamedResponseBoundedRLEG5 proves request.max_response_bytes
// (R-LEG-5, R-API-8): a non-streamed request whose aggregated output goes
// beyond it — here many choices with logprobs, as a hostile client would
// ask to make the router hold gigabytes — gets 400 naming the setting
// while the engine is still generating; the decode leg is cancelled,
// every reservation returns, nothing is blamed on the engine, and the
// same request streamed, or with less output, is served whole.
func TestNonStreamedResponseBoundedRLEG5(t *testing.T) {
	const bound = 256 << 10
	s := newStack(t, longOutput(), func(c *config.Config) { c.Request.MaxResponseBytes = bound })
	s.waitModels()
	body := func(tokens int, stream bool) string {
		return fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":"x"}],"n":4,"max_tokens":%d,"ignore_eos":true,"logprobs":true,"top_logprobs":20,"stream":%t}`, tokens, stream)
	}
	// About 4 × 50,000 tokens × 1 KiB of logprobs: far beyond the bound.
	resp, b := s.post(schemas.EndpointChat, body(50000, false), "X-Request-Id", "too-large-1")
	if resp.StatusCode != 400 || !strings.Contains(string(b), "request.max_response_bytes") || !strings.Contains(string(b), `"type":"BadRequestError"`) {
		t.Fatalf("status %d, body %.300s; want 400 naming request.max_response_bytes", resp.StatusCode, b)
	}
	var ev *schemas.RequestCompleted
	testkit.WaitFor(t, 2*time.Second, "the request event", func() bool { ev = s.findRequestEvent("too-large-1"); return ev != nil })
	if ev.ErrorKind != outcomeResponseTooLarge || ev.Status != 400 {
		t.Errorf("request ended %q %d, want %s 400", ev.ErrorKind, ev.Status, outcomeResponseTooLarge)
	}
	s.idle()
	testkit.WaitFor(t, 2*time.Second, "the decode engine to see its leg cancelled (it must not run to its end)", func() bool {
		var aborted, active int64
		for _, id := range []string{"d1", "d2"} {
			st := s.sims[id].Stats()
			aborted, active = aborted+st.Aborted, active+st.ActiveStreams
		}
		return aborted == 1 && active == 0
	})
	s.checkNobodyBlamed()

	// Under the bound, and streamed beyond it: served whole.
	if resp, b := s.post(schemas.EndpointChat, body(20, false)); resp.StatusCode != 200 {
		t.Fatalf("small non-streamed request: %d %.300s", resp.StatusCode, b)
	}
	if resp, b := s.post(schemas.EndpointChat, body(300, true)); resp.StatusCode != 200 || !strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]") || len(b) < bound {
		t.Fatalf("streamed request beyond the bound: %d, %d bytes, ends %q", resp.StatusCode, len(b), b[max(0, len(b)-40):])
	}
	s.idle()
}

// TestExpectContinueRefusedBeforeTheBodyRAPI7 proves a request that sends
// "Expect: 100-continue" with a body over request.max_body_bytes gets its
// OpenAI-shaped 413 at once — no "100 Continue" that would invite the
// client to send the body — while one within the limit is continued and
// served.
func TestExpectContinueRefusedBeforeTheBodyRAPI7(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) { c.Request.MaxBodyBytes = 4096 })
	s.waitModels()
	c := s.dial()
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", 40<<20)
	resp, b := readResponse(t, c, 5*time.Second)
	if resp.StatusCode != 413 {
		t.Fatalf("status %d, want 413 before the body: %s", resp.StatusCode, b)
	}
	if e := errorObject(t, b); !strings.Contains(e.Message, "request.max_body_bytes") || e.Code != 413 {
		t.Fatalf("error %+v", e)
	}
	if !resp.Close {
		t.Error("413 without Connection: close")
	}

	c = s.dial()
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", len(doorChat))
	resp, b = readResponse(t, c, 5*time.Second)
	if resp.StatusCode != 100 {
		t.Fatalf("status %d, want 100 Continue within the limit: %s", resp.StatusCode, b)
	}
	fmt.Fprint(c, doorChat)
	resp, b = readResponse(t, c, 5*time.Second)
	if resp.StatusCode != 200 {
		t.Fatalf("continued request: %d %s", resp.StatusCode, b)
	}
}

// TestBodyTooLargeAnsweredToAClientThatSendsItAllRAPI7: a client that
// writes its whole 24 MiB body before reading (as most HTTP libraries
// do) gets the router's 413, not a connection reset: the router lingers,
// discarding the body it refused, before it closes.
func TestBodyTooLargeAnsweredToAClientThatSendsItAllRAPI7(t *testing.T) {
	s := newStack(t, pd(), func(c *config.Config) { c.Request.MaxBodyBytes = 1 << 20 })
	s.waitModels()
	c := s.dial()
	const size = 24 << 20
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", size)
	_ = c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	chunk := bytes.Repeat([]byte("x"), 1<<20)
	for sent := 0; sent < size; sent += len(chunk) {
		if _, err := c.Write(chunk); err != nil {
			t.Fatalf("writing the body at %d of %d bytes: %v", sent, size, err)
		}
	}
	resp, b := readResponse(t, c, 5*time.Second)
	if resp.StatusCode != 413 {
		t.Fatalf("status %d, want 413: %s", resp.StatusCode, b)
	}
	if e := errorObject(t, b); !strings.Contains(e.Message, "request.max_body_bytes") {
		t.Fatalf("error %+v", e)
	}
}

// TestBodyRefusalsPublishNoEventRAPI4 proves that a request refused on
// its body (behaviour.md R-API-4, R-API-8: JSON that does not parse, a
// missing field, a value over a request limit) gets its 400 with no
// request event, as every refusal at the door (docs/security.md), while it
// is still counted in narwhal_requests_total and logged; a 404 for an
// unknown model, decided after the body parsed, still publishes one.
func TestBodyRefusalsPublishNoEventRAPI4(t *testing.T) {
	logs := &syncBuffer{}
	s := newStackLogged(t, pd(), nil, nil, logs)
	s.waitModels()
	bodies := []string{
		`{"model":`,
		`{"messages":[{"role":"user","content":"x"}]}`,
		`{"model":"sim-model"}`,
		`{"model":"sim-model","messages":[{"role":"user","content":"x"}],"max_tokens":1e30}`,
		`{"model":"sim-model","messages":[{"role":"user","content":"x"}],"n":17}`,
		`{"model":"sim-model","messages":[{"role":"user","content":"x"}],"max_tokens":2.5}`,
	}
	for _, b := range bodies {
		resp, got := s.post(schemas.EndpointChat, b)
		if resp.StatusCode != 400 || errorObject(t, got).Code != 400 {
			t.Errorf("%s: HTTP %d %s, want 400", b, resp.StatusCode, got)
		}
	}
	if got := s.metricSum("narwhal_requests_total", "code", "400", "outcome", "client_error", "endpoint", schemas.EndpointChat); got != float64(len(bodies)) {
		t.Errorf("400s counted %v, want %d", got, len(bodies))
	}
	if got := strings.Count(logs.String(), "request ended"); got != len(bodies) {
		t.Errorf("%d 'request ended' log lines for %d refusals:\n%s", got, len(bodies), logs.String())
	}
	// An unknown model is published: its event is the one request event.
	if resp, b := s.post(schemas.EndpointChat, `{"model":"no-such-model","messages":[{"role":"user","content":"x"}]}`); resp.StatusCode != 404 {
		t.Fatalf("unknown model: HTTP %d %s", resp.StatusCode, b)
	}
	testkit.WaitFor(t, 2*time.Second, "the 404's request event", func() bool { return len(s.events.requests()) > 0 })
	if evs := s.events.requests(); len(evs) != 1 || evs[0].Status != 404 {
		for _, ev := range evs {
			t.Errorf("request event %d %s", ev.Status, ev.ErrorKind)
		}
		t.Fatalf("%d request events, want only the 404's", len(evs))
	}
}
