package router

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// cleanupBound is how soon after a client hangs up everything the request
// held must be gone (R-OWN-1, R-OWN-5).
const cleanupBound = 200 * time.Millisecond

// establishedTo counts the ESTABLISHED TCP connections (in this network
// namespace) whose remote end is 127.0.0.1:port, i.e. the client side of
// connections to a local server on port. It returns -1 where /proc/net/tcp
// cannot be read.
func establishedTo(port int) int {
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return -1
	}
	// Lines read "sl local rem st …": a remote address followed by state
	// 01 (ESTABLISHED).
	return strings.Count(string(b), fmt.Sprintf(" 0100007F:%04X 01 ", port))
}

// openFDs counts this process's open file descriptors, sockets included;
// -1 where /proc/self/fd cannot be read.
func openFDs() int {
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(es)
}

// portOf returns the port of a base URL.
func portOf(t testing.TB, base string) int {
	t.Helper()
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	p, err := strconv.Atoi(u.Port())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// openConns counts the connections the test client holds to the router and
// the router holds to its engines' APIs (0 when every one is closed).
func (s *stack) openConns() int {
	n := establishedTo(portOf(s.t, s.url))
	for _, srv := range s.sims {
		n += establishedTo(portOf(s.t, srv.URL()))
	}
	return n
}

// closeIdle closes the idle keep-alive connections of client and of the
// router's engine client, whose goroutines are not the request's.
func (s *stack) closeIdle(client *http.Client) {
	client.CloseIdleConnections()
	s.rt.client.CloseIdleConnections()
}

// quiesce closes idle connections and waits until no connection to the
// router or its engines is open and the goroutine and file descriptor
// counts have been steady for 50 ms; it returns those counts.
func (s *stack) quiesce(client *http.Client) (goroutines, fds int) {
	s.t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	lastG, lastF, steady := -1, -1, 0
	for time.Now().Before(deadline) {
		s.closeIdle(client)
		g, f := runtime.NumGoroutine(), openFDs()
		if g == lastG && f == lastF {
			steady++
			if steady >= 10 && s.openConns() <= 0 {
				return g, f
			}
		} else {
			lastG, lastF, steady = g, f, 0
		}
		time.Sleep(5 * time.Millisecond)
	}
	s.t.Fatalf("goroutines and descriptors never settled (last %d, %d; %d connections open)", lastG, lastF, s.openConns())
	return 0, 0
}

// goroutineDump returns every goroutine's stack, for failure messages.
func goroutineDump() string {
	buf := make([]byte, 1<<20)
	return string(buf[:runtime.Stack(buf, true)])
}

// R-OWN-1, R-OWN-5, R-OWN-6: a client that hangs up during the prefill,
// between the prefill and the first token, or during the decode after
// commit leaves nothing behind within 200 ms: the engine sees its request
// end (the upstream connection is closed), no slot stays reserved, no
// request is in flight, no goroutine remains and no connection stays open;
// an unconsumed handoff is abandoned (and released while the producer
// still holds it), a consumed one is not.
func TestClientDisconnectROWN5(t *testing.T) {
	cases := []struct {
		name     string
		engine   string // the engine whose leg is in flight when the client leaves
		fault    sim.Fault
		pulled   bool // the consumer pulled the KV before the client left
		tokens   int  // generated chunks the client reads before it leaves
		handoff  bool // an abandoned handoff event is expected
		released bool
	}{
		{name: "during prefill", engine: "p1", fault: sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhasePrefill, DelayMS: 5000, Count: 1}},
		{name: "before decode headers", engine: "d1", fault: sim.Fault{Kind: sim.FaultHeaderDelay, Phase: sim.PhaseDecode, DelayMS: 5000, Count: 1}, handoff: true, released: true},
		{name: "before first token", engine: "d1", fault: sim.Fault{Kind: sim.FaultFirstTokenDelay, Phase: sim.PhaseDecode, DelayMS: 5000, IntervalMS: 50, Count: 1}, pulled: true, handoff: true},
		{name: "during decode", engine: "d1", fault: sim.Fault{Kind: sim.FaultTrickle, Phase: sim.PhaseDecode, DelayMS: 200, Count: 1}, pulled: true, tokens: 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, nil)
			s.waitModels()
			client := &http.Client{Transport: &http.Transport{}}
			defer client.CloseIdleConnections()
			// Warm up: the worker, the KV side channel connection and the
			// engine connections exist before the baseline is taken.
			resp, body := s.postWith(client, schemas.EndpointChat, chatBody("warm up", `"stream":true,"max_tokens":4`))
			if resp.StatusCode != 200 {
				t.Fatalf("warm-up: %d %s", resp.StatusCode, body)
			}
			s.idle()
			baseline, baseFDs := s.quiesce(client)
			baseStacks := goroutineStacks()
			engine := s.sims[tc.engine]
			before := engine.Stats()
			pulledBefore := s.sims["d1"].Stats().KVPulled
			nEvents := len(s.events.handoffs())
			engine.Arm(tc.fault)

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			enough := make(chan struct{})
			clientDone := make(chan error, 1)
			go func() {
				req, _ := http.NewRequestWithContext(ctx, "POST", s.url+schemas.EndpointChat, strings.NewReader(chatBody("hang up", `"stream":true,"max_tokens":16`)))
				req.Header.Set("X-Request-Id", "gone")
				resp, err := client.Do(req)
				if err != nil {
					clientDone <- err
					return
				}
				defer resp.Body.Close()
				br := bufio.NewReader(resp.Body)
				got := 0
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						clientDone <- err
						return
					}
					var c sseChunk
					if p, ok := strings.CutPrefix(strings.TrimSpace(line), "data: "); ok && json.Unmarshal([]byte(p), &c) == nil {
						if len(c.Choices) > 0 && c.Choices[0].Delta.Content != "" {
							if got++; got == tc.tokens {
								close(enough)
							}
						}
					}
				}
			}()
			// Wait until the leg is where the case wants it.
			testkit.WaitFor(t, 5*time.Second, tc.engine+" leg in flight", func() bool {
				st := engine.Stats()
				if st.ActiveStreams != 1 {
					return false
				}
				return !tc.pulled || s.sims["d1"].Stats().KVPulled == pulledBefore+1
			})
			if tc.tokens > 0 {
				select {
				case <-enough:
				case err := <-clientDone:
					t.Fatalf("stream ended before %d tokens: %v", tc.tokens, err)
				case <-time.After(5 * time.Second):
					t.Fatalf("no %d tokens", tc.tokens)
				}
			}

			cancel()
			start := time.Now()
			var state string
			cleaned := func() bool {
				st := engine.Stats()
				p, d := s.rt.Reservations()
				state = fmt.Sprintf("engine active %d aborted %d (was %d), in flight %d, reservations %d/%d, producer holds %d",
					st.ActiveStreams, st.Aborted, before.Aborted, s.rt.InFlight(), p, d, s.sims["p1"].Stats().KVHeld)
				return st.ActiveStreams == 0 && st.Aborted == before.Aborted+1 && s.rt.InFlight() == 0 && p == 0 && d == 0 &&
					s.sims["p1"].Stats().KVHeld == 0
			}
			for !cleaned() {
				if time.Since(start) > cleanupBound {
					t.Fatalf("%v after the client left: %s", cleanupBound, state)
				}
				time.Sleep(2 * time.Millisecond)
			}
			released := time.Since(start)
			select {
			case <-clientDone:
			case <-time.After(cleanupBound):
				t.Fatal("the client's request did not end after its cancel")
			}
			// Nothing of the request survives: goroutines back to the
			// baseline and no connection open (idle keep-alives are closed
			// first: they belong to the pools, not to the request).
			for {
				s.closeIdle(client)
				n, fds := runtime.NumGoroutine(), openFDs()
				if n <= baseline && fds <= baseFDs {
					// The count may hide a new goroutine behind one that
					// ended meanwhile: none may be new, either.
					if left := leftovers(baseStacks); len(left) == 0 {
						break
					} else if time.Since(start) > cleanupBound {
						t.Fatalf("%v after the client left, goroutines remain:\n%s", cleanupBound, strings.Join(left, "\n\n"))
					}
				}
				if time.Since(start) > cleanupBound {
					t.Fatalf("%v after the client left: %d goroutines (baseline %d), %d descriptors (baseline %d), %d connections open\n%s",
						cleanupBound, n, baseline, fds, baseFDs, s.openConns(), goroutineDump())
				}
				time.Sleep(2 * time.Millisecond)
			}
			if n := s.openConns(); n > 0 {
				t.Fatalf("%d connections to the router or its engines still open", n)
			}
			t.Logf("engine request ended and slots released %v after the client left; goroutines back %v after", released, time.Since(start))

			ev := s.requestEvent("gone")
			if ev.ErrorKind != string(engines.KindClientGone) {
				t.Fatalf("request event %+v", ev)
			}
			if n := s.metricSum("narwhal_client_disconnects_total"); n != 1 {
				t.Fatalf("narwhal_client_disconnects_total %v", n)
			}
			if fs := s.events.failures(); len(fs) != 0 {
				t.Fatalf("a client disconnect published failure events: %+v", fs)
			}
			hs := s.events.handoffs()[nEvents:]
			if !tc.handoff {
				if len(hs) != 0 {
					t.Fatalf("handoff events %+v, want none", hs)
				}
				return
			}
			if len(hs) != 1 {
				t.Fatalf("%d handoff events, want 1", len(hs))
			}
			h := hs[0]
			backend := phaseLegs(s.sims["d1"], sim.PhaseDecode)
			if h.Outcome != schemas.HandoffAbandoned || h.Reason != "client_disconnected" || h.Released != tc.released ||
				h.EngineID != "p1" || h.ConsumerID != "d1" || h.RequestID != "gone" || h.BackendRequestID != backend[len(backend)-1].RequestID {
				t.Fatalf("handoff event %+v", h)
			}
		})
	}
}

