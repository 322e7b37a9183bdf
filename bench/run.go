package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"time"
)

// Progress is the live progress line a run writes while it runs: elapsed
// time, requests done, errors and the current requests/s, about once per
// Interval.
type Progress struct {
	// W receives the lines (typically os.Stderr); nil means no progress.
	W io.Writer
	// Interval is the update period; 0 means one second.
	Interval time.Duration
	// Overwrite rewrites one terminal line in place ("\r" and an erase)
	// instead of writing one line per update.
	Overwrite bool
}

// RunOptions are the options shared by Run and Compare.
type RunOptions struct {
	// Progress, when set, receives the live progress line.
	Progress *Progress
	// RouterPID, when > 0, is the router's process id: its CPU time is
	// read from /proc/<pid>/stat around the router's measured stretches
	// (Report.RouterProcess). Use it when the router runs as a separate
	// process (RouterProcess).
	RouterPID int
	// BenchHolds says what runs in this process besides the client, for
	// Report.BenchProcess.Holds (e.g. "4 sims"); "" means nothing.
	BenchHolds string

	// onPayload, when set, sees every data payload (tests).
	onPayload func(payload []byte)
}

// CompareOptions configure Compare.
type CompareOptions struct {
	// RunOptions apply to every slice.
	RunOptions
	// Slices is the number of alternating measured slices, shared equally
	// by the router and the floor; 0 means 8. It is rounded up to an even
	// number. The order is ABBA (router, floor, floor, router, …) so that
	// a linear drift of the machine cancels exactly for multiples of 4.
	Slices int
}

// counters are the live figures the progress line shows.
type counters struct {
	done, errors atomic.Int64
}

// runner runs the stretches (warm-up, measured run, slices) of one
// workload.
type runner struct {
	wl      Workload
	shape   *bodyShape
	opts    RunOptions
	live    counters
	started time.Time

	mu    sync.Mutex
	all   []*worker // every worker ever made, in creation order
	free  []*worker // open loop: workers not in use
	seeds uint64
}

func newRunner(wl Workload, opts RunOptions) (*runner, error) {
	if err := wl.Validate(); err != nil {
		return nil, err
	}
	return &runner{wl: wl, shape: wl.shape(), opts: opts}, nil
}

func (r *runner) newWorker() *worker {
	r.seeds++
	w := newWorker(r.shape, &r.wl, r.seeds, &r.live)
	w.onPayload = r.opts.onPayload
	r.all = append(r.all, w)
	return w
}

// take returns an idle worker for the open loop, making one if needed.
func (r *runner) take() *worker {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n := len(r.free); n > 0 {
		w := r.free[n-1]
		r.free = r.free[:n-1]
		return w
	}
	return r.newWorker()
}

func (r *runner) give(w *worker) {
	r.mu.Lock()
	r.free = append(r.free, w)
	r.mu.Unlock()
}

// stretch is what one stretch of load measured.
type stretch struct {
	rec       recorder
	elapsed   time.Duration
	benchCPU  time.Duration
	allocs    uint64
	allocB    uint64
	routerCPU time.Duration
	routerOK  bool // the router's CPU time was read before and after
	parts     int  // stretches added into this one
	// routerRSS0 and routerRSSPeak are the router's resident memory before
	// the stretch and its highest sample during it (every 200 ms), bytes.
	routerRSS0, routerRSSPeak int64
}

// add accumulates o into s; the router's CPU time stays valid only if it
// was read around every part.
func (s *stretch) add(o *stretch) {
	s.routerOK = (s.parts == 0 || s.routerOK) && o.routerOK
	s.parts++
	s.rec.merge(&o.rec)
	s.elapsed += o.elapsed
	s.benchCPU += o.benchCPU
	s.allocs += o.allocs
	s.allocB += o.allocB
	s.routerCPU += o.routerCPU
	if s.parts == 1 || (o.routerRSS0 > 0 && o.routerRSS0 < s.routerRSS0) {
		s.routerRSS0 = o.routerRSS0
	}
	s.routerRSSPeak = max(s.routerRSSPeak, o.routerRSSPeak)
}

var allocSamples = []metrics.Sample{{Name: "/gc/heap/allocs:objects"}, {Name: "/gc/heap/allocs:bytes"}}

func readAllocs() (objects, bytes uint64) {
	s := make([]metrics.Sample, len(allocSamples))
	copy(s, allocSamples)
	metrics.Read(s)
	if s[0].Value.Kind() == metrics.KindUint64 {
		objects = s[0].Value.Uint64()
	}
	if s[1].Value.Kind() == metrics.KindUint64 {
		bytes = s[1].Value.Uint64()
	}
	return
}

