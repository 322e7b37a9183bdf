package router

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// relayBody is the body of a committed stream (behaviour.md R-FAIL-5, R-RETRY-4).
// fasthttp calls WriteTo in the connection's own goroutine and sends each
// Write as one chunk, flushed: the relay writes the metadata held before
// the first output, the first output, then every event as the engine sent
// it, one Write per batch of events the engine had ready. It ends with
// data: [DONE], or after a failure with one terminal error event and no
// [DONE]. Close, which fasthttp always calls, finishes the request.
//
// The client's pace is its own (R-TMO-6): while a Write is blocked on a
// client that does not read, the engine's between-chunk bound does not
// run and nothing more is read from the engine, and each Write must be
// accepted within server.stall_timeout_s (the connection's write
// deadline), or the request ends as client_stalled.
type relayBody struct {
	c       *call
	bp      *[]byte // buf's pool entry
	buf     []byte
	off     int // what Read has handed out of buf
	started bool
	done    bool

	conn     net.Conn      // the client's connection, for its write deadline
	stall    time.Duration // server.stall_timeout_s
	deadline time.Time     // the write deadline set last
	unblock  func() bool   // stops the context's hold on the write deadline
	ended    atomic.Bool   // the request's context ended: no more extensions
	tcp      *net.TCPConn  // conn's TCP connection, whose send buffer is small while it streams
}

// Send buffers of a client connection that carries a stream (R-TMO-6,
// docs/security.md#slow-readers).
const (
	// streamSendBuffer is the kernel send buffer (SO_SNDBUF; Linux
	// reserves twice it, 32 KiB) asked for while the connection carries a
	// stream: once its client stops reading, the router can hand the
	// kernel only that much more (beyond what the client's receive window
	// takes) before a write blocks and server.stall_timeout_s starts,
	// where the kernel's own tuning would first take megabytes. A reading
	// client still gets 32 KiB a round trip (320 KB/s at 100 ms), far
	// beyond a decode engine's output.
	streamSendBuffer = 16 << 10
	// afterStreamSendBuffer is the send buffer the connection gets back
	// once its stream ended, for the next responses on it (the kernel
	// clamps it to net.core.wmem_max): a whole non-streamed response must
	// be accepted within server.stall_timeout_s.
	afterStreamSendBuffer = 4 << 20
)

// tcpConn returns the TCP connection under conn (through TLS), or nil.
func tcpConn(conn net.Conn) *net.TCPConn {
	for range 4 {
		switch c := conn.(type) {
		case *net.TCPConn:
			return c
		case interface{ NetConn() net.Conn }:
			conn = c.NetConn()
		default:
			return nil
		}
	}
	return nil
}

// newRelayBody returns the body of c's committed stream to the client on
// conn, each write bounded by stall, with conn's send buffer at
// streamSendBuffer until Close. Once the request's context ends (its
// deadline, R-TMO-5; the router's shutdown; the client's disconnect), the
// client gets at most endGrace more to take what is left, the terminal
// error event included: a stalled client never holds a request or a
// shutdown beyond them.
func newRelayBody(c *call, conn net.Conn, stall time.Duration) *relayBody {
	bp := relayBufPool.Get().(*[]byte)
	r := &relayBody{c: c, bp: bp, buf: (*bp)[:0], conn: conn, stall: stall}
	if r.tcp = tcpConn(conn); r.tcp != nil && r.tcp.SetWriteBuffer(streamSendBuffer) != nil {
		r.tcp = nil
	}
	if conn != nil {
		r.unblock = context.AfterFunc(c.ctx, func() {
			r.ended.Store(true)
			_ = conn.SetWriteDeadline(time.Now().Add(r.endGrace()))
		})
	}
	return r
}

// endGrace is how long a client may still take to accept the rest of its
// stream once the request has ended: a second, or stall if shorter.
func (r *relayBody) endGrace() time.Duration {
	return min(r.stall, time.Second)
}

// relayBatchBytes bounds one write to the client: a batch ends after the
// event that reaches it.
const relayBatchBytes = 16 << 10

var relayBufPool = sync.Pool{New: func() any { b := make([]byte, 0, 2<<10); return &b }}

// SupportsBodyWriteTo tells fasthttp to use WriteTo (fasthttp.BodyWriterTo).
func (r *relayBody) SupportsBodyWriteTo() bool { return true }

// WriteTo relays the stream to w until it ends.
func (r *relayBody) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for {
		more := r.fill()
		if len(r.buf) > 0 {
			n, err := r.write(w)
			total += int64(n)

			r.buf = r.buf[:0]
			if err != nil {
				r.writeFailed(err)
				return total, err
			}
		}
		if !more {
			return total, nil
		}
	}
}

