package router

import (
	"io"
	"sync"

	"github.com/valyala/fasthttp"

	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/schemas"
)

// relayBody is the body of a committed stream (SPEC R-FAIL-5, R-RETRY-4).
// fasthttp calls WriteTo in the connection's own goroutine and sends each
// Write as one chunk, flushed: the relay writes the metadata held before
// the first output, the first output, then every event as the engine sent
// it, one Write per batch of events the engine had ready. It ends with
// data: [DONE], or after a failure with one terminal error event and no
// [DONE]. Close, which fasthttp always calls, finishes the request.
type relayBody struct {
	c       *call
	bp      *[]byte // buf's pool entry
	buf     []byte
	off     int // what Read has handed out of buf
	started bool
	done    bool
}

var relayBufPool = sync.Pool{New: func() any { b := make([]byte, 0, 2<<10); return &b }}

// SupportsBodyWriteTo tells fasthttp to use WriteTo (fasthttp.BodyWriterTo).
func (r *relayBody) SupportsBodyWriteTo() bool { return true }

// WriteTo relays the stream to w until it ends.
func (r *relayBody) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for {
		more := r.fill()
		if len(r.buf) > 0 {
			n, err := w.Write(r.buf)
			total += int64(n)
			r.buf = r.buf[:0]
			if err != nil {
				r.c.clientGone()
				return total, err
			}
		}
		if !more {
			return total, nil
		}
	}
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
		r.buf = c.appendEvent(r.buf, payload, c.stream.Chunk())
		if c.stream.Buffered() == 0 {
			return true
		}
	}
}

// Close finishes the request; fasthttp calls it once the body is written
// or the connection failed.
func (r *relayBody) Close() error {
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
		c.promptTokens, c.completionTokens = ch.PromptTokens, ch.CompletionTokens
		if !c.req.IncludeUsage && ch.UsageOnly {
			return dst
		}
	}
	dst = append(dst, "data: "...)
	dst = append(dst, payload...)
	return append(dst, "\n\n"...)
}

// clientGone ends a committed stream whose client went away (R-OWN-5).
func (c *call) clientGone() {
	c.cancel(engines.ErrClientGone)
	c.outcome = string(engines.KindClientGone)
	c.rt.metrics.disconnects.Inc()
}

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
		if err := agg.Add(payload); err != nil {
			f := engines.NewFault(engines.KindInvalidStream, schemas.PhaseDecode, c.consumer.ID, 0, "decode engine "+c.consumer.ID+" sent a chunk that could not be aggregated")
			c.recordFault(f)
			c.fail(fctx, f)
			return
		}
	}
	if prompt, completion, ok := agg.Usage(); ok {
		c.promptTokens, c.completionTokens = prompt, completion
	}
	c.watch.stop()
	c.watch = nil
	fctx.SetStatusCode(200)
	fctx.SetContentType("application/json")
	fctx.SetBody(agg.AppendJSON(nil))
	c.status, c.outcome = 200, "ok"
	c.finish()
}
