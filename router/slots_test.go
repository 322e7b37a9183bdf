package router

import (
	"fmt"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestStalledStreamsReleasedWithinBoundRAPI7RTMO6 proves that no stream
// waits for ever on a client that stops reading (R-API-7, R-TMO-6), over
// real sockets and with the kernel's own buffer tuning (no listener
// wrapper): the router makes a streaming connection's send buffer small
// (streamSendBuffer), so once eight clients with 4 KiB receive buffers
// stop reading, the engine's next tens of KiB fill the buffers and each
// request ends as client_stalled within 9/8 of server.stall_timeout_s
// plus a margin for those bytes — where the kernel would otherwise first
// take megabytes. Every decode leg is cancelled at its engine, every
// reservation returns, nobody is blamed, and another client is served
// meanwhile.
func TestStalledStreamsReleasedWithinBoundRAPI7RTMO6(t *testing.T) {
	const (
		stall = time.Second // server.stall_timeout_s
		// fill is what the engines (a token every millisecond, about 150
		// bytes each) take to produce what the buffers hold before a write
		// blocks: the client's receive window, the router's 32 KiB send
		// buffer and one batch, well under 100 KiB; with slack for eight
		// streams on two shared cores.
		fill = 1500 * time.Millisecond
		n    = 8
	)
	defs := longOutput()
	for i := range defs {
		defs[i].cfg.ITL = time.Millisecond
	}
	s := newStackOn(t, defs, func(c *config.Config) {
		stallConfig(c)
		c.Engine.DecodeReadTimeoutS = 1
		c.Server.StallTimeoutS = stall.Seconds()
	}, nil)
	s.waitModels()

	var wg sync.WaitGroup
	stopped := make([]time.Time, n)
	errs := make([]error, n)
	for i := range n {
		c := s.dialSmall()
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = openLongStream(c, fmt.Sprintf("stalled-%d", i), longTokens)
			stopped[i] = time.Now()
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}

	// Another client is served while the eight are stalled.
	resp, body := s.post("/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":8}`)
	if resp.StatusCode != 200 {
		t.Fatalf("a client beside the stalled ones: HTTP %d %s", resp.StatusCode, body)
	}

	bound := stall*9/8 + fill
	ended := make([]time.Time, n)
	last := stopped[0]
	for _, at := range stopped {
		if at.After(last) {
			last = at
		}
	}
	testkit.WaitFor(t, time.Until(last.Add(bound+time.Second)), "every stalled request to end", func() bool {
		all := true
		for i := range n {
			if ended[i].IsZero() {
				if s.findRequestEvent(fmt.Sprintf("stalled-%d", i)) != nil {
					ended[i] = time.Now()
				} else {
					all = false
				}
			}
		}
		return all
	})
	var longest time.Duration
	for i := range n {
		id := fmt.Sprintf("stalled-%d", i)
		if ev := s.findRequestEvent(id); ev.ErrorKind != outcomeClientStalled || ev.Status != 200 {
			t.Errorf("%s ended %q (status %d), want %s", id, ev.ErrorKind, ev.Status, outcomeClientStalled)
		}
		took := ended[i].Sub(stopped[i])
		longest = max(longest, took)
		if took > bound {
			t.Errorf("%s ended %v after its client stopped reading, want within %v", id, took, bound)
		}
	}
	t.Logf("stalled streams ended at most %v after their clients stopped reading (bound %v)", longest, bound)
	s.idle()
	s.checkNobodyBlamed()
	testkit.WaitFor(t, 2*time.Second, "every decode leg cancelled at its engine", func() bool {
		var aborted, active int64
		for _, id := range []string{"d1", "d2"} {
			st := s.sims[id].Stats()
			aborted += st.Aborted
			active += int64(st.ActiveStreams)
		}
		return aborted == n && active == 0
	})
}

// TestStreamSendBufferIsRestoredRTMO6 proves that a connection's small send
// buffer lasts only while it carries a stream: a kept-alive connection
// whose stream ended gets a large one back for its next responses (a
// whole non-streamed response must be accepted within
// server.stall_timeout_s).
func TestStreamSendBufferIsRestoredRTMO6(t *testing.T) {
	var mu sync.Mutex
	var conns []*net.TCPConn
	s := newStackOn(t, pd(), nil, func(ln net.Listener) net.Listener { return recordingListener{ln, &mu, &conns} })
	s.waitModels()
	resp, body := s.post("/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true}`)
	if resp.StatusCode != 200 || !strings.Contains(string(body), "[DONE]") {
		t.Fatalf("stream: HTTP %d %s", resp.StatusCode, body)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(conns) == 0 {
		t.Fatal("no connection accepted")
	}
	for _, c := range conns {
		raw, err := c.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		size := 0
		_ = raw.Control(func(fd uintptr) { size = sendBufferOf(fd) })
		if size <= 2*streamSendBuffer {
			t.Errorf("send buffer %d bytes after the stream ended, want more than the stream's %d", size, 2*streamSendBuffer)
		}
	}
}

type recordingListener struct {
	net.Listener
	mu    *sync.Mutex
	conns *[]*net.TCPConn
}

func (l recordingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		l.mu.Lock()
		*l.conns = append(*l.conns, tc)
		l.mu.Unlock()
	}
	return c, err
}

func sendBufferOf(fd uintptr) int {
	v, _ := syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF)
	return v
}