// writeFailed ends the stream after a failed write: the request's own end
// (deadline, shutdown) when its context ended first, else a stalled or a
// departed client.
func (r *relayBody) writeFailed(err error) {
	c := r.c
	switch cause := context.Cause(c.ctx); {
	case errors.Is(cause, engines.ErrRouterShutdown):
		c.outcome = string(engines.KindShutdown)
	case errors.Is(cause, context.DeadlineExceeded):
		c.outcome = string(engines.KindRequestTimeout)
	case cause == nil && errors.Is(err, errClientStalled):
		c.clientStalled()
	default:
		c.clientGone()
	}
}

// errClientStalled is the error of a write the client did not accept
// within server.stall_timeout_s.
var errClientStalled = errors.New("client accepted no bytes for server.stall_timeout_s")

// write writes r.buf to w with the stream's between-chunk bound paused
// (R-TMO-6) and the connection's write deadline at least stall away: it
// is moved only once less than stall is left, to now plus 9/8 of stall,
// so a write may block between stall and 9/8 of stall before it fails,
// at the cost of one deadline update per eighth of stall. A write that
// runs into the deadline returns errClientStalled.
func (r *relayBody) write(w io.Writer) (int, error) {
	if r.conn != nil && r.stall > 0 && !r.ended.Load() {
		if now := time.Now(); r.deadline.Sub(now) < r.stall {
			r.deadline = now.Add(r.stall + r.stall/8)
			if err := r.conn.SetWriteDeadline(r.deadline); err != nil {
				return 0, err
			}
			if r.ended.Load() {
				// The context ended while the deadline moved: its bound wins.
				_ = r.conn.SetWriteDeadline(now.Add(r.endGrace()))
			}
		}
	}
	s := r.c.stream
	if s != nil {
		s.ClientWait()
	}
	n, err := w.Write(r.buf)
	if s != nil {
		s.ClientDone()
	}
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		return n, errClientStalled
	}
	return n, err
}

// Read is the io.Reader fallback of WriteTo.
func (r *relayBody) Read(p []byte) (int, error) {
	for r.off >= len(r.buf) {
		if r.done {
			return 0, io.EOF
		}
		r.buf, r.off = r.buf[:0], 0
		r.fill()
	}
	n := copy(p, r.buf[r.off:])
	r.off += n
	return n, nil
}

// fill appends the next batch to r.buf: first the held metadata and the
// first output, then events until the engine has nothing more buffered. It
// returns false once the stream has ended (its last bytes, [DONE] or the
// terminal error event, are then in r.buf).
func (r *relayBody) fill() bool {
	c := r.c
	if r.done {
		return false
	}
	if !r.started {
		r.started = true
		for _, h := range c.pending {
			r.buf = c.appendEvent(r.buf, h.payload, h.chunk)
		}
		r.buf = c.appendEvent(r.buf, c.first, schemas.Chunk{Kind: schemas.ChunkOutput})
		return true
	}
	for {
		payload, _, err := c.stream.Next()
		if err == io.EOF {
			r.buf = append(r.buf, "data: [DONE]\n\n"...)
			c.outcome = "ok"
			r.done = true
			return false
		}
		if err != nil {
			r.done = true
			f := engines.AsFault(err, schemas.PhaseDecode, c.consumer.ID)
			if f.Kind == engines.KindClientGone {
				c.clientGone()
				return false
			}
			c.recordFault(f)
			c.outcome = string(f.Kind)
			r.buf = append(r.buf, "data: "...)
			r.buf = f.AppendJSON(r.buf)
			r.buf = append(r.buf, "\n\n"...)
			return false
		}
		c.chunks++
		ch := c.stream.Chunk()
		if ch.Kind == schemas.ChunkOutput {
			c.observeOutput()
		}
		r.buf = c.appendEvent(r.buf, payload, ch)
		// One batch is what the engine had ready, up to relayBatchBytes:
		// after a client's pause the engine's backlog leaves in writes of
		// bounded size, so the relay's buffer stays small and a write
		// blocks only as long as the client takes none of it (R-TMO-6).
		if c.stream.Buffered() == 0 || len(r.buf) >= relayBatchBytes {
			return true
		}
	}
}

// Close finishes the request; fasthttp calls it once the body is written
// or the connection failed. The context's hold on the write deadline ends
// first: fasthttp still flushes the stream's last chunk after Close.
func (r *relayBody) Close() error {
	if r.unblock != nil {
		r.unblock()
		r.unblock = nil
	}
	if r.tcp != nil {
		_ = r.tcp.SetWriteBuffer(afterStreamSendBuffer)
		r.tcp = nil
	}
	r.c.finish()
	if r.bp != nil && cap(r.buf) <= 1<<20 {
		*r.bp = r.buf[:0]
		relayBufPool.Put(r.bp)
	}
	r.bp, r.buf = nil, nil
	return nil
}