// postWith sends body to path with client and returns the response with
// its body read whole.
func (s *stack) postWith(client *http.Client, path, body string) (*http.Response, []byte) {
	s.t.Helper()
	req, _ := http.NewRequest("POST", s.url+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		s.t.Fatal(err)
	}
	defer resp.Body.Close()
	var sb strings.Builder
	if _, err := bufio.NewReader(resp.Body).WriteTo(&sb); err != nil {
		s.t.Fatal(err)
	}
	return resp, []byte(sb.String())
}

// R-API-1 (stream true), R-RETRY-4: the relay hands every event to the
// client as soon as the engine sent it, not when the next one arrives; a
// client streaming at 150 ms per token sees tokens 150 ms apart. (The
// disconnect test above relies on it: a client reads a few tokens, then
// hangs up.)
func TestRelayDeliversEachTokenAsItArrives(t *testing.T) {
	s := newStack(t, []engineDef{{id: "p1", role: "prefill"}, {id: "d1", role: "decode"}}, nil)
	s.waitModels()
	const gap = 150 * time.Millisecond
	s.sims["d1"].Arm(sim.Fault{Kind: sim.FaultTrickle, Phase: sim.PhaseDecode, DelayMS: int(gap / time.Millisecond)})
	req, _ := http.NewRequest("POST", s.url+schemas.EndpointChat, strings.NewReader(chatBody("warm up", `"stream":true,"max_tokens":5`)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	var arrivals []time.Time
	var text strings.Builder
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			break
		}
		var c sseChunk
		if p, ok := strings.CutPrefix(strings.TrimSpace(line), "data: "); ok && json.Unmarshal([]byte(p), &c) == nil {
			if len(c.Choices) > 0 && c.Choices[0].Delta.Content != "" {
				arrivals = append(arrivals, time.Now())
				text.WriteString(c.Choices[0].Delta.Content)
			}
		}
	}
	if want := expectedChat(t, "warm up", 0, 5); text.String() != want || len(arrivals) != 5 {
		t.Fatalf("text %q in %d chunks, want %q", text.String(), len(arrivals), want)
	}
	for i := 1; i < len(arrivals); i++ {
		if d := arrivals[i].Sub(arrivals[i-1]); d < gap*2/3 {
			t.Fatalf("token %d arrived %v after token %d: the relay held it back", i, d, i-1)
		}
	}
}
