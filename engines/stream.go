package engines

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Stream is an open decode stream (behaviour.md §5, §6). It enforces both timers:
// the first-token budget, running since before the decode request was
// opened and spent by connect, headers and metadata chunks alike (R-TMO-1),
// and after the first generated output the between-chunk bound, reset by
// every transport chunk, metadata included (R-TMO-2, R-TMO-4).
//
// A Stream has one owner: Next and Close must not be called concurrently.
type Stream struct {
	parent context.Context
	ctx    context.Context
	cancel context.CancelCauseFunc
	leg    *leg          // the decode leg on the client's own connection (Decode)
	closer io.Closer     // the body given to NewStream
	open   bool          // Close has not run
	br     *bufio.Reader // SSE lines, from the decoded body
	body   activityBody
	timer  *time.Timer

	engineID    string
	readTimeout time.Duration
	start       time.Time
	// state is streamWaiting until the first output, then streamFlowing; the
	// timer moves it to streamExpired if the first-token budget ran out.
	state atomic.Int32
	// onClient is set while the owner is blocked writing to its client:
	// that time is not engine silence (R-TMO-6).
	onClient atomic.Bool

	chunk    schemas.Chunk // the scan of the payload Next returned last
	long     []byte        // a data line longer than the reader's buffer
	done     bool
	err      error
	firstOut time.Time
}

const (
	streamWaiting int32 = iota
	streamFlowing
	streamExpired
	streamDraining
)

// drainTimeout bounds how long Close waits for the end of a body after
// [DONE] before closing the connection instead of reusing it.
const drainTimeout = 100 * time.Millisecond

// activityBody records the time of every transport chunk (any Read that
// returns bytes) for the between-chunk timer, and whether the body ended.
type activityBody struct {
	r    io.Reader
	s    *Stream
	last atomic.Int64 // nanoseconds since s.start
	eof  bool         // the body ended cleanly (io.EOF)
	// conn is the connection's reader under a chunked body r (nil for a
	// body given to NewStream): a Read goes on to the next chunks while
	// their headers are already buffered, so that events that arrived
	// together are read — and relayed — together.
	conn *bufio.Reader
}

func (a *activityBody) Read(p []byte) (int, error) {
	n, err := a.r.Read(p)
	for err == nil && n > 0 && n < len(p) && a.conn != nil && chunkHeaderBuffered(a.conn) {
		var m int
		m, err = a.r.Read(p[n:])
		n += m
	}
	if n > 0 {
		a.last.Store(int64(time.Since(a.s.start)))
	}
	if err == io.EOF {
		a.eof = true
	}
	return n, err
}

// chunkHeaderBuffered reports whether br holds a whole line (the next
// chunk's size line), so that reading the next chunk does not block before
// it returns data; as net/http's chunked reader does.
func chunkHeaderBuffered(br *bufio.Reader) bool {
	b, _ := br.Peek(br.Buffered())
	return bytes.IndexByte(b, '\n') >= 0
}

var readerPool = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 2<<10) }}

// openStream starts the first-token budget, sends the decode request and
// waits for response headers.
func (c *Client) openStream(ctx context.Context, req *Request, body []byte) (*Stream, error) {
	consumer := req.Consumer
	s := &Stream{parent: ctx, engineID: consumer.ID, readTimeout: c.readTimeout, start: time.Now()}
	s.ctx, s.cancel = context.WithCancelCause(ctx)
	s.timer = time.AfterFunc(c.firstTokenBudget(), s.onTimer)
	l, err := send(s.ctx, c.decodePools, &decodeReaders, consumer, req, body)
	if err != nil {
		f := classifyTransport(ctx, s.ctx, err, schemas.PhaseDecode, consumer.ID, true)
		s.stop()
		return nil, f
	}
	if l.status()/100 != 2 {
		f := HandoffRefusal(req, c.statusFault(l.httpResponse(), schemas.PhaseDecode, consumer.ID))
		l.finish(false)
		if cf := s.timerFault(); cf != nil {
			f = cf
		}
		s.stop()
		return nil, f
	}
	r, err := l.bodyStream()
	if err != nil {
		l.finish(false)
		f := classifyTransport(ctx, s.ctx, err, schemas.PhaseDecode, consumer.ID, true)
		s.stop()
		return nil, f
	}
	s.leg = l
	s.attach(r)
	if l.resp.Header.ContentLength() == -1 {
		s.body.conn = l.br
	}
	return s, nil
}

// noBound is the timer duration of a first-token budget that is not
// bounded (Options.FirstTokenTimeout zero): the stream's one timer is still
// armed, so that the first output can re-arm it for the between-chunk bound.
const noBound = time.Duration(1<<63 - 1)

// firstTokenBudget returns the first-token budget decode streams get.
func (c *Client) firstTokenBudget() time.Duration {
	if c.firstTokenTimeout <= 0 {
		return noBound
	}
	return c.firstTokenTimeout
}

