package eventview

import (
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
)

// TestResumeNoticeRBUS5 checks the stderr lines of `narwhal events` when
// it resumes (R-BUS-5: it never skips, and says what the stream's
// retention removed before it could read it).
func TestResumeNoticeRBUS5(t *testing.T) {
	all := Selection{}
	for _, c := range []struct {
		r    bus.Resumption
		sel  Selection
		want string
	}{
		{bus.Resumption{Start: 42}, all, "resumed at stream sequence 42"},
		{bus.Resumption{}, all, "resumed at its first start again (no event read yet)"},
		{bus.Resumption{Start: 1, NewStream: true}, all, "stream NARWHAL_EVENTS was made anew; following it from its start"},
		{bus.Resumption{Start: 30, Lost: 12}, all,
			"12 events lost: removed by the stream's retention before they could be read (sequences 30–41); resumed at stream sequence 42"},
		{bus.Resumption{Start: 30, Lost: 1}, all,
			"1 event lost: removed by the stream's retention before they could be read (sequence 30); resumed at stream sequence 31"},
		{bus.Resumption{Start: 1, Lost: 3, NewStream: true}, all,
			"stream NARWHAL_EVENTS was made anew; following it from its start; 3 events lost: removed by the stream's retention before they could be read (sequences 1–3)"},
		{bus.Resumption{Start: 30, Lost: 12}, Selection{Kind: "failure"},
			"12 events lost: removed by the stream's retention before they could be read (sequences 30–41, of every kind and engine: fewer may have matched --kind failure); resumed at stream sequence 42"},
		{bus.Resumption{Start: 30, Lost: 2}, Selection{Kind: "request", Engine: "d1"},
			"2 events lost: removed by the stream's retention before they could be read (sequences 30–31, of every kind and engine: fewer may have matched --kind request --engine d1); resumed at stream sequence 32"},
	} {
		if got := ResumeNotice(c.r, c.sel); got != c.want {
			t.Errorf("ResumeNotice(%+v, %+v) =\n%s\nwant\n%s", c.r, c.sel, got, c.want)
		}
	}
}
