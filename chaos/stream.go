package chaos

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"sync"
	"time"

	"github.com/narwhalmesh/narwhal/schemas"
)

// sseReaderSize is the buffer of the line reader over an upstream stream;
// longer lines are gathered in streamFaults.long.
const sseReaderSize = 32 << 10

// maxBatch bounds the bytes handed on in one Read batch.
const maxBatch = 16 << 10

// sseBuffers are the line reader and output buffer of one faulted stream,
// pooled so that a stream allocates neither.
type sseBuffers struct {
	br  *bufio.Reader
	out []byte
}

var ssePool = sync.Pool{New: func() any {
	return &sseBuffers{br: bufio.NewReaderSize(nil, sseReaderSize), out: make([]byte, 0, 2*maxBatch)}
}}

var doneFrame = []byte("data: [DONE]\n\n")

// streamFaults is the body of a faulted SSE response: it reads the engine's
// stream line by line, classifies each data payload with
// schemas.ClassifyChunk, and hands the proxy's copy loop what the client
// should see — delayed (first-token-delay, trickle), cut
// (close-before-done, mid-stream-silence) or rewritten (done-before-token,
// error-object). Whatever complete lines the engine sent together are
// handed on together, so each engine write is one client flush. It does
// not allocate per chunk.
type streamFaults struct {
	src  io.ReadCloser
	bufs *sseBuffers // pooled; br and out come from it
	br   *bufio.Reader
	x    *exchange

	// the striking faults
	term       faultKind // the fault that ends the stream; numKinds for none
	after      int       // output chunks forwarded before term strikes
	firstDelay time.Duration
	trickle    time.Duration

	out  []byte // bytes for the client, out[off:] not yet handed on
	off  int
	long []byte // a line longer than the reader's buffer
	end  error  // once out is drained, Read returns it

	held       []byte // a line waiting for its delay
	heldDelay  time.Duration
	heldOutput bool
	hasHeld    bool
	silence    bool // mid-stream-silence struck: hold, then end

	outputs    int  // output chunks handed on
	eventStart bool // the next line starts an SSE event
	timer      *time.Timer
	closed     bool
}

func newStreamFaults(src io.ReadCloser, x *exchange) *streamFaults {
	bufs := ssePool.Get().(*sseBuffers)
	bufs.br.Reset(src)
	s := &streamFaults{src: src, bufs: bufs, br: bufs.br, out: bufs.out[:0], x: x, term: numKinds, eventStart: true}
	if x.hits(kindFirstTokenDelay) {
		s.firstDelay = x.set[kindFirstTokenDelay].delay
	}
	if x.hits(kindTrickle) {
		s.trickle = x.set[kindTrickle].delay
	}
	if t := x.has & terminatorKinds; t != 0 {
		s.term = bitKind(t)
		s.after = x.set[s.term].after
		if s.term == kindDoneBeforeToken {
			s.after = 0
		}
	}
	return s
}

// Read hands on the next bytes for the client.
func (s *streamFaults) Read(p []byte) (int, error) {
	for s.off == len(s.out) {
		if s.end != nil {
			return 0, s.end
		}
		s.out, s.off = s.out[:0], 0
		if err := s.fill(); err != nil {
			s.end = err
		}
	}
	n := copy(p, s.out[s.off:])
	s.off += n
	return n, nil
}

// Close closes the engine's response body. A stream cut short was already
// cancelled upstream when the fault struck.
func (s *streamFaults) Close() error {
	if s.closed {
		return nil
	}
	s.closed = true
	err := s.src.Close()
	if s.timer != nil {
		s.timer.Stop()
	}
	s.br.Reset(nil)
	if cap(s.out) <= 8*maxBatch { // keep what grew for a long line, within reason
		s.bufs.out = s.out[:0]
	}
	ssePool.Put(s.bufs)
	s.bufs, s.br, s.out = nil, nil, nil
	return err
}