// attach makes body the stream's source.
func (s *Stream) attach(body io.Reader) {
	s.open = true
	s.body.r = body
	s.body.s = s
	s.br = readerPool.Get().(*bufio.Reader)
	s.br.Reset(&s.body)
}

// NewStream wraps body, an already-open decode response body
// (text/event-stream) from engineID, as a Stream with the client's timers
// armed from now. It serves decode legs opened by other means than Decode,
// and benchmarks of the relay. A timer that fires cancels the stream's
// context; a body that ignores contexts then ends only when it ends or is
// closed. Close closes body.
func (c *Client) NewStream(ctx context.Context, engineID string, body io.ReadCloser) *Stream {
	s := &Stream{parent: ctx, engineID: engineID, readTimeout: c.readTimeout, start: time.Now()}
	s.ctx, s.cancel = context.WithCancelCause(ctx)
	s.timer = time.AfterFunc(c.firstTokenBudget(), s.onTimer)
	s.closer = body
	s.attach(body)
	return s
}

// onTimer runs when the armed timer fires: before the first output it
// expires the first-token budget; after it, it checks the silence since
// the last transport chunk and either cancels the leg or re-arms for the
// remainder (one timer, no Reset per chunk).
func (s *Stream) onTimer() {
	if s.state.CompareAndSwap(streamWaiting, streamExpired) {
		s.cancel(errFirstTokenTimeout)
		return
	}
	if s.state.Load() == streamDraining {
		s.cancel(errStreamClosed)
		return
	}
	if s.readTimeout <= 0 || s.state.Load() != streamFlowing {
		return
	}
	if s.onClient.Load() {
		// The owner waits on its client, not on the engine (R-TMO-6);
		// ClientDone restarts the bound.
		s.timer.Reset(s.readTimeout)
		return
	}
	idle := time.Since(s.start) - time.Duration(s.body.last.Load())
	if idle >= s.readTimeout {
		s.cancel(errSilence)
		return
	}
	s.timer.Reset(s.readTimeout - idle)
}

// timerFault returns the timeout fault if the leg's own timer cancelled it.
func (s *Stream) timerFault() *Fault {
	if s.parent.Err() != nil {
		return nil
	}
	switch context.Cause(s.ctx) {
	case errFirstTokenTimeout:
		return NewFault(KindFirstTokenTimeout, schemas.PhaseDecode, s.engineID, 0, MsgFirstTokenTimeout)
	case errSilence:
		return NewFault(KindMidStreamSilence, schemas.PhaseDecode, s.engineID, 0, silenceMessage(s.readTimeout))
	}
	return nil
}

func silenceMessage(d time.Duration) string {
	return MsgSilence + " (no bytes for " + d.String() + ")"
}

// ClientWait tells the stream that its owner is about to block writing to
// its client: until ClientDone, the between-chunk bound does not run, so a
// client that reads slowly is never taken for a silent engine (R-TMO-6).
// The stream reads nothing from the engine meanwhile (its owner is not
// calling Next), so what it holds stays bounded by its buffer. It is safe
// to call concurrently with the stream's timer; it allocates nothing.
func (s *Stream) ClientWait() { s.onClient.Store(true) }

// ClientDone ends a ClientWait: the between-chunk bound restarts from now,
// as if a transport chunk had just arrived.
func (s *Stream) ClientDone() {
	s.body.last.Store(int64(time.Since(s.start)))
	s.onClient.Store(false)
}

// Buffered returns how many bytes of the stream are already read from the
// connection but not yet returned by Next: a relay flushes its client only
// when this is 0, so chunks that arrive together leave together.
func (s *Stream) Buffered() int {
	if s.br == nil {
		return 0
	}
	return s.br.Buffered()
}

// EngineID returns the consumer's engine id.
func (s *Stream) EngineID() string { return s.engineID }

// FirstOutput returns when the first generated output was read, or the
// zero time if none was.
func (s *Stream) FirstOutput() time.Time { return s.firstOut }

// Chunk returns what the one scan of the payload Next returned last found
// in it: its kind and its usage (R-LEG-5, R-LEG-6), so that a relay reads
// each chunk once. It is the zero Chunk before the first payload.
func (s *Stream) Chunk() schemas.Chunk { return s.chunk }

