package testkit

import (
	"testing"

	"go.uber.org/goleak"
)

// CheckLeaks fails t when a goroutine that did not exist when CheckLeaks
// was called is still running after the test's other cleanups. Call it
// first in the test: cleanups run last-registered first, so its check
// then runs after every server, client and bus of the test has stopped.
// opts are goleak's, for goroutines that outlive a test by design (see
// FasthttpLongLived).
func CheckLeaks(t testing.TB, opts ...goleak.Option) {
	t.Helper()
	opts = append([]goleak.Option{goleak.IgnoreCurrent()}, opts...)
	t.Cleanup(func() { goleak.VerifyNone(t, opts...) })
}

// FasthttpLongLived ignores the goroutines fasthttp keeps by design past
// a server's Shutdown: its process-wide date updater, and its worker
// pools' cleaners, which notice a stopped server only on their next 10 s
// tick.
func FasthttpLongLived() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
	}
}
