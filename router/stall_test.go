package router

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Bounds of the slow-reader tests (R-TMO-6): the engine's between-chunk
// bound is far shorter than the client's stall bound, so a router that
// took the client's backpressure for engine silence would blame the
// engine long before the client is declared stalled.
const (
	stallSilence = 300 * time.Millisecond // engine.decode_read_timeout_s
	stallBound   = time.Second            // server.stall_timeout_s
	// stallMargin is what the request may take beyond stallBound from the
	// moment its client stops reading: the router first fills the socket
	// buffers towards the client, then its blocked write runs into the
	// deadline after stallBound to 9/8 of it.
	stallMargin = 700 * time.Millisecond
	// longTokens is an output far larger than the socket buffers between
	// the router and its client (about 150 bytes a token).
	longTokens = 200000
)

// longOutput is pd() with engines that accept a context long enough for
// outputs of many megabytes, generated as fast as they can.
func longOutput() []engineDef {
	defs := pd()
	for i := range defs {
		defs[i].cfg.MaxModelLen = 1 << 21
	}
	return defs
}

// smallSendBuffers gives every connection the router accepts a 64 KiB
// send buffer, as a loaded host's would be: on an idle loopback the kernel
// grows it to megabytes, which the router would first have to fill at the
// engine's pace before its writes block on a client that stopped reading.
// The router's own logic is unchanged.
func smallSendBuffers(ln net.Listener) net.Listener { return sndbufListener{ln} }

type sndbufListener struct{ net.Listener }

func (l sndbufListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetWriteBuffer(64 << 10)
	}
	return c, err
}

func stallConfig(c *config.Config) {
	c.Engine.DecodeReadTimeoutS = stallSilence.Seconds()
	c.Server.StallTimeoutS = stallBound.Seconds()
	c.Recovery.FailureQuarantineS = 60 // a blamed engine would leave placement
}

// dialSmall connects to the router with a 4 KiB receive buffer, set before
// the connection is made so the TCP window stays small.
func (s *stack) dialSmall() net.Conn {
	s.t.Helper()
	c, err := testkit.DialSmallWindow(s.addr())
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { c.Close() })
	return c
}

// startLongStream sends a streaming request for maxTokens tokens on c and
// reads its headers and the first few events; it returns the reader.
func startLongStream(t *testing.T, c net.Conn, id string, maxTokens int) *bufio.Reader {
	t.Helper()
	br, err := openLongStream(c, id, maxTokens)
	if err != nil {
		t.Fatal(err)
	}
	return br
}

// openLongStream is startLongStream returning what went wrong, for other
// goroutines than the test's.
func openLongStream(c net.Conn, id string, maxTokens int, header ...string) (*bufio.Reader, error) {
	return openStream(c, id, fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":"tell a long story"}],"stream":true,"max_tokens":%d,"ignore_eos":true}`, maxTokens), header...)
}

// openStream sends the streaming chat request body on c with request id
// id and reads its headers and its first 2 KiB within 30 s (a loaded
// machine schedules a hundred clients late); it returns the reader.
func openStream(c net.Conn, id, body string, header ...string) (*bufio.Reader, error) {
	extra := ""
	for _, h := range header {
		extra += h + "\r\n"
	}
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: %s\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", id, extra, len(body), body)
	br := bufio.NewReaderSize(c, 4096)
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", id, err)
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		return nil, fmt.Errorf("%s: status %d %s", id, resp.StatusCode, b)
	}
	// A few events through the chunked body, then the client stops.
	if n, err := io.ReadFull(resp.Body, make([]byte, 2048)); err != nil {
		return nil, fmt.Errorf("%s: first bytes (%d read): %v", id, n, err)
	}
	_ = c.SetReadDeadline(time.Time{})
	return br, nil
}

// findRequestEvent returns the request event of id, or nil.
func (s *stack) findRequestEvent(id string) *schemas.RequestCompleted {
	for _, ev := range s.events.requests() {
		if ev.RequestID == id {
			return ev
		}
	}
	return nil
}

// checkNobodyBlamed asserts that no failure or quarantine event was
// published and that every engine is still placeable (R-TMO-6).
func (s *stack) checkNobodyBlamed() {
	s.t.Helper()
	if fs := s.events.failures(); len(fs) > 0 {
		s.t.Errorf("%d failure events, want none; first: %+v", len(fs), *fs[0])
	}
	s.events.mu.Lock()
	for _, ev := range s.events.all {
		if q, ok := ev.(*schemas.Quarantine); ok {
			s.t.Errorf("quarantine event: %+v", *q)
		}
	}
	s.events.mu.Unlock()
	now := nowNano()
	for _, m := range s.rt.fleet().Members() {
		if !m.Available(now) {
			s.t.Errorf("engine %s not available after slow clients", m.ID)
		}
	}
	if n := testkit.GatheredSum(s.t, s.rt.Registry(), "narwhal_engine_faults_total"); n != 0 {
		s.t.Errorf("narwhal_engine_faults_total %v, want 0", n)
	}
}

