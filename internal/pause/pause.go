// Package pause waits for a while unless a context ends first: the one
// cancellable sleep of the bus set-up, the breaker's cadences and the
// chaos proxy's delays, and the one periodic loop of the simulator's KV
// expiry, the router's body-budget sweep and the breaker's readmission
// rounds.
package pause

import (
	"context"
	"time"
)

// For waits d (a time.Duration; d <= 0 returns at once) or until ctx
// ends, whichever comes first, and reports whether d passed. Its timer is
// stopped either way.
func For(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Every calls f with the tick's time every period (a time.Duration > 0)
// until ctx ends, and returns then. The first call comes one period after
// the start; a call that outlasts a period delays the next tick rather
// than queueing ticks (time.Ticker's rule). f runs on the caller's
// goroutine.
func Every(ctx context.Context, period time.Duration, f func(now time.Time)) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			f(now)
		}
	}
}
