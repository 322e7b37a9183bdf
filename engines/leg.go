package engines

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// leg is one engine request in flight on a connection of the client's own:
// the request was written, the response headers were read. The leg holds
// the connection, its read buffer and the context.AfterFunc that aborts it.
type leg struct {
	conn    *engineConn
	br      *bufio.Reader
	readers *sync.Pool
	stop    func() bool
	resp    *fasthttp.Response
	// cut: the engine cut the request's upload before answering
	// (answerAfterCut); the connection is closed when the leg ends.
	cut bool
}

var reqHeaders = sync.Pool{New: func() any { return new(fasthttp.RequestHeader) }}

// errTooManyInterim is returned when an engine sends informational (1xx)
// answers without end.
var errTooManyInterim = errors.New("too many informational responses")

// send writes one POST of body to the engine at e (its base URL and
// credential; req's endpoint, backend request id as X-Request-Id and trace
// context) on a connection of ps, in one write,
// and reads the response headers into the leg's response. A connection
// the engine closed while it was idle is replaced before anything is
// written; a write that fails on a reused connection is retried once on a
// fresh one (nothing of the request reached the engine as a whole, so it
// cannot run twice). A write the engine cut on a fresh connection ends
// with the answer it sent first, if any (answerAfterCut). Any other
// failure is not retried. ctx aborts the
// connection (its deadline set to the past) whenever it ends; after an
// abort the connection is closed, never reused.
func send(ctx context.Context, ps *enginePools, readers *sync.Pool, e *Engine, req *Request, body []byte) (*leg, error) {
	entry := ps.lookup(e.URL)
	if entry.err != nil {
		return nil, entry.err
	}
	bp := requestBufs.Get().(*[]byte)
	h := reqHeaders.Get().(*fasthttp.RequestHeader)
	h.Reset()
	h.SetMethod(fasthttp.MethodPost)
	h.SetRequestURI(entry.target.prefix + req.Body.Endpoint)
	h.SetHost(entry.target.host)
	h.SetContentType("application/json")
	h.SetContentLength(len(body))
	h.Set("Accept", "application/json, text/event-stream")
	h.Set("X-Request-Id", req.BackendRequestID)
	req.writeTrace(h)
	if e.Credential.header != "" {
		h.Set("Authorization", e.Credential.header)
	}
	buf := append(h.AppendBytes((*bp)[:0]), body...)
	reqHeaders.Put(h)
	defer func() {
		if cap(buf) <= 64<<10 {
			*bp = buf[:0]
			requestBufs.Put(bp)
		}
	}()

	fresh := false
	for {
		conn, err := entry.pool.get(ctx, fresh)
		if err != nil {
			return nil, err
		}
		stop := context.AfterFunc(ctx, conn.abortFn)
		if n, err := conn.Write(buf); err != nil {
			stopped := stop()
			if conn.reused && !fresh && stopped && ctx.Err() == nil {
				// Whatever a kept-alive connection holds may predate this
				// request: ask again on a fresh one.
				entry.pool.discard(conn)
				fresh = true
				continue
			}
			if stopped && n > 0 && ctx.Err() == nil {
				if l := answerAfterCut(ctx, readers, conn); l != nil {
					return l, nil
				}
			}
			entry.pool.discard(conn)
			return nil, err
		}
		l := &leg{conn: conn, readers: readers, stop: stop, resp: fasthttp.AcquireResponse()}
		l.br = readers.Get().(*bufio.Reader)
		l.br.Reset(conn)
		if err := l.readHeader(); err != nil {
			l.finish(false)
			return nil, err
		}
		return l, nil
	}
}

// cutAnswerWait bounds the wait for an engine's answer after it cut the
// request's upload. An engine that refuses a body (413, 400) answers
// before it closes, so the answer is already received when the write
// fails; the bound only limits a connection that went silent.
const cutAnswerWait = 250 * time.Millisecond