// appendEvent appends one data event to dst, keeping the usage chunk only
// for clients that asked for it (R-LEG-5, R-LEG-6) while reading usage from
// it either way. ch is what the stream's one scan of payload found: the
// relay never reads a payload again. Output chunks are passed through.
func (c *call) appendEvent(dst, payload []byte, ch schemas.Chunk) []byte {
	if ch.Kind == schemas.ChunkMetadata && ch.Usage {
		c.promptTokens, c.completionTokens, c.usage = ch.PromptTokens, ch.CompletionTokens, true
		c.cachedTokens, c.cachedKnown = ch.CachedTokens, ch.Cached
		if !c.req.IncludeUsage && ch.UsageOnly {
			return dst
		}
	}
	dst = append(dst, "data: "...)
	dst = append(dst, payload...)
	return append(dst, "\n\n"...)
}

// clientStalled ends a committed stream whose client accepted no bytes for
// server.stall_timeout_s (R-TMO-6): a client fault. The legs are cancelled
// and everything is released by finish, which Close runs next; nothing is
// counted against the engine, and fasthttp closes the connection.
func (c *call) clientStalled() {
	c.cancel(errClientStalled)
	c.outcome = outcomeClientStalled
	c.rt.front.stalls.Inc()
}

// clientGone ends a committed stream whose client went away (R-OWN-5).
func (c *call) clientGone() {
	c.cancel(engines.ErrClientGone)
	c.outcome = string(engines.KindClientGone)
	c.rt.metrics.disconnects.Inc()
}

// outcomeResponseTooLarge ends a non-streamed request whose aggregated
// output went beyond request.max_response_bytes (R-LEG-5, R-API-8).
const outcomeResponseTooLarge = "response_too_large"

// aggregate answers a non-streaming client with one completion built from
// the decode stream (R-LEG-5).
func (c *call) aggregate(fctx *fasthttp.RequestCtx) {
	agg := schemas.NewAggregator(c.req.Chat())
	for _, h := range c.pending {
		_ = agg.Add(h.payload)
	}
	_ = agg.Add(c.first)
	for {
		payload, _, err := c.stream.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			f := engines.AsFault(err, schemas.PhaseDecode, c.consumer.ID)
			if f.Kind == engines.KindClientGone {
				c.rt.metrics.disconnects.Inc()
			} else {
				c.recordFault(f)
			}
			c.fail(fctx, f)
			return
		}
		ch := c.stream.Chunk()
		if ch.Kind == schemas.ChunkOutput {
			c.observeOutput()
		}
		if ch.Usage {
			c.cachedTokens, c.cachedKnown = ch.CachedTokens, ch.Cached
		}
		if err := agg.Add(payload); err != nil {
			f := engines.NewFault(engines.KindInvalidStream, schemas.PhaseDecode, c.consumer.ID, 0, "decode engine "+c.consumer.ID+" sent a chunk that could not be aggregated")
			c.recordFault(f)
			c.fail(fctx, f)
			return
		}
		if lim := c.rt.cfg.Request.MaxResponseBytes; agg.Bytes() > lim {
			// The client asked for more output than the router holds for
			// one response: its request, not the engine, is at fault; finish
			// cancels the leg and releases everything at once.
			c.reject(fctx, 400, "the response exceeds "+strconv.Itoa(lim)+" bytes (request.max_response_bytes) when not streamed: send \"stream\": true, or ask for less output (max_tokens, n, logprobs)", outcomeResponseTooLarge)
			return
		}
	}
	if prompt, completion, ok := agg.Usage(); ok {
		c.promptTokens, c.completionTokens, c.usage = prompt, completion, true
	}
	c.watch.stop()
	c.watch = nil
	fctx.SetStatusCode(200)
	fctx.SetContentType("application/json")
	fctx.SetBody(agg.AppendJSON(nil))
	c.status, c.outcome = 200, "ok"
	c.finish()
}

// maxHeldBytes bounds the metadata chunks a decode leg may send before its
// first generated output, which are held for the client until then
// (R-TMO-1): normally one role chunk of a few hundred bytes. An engine
// that sends metadata without end would otherwise grow the router's
// memory until the first-token timeout.
const maxHeldBytes = 1 << 20

// hold keeps one metadata chunk read before the first output; held is
// the attempt's count of bytes held so far. Past maxHeldBytes it holds
// nothing more and returns the consumer's fault (invalid_stream, 502).
func (c *call) hold(held *int, payload []byte, chunk schemas.Chunk) *engines.Fault {
	*held += len(payload)
	if *held > maxHeldBytes {
		return engines.NewFault(engines.KindInvalidStream, schemas.PhaseDecode, c.consumer.ID, 0,
			"decode engine "+c.consumer.ID+" sent more than 1 MiB of chunks before its first generated token")
	}
	c.pending = append(c.pending, heldChunk{payload: append([]byte(nil), payload...), chunk: chunk})
	return nil
}