// runStretch sends the workload to t for dur (when > 0) or requests
// requests (when > 0), whichever ends first, waits for the requests in
// flight, and returns what it measured. label names the stretch on the
// progress line.
func (r *runner) runStretch(ctx context.Context, t Target, dur time.Duration, requests int, label string) *stretch {
	st := &stretch{}
	var r0 time.Duration
	if r.opts.RouterPID > 0 {
		var err error
		r0, err = ProcessCPU(r.opts.RouterPID)
		st.routerOK = err == nil
	}
	cpu0 := selfCPU()
	a0, b0 := readAllocs()
	stopRSS := func() {}
	if r.opts.RouterPID > 0 {
		stopRSS = sampleRSS(r.opts.RouterPID, st)
	}
	stop := r.progress(label)
	start := time.Now()
	var used []*worker
	if r.wl.Concurrency > 0 {
		used = r.closedLoop(ctx, t, start, dur, requests)
	} else {
		used = r.openLoop(ctx, t, start, dur, requests)
	}
	st.elapsed = time.Since(start)
	stop()
	stopRSS()
	a1, b1 := readAllocs()
	st.benchCPU = selfCPU() - cpu0
	st.allocs, st.allocB = a1-a0, b1-b0
	if st.routerOK {
		r1, err := ProcessCPU(r.opts.RouterPID)
		st.routerOK = err == nil
		st.routerCPU = r1 - r0
	}
	for _, w := range used {
		st.rec.merge(&w.rec)
		w.rec.reset()
	}
	if st.rec.errors == nil {
		st.rec.errors = map[string]int{}
	}
	return st
}

// closedLoop runs Concurrency workers, each sending its next request when
// its previous one ended, until the deadline or the request budget.
func (r *runner) closedLoop(ctx context.Context, t Target, start time.Time, dur time.Duration, requests int) []*worker {
	for len(r.all) < r.wl.Concurrency {
		r.newWorker()
	}
	used := r.all[:r.wl.Concurrency]
	deadline := start.Add(dur)
	var issued atomic.Int64
	var wg sync.WaitGroup
	for _, w := range used {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				if requests > 0 && issued.Add(1) > int64(requests) {
					return
				}
				now := time.Now()
				if dur > 0 && !now.Before(deadline) {
					return
				}
				t.do(ctx, w, now)
			}
		}()
	}
	wg.Wait()
	return used
}

// openLoop sends requests at Poisson arrival times of rate Rate, each on
// its own goroutine with an idle worker, until the deadline or the request
// budget; latencies count from the scheduled arrival, so a slow target
// cannot slow the arrivals down (no coordinated omission).
func (r *runner) openLoop(ctx context.Context, t Target, start time.Time, dur time.Duration, requests int) []*worker {
	r.mu.Lock()
	r.seeds++
	rng := rand.New(rand.NewPCG(r.wl.Seed^0x9e3779b97f4a7c15, r.seeds))
	r.mu.Unlock()
	deadline := start.Add(dur)
	capacity := int64(r.wl.maxInFlight())
	var inflight atomic.Int64
	var wg sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	// Arrivals refused by the in-flight cap are recorded by this worker.
	capped := r.take()
	next := start
	for n := 0; requests <= 0 || n < requests; n++ {
		next = next.Add(time.Duration(rng.ExpFloat64() / r.wl.Rate * float64(time.Second)))
		if dur > 0 && !next.Before(deadline) {
			break
		}
		if d := time.Until(next); d > 0 {
			timer.Reset(d)
			select {
			case <-timer.C:
			case <-ctx.Done():
			}
		}
		if ctx.Err() != nil {
			break
		}
		if inflight.Add(1) > capacity {
			inflight.Add(-1)
			capped.rec.errors[ClassInflightCap]++
			r.live.done.Add(1)
			r.live.errors.Add(1)
			continue
		}
		w := r.take()
		wg.Add(1)
		go func(at time.Time) {
			defer wg.Done()
			t.do(ctx, w, at)
			inflight.Add(-1)
			r.give(w)
		}(next)
	}
	wg.Wait()
	r.give(capped)
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*worker(nil), r.all...)
}

// progress starts the live progress line for one stretch and returns the
// function that ends it (after a last update).
func (r *runner) progress(label string) (stop func()) {
	p := r.opts.Progress
	if p == nil || p.W == nil {
		return func() {}
	}
	interval := p.Interval
	if interval <= 0 {
		interval = time.Second
	}
	done := make(chan struct{})
	exited := make(chan struct{})
	startT, startN := time.Now(), r.live.done.Load()
	lastT, lastN := startT, startN
	line := func(final bool) {
		now := time.Now()
		n := r.live.done.Load()
		if final {
			// The last line gives the stretch's average rate.
			lastT, lastN = startT, startN
		}
		rate := 0.0
		if dt := now.Sub(lastT).Seconds(); dt > 0 {
			rate = float64(n-lastN) / dt
		}
		lastT, lastN = now, n
		text := fmt.Sprintf("%-14s elapsed %6.1fs  done %8d  errors %6d  %8.1f req/s",
			label, now.Sub(r.started).Seconds(), n, r.live.errors.Load(), rate)
		switch {
		case p.Overwrite && final:
			fmt.Fprintf(p.W, "\r\033[K%s\n", text)
		case p.Overwrite:
			fmt.Fprintf(p.W, "\r\033[K%s", text)
		default:
			fmt.Fprintln(p.W, text)
		}
	}
	go func() {
		defer close(exited)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				line(false)
			}
		}
	}()
	return func() {
		close(done)
		<-exited
		line(true)
	}
}

