//go:build linux

package router

import (
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// watcherLoops counts the disconnect watchers' goroutines.
func watcherLoops() int {
	return strings.Count(goroutineDump(), "router.(*disconnectWatcher).loop")
}

// watcherWaiting counts the watcher goroutines blocked in epoll_wait.
func watcherWaiting() int {
	n := 0
	for _, g := range strings.Split(goroutineDump(), "\n\n") {
		if strings.Contains(g, "router.(*disconnectWatcher).loop") && strings.Contains(g, "EpollWait") {
			n++
		}
	}
	return n
}

// TestWatcherWithoutEventfdLeavesNoGoroutine: when the wake-up eventfd
// cannot be created (here: the process is out of file descriptors), no
// watcher goroutine is left blocked in epoll_wait (R-OWN-1): either the
// watcher does not start, or close still stops it.
func TestWatcherWithoutEventfdLeavesNoGoroutine(t *testing.T) {
	before := watcherLoops()
	orig := newEventfd
	newEventfd = func() (int, error) { return -1, unix.EMFILE }
	defer func() { newEventfd = orig }()
	waiting := watcherWaiting()
	w, err := newDisconnectWatcher()
	if err == nil {
		// Close it the way Shutdown does: with its goroutine asleep in
		// epoll_wait.
		testkit.WaitFor(t, time.Second, "the watcher in epoll_wait", func() bool { return watcherWaiting() > waiting })
		w.close()
	}
	testkit.WaitFor(t, time.Second, "no disconnect watcher goroutine left after close", func() bool { return watcherLoops() == before })
	if err == nil {
		t.Fatal("a watcher that cannot be woken for close started anyway")
	}
}

// TestWatcherCloseStopsItsGoroutine: the ordinary path, for comparison.
func TestWatcherCloseStopsItsGoroutine(t *testing.T) {
	before := watcherLoops()
	w, err := newDisconnectWatcher()
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, time.Second, "the watcher in epoll_wait", func() bool { return watcherWaiting() > 0 })
	w.close()
	w.close() // idempotent
	testkit.WaitFor(t, time.Second, "the watcher goroutine gone", func() bool { return watcherLoops() == before })
}
