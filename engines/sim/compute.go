package sim

import (
	"context"
	"sync"
	"time"
)

// prefillCompute is an engine's prefill compute, shared by the prompts it
// computes at once as one GPU's is (processor sharing, docs/simulator.md
// "Prefill compute"): the engine computes 1/Config.PrefillPerToken prompt
// tokens per second whatever the concurrency, so each of N prompts
// computing at once progresses at 1/N of that speed.
//
// It keeps a virtual clock, the compute each prompt computing has
// received since the engine started: it advances at 1/N of real time
// while N prompts compute. A prompt that needs w of compute when the
// virtual clock reads v is done when the clock reads v+w (its finish
// tag). Each computing prompt sleeps on its own timer until its tag
// would be reached as the engine stands; a prompt that arrives only
// makes the others later (they wake early, see it and sleep again), and
// one that leaves makes them earlier, so it wakes them to look again.
type prefillCompute struct {
	mu      sync.Mutex
	base    time.Time     // the real clock's origin (monotonic)
	last    time.Duration // real time, since base, of the last advance
	virtual time.Duration // the virtual clock at last
	tagSum  time.Duration // the finish tags of jobs, summed
	jobs    []*computeJob // the prompts computing, in no order
}

// computeJob is one prompt's computation; an exchange holds one and
// reuses it (and its timer and channel) across requests.
type computeJob struct {
	tag   time.Duration // the virtual time at which it is done
	index int           // in prefillCompute.jobs while computing
	kick  chan struct{} // a value when another left; capacity 1
	timer *time.Timer
}

func newPrefillCompute() *prefillCompute {
	return &prefillCompute{base: time.Now()}
}

// doneSlack is how close to its tag a computation counts as done: less
// than a timer's own lateness, so that a wake-up at the estimate ends it
// rather than sleeping again for the nanoseconds of rounding.
const doneSlack = time.Microsecond

// advance moves the virtual clock to real time now (since base): each
// computing prompt received 1/N of the time since the last advance. The
// caller holds mu.
func (p *prefillCompute) advance(now time.Duration) {
	if n := len(p.jobs); n > 0 {
		p.virtual += (now - p.last) / time.Duration(n)
	}
	p.last = now
}

// remove takes j out of the computing prompts and wakes the others, whose
// tags are now nearer in real time. The caller holds mu.
func (p *prefillCompute) remove(j *computeJob) {
	last := len(p.jobs) - 1
	p.jobs[j.index] = p.jobs[last]
	p.jobs[j.index].index = j.index
	p.jobs[last] = nil
	p.jobs = p.jobs[:last]
	p.tagSum -= j.tag
	for _, o := range p.jobs {
		select {
		case o.kick <- struct{}{}:
		default:
		}
	}
}

// run computes for j a prompt needing work of compute at full speed,
// sharing the engine with the prompts computing meanwhile. It returns
// false when ctx ended first (j is then no longer computing).
func (p *prefillCompute) run(ctx context.Context, j *computeJob, work time.Duration) bool {
	if j.kick == nil {
		j.kick = make(chan struct{}, 1)
	}
	p.mu.Lock()
	p.advance(time.Since(p.base))
	j.tag = p.virtual + work
	p.tagSum += j.tag
	j.index = len(p.jobs)
	p.jobs = append(p.jobs, j)
	wait := work * time.Duration(len(p.jobs))
	p.mu.Unlock()
	if j.timer == nil {
		j.timer = time.NewTimer(wait)
	} else {
		j.timer.Reset(wait)
	}
	done := true
	for {
		select {
		case <-j.timer.C:
		case <-j.kick:
		case <-ctx.Done():
			done = false
		}
		p.mu.Lock()
		p.advance(time.Since(p.base))
		if rest := (j.tag - p.virtual) * time.Duration(len(p.jobs)); done && rest > doneSlack {
			p.mu.Unlock()
			j.timer.Reset(rest)
			continue
		}
		p.remove(j)
		p.mu.Unlock()
		j.timer.Stop()
		select { // a kick sent before remove; the next run starts clean
		case <-j.kick:
		default:
		}
		return done
	}
}

// left returns the compute the prompts computing still need, summed, at
// full speed: the time the engine needs to end them all.
func (p *prefillCompute) left() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.advance(time.Since(p.base))
	return max(p.tagSum-time.Duration(len(p.jobs))*p.virtual, 0)
}
