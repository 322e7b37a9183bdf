package e2e

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// Settings of the stalled-clients test (R-TMO-6): the engines' between-chunk
// bound is a quarter of the clients' stall bound, so a router that took its
// clients' backpressure for engine silence would blame the decode engines
// long before declaring the clients stalled.
const (
	stallDecodeRead = 500 * time.Millisecond // engine.decode_read_timeout_s
	stallBound      = 2 * time.Second        // server.stall_timeout_s
	stalledClients  = 10
)

// stalledStream opens a streaming request for a very long output on a
// connection with a 4 KiB receive buffer, reads its headers and first
// events, and then stops reading. It returns the connection.
func stalledStream(addr, id string) (net.Conn, error) {
	c, err := testkit.DialSmallWindow(addr)
	if err != nil {
		return nil, err
	}
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"a very long story"}],"stream":true,"max_tokens":400000,"ignore_eos":true}`, clusterModel)
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nX-Request-Id: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		schemas.EndpointChat, addr, id, len(body), body)
	_ = c.SetReadDeadline(time.Now().Add(requestBound))
	br := bufio.NewReaderSize(c, 4096)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("%s: %v", id, err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		c.Close()
		return nil, fmt.Errorf("%s: HTTP %d %s", id, resp.StatusCode, b)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 2048)); err != nil {
		c.Close()
		return nil, fmt.Errorf("%s: first bytes: %v", id, err)
	}
	return c, nil
}

// TestClusterStalledClientsEjectNothingRTMO6 proves R-TMO-6 through the
// real binaries — a router, the breaker, four simulators and the bus, with
// recovery.eject_after 2: ten clients with small receive buffers stop
// reading in the middle of long streams at once. No decode engine is
// blamed: no failure event, no ejection, the breaker's streak of every
// engine stays 0 and every engine stays available on the router; each
// request ends as client_stalled within server.stall_timeout_s plus a
// margin, the router's reservations and in-flight requests return to 0,
// and the engines see every leg cancelled. A normal request is served
// afterwards.
func TestClusterStalledClientsEjectNothingRTMO6(t *testing.T) {
	env := []string{
		"NARWHAL_RECOVERY_EJECT_AFTER=2",
		"NARWHAL_ENGINE_DECODE_READ_TIMEOUT_S=" + seconds(stallDecodeRead),
		"NARWHAL_SERVER_STALL_TIMEOUT_S=" + seconds(stallBound),
		"NARWHAL_REQUEST_TIMEOUT_S=120",
		// Ten long streams start at once: on a loaded machine their first
		// tokens may take longer than the cluster's 2 s, which is not what
		// this test is about.
		"NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S=15",
		"NARWHAL_ENGINE_PREFILL_TIMEOUT_S=15",
	}
	c := startCluster(t, clusterOptions{routers: 1, breakers: 1, routerEnv: env, breakerEnv: env,
		simArgs: []string{"--max-model-len", "1048576"}})
	r := c.routers[0]
	mark := c.events.Len()

	type opened struct {
		conn net.Conn
		err  error
	}
	results := make(chan opened, stalledClients)
	for i := range stalledClients {
		go func() {
			conn, err := stalledStream(r.addr, fmt.Sprintf("stalled-%d", i))
			results <- opened{conn, err}
		}()
	}
	for range stalledClients {
		o := <-results
		if o.err != nil {
			t.Fatal(o.err)
		}
		t.Cleanup(func() { o.conn.Close() })
	}
	stopped := time.Now()

	stalled := func(e event) bool {
		return e.seq >= mark && e.kind == schemas.KindRequest && e.ErrorKind == "client_stalled"
	}
	// Each router write blocks only once the socket buffers towards its
	// client are full (a few MB at the engines' pace, which ten streams on
	// a loaded machine reach slowly), then for 1 to 9/8 stall bounds. A
	// router that did not bound a stalled write would hold each request
	// to its 120 s deadline.
	c.waitEvents(t, stallBound*9/8+45*time.Second, stalledClients, "every stalled request to end as client_stalled", stalled)
	t.Logf("R-TMO-6: %d stalled streams ended as client_stalled within %v of their clients' stop", stalledClients, time.Since(stopped).Round(time.Millisecond))

	since := func(kind string) func(event) bool {
		return func(e event) bool { return e.seq >= mark && e.kind == kind }
	}
	if fs := c.list(t, since(schemas.KindFailure)); len(fs) > 0 {
		t.Fatalf("%d failure events, want none; first: %s", len(fs), fs[0].raw)
	}
	if qs := c.list(t, since(schemas.KindQuarantine)); len(qs) > 0 {
		t.Fatalf("quarantine event: %s", qs[0].raw)
	}
	for _, s := range c.simOrder {
		if ej := c.list(t, func(e event) bool { return e.seq >= mark && isEjection(s.id)(e) }); len(ej) > 0 {
			t.Fatalf("%s ejected: %s", s.id, ej[0].raw)
		}
		e, ok := c.placement(t, s.id)
		if !ok || !e.Eligible || e.Streak != 0 {
			t.Fatalf("%s's placement entry %+v (found %v): want eligible with streak 0", s.id, e, ok)
		}
		if ok, err := available(r, s.id); err != nil || !ok {
			t.Fatalf("%s not available on the router (%v)", s.id, err)
		}
	}
	testkit.WaitEvery(t, 5*time.Second, pollInterval, "no reservation and no request in flight on the router", func() bool {
		mfs, err := testkit.Scrape(probeClient, r.url+"/metrics")
		if err != nil {
			return false
		}
		res, _ := testkit.Sum(mfs, "narwhal_reservations")
		in, _ := testkit.Sum(mfs, "narwhal_inflight_requests")
		return res == 0 && in == 0
	})
	testkit.WaitEvery(t, 5*time.Second, pollInterval, "the decode engines to see every leg cancelled", func() bool {
		var aborted, active int64
		for _, id := range []string{"d1", "d2"} {
			var st sim.Stats
			getJSON(t, c.sims[id].url+"/sim/stats", &st)
			aborted += st.Aborted
			active += st.ActiveStreams
		}
		return aborted >= stalledClients && active == 0
	})
	if n := testkit.ScrapedSum(t, probeClient, r.url+"/metrics", "narwhal_client_stalls_total"); n != stalledClients {
		t.Errorf("narwhal_client_stalls_total %v, want %d", n, stalledClients)
	}
	if rep := c.mustSend(t, r); rep.status != http.StatusOK {
		t.Fatalf("a normal request after the stalls: HTTP %d %s", rep.status, rep.body)
	}
}