// Run measures wl against t: the warm-up (discarded), then the measured
// run, and returns its Report. It fails only on an invalid workload; a
// cancelled ctx ends the run early with what was measured (requests cut
// short by the cancellation are not counted).
func Run(ctx context.Context, t Target, wl Workload, opts RunOptions) (*Report, error) {
	r, err := newRunner(wl, opts)
	if err != nil {
		return nil, err
	}
	r.started = time.Now()
	var idleRSS int64
	if opts.RouterPID > 0 {
		idleRSS, _ = ProcessRSS(opts.RouterPID) // before any load of this run
	}
	if wl.Warmup > 0 {
		r.runStretch(ctx, t, wl.Warmup, 0, "warmup "+t.Name())
		r.live.done.Store(0)
		r.live.errors.Store(0)
	}
	st := r.runStretch(ctx, t, wl.Duration, wl.Requests, t.Name())
	if idleRSS > 0 {
		st.routerRSS0 = idleRSS
	}
	rep := newReport(t, st, opts.BenchHolds)
	if opts.RouterPID > 0 {
		if _, ok := t.(*RouterTarget); ok {
			rep.RouterProcess = routerCost(st, rep.Requests, wl.Concurrency)
		}
	}
	return rep, nil
}

// Compare measures wl against the router and against the floor over the
// same engines, interleaved: a warm-up of each, then Slices alternating
// slices of Duration/Slices (or Requests/Slices requests) each, in ABBA
// order. It returns both Reports with the router's added latency per
// percentile, the throughput ratio and, with RouterPID, the router's CPU
// time per request and its idle CPU during the floor's slices.
func Compare(ctx context.Context, router *RouterTarget, floor *FloorTarget, wl Workload, opts CompareOptions) (*Comparison, error) {
	r, err := newRunner(wl, opts.RunOptions)
	if err != nil {
		return nil, err
	}
	slices := opts.Slices
	if slices <= 0 {
		slices = 8
	}
	slices += slices % 2
	r.started = time.Now()
	if wl.Warmup > 0 {
		r.runStretch(ctx, router, wl.Warmup, 0, "warmup router")
		r.runStretch(ctx, floor, wl.Warmup, 0, "warmup floor")
		r.live.done.Store(0)
		r.live.errors.Store(0)
	}
	var sides [2]stretch // 0: router, 1: floor
	for i := 0; i < slices && ctx.Err() == nil; i++ {
		side := (i + i/2) % 2 // 0 1 1 0 0 1 1 0 …: ABBA
		var t Target = router
		if side == 1 {
			t = floor
		}
		dur := wl.Duration / time.Duration(slices)
		req := 0
		if wl.Requests > 0 {
			req = wl.Requests / slices
			if i < wl.Requests%slices {
				req++
			}
		}
		label := fmt.Sprintf("%s %d/%d", t.Name(), i+1, slices)
		st := r.runStretch(ctx, t, dur, req, label)
		sides[side].add(st)
	}
	for i := range sides {
		if sides[i].rec.errors == nil {
			sides[i].rec.errors = map[string]int{}
		}
	}
	c := &Comparison{
		Slices: slices,
		Router: newReport(router, &sides[0], opts.BenchHolds),
		Floor:  newReport(floor, &sides[1], opts.BenchHolds),
	}
	if opts.RouterPID > 0 && sides[0].routerOK {
		c.Router.RouterProcess = routerCost(&sides[0], c.Router.Requests, wl.Concurrency)
		c.RouterCPUPerRequestUS = c.Router.RouterProcess.CPUPerRequestUS
		if sides[1].routerOK && sides[1].elapsed > 0 {
			c.RouterIdleCPUCores = sides[1].routerCPU.Seconds() / sides[1].elapsed.Seconds()
		}
	}
	c.compute()
	return c, nil
}

// sampleRSS records the router's resident memory before the stretch and
// samples it every 200 ms until the returned function is called, keeping
// the peak in st.
func sampleRSS(pid int, st *stretch) (stop func()) {
	st.routerRSS0, _ = ProcessRSS(pid)
	st.routerRSSPeak = st.routerRSS0
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				if rss, err := ProcessRSS(pid); err == nil && rss > st.routerRSSPeak {
					st.routerRSSPeak = rss
				}
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}
