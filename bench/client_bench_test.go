package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"net/textproto"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// cannedServer answers every POST on a keep-alive connection with the same
// pre-built chunked SSE response, doing as little work per request as
// possible so that a benchmark of the client measures the client.
func cannedServer(tb testing.TB, tokens int) (url string, stop func()) {
	stream := syntheticStream(tokens)
	var resp bytes.Buffer
	resp.WriteString("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
	// One chunk per event, as an engine that flushes every token sends it.
	for _, ev := range bytes.SplitAfter(stream, []byte("\n\n")) {
		if len(ev) > 0 {
			fmt.Fprintf(&resp, "%x\r\n%s\r\n", len(ev), ev)
		}
	}
	resp.WriteString("0\r\n\r\n")
	canned := resp.Bytes()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				tp := textproto.NewReader(bufio.NewReader(c))
				for {
					if _, err := tp.ReadLine(); err != nil { // the request line
						return
					}
					hdr, err := tp.ReadMIMEHeader()
					if err != nil {
						return
					}
					n, _ := strconv.Atoi(hdr.Get("Content-Length"))
					if _, err := tp.R.Discard(n); err != nil {
						return
					}
					if _, err := c.Write(canned); err != nil {
						return
					}
				}
			}()
		}
	}()
	return "http://" + ln.Addr().String(), func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}
}

// BenchmarkRouterClientRequest is the client's own cost per streamed
// request of 16 tokens (allocs/op, B/op, ns/op) against a server that
// replays a canned response.
func BenchmarkRouterClientRequest(b *testing.B) {
	url, stop := cannedServer(b, 16)
	defer stop()
	target := NewRouterTarget(url, 1)
	defer target.Close()
	wl := testWorkload("m", 16)
	var live counters
	w := newWorker(wl.shape(), &wl, 1, &live)
	w.rec.itl = make([]time.Duration, 0, 64)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		target.do(ctx, w, time.Now())
		if len(w.rec.itl) > 32 {
			w.rec.reset()
		}
	}
	if live.errors.Load() != 0 {
		b.Fatalf("errors: %v", w.rec.errors)
	}
}

// The canned server is a valid stream for the client.
func TestCannedServerStream(t *testing.T) {
	url, stop := cannedServer(t, 16)
	defer stop()
	target := NewRouterTarget(url, 1)
	defer target.Close()
	wl := testWorkload("m", 16)
	wl.Requests = 3
	rep, err := Run(context.Background(), target, wl, RunOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.OK != 3 || rep.OutputTokens != 48 || rep.ITL.Count != 3*16 || !strings.EqualFold(rep.Target, "router") {
		t.Fatalf("report %+v", rep)
	}
}
