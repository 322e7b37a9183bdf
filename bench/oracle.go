package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/narwhalmesh/narwhal/engines/sim"
)

// PolicyOracle is the benchmark-only placement of ComparePolicies (not a
// placement.policy value): for every request it asks every prefill
// simulator what it holds (POST /sim/cached) and sends the request to the
// one with the least expected wait, OracleWait. It is the best a greedy
// placement can do that knows each engine's cache and queue exactly: the
// limit the routers' policies are measured against.
const PolicyOracle = "oracle"

// OracleWait is the prefill work, in prompt tokens, a request waits for
// and does on the engine that answered c: the uncached prompt tokens
// already queued or running there plus this prompt's own uncached
// tokens.
func OracleWait(c sim.Cached) int64 {
	return c.QueuedPromptTokens + int64(c.PromptTokens-c.CachedTokens)
}

// oracleAnswer is one simulator's answer to a look-up.
type oracleAnswer struct {
	c  sim.Cached
	ok bool
}

// OracleTarget places like PolicyOracle. Its look-ups are made one request
// at a time, in arrival order (each sees the engines after the previous
// request was sent on), and are not counted in the request's latencies:
// they count from the request's due time plus the look-ups' duration.
// The request then goes through routers[i], a router whose fleet has
// producer i as its only producer, so the relay and the decode leg are
// the routers' own.
type OracleTarget struct {
	routers []Target
	sims    []string
	tr      *http.Transport
	client  *http.Client

	mu      sync.Mutex // serialises look-ups; guards the fields below
	answers []oracleAnswer
	next    int
	lookups int64
	spent   time.Duration
	failed  int64
}

// NewOracleTarget returns an oracle over the prefill simulators at
// simURLs (base URLs) and, for each, routers[i] placing on that simulator
// alone. The two lists have the same length, at least 1.
func NewOracleTarget(routers []Target, simURLs []string) *OracleTarget {
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	urls := make([]string, len(simURLs))
	for i, u := range simURLs {
		urls[i] = strings.TrimRight(u, "/")
	}
	return &OracleTarget{
		routers: routers, sims: urls, tr: tr,
		client:  &http.Client{Transport: tr, Timeout: 5 * time.Second},
		answers: make([]oracleAnswer, len(urls)),
	}
}

// Name returns "oracle".
func (t *OracleTarget) Name() string { return PolicyOracle }

// Close closes the look-ups' idle connections.
func (t *OracleTarget) Close() { t.tr.CloseIdleConnections() }

// LookupStats returns how many look-up rounds the oracle made, their
// total duration (left out of the requests' latencies) and how many found
// no simulator answering (those requests went round-robin).
func (t *OracleTarget) LookupStats() (rounds int64, spent time.Duration, failed int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.lookups, t.spent, t.failed
}

// do implements Target: look up, choose, then send through the chosen
// producer's router with the look-ups' time added to start.
func (t *OracleTarget) do(ctx context.Context, w *worker, start time.Time) {
	if w.fixed == nil {
		w.fixed = w.newBody()
	}
	began := time.Now()
	i := t.Choose(ctx, w.fixed)
	t.routers[i].do(ctx, w, start.Add(time.Since(began)))
}

// Choose asks every simulator what it holds for body and returns the
// index of the one with the least OracleWait; ties go to the fewer
// requests waiting and running, then to the next in turn. When no
// simulator answers it returns the next in turn.
func (t *OracleTarget) Choose(ctx context.Context, body []byte) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	began := time.Now()
	var wg sync.WaitGroup
	for i := range t.sims {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t.answers[i] = t.ask(ctx, t.sims[i], body)
		}()
	}
	wg.Wait()
	start := t.next
	t.next = (t.next + 1) % len(t.sims)
	best := pickLeastWait(t.answers, start)
	t.lookups++
	t.spent += time.Since(began)
	if best < 0 {
		t.failed++
		return start
	}
	return best
}

// ask posts body to url's /sim/cached.
func (t *OracleTarget) ask(ctx context.Context, url string, body []byte) oracleAnswer {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/sim/cached", bytes.NewReader(body))
	if err != nil {
		return oracleAnswer{}
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.client.Do(req)
	if err != nil {
		return oracleAnswer{}
	}
	defer resp.Body.Close()
	var a oracleAnswer
	if resp.StatusCode == http.StatusOK && json.NewDecoder(io.LimitReader(resp.Body, 1<<16)).Decode(&a.c) == nil {
		a.ok = true
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return a
}

// pickLeastWait returns the index of the answer with the least OracleWait,
// ties broken by fewer waiting + running requests, then by the order of
// a scan that begins at start; −1 when no answer is ok.
func pickLeastWait(answers []oracleAnswer, start int) int {
	best := -1
	var bestWait, bestLoad int64
	for k := range answers {
		i := (start + k) % len(answers)
		a := answers[i]
		if !a.ok {
			continue
		}
		wait, load := OracleWait(a.c), a.c.Waiting+a.c.Running
		if best < 0 || wait < bestWait || (wait == bestWait && load < bestLoad) {
			best, bestWait, bestLoad = i, wait, load
		}
	}
	return best
}
