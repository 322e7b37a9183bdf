package pause

import (
	"context"
	"testing"
	"time"
)

func TestForWaitsOrEndsWithItsContext(t *testing.T) {
	start := time.Now()
	if !For(context.Background(), 20*time.Millisecond) {
		t.Fatal("For with a live context reported it was cut short")
	}
	if took := time.Since(start); took < 20*time.Millisecond {
		t.Fatalf("For returned after %v, before its 20ms", took)
	}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(10*time.Millisecond, cancel)
	start = time.Now()
	if For(ctx, time.Hour) {
		t.Fatal("For reported an hour passed")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("For took %v to see its context end", took)
	}
}

func TestEveryTicksUntilItsContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	start := time.Now()
	var ticks []time.Time
	Every(ctx, 10*time.Millisecond, func(now time.Time) {
		ticks = append(ticks, now)
		if len(ticks) == 3 {
			cancel()
		}
	})
	if len(ticks) != 3 {
		t.Fatalf("%d ticks, want 3 before the cancel", len(ticks))
	}
	if first := ticks[0].Sub(start); first < 10*time.Millisecond {
		t.Errorf("the first tick came after %v, before one period", first)
	}
	for i := 1; i < len(ticks); i++ {
		if !ticks[i].After(ticks[i-1]) {
			t.Errorf("tick %d at %v is not after tick %d", i, ticks[i], i-1)
		}
	}
}
