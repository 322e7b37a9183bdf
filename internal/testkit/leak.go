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
// FasthttpLongLived); NATSLongLived's are always ignored.
func CheckLeaks(t testing.TB, opts ...goleak.Option) {
	t.Helper()
	opts = append(append([]goleak.Option{goleak.IgnoreCurrent()}, NATSLongLived()...), opts...)
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

// NATSLongLived ignores the goroutine nats-server keeps past its Shutdown
// while it sets up a stream's source (NARWHAL_HISTORY sources
// NARWHAL_EVENTS): it waits up to 30 s for an answer that a server shut
// down right after creating the stream never sends, then ends on its own.
func NATSLongLived() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).trySetupSourceConsumer.func3"),
	}
}
