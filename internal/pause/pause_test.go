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