// Next returns the next data payload of the stream and its kind: either
// schemas.ChunkMetadata or schemas.ChunkOutput. The payload aliases an
// internal buffer and is valid only until the next call. SSE comments and
// blank lines are consumed silently (they still reset the between-chunk
// timer). After [DONE] following generated output Next returns io.EOF.
// Every other end is a *Fault: done_before_token (R-FAIL-3), error_object
// (R-FAIL-4), closed_before_done (R-FAIL-2), first_token_timeout
// (R-TMO-1), mid_stream_silence (R-TMO-3), invalid_stream,
// request_timeout or client_disconnected. Once Next has returned an error
// it returns the same error.
func (s *Stream) Next() ([]byte, schemas.ChunkKind, error) {
	if s.err != nil {
		return nil, 0, s.err
	}
	for {
		line, err := s.readLine()
		if err != nil {
			return nil, 0, s.fail(s.readFault(err))
		}
		payload, ok := schemas.SSEData(line)
		if !ok || len(payload) == 0 {
			continue // comments, blank lines and empty data lines are keep-alives
		}
		s.chunk = schemas.ScanChunk(payload)
		switch kind := s.chunk.Kind; kind {
		case schemas.ChunkOutput:
			if s.state.Load() != streamFlowing {
				if !s.state.CompareAndSwap(streamWaiting, streamFlowing) {
					// The budget ran out before this output was read.
					return nil, 0, s.fail(NewFault(KindFirstTokenTimeout, schemas.PhaseDecode, s.engineID, 0, MsgFirstTokenTimeout))
				}
				s.firstOut = time.Now()
				if s.readTimeout > 0 {
					s.body.last.Store(int64(time.Since(s.start)))
					s.timer.Reset(s.readTimeout)
				} else {
					s.timer.Stop()
				}
			}
			s.skipEventEnd()
			return payload, kind, nil
		case schemas.ChunkMetadata:
			s.skipEventEnd()
			return payload, kind, nil
		case schemas.ChunkDone:
			if s.state.Load() != streamFlowing {
				return nil, 0, s.fail(NewFault(KindDoneBeforeToken, schemas.PhaseDecode, s.engineID, 0, MsgDoneBeforeToken))
			}
			s.done = true
			s.err = io.EOF
			s.timer.Stop()
			return nil, schemas.ChunkDone, io.EOF
		case schemas.ChunkError:
			return nil, 0, s.fail(errorObjectFault(payload, s.engineID))
		default:
			return nil, 0, s.fail(NewFault(KindInvalidStream, schemas.PhaseDecode, s.engineID, 0, "decode engine "+s.engineID+" sent data that is not JSON"))
		}
	}
}

// skipEventEnd discards the blank line that ends the event just read when
// it is already buffered, so that Buffered counts only bytes of events
// still to come: otherwise a relay would hold every event that arrived
// alone until the next one. It never reads from the connection, so the
// payload just returned stays valid.
func (s *Stream) skipEventEnd() {
	for s.br.Buffered() > 0 {
		b, _ := s.br.Peek(1)
		if b[0] != '\n' && b[0] != '\r' {
			return
		}
		_, _ = s.br.Discard(1)
	}
}

// errorObjectFault builds the R-FAIL-4 fault from an in-stream error
// object, keeping the engine's message and type.
func errorObjectFault(payload []byte, engineID string) *Fault {
	obj, ok := schemas.ParseError(payload)
	if !ok {
		obj = schemas.ErrorObject{Message: "decode engine " + engineID + " sent an error object"}
	}
	if obj.Message == "" {
		obj.Message = "decode engine " + engineID + " sent an error object"
	}
	f := NewFault(KindErrorObject, schemas.PhaseDecode, engineID, obj.Code, obj.Message)
	if obj.Type != "" {
		f.Type = obj.Type
	}
	return f
}

// readLine returns the next line, including its newline (R-FAIL-2 reads
// to the end of every event).
func (s *Stream) readLine() ([]byte, error) { return schemas.ReadSSELine(s.br, &s.long) }

// readFault classifies a read error: the leg's timers, the request's
// context, or a stream that ended before [DONE].
func (s *Stream) readFault(err error) *Fault {
	if f := s.timerFault(); f != nil {
		f.Cause = err
		return f
	}
	return classifyTransport(s.parent, s.ctx, err, schemas.PhaseDecode, s.engineID, false)
}

func (s *Stream) fail(f *Fault) error {
	s.err = f
	s.timer.Stop()
	return f
}

// Close ends the stream and releases its resources. After a clean [DONE]
// the rest of the body is drained (bounded) so the connection can be
// reused; otherwise the connection is closed, which tells the engine to
// abort the request (R-OWN-5). Close is idempotent.
func (s *Stream) Close() {
	if !s.open {
		return
	}
	s.open = false
	if s.done {
		// The terminating chunk normally arrived with [DONE]; drain what is
		// left, briefly, so the connection goes back to the pool.
		s.state.Store(streamDraining)
		s.timer.Reset(drainTimeout)
		_, _ = io.CopyN(io.Discard, s.br, 4<<10)
	}
	if s.leg != nil {
		// Reused only after a clean end of the body: the connection's abort
		// (registered on s.ctx) is stopped before s.ctx is cancelled below.
		s.leg.finish(s.done && s.body.eof && s.br.Buffered() == 0)
		s.leg = nil
	} else {
		_ = s.closer.Close()
	}
	s.body.r, s.body.conn = nil, nil
	s.br.Reset(nil)
	readerPool.Put(s.br)
	s.br = nil
	s.stop()
}

func (s *Stream) stop() {
	s.timer.Stop()
	s.cancel(errStreamClosed)
}