// fill appends the next bytes for the client to out. A non-nil error ends
// the stream once out is handed on: io.EOF for a clean end, anything else
// aborts the client connection.
func (s *streamFaults) fill() error {
	if s.silence {
		return s.hold()
	}
	if s.hasHeld {
		s.hasHeld = false
		if !s.wait(s.heldDelay) {
			return context.Cause(s.x.clientCtx)
		}
		s.out = append(s.out, s.held...)
		if s.heldOutput {
			s.outputs++
		}
	}
	for {
		if len(s.out) > 0 && (len(s.out) >= maxBatch || !s.lineBuffered()) {
			return nil
		}
		line, err := s.readLine()
		if len(line) > 0 {
			if stop, end := s.handle(line); stop {
				return end
			}
		}
		if err != nil {
			if err != io.EOF && s.x.clientCtx.Err() != nil {
				return context.Cause(s.x.clientCtx)
			}
			return err
		}
	}
}

// handle processes one line of the engine's stream. stop is true when fill
// must return now (with end as its result): a delay is pending, or a fault
// struck.
func (s *streamFaults) handle(line []byte) (stop bool, end error) {
	payload, isData := schemas.SSEData(line)
	kind := schemas.ChunkMetadata
	if isData {
		kind = schemas.ClassifyChunk(payload)
	}
	start := s.eventStart
	s.eventStart = isBlank(line)
	if s.term != numKinds && isData &&
		((kind == schemas.ChunkOutput && s.outputs >= s.after) || kind == schemas.ChunkDone) {
		return true, s.strike()
	}
	var delay time.Duration
	if s.trickle > 0 && start && !s.eventStart {
		delay += s.trickle
	}
	if s.firstDelay > 0 && kind == schemas.ChunkOutput && s.outputs == 0 {
		delay += s.firstDelay
	}
	output := kind == schemas.ChunkOutput
	if delay > 0 {
		if len(s.out) > 0 { // hand on what came before, then wait
			s.held = append(s.held[:0], line...)
			s.heldDelay, s.heldOutput, s.hasHeld = delay, output, true
			return true, nil
		}
		if !s.wait(delay) {
			return true, context.Cause(s.x.clientCtx)
		}
	}
	s.out = append(s.out, line...)
	if output {
		s.outputs++
	}
	return false, nil
}

// strike ends the stream as the terminating fault says, cancelling the
// upstream request so the engine frees it.
func (s *streamFaults) strike() error {
	s.x.cancel()
	switch s.term {
	case kindDoneBeforeToken:
		s.out = append(s.out, doneFrame...)
	case kindErrorObject:
		s.out = append(s.out, s.x.set[kindErrorObject].frame...)
	case kindMidStreamSilence:
		s.silence = true
		return nil
	}
	return io.EOF
}

// hold is the silence of mid-stream-silence: delay_ms, or until the client
// leaves when it is 0; then the stream ends without [DONE].
func (s *streamFaults) hold() error {
	d := s.x.set[kindMidStreamSilence].delay
	if d == 0 {
		<-s.x.clientCtx.Done()
		return context.Cause(s.x.clientCtx)
	}
	if !s.wait(d) {
		return context.Cause(s.x.clientCtx)
	}
	return io.EOF
}

// wait waits d or until the client leaves; it reports whether d elapsed.
func (s *streamFaults) wait(d time.Duration) bool {
	if s.timer == nil {
		s.timer = time.NewTimer(d)
	} else {
		s.timer.Reset(d)
	}
	select {
	case <-s.timer.C:
		return true
	case <-s.x.clientCtx.Done():
		s.timer.Stop()
		return false
	}
}

// readLine returns the next line of the engine's stream with its "\n" (the
// last one may lack it). The line is valid until the next read.
func (s *streamFaults) readLine() ([]byte, error) { return schemas.ReadSSELine(s.br, &s.long) }

// lineBuffered reports whether a complete line is buffered, so reading it
// does not wait for the engine.
func (s *streamFaults) lineBuffered() bool {
	n := s.br.Buffered()
	if n == 0 {
		return false
	}
	b, _ := s.br.Peek(n)
	return bytes.IndexByte(b, '\n') >= 0
}

// isBlank reports whether line is empty but for its line ending: the end
// of an SSE event.
func isBlank(line []byte) bool {
	for _, c := range line {
		if c != '\n' && c != '\r' {
			return false
		}
	}
	return true
}
