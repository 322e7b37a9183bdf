package eventview

import (
	"context"
	"fmt"
	"io"
	"sync"

	"github.com/narwhalmesh/narwhal/bus"
)

// Follow follows stream NARWHAL_EVENTS on b from start (its Filter is
// replaced by sel's) and writes each selected event to w as one line
// (Printer; with asJSON the JSON exactly as published), one event at a
// time and in stream order (behaviour.md R-BUS-5). Once the consumer exists it
// calls ready, when set, with the subject filter in use.
//
// It runs until ctx ends and then returns nil. It returns an error when
// the consumer cannot be created or when w fails ("write: …"; nothing is
// written after that).
func Follow(ctx context.Context, b *bus.Bus, start bus.SubscribeOptions, sel Selection, w io.Writer, asJSON bool, ready func(filter string)) error {
	start.Filter = sel.Filter()
	p := NewPrinter(w, asJSON)
	failed := make(chan error, 1)
	var mu sync.Mutex // one event at a time, also across consumer resets
	stop, err := bus.SubscribeWith(ctx, b, start, func(subject string, payload []byte) {
		mu.Lock()
		defer mu.Unlock()
		if p.err != nil || !sel.Keep(subject, payload) {
			return
		}
		if err := p.Print(subject, payload); err != nil {
			failed <- fmt.Errorf("write: %w", err) // once: p.err is set now
		}
	})
	if err != nil {
		return err
	}
	defer stop()
	if ready != nil {
		ready(start.Filter)
	}
	select {
	case <-ctx.Done():
		return nil
	case err := <-failed:
		return err
	}
}
