package bus

import (
	"testing"
	"time"
)

// TestResumeFromRBUS5 proves where a follower of NARWHAL_EVENTS resumes
// after a reconnect (R-BUS-5, `narwhal events` never skips): on the same
// stream at the sequence after the last one read, on a stream made anew
// at its start, and with the events the retention removed counted.
func TestResumeFromRBUS5(t *testing.T) {
	created := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	later := created.Add(time.Hour)
	cases := []struct {
		name        string
		mark        StreamMark
		created     time.Time
		first, last uint64
		want        Resumption
	}{
		{"same stream, events stored meanwhile", StreamMark{created, 43}, created, 1, 60, Resumption{Start: 43}},
		{"same stream, nothing new", StreamMark{created, 43}, created, 1, 42, Resumption{Start: 43}},
		{"same stream, nothing read yet (new events only)", StreamMark{created, 43}, created, 40, 42, Resumption{Start: 43}},
		{"same stream, no position yet (since a time)", StreamMark{created, 0}, created, 5, 42, Resumption{Start: 0}},
		{"same stream, retention removed 12", StreamMark{created, 43}, created, 55, 70, Resumption{Start: 43, Lost: 12}},
		{"same stream, retention removed exactly up to it", StreamMark{created, 43}, created, 43, 70, Resumption{Start: 43}},
		{"same stream, everything removed, nothing wanted", StreamMark{created, 43}, created, 43, 42, Resumption{Start: 43}},
		{"same stream, everything removed", StreamMark{created, 43}, created, 51, 50, Resumption{Start: 43, Lost: 8}},
		{"new stream (another creation time)", StreamMark{created, 43}, later, 1, 5, Resumption{Start: 1, NewStream: true}},
		{"new stream, still empty", StreamMark{created, 43}, later, 0, 0, Resumption{Start: 1, NewStream: true}},
		{"new stream, longer than the old one", StreamMark{created, 43}, later, 1, 500, Resumption{Start: 1, NewStream: true}},
		{"new stream, its first events removed", StreamMark{created, 43}, later, 4, 9, Resumption{Start: 1, Lost: 3, NewStream: true}},
		{"new stream before any event was read", StreamMark{created, 0}, later, 1, 3, Resumption{Start: 1, NewStream: true}},
		{"same creation time but sequences end before the mark", StreamMark{created, 43}, created, 1, 10, Resumption{Start: 1, NewStream: true}},
	}
	for _, c := range cases {
		if got := ResumeFrom(c.mark, c.created, c.first, c.last); got != c.want {
			t.Errorf("%s: ResumeFrom(%+v, first %d, last %d) = %+v, want %+v", c.name, c.mark, c.first, c.last, got, c.want)
		}
	}
}
