// Package pause waits for a while unless a context ends first: the one
// cancellable sleep of the bus set-up, the breaker's cadences and the
// chaos proxy's delays.
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
