package bus_test

import (
	"errors"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
)

// TestStartEmbeddedBusyPortFailsAtOnce proves that an embedded server
// whose client or cluster port another process holds fails at once (not
// after the ready timeout) with a *bus.ListenError naming the address and
// wrapping syscall.EADDRINUSE, set-up or not.
func TestStartEmbeddedBusyPortFailsAtOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	taken := ln.Addr().(*net.TCPAddr)
	for _, c := range []struct {
		name string
		opts bus.EmbeddedOptions
		port string
	}{
		{"client port, no set-up", bus.EmbeddedOptions{Host: "127.0.0.1", Port: taken.Port, NoSetup: true}, "client"},
		{"client port, set-up", bus.EmbeddedOptions{Host: "127.0.0.1", Port: taken.Port}, "client"},
		{"cluster port", bus.EmbeddedOptions{Host: "127.0.0.1", Port: -1, NoSetup: true, ServerName: "a", Cluster: taken.String(),
			Routes: []string{"nats://127.0.0.1:1"}}, "cluster"},
	} {
		c.opts.Dir = t.TempDir()
		start := time.Now()
		emb, err := bus.StartEmbedded(c.opts)
		if err == nil {
			emb.Shutdown()
			t.Errorf("%s: started on the taken %s", c.name, taken)
			continue
		}
		if d := time.Since(start); d > 3*time.Second {
			t.Errorf("%s: failed after %v, want at once", c.name, d)
		}
		var le *bus.ListenError
		if !errors.As(err, &le) || le.Port != c.port || le.Addr != taken.String() || !errors.Is(err, syscall.EADDRINUSE) ||
			!strings.Contains(err.Error(), taken.String()+": the address is already in use") {
			t.Errorf("%s: error %v (%#v), want a ListenError of the %s port %s in use", c.name, err, le, c.port, taken)
		}
	}
}
