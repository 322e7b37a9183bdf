//go:build !linux

package router

import "net"

// disconnectWatcher is a no-op outside Linux: a client that leaves is seen
// at the next failed write, and every leg is still bounded by its timers
// and the request deadline.
type disconnectWatcher struct{}

type watch struct{}

func newDisconnectWatcher() (*disconnectWatcher, error)  { return &disconnectWatcher{}, nil }
func (w *disconnectWatcher) add(net.Conn, func()) *watch { return nil }
func (wt *watch) stop()                                  {}
func (w *disconnectWatcher) close()                      {}
