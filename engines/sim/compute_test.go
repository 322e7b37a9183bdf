package sim

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// timedCompletion posts a one-token completion of prompt and returns how
// long it took, or the error that ended it.
func timedCompletion(c *http.Client, url, prompt string) (time.Duration, error) {
	start := time.Now()
	resp, err := c.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"`+prompt+`","max_tokens":1}`))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %s", resp.Status)
	}
	return time.Since(start), nil
}

// TestConcurrentPrefillsShareCompute: two prefills of P uncached tokens
// on one engine at once share its compute, as on one GPU: each takes about
// 2·P·PrefillPerToken, not P·PrefillPerToken (docs/simulator.md "Prefill
// compute"). However far apart within the first 40% of P·PrefillPerToken
// they start, each takes at least 1.6·P·PrefillPerToken under processor
// sharing (both take 2·P·per minus the offset), against ~1·P·per had each
// its own compute. Meanwhile /sim/cached's queued_prompt_tokens falls by
// one token per PrefillPerToken in all, not one per computing prompt.
func TestConcurrentPrefillsShareCompute(t *testing.T) {
	const (
		per = 5 * time.Millisecond
		p   = 40 // tokens: 200 ms of compute each
	)
	alone := per * p
	s, url := startEngine(t, Config{PrefillPerToken: per})
	c := newClient(t)
	var (
		wg      sync.WaitGroup
		elapsed [2]time.Duration
		errs    [2]error
	)
	start := time.Now()
	for i, tag := range []string{"a", "b"} {
		wg.Go(func() { elapsed[i], errs[i] = timedCompletion(c, url, words(tag, p)) })
	}
	testkit.WaitFor(t, 5*time.Second, "both prefills computing", func() bool { return s.Stats().Running == 2 })
	// queued_prompt_tokens as both compute: one reading, then another
	// at least 40 ms later, each bracketed by the times around it.
	b1 := time.Now()
	q1 := askCached(t, c, url, completionBody("x")).QueuedPromptTokens
	a1 := time.Now()
	testkit.WaitFor(t, 5*time.Second, "40 ms to pass", func() bool { return time.Since(a1) >= 40*time.Millisecond })
	b2 := time.Now()
	q2 := askCached(t, c, url, completionBody("x")).QueuedPromptTokens
	a2 := time.Now()
	wg.Wait()
	total := time.Since(start)
	for i := range errs {
		if errs[i] != nil {
			t.Fatalf("prefill %d: %v", i, errs[i])
		}
	}
	for i, el := range elapsed {
		if el < alone*16/10 {
			t.Errorf("prefill %d took %v with another computing, want at least 1.6×%v (shared compute)", i, el, alone)
		}
		if el > 2*alone+time.Second {
			t.Errorf("prefill %d took %v, far beyond 2×%v", i, el, alone)
		}
	}
	if total < alone*18/10 {
		t.Errorf("two prefills of %v each ended after %v, want about 2×%v: the engine computed more than 1/PrefillPerToken tokens a second", alone, total, alone)
	}
	if q1 > 2*p || q2 >= q1 {
		t.Errorf("queued_prompt_tokens %d then %d while both compute, want at most %d and falling", q1, q2, 2*p)
	}
	most := int64((a2.Sub(b1)+per-1)/per) + 1
	least := int64(b2.Sub(a1)/per) / 2
	if drop := q1 - q2; drop > most || drop < least {
		t.Errorf("queued_prompt_tokens fell by %d in %v…%v, want %d…%d: one token per %v in all", drop, b2.Sub(a1), a2.Sub(b1), least, most, per)
	}
	t.Logf("alone %v; shared: %v and %v, both done after %v; queued %d → %d", alone, elapsed[0], elapsed[1], total, q1, q2)
}

// TestPrefillComputeCancelFreesShare: a computation whose request ends
// gives its share back at once: the other ends as soon as it would
// alone, and nothing is left counted.
func TestPrefillComputeCancelFreesShare(t *testing.T) {
	p := newPrefillCompute()
	const work = 200 * time.Millisecond
	ctx, cancel := context.WithCancel(t.Context())
	var long, short computeJob
	gone := make(chan bool)
	go func() { gone <- p.run(ctx, &long, time.Hour) }()
	testkit.WaitFor(t, 5*time.Second, "the long computation to start", func() bool { return p.left() > time.Hour/2 })
	start := time.Now()
	ended := make(chan bool)
	go func() { ended <- p.run(t.Context(), &short, work) }()
	testkit.WaitFor(t, 5*time.Second, "both computing", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.jobs) == 2
	})
	cancel()
	if <-gone {
		t.Fatal("the cancelled computation reports done")
	}
	if !<-ended {
		t.Fatal("the short computation did not end")
	}
	if el := time.Since(start); el < work || el > work*15/10 {
		t.Fatalf("the short computation took %v, want %v…1.5×%v once alone", el, work, work)
	}
	if left := p.left(); left != 0 || len(p.jobs) != 0 || len(long.kick) != 0 || len(short.kick) != 0 {
		t.Fatalf("after both: left %v, %d computing, kicks pending %d %d", left, len(p.jobs), len(long.kick), len(short.kick))
	}
}

// TestPrefillComputeAllocatesNothing: a computation on a reused job
// allocates nothing in steady state.
func TestPrefillComputeAllocatesNothing(t *testing.T) {
	p := newPrefillCompute()
	var j computeJob
	p.run(t.Context(), &j, time.Microsecond)
	if a := testkit.LeastAllocs(50, func() { p.run(t.Context(), &j, time.Microsecond) }); a != 0 {
		t.Fatalf("%.1f allocations per computation", a)
	}
}
