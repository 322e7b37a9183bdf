package eventview

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"

	"github.com/narwhalmesh/narwhal/bus"
)

// Follow follows stream NARWHAL_EVENTS on b from start (its Filter is
// replaced by sel's) and writes each selected event to w as one line
// (Printer; with asJSON the JSON exactly as published), one event at a
// time and in stream order (behaviour.md R-BUS-5), each event once: after
// a reconnect or the loss of its consumer it resumes where it stopped
// (bus.SubscribeResuming) and writes to notices,
// when set, the line of ResumeNotice for that resumption. Once the
// consumer exists it calls ready, when set, with the subject filter in
// use.
//
// It runs until ctx ends and then returns nil. It returns an error when
// the consumer cannot be created or when w fails ("write: …"; nothing is
// written after that).
func Follow(ctx context.Context, b *bus.Bus, start bus.SubscribeOptions, sel Selection, w, notices io.Writer, asJSON bool, ready func(filter string)) error {
	start.Filter = sel.Filter()
	p := NewPrinter(w, asJSON)
	failed := make(chan error, 1)
	var mu sync.Mutex // one event at a time, also across consumer resets
	stop, err := bus.SubscribeResuming(ctx, b, start, func(subject string, payload []byte) {
		mu.Lock()
		defer mu.Unlock()
		if p.err != nil || !sel.Keep(subject, payload) {
			return
		}
		if err := p.Print(subject, payload); err != nil {
			failed <- fmt.Errorf("write: %w", err) // once: p.err is set now
		}
	}, func(r bus.Resumption) {
		if notices == nil {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintln(notices, ResumeNotice(r, sel))
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

// ResumeNotice is the stderr line of `narwhal events` when it resumes
// after a reconnect or the loss of its consumer (behaviour.md R-BUS-5),
// showing sel:
//
//	resumed at stream sequence 42
//	stream NARWHAL_EVENTS was made anew; following it from its start
//	12 events lost: removed by the stream's retention before they could be read (sequences 30–41); resumed at stream sequence 42
//
// A loss is counted over every event; with a --kind or --engine the line
// adds that fewer of them may have matched it.
func ResumeNotice(r bus.Resumption, sel Selection) string {
	var line string
	if r.NewStream {
		line = "stream " + bus.StreamName + " was made anew; following it from its start"
	}
	if r.Lost > 0 {
		events := "events"
		if r.Lost == 1 {
			events = "event"
		}
		first, last := r.Start, r.Start+r.Lost-1
		span := fmt.Sprintf("sequence %d", first)
		if last > first {
			span = fmt.Sprintf("sequences %d–%d", first, last)
		}
		loss := fmt.Sprintf("%d %s lost: removed by the stream's retention before they could be read (%s", r.Lost, events, span)
		if narrow := sel.flags(); narrow != "" {
			loss += ", of every kind and engine: fewer may have matched " + narrow
		}
		loss += ")"
		if line != "" {
			line += "; " + loss
		} else {
			line = loss
		}
	}
	if !r.NewStream {
		resumed := fmt.Sprintf("resumed at stream sequence %d", r.Start+r.Lost)
		if r.Start == 0 {
			resumed = "resumed at its first start again (no event read yet)"
		}
		if line != "" {
			line += "; " + resumed
		} else {
			line = resumed
		}
	}
	return line
}

// flags returns the selection as `narwhal events` flags ("--kind failure
// --engine d1"), "" for every event.
func (s Selection) flags() string {
	var f []string
	if s.Kind != "" {
		f = append(f, "--kind "+s.Kind)
	}
	if s.Engine != "" {
		f = append(f, "--engine "+s.Engine)
	}
	return strings.Join(f, " ")
}
