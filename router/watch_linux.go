//go:build linux

package router

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// disconnectWatcher tells a request that its client went away while the
// router waits on engines (behaviour.md R-OWN-5). fasthttp cannot see this itself:
// nothing reads the socket while the handler waits (fasthttp issues #468,
// #965). Instead of
// peeking every socket a few times a second, the watcher registers each
// waiting connection in a private epoll set for EPOLLRDHUP (peer closed its
// side), EPOLLHUP and EPOLLERR (reset), one-shot: one goroutine sleeps in
// epoll_wait and cancels the request the moment the client leaves, at no
// cost while nothing happens. An fd can be in several epoll sets, so Go's
// own netpoller is untouched.
type disconnectWatcher struct {
	epfd    int
	wake    int // eventfd registered under id 0: written by close
	nextID  atomic.Uint32
	waiters sync.Map // uint32 → *watch
	done    chan struct{}
	closed  atomic.Bool
}

// watch is one registered connection.
type watch struct {
	id     uint32
	fd     int
	cancel func()
	w      *disconnectWatcher
}

// newEventfd creates the watcher's wake-up eventfd. It is a variable so
// that a test can make it fail.
var newEventfd = func() (int, error) { return unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK) }

// newDisconnectWatcher starts a watcher. Its wake-up eventfd is made and
// registered before the goroutine starts, not at close: a watcher whose
// close could not wake it would leave its goroutine blocked in epoll_wait
// for good. It returns the error when the epoll set or the eventfd cannot
// be made (file descriptors exhausted, typically).
func newDisconnectWatcher() (*disconnectWatcher, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	efd, err := newEventfd()
	if err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: 0}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, efd, &ev); err != nil {
		unix.Close(efd)
		unix.Close(epfd)
		return nil, fmt.Errorf("epoll_ctl: %w", err)
	}
	w := &disconnectWatcher{epfd: epfd, wake: efd, done: make(chan struct{})}
	go w.loop()
	return w, nil
}

func (w *disconnectWatcher) loop() {
	defer close(w.done)
	events := make([]unix.EpollEvent, 128)
	for {
		n, err := unix.EpollWait(w.epfd, events, -1)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return
		}
		for i := 0; i < n; i++ {
			id := uint32(events[i].Fd)
			if id == 0 { // wake-up for Close
				if w.closed.Load() {
					return
				}
				continue
			}
			if v, ok := w.waiters.Load(id); ok {
				v.(*watch).cancel()
			}
		}
	}
}

// add starts watching conn and calls cancel once if its peer goes away. It
// returns nil when the connection cannot be watched (not a TCP or Unix
// socket); stop the returned watch before the handler gives the
// connection back to fasthttp.
func (w *disconnectWatcher) add(conn net.Conn, cancel func()) *watch {
	if tc, ok := conn.(*tls.Conn); ok {
		// The TCP socket under TLS: a peer that closes it is gone the
		// same way.
		conn = tc.NetConn()
	}
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	id := w.nextID.Add(1)
	if id == 0 {
		id = w.nextID.Add(1)
	}
	wt := &watch{id: id, fd: -1, cancel: cancel, w: w}
	w.waiters.Store(id, wt)
	var regErr error
	_ = raw.Control(func(fd uintptr) {
		ev := unix.EpollEvent{Events: unix.EPOLLRDHUP | unix.EPOLLHUP | unix.EPOLLERR | unix.EPOLLONESHOT, Fd: int32(id)}
		regErr = unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, int(fd), &ev)
		if regErr == nil {
			wt.fd = int(fd)
		}
	})
	if regErr != nil {
		w.waiters.Delete(id)
		return nil
	}
	return wt
}

// stop ends the watch. It must run while the connection is still open.
func (wt *watch) stop() {
	if wt == nil {
		return
	}
	if wt.fd >= 0 {
		_ = unix.EpollCtl(wt.w.epfd, unix.EPOLL_CTL_DEL, wt.fd, nil)
	}
	wt.w.waiters.Delete(wt.id)
}

// close stops the watcher goroutine and waits for it to end. It is
// idempotent.
func (w *disconnectWatcher) close() {
	if !w.closed.CompareAndSwap(false, true) {
		return
	}
	// One write of 8 bytes to an eventfd of our own fails only when a
	// signal interrupts it. Should it fail otherwise, the goroutine cannot
	// be woken: close then does not wait for it, and leaves both
	// descriptors open, for it still sleeps on them.
	one := []byte{1, 0, 0, 0, 0, 0, 0, 0}
	var err error
	for {
		if _, err = unix.Write(w.wake, one); !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		return
	}
	<-w.done
	unix.Close(w.wake)
	unix.Close(w.epfd)
}