// TestStalledClientIsNotEngineSilenceRTMO6 proves R-TMO-6: a real TCP
// client with a small receive buffer that stops reading in the middle of
// a long stream does not get its decode engine blamed (no failure event,
// no quarantine, the engine stays placeable), although the router is
// blocked writing to it for far longer than engine.decode_read_timeout_s;
// the request ends as client_stalled within server.stall_timeout_s plus a
// margin, the connection is closed, every reservation returns and the
// engine sees its leg cancelled.
func TestStalledClientIsNotEngineSilenceRTMO6(t *testing.T) {
	s := newStackOn(t, longOutput(), stallConfig, smallSendBuffers)
	s.waitModels()
	c := s.dialSmall()
	br := startLongStream(t, c, "stalled-1", longTokens)
	stopped := time.Now()

	var ev *schemas.RequestCompleted
	testkit.WaitFor(t, stallBound+stallMargin+time.Second, "the request to end as client_stalled", func() bool {
		ev = s.findRequestEvent("stalled-1")
		return ev != nil
	})
	took := time.Since(stopped)
	if ev.ErrorKind != outcomeClientStalled || ev.Status != 200 {
		t.Fatalf("request ended %q (status %d), want %s", ev.ErrorKind, ev.Status, outcomeClientStalled)
	}
	if took < stallBound || took > stallBound+stallMargin {
		t.Errorf("client_stalled %v after the client stopped reading, want within %v + %v", took, stallBound, stallMargin)
	}
	t.Logf("client_stalled %v after the client stopped reading", took)
	s.idle() // no request, no reservation
	var d = s.sims["d1"]
	if s.findRequestEvent("stalled-1").ConsumerID == "d2" {
		d = s.sims["d2"]
	}
	testkit.WaitFor(t, time.Second, "the decode engine to see its leg cancelled", func() bool {
		st := d.Stats()
		return st.Aborted == 1 && st.ActiveStreams == 0
	})
	s.checkNobodyBlamed()
	if n := testkit.GatheredSum(t, s.rt.Registry(), "narwhal_requests_total", "outcome", outcomeClientStalled); n != 1 {
		t.Errorf("narwhal_requests_total{outcome=client_stalled} %v, want 1", n)
	}
	// The router closed the connection: what is left in the buffers drains
	// and then the read ends, well before a timeout.
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.Copy(io.Discard, br)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("the stalled client's connection is still open: %v", err)
	}
}

