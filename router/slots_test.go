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
// (streamSendBuffer), so once a hundred clients with 4 KiB receive
// buffers stop reading, the engine's next tens of KiB fill the buffers
// and each request ends as client_stalled within 9/8 of
// server.stall_timeout_s plus the time those bytes take — where the
// kernel would otherwise first take megabytes. Every decode leg is
// cancelled at its engine, every reservation returns, nobody is blamed,
// and another client is served meanwhile.
//
// The clients ask for 20 top logprobs, so each event is about 1.5 KB and
// the buffers fill in a few dozen tokens; they open in waves of 20, and
// server.stall_timeout_s is 3 s, so that a loaded machine that schedules
// a client late does not cut it while it reads its first bytes.
func TestStalledStreamsReleasedWithinBoundRAPI7RTMO6(t *testing.T) {
	const (
		stall = 3 * time.Second // server.stall_timeout_s
		// fill is what the engines (a token every 5 ms, about 1.5 KB
		// each) take to produce what the buffers hold before a write
		// blocks: the client's receive window, the router's 32 KiB send
		// buffer and one batch, under 64 KiB or about 45 tokens (0.2 s
		// alone; up to 3.3 s was seen with a hundred streams on two
		// cores shared with other test binaries at a load of 14-23).
		fill = 4 * time.Second
		n    = 100
		wave = 20
	)
	defs := longOutput()
	for i := range defs {
		defs[i].cfg.ITL = 5 * time.Millisecond
	}
	s := newStackOn(t, defs, func(c *config.Config) {
		stallConfig(c)
		c.Engine.DecodeReadTimeoutS = 1
		c.Server.StallTimeoutS = stall.Seconds()
	}, nil)
	s.waitModels()

	// 5,000 tokens are 25 s of output, far beyond the test's few seconds
	// (the simulator draws a request's tokens when it starts, so
	// longTokens would cost a hundred times 200,000 words).
	body := `{"model":"sim-model","messages":[{"role":"user","content":"tell a long story"}],"stream":true,"max_tokens":5000,"ignore_eos":true,"logprobs":true,"top_logprobs":20}`
	stopped := make([]time.Time, n)
	errs := make([]error, n)
	for first := 0; first < n; first += wave {
		var wg sync.WaitGroup
		for i := first; i < min(first+wave, n); i++ {
			c := s.dialSmall()
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = openStream(c, fmt.Sprintf("stalled-%d", i), body)
				stopped[i] = time.Now()
			}()
		}
		wg.Wait()
		for _, err := range errs[first:min(first+wave, n)] {
			if err != nil {
				t.Fatal(err)
			}
		}
	}

	// Another client is served while the hundred are stalled.
	resp, got := s.post("/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":8}`)
	if resp.StatusCode != 200 {
		t.Fatalf("a client beside the stalled ones: HTTP %d %s", resp.StatusCode, got)
	}

	bound := stall*9/8 + fill
	ended := make([]time.Time, n)
	testkit.WaitFor(t, time.Until(stopped[n-1].Add(bound+time.Second)), "every stalled request to end", func() bool {
		all := true
		for i := range n {
			if ended[i].IsZero() {
				if ev := s.findRequestEvent(fmt.Sprintf("stalled-%d", i)); ev != nil {
					ended[i] = ev.At // when the router ended it, not when the test looked
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
	t.Logf("%d stalled streams ended at most %v after their clients stopped reading (bound %v)", n, longest, bound)
	s.idle()
	s.checkNobodyBlamed()
	testkit.WaitFor(t, 5*time.Second, "every decode leg cancelled at its engine", func() bool {
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