// answerAfterCut reads the answer an engine sent before it cut off the
// request's upload after n > 0 bytes (a web server refusing a body larger
// than it accepts answers 413 and closes the connection while the router
// is still writing, docs/failures.md "A body the engine refuses"). It
// returns a leg holding that answer when it is a complete final status
// line of a non-2xx response, read within cutAnswerWait; nil otherwise
// (no answer, a broken one, or a 2xx that cannot answer a request the
// engine never read whole), and the caller keeps the write error. The
// leg's connection is never reused.
func answerAfterCut(ctx context.Context, readers *sync.Pool, conn *engineConn) *leg {
	if conn.SetReadDeadline(time.Now().Add(cutAnswerWait)) != nil {
		return nil
	}
	l := &leg{conn: conn, readers: readers, stop: context.AfterFunc(ctx, conn.abortFn), resp: fasthttp.AcquireResponse(), cut: true}
	l.br = readers.Get().(*bufio.Reader)
	l.br.Reset(conn)
	if err := l.readHeader(); err != nil || l.status() < 300 {
		l.finish(false)
		return nil
	}
	return l
}

// readHeader reads the final response's headers, skipping informational
// answers (100 Continue, 103 Early Hints).
func (l *leg) readHeader() error {
	for range 100 {
		if err := l.resp.Header.Read(l.br); err != nil {
			if err == io.EOF {
				return io.ErrUnexpectedEOF
			}
			return err
		}
		if code := l.resp.Header.StatusCode(); code < 100 || code > 199 {
			return nil
		}
	}
	return errTooManyInterim
}

// status is the response's HTTP status code.
func (l *leg) status() int { return l.resp.Header.StatusCode() }

// readBody reads the whole body, at most limit bytes (fasthttp's
// ErrBodyTooLarge beyond), and any trailer of a chunked body. The body
// aliases the leg's response: valid until finish.
func (l *leg) readBody(limit int) ([]byte, error) {
	if err := l.resp.ReadBody(l.br, limit); err != nil {
		return nil, err
	}
	if l.resp.Header.ContentLength() == -1 {
		if err := l.resp.Header.ReadTrailer(l.br); err != nil {
			return nil, err
		}
	}
	return l.resp.Body(), nil
}

// bodyStream makes the body a stream read as it arrives (decoded from
// chunked transfer encoding by fasthttp).
func (l *leg) bodyStream() (io.Reader, error) {
	l.resp.StreamBody = true
	if err := l.resp.ReadBody(l.br, 0); err != nil {
		return nil, err
	}
	return l.resp.BodyStream(), nil
}

// httpResponse is the leg's status, headers and (streamed) body as an
// *http.Response, for statusFault. It serves error answers only, where
// cost does not matter.
func (l *leg) httpResponse() *http.Response {
	r := &http.Response{StatusCode: l.status(), Header: http.Header{}, Body: http.NoBody}
	for k, v := range l.resp.Header.All() {
		r.Header.Add(string(k), string(v))
	}
	if body, err := l.bodyStream(); err == nil && body != nil {
		r.Body = io.NopCloser(body)
	}
	return r
}

// finish ends the leg: the connection goes back to its pool when clean
// (the whole response was read), its abort never ran, the engine did not
// ask to close it and nothing beyond the response was received; otherwise
// it is closed.
func (l *leg) finish(clean bool) {
	stopped := l.stop()
	reuse := clean && stopped && !l.cut && l.br.Buffered() == 0 && !l.resp.Header.ConnectionClose() && l.resp.Header.ContentLength() != -2
	_ = l.resp.CloseBodyStream()
	fasthttp.ReleaseResponse(l.resp)
	l.resp = nil
	l.br.Reset(nil)
	l.readers.Put(l.br)
	l.br = nil
	if reuse {
		l.conn.pool.put(l.conn)
	} else {
		l.conn.pool.discard(l.conn)
	}
}