// TestTenStalledClientsEjectNothingRTMO6 is the same with ten stalled
// clients at once and recovery.eject_after 2: nothing is published that a
// breaker could count, so no engine can be ejected; every request ends as
// client_stalled within the bound and every reservation returns.
func TestTenStalledClientsEjectNothingRTMO6(t *testing.T) {
	// Ten streams and their engines at full speed share two cores here:
	// the between-chunk bound is one second so that a starved scheduler is
	// not taken for a silent engine, and the stall bound twice that, so the
	// router is still blocked on its clients far longer than the engine
	// bound.
	s := newStackOn(t, longOutput(), func(c *config.Config) {
		stallConfig(c)
		c.Engine.DecodeReadTimeoutS = 1
		c.Server.StallTimeoutS = 2
		c.Recovery.EjectAfter = 2
	}, smallSendBuffers)
	s.waitModels()
	const n = 10
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := 0; i < n; i++ {
		c := s.dialSmall()
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = openLongStream(c, fmt.Sprintf("stalled-%d", i), longTokens)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	stopped := time.Now()
	testkit.WaitFor(t, 2*time.Second*9/8+stallMargin+time.Second, "every request to end", func() bool { return len(s.events.requests()) == n })
	t.Logf("all %d ended %v after the last client stopped reading", n, time.Since(stopped))
	for i := 0; i < n; i++ {
		ev := s.findRequestEvent(fmt.Sprintf("stalled-%d", i))
		if ev == nil || ev.ErrorKind != outcomeClientStalled {
			t.Fatalf("request %d: %+v, want client_stalled", i, ev)
		}
	}
	s.idle()
	s.checkNobodyBlamed()
	// An engine notices a cancelled leg when its next write fails: wait
	// for it, bounded.
	var aborted int64
	testkit.WaitFor(t, time.Second, "every decode leg cancelled at its engine", func() bool {
		aborted = 0
		for _, id := range []string{"d1", "d2"} {
			aborted += s.sims[id].Stats().Aborted
		}
		return aborted >= n
	})
	if aborted != n {
		t.Errorf("decode engines saw %d legs cancelled, want %d", aborted, n)
	}
}

// TestSlowReaderIsNotEngineSilenceRTMO6 proves the other half of R-TMO-6:
// a client that reads in bursts with pauses longer than
// engine.decode_read_timeout_s (but shorter than server.stall_timeout_s)
// gets its whole long stream, ending with [DONE], and nobody is blamed.
//
// Its bounds are wider than the other stall tests': a loaded machine that
// starves the engine's or the router's goroutines for stallSilence is a
// real silence to the router, and a client that sleeps past its pause
// for long looks stalled. The client pauses half again the decode read
// timeout, far below the stall timeout.
func TestSlowReaderIsNotEngineSilenceRTMO6(t *testing.T) {
	const (
		readTimeout = time.Second // engine.decode_read_timeout_s
		pause       = readTimeout * 3 / 2
		stall       = 5 * time.Second // server.stall_timeout_s
	)
	s := newStackOn(t, longOutput(), func(c *config.Config) {
		stallConfig(c)
		c.Engine.DecodeReadTimeoutS = readTimeout.Seconds()
		c.Server.StallTimeoutS = stall.Seconds()
	}, smallSendBuffers)
	s.waitModels()
	c := s.dialSmall()
	br := startLongStream(t, c, "slow-1", 8000)
	var tail bytes.Buffer
	buf := make([]byte, 256<<10)
	pauses := 0
	for {
		_ = c.SetReadDeadline(time.Now().Add(stall))
		n, err := io.ReadFull(br, buf)
		tail.Write(buf[:n])
		if tail.Len() > 64 {
			tail.Next(tail.Len() - 64)
		}
		if err != nil {
			break
		}
		pauses++
		time.Sleep(pause) // the client's own pace, not synchronisation
	}
	if !strings.Contains(tail.String(), "data: [DONE]") {
		t.Fatalf("the slow reader's stream did not end with [DONE]: …%q", tail.String())
	}
	t.Logf("%d pauses of %v", pauses, pause)
	if pauses < 3 {
		t.Fatalf("only %d pauses: the output was too short to block the router", pauses)
	}
	testkit.WaitFor(t, 2*time.Second, "the request event", func() bool { return s.findRequestEvent("slow-1") != nil })
	if ev := s.findRequestEvent("slow-1"); ev.ErrorKind != "" || ev.Status != 200 {
		t.Fatalf("slow reader's request ended %q %d", ev.ErrorKind, ev.Status)
	}
	s.idle()
	s.checkNobodyBlamed()
}

// TestStalledClientEndsAtTheRequestDeadlineRTMO5 proves that a client
// stalled in the middle of its stream holds its request no longer than
// the request's own deadline (R-TMO-5) plus the second the relay grants to
// deliver the end of a stream, even when server.stall_timeout_s is far
// longer; the outcome is the deadline's, and nobody is blamed.
func TestStalledClientEndsAtTheRequestDeadlineRTMO5(t *testing.T) {
	s := newStackOn(t, longOutput(), func(c *config.Config) {
		stallConfig(c)
		c.Server.StallTimeoutS = 30
	}, smallSendBuffers)
	s.waitModels()
	c := s.dialSmall()
	start := time.Now()
	if _, err := openLongStream(c, "deadline-1", longTokens, "X-Request-Timeout: 1"); err != nil {
		t.Fatal(err)
	}
	var ev *schemas.RequestCompleted
	testkit.WaitFor(t, 4*time.Second, "the request to end", func() bool {
		ev = s.findRequestEvent("deadline-1")
		return ev != nil
	})
	if el := time.Since(start); el > 1*time.Second+time.Second+stallMargin {
		t.Errorf("ended %v after it started, want within its 1 s deadline plus 1 s", el)
	}
	if ev.ErrorKind != "request_timeout" {
		t.Errorf("outcome %q, want request_timeout", ev.ErrorKind)
	}
	s.idle()
	s.checkNobodyBlamed()
}

// TestRelayBatchIsBounded proves the relay's read-ahead bound (R-TMO-6):
// however much the engine has ready (here an endless backlog, as after a
// client's pause), one batch holds at most relayBatchBytes plus one event,
// so a slow client costs a bounded buffer and each write is small.
func TestRelayBatchIsBounded(t *testing.T) {
	event := "data: " + benchChunk + "\n\n"
	client := engines.NewClient(engines.Options{FirstTokenTimeout: time.Hour, DecodeReadTimeout: time.Hour})
	// A backlog of 1 MiB of events and [DONE], every Read filling its
	// buffer whole, so the stream's buffer never ends on an event's end.
	backlog := strings.Repeat(event, (1<<20)/len(event)) + "data: [DONE]\n\n"
	s := client.NewStream(context.Background(), "d1", io.NopCloser(strings.NewReader(backlog)))
	defer s.Close()
	c := &call{req: &schemas.Request{Endpoint: schemas.EndpointChat}, stream: s}
	r := &relayBody{c: c, started: true}
	for i := 0; i < 20; i++ {
		if !r.fill() {
			t.Fatalf("batch %d: the whole backlog was read into one batch of %d bytes", i, len(r.buf))
		}
		if len(r.buf) > relayBatchBytes+len(event) {
			t.Fatalf("batch %d of %d bytes, want at most %d", i, len(r.buf), relayBatchBytes+len(event))
		}
		r.buf = r.buf[:0]
	}
}
