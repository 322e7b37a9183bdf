package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// zmq4 (v0.17.0) reads a ZMTP frame by allocating the size its header
// claims, up to 2^63 bytes, before reading a byte of it; it reads frames
// of one message without a limit on their number; its NULL handshake
// parses the peer's READY metadata with index checks that a malformed
// property slips past (a panic, which would stop the agent); and its
// accept loop waits for a peer's greeting without a deadline. A publisher
// is hostile input (docs/behaviour.md R-BUS-9's rule applied to ZeroMQ),
// so every connection the agent makes or accepts runs through guardConn:
// it parses the ZMTP stream ahead of zmq4 and ends the connection — before
// zmq4 allocates anything for it — at a frame larger than the message
// bound, a message of more frames or bytes than the bounds, a command
// larger than 64 KiB, a malformed greeting or READY, a handshake not
// done within the handshake bound, or a message not whole within the
// message bound (a publisher trickling a message would hold the
// connection, and the rank's events behind it, for as long as it likes).

// Transports the agent registers with zmq4: the same networks as tcp://
// and ipc://, through guardConn.
const (
	guardedTCP = "narwhal-kv-tcp"
	guardedIPC = "narwhal-kv-ipc"
)

// ZMTP's framing (rfc.zeromq.org/spec:23/ZMTP).
const (
	zmtpGreeting   = 64
	zmtpFlagMore   = 0x01
	zmtpFlagLong   = 0x02
	zmtpFlagCmd    = 0x04
	maxCommandSize = 64 << 10
	// maxFrames bounds the frames of one message: vLLM's have 3 (a
	// replay answer 3 on a DEALER); anything far above is not a
	// publisher of KV events.
	maxFrames = 16
)

// guardLimits are the bounds a guarded connection enforces.
type guardLimits struct {
	maxMessage int           // bytes of one message, all its frames
	handshake  time.Duration // greeting and READY within this
	message    time.Duration // each message, first header to last byte, within this (0: unbounded)
	refused    func(reason string)
	connected  func()
}

var (
	registerOnce sync.Once
	registerErr  error
)

// limitsKey hands a socket's limits to the transport through the
// socket's context, the only thing zmq4 passes it.
type limitsKey struct{}

// registerTransports registers the guarded transports once per process.
func registerTransports() error {
	registerOnce.Do(func() {
		registerErr = errors.Join(
			zmq4.RegisterTransport(guardedTCP, guardTransport{inner: transport.New("tcp")}),
			zmq4.RegisterTransport(guardedIPC, guardTransport{inner: transport.New("unix")}),
		)
	})
	return registerErr
}

// guardedEndpoint maps a tcp:// or ipc:// endpoint to its guarded
// transport's; any other scheme is an error.
func guardedEndpoint(ep string) (string, error) {
	switch {
	case strings.HasPrefix(ep, "tcp://") && len(ep) > len("tcp://"):
		return guardedTCP + "://" + strings.TrimPrefix(ep, "tcp://"), nil
	case strings.HasPrefix(ep, "ipc://") && len(ep) > len("ipc://"):
		return guardedIPC + "://" + strings.TrimPrefix(ep, "ipc://"), nil
	}
	return "", fmt.Errorf("endpoint %q: want tcp://HOST:PORT or ipc://PATH", ep)
}

// withLimits returns ctx carrying lim for the guarded transport.
func withLimits(ctx context.Context, lim guardLimits) context.Context {
	return context.WithValue(ctx, limitsKey{}, lim)
}

func limitsOf(ctx context.Context) guardLimits {
	if lim, ok := ctx.Value(limitsKey{}).(guardLimits); ok {
		return lim
	}
	return guardLimits{maxMessage: DefaultMaxMessage, handshake: defaultHandshake, message: defaultMessageWait}
}

// guardTransport wraps every connection of inner in a guardConn.
type guardTransport struct{ inner transport.Transport }

func (g guardTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := g.inner.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newGuardConn(c, limitsOf(ctx)), nil
}

func (g guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	ln, err := g.inner.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return guardListener{Listener: ln, lim: limitsOf(ctx)}, nil
}

func (g guardTransport) Addr(ep string) (string, error) { return g.inner.Addr(ep) }

type guardListener struct {
	net.Listener
	lim guardLimits
}

func (l guardListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newGuardConn(c, l.lim), nil
}

// A guarded connection's buffer starts at guardBufStart bytes, enough
// for a handshake and any frame header, and grows only for a command
// held until it is whole, up to guardBufMax: a connection that says
// nothing after its handshake costs 4 KiB of it, not 64.
const (
	guardBufStart = 4 << 10
	guardBufMax   = maxCommandSize + 64
)

// guardError ends a guarded connection. It is a net.Error that is not a
// timeout, so that zmq4 marks the connection closed and drops it.
type guardError struct{ reason string }

func (e *guardError) Error() string   { return "kv events: ZMTP stream refused: " + e.reason }
func (e *guardError) Timeout() bool   { return false }
func (e *guardError) Temporary() bool { return false }

// guardConn parses the ZMTP stream it reads ahead of its reader and hands
// on only bytes it has checked.
type guardConn struct {
	net.Conn
	lim guardLimits

	buf    []byte // raw[served:checked] may be read; raw[checked:filled] not yet
	served int
	check  int
	filled int

	greeted   bool
	ready     bool   // the peer's READY was checked
	bodyLeft  uint64 // bytes of the current message frame's body still to pass
	msgBytes  int
	msgFrames int
	inMsg     bool
	// open: a frame (a message's first, or a command) began after the
	// handshake and its message or command is not whole yet. waited is
	// how long the guard has waited on the socket since: the message
	// bound counts that time only, not the time the reader above it did
	// not ask for more (a slow consumer is not a slow publisher).
	open   bool
	waited time.Duration
	err    error
}

func newGuardConn(c net.Conn, lim guardLimits) *guardConn {
	if lim.connected != nil {
		lim.connected()
	}
	if lim.handshake > 0 {
		_ = c.SetReadDeadline(time.Now().Add(lim.handshake))
	}
	return &guardConn{Conn: c, lim: lim, buf: make([]byte, guardBufStart)}
}

func (g *guardConn) fail(reason string) error {
	if g.err == nil {
		g.err = &guardError{reason: reason}
		if g.lim.refused != nil {
			g.lim.refused(reason)
		}
		_ = g.Conn.Close()
	}
	return g.err
}

// Read hands on checked bytes, reading and checking more when it has
// none.
func (g *guardConn) Read(p []byte) (int, error) {
	for g.served == g.check {
		if g.err != nil {
			return 0, g.err
		}
		if g.served == g.filled {
			g.served, g.check, g.filled = 0, 0, 0
		} else if g.filled == len(g.buf) && g.served > 0 {
			n := copy(g.buf, g.buf[g.served:g.filled])
			g.check -= g.served
			g.filled = n
			g.served = 0
		} else if g.filled == len(g.buf) {
			// Unchecked bytes fill the buffer: a command held until it
			// is whole. It grows, up to the largest command's room (a
			// larger command was refused by its header).
			if len(g.buf) >= guardBufMax {
				return 0, g.fail("a frame past the guard's buffer")
			}
			nb := make([]byte, min(2*len(g.buf), guardBufMax))
			copy(nb, g.buf[:g.filled])
			g.buf = nb
		}
		n, err := g.readConn()
		g.filled += n
		if perr := g.advance(); perr != nil {
			return 0, perr
		}
		if g.served < g.check {
			break
		}
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				switch {
				case !g.ready:
					return 0, g.fail("no handshake within the bound")
				case g.open:
					return 0, g.fail("a message not whole within the bound")
				}
			}
			return 0, err
		}
	}
	n := copy(p, g.buf[g.served:g.check])
	g.served += n
	return n, nil
}

// readConn reads from the connection into buf[filled:]. While a message
// or command is open it bounds the read by what is left of the message
// bound, and counts the time it waited.
func (g *guardConn) readConn() (int, error) {
	if !g.open {
		return g.Conn.Read(g.buf[g.filled:])
	}
	left := g.lim.message - g.waited
	if left <= 0 {
		return 0, g.fail("a message not whole within the bound")
	}
	start := time.Now()
	_ = g.Conn.SetReadDeadline(start.Add(left))
	n, err := g.Conn.Read(g.buf[g.filled:])
	g.waited += time.Since(start)
	return n, err
}

// advance checks what it can of buf[check:filled].
func (g *guardConn) advance() error {
	for g.check < g.filled {
		avail := g.buf[g.check:g.filled]
		if !g.greeted {
			if len(avail) < zmtpGreeting {
				return nil
			}
			gr := avail[:zmtpGreeting]
			if gr[0] != 0xff || gr[9] != 0x7f || gr[10] < 3 {
				return g.fail("not a ZMTP 3 greeting")
			}
			g.greeted = true
			g.check += zmtpGreeting
			continue
		}
		if g.bodyLeft > 0 {
			n := min(uint64(len(avail)), g.bodyLeft)
			g.bodyLeft -= n
			g.check += int(n)
			g.closeMessage()
			continue
		}
		if g.ready && !g.open && g.lim.message > 0 {
			// A frame begins: its message (or command) must be whole
			// within the bound, its header included.
			g.open, g.waited = true, 0
		}
		flags := avail[0]
		if flags&^(zmtpFlagMore|zmtpFlagLong|zmtpFlagCmd) != 0 {
			return g.fail(fmt.Sprintf("frame flags %#x", flags))
		}
		hdr := 2
		if flags&zmtpFlagLong != 0 {
			hdr = 9
		}
		if len(avail) < hdr {
			return nil
		}
		var size uint64
		if hdr == 2 {
			size = uint64(avail[1])
		} else {
			size = binary.BigEndian.Uint64(avail[1:9])
		}
		if flags&zmtpFlagCmd != 0 {
			if flags&zmtpFlagMore != 0 || g.inMsg {
				return g.fail("a command inside a message")
			}
			if size > maxCommandSize {
				return g.fail("a command larger than 64 KiB")
			}
			if uint64(len(avail)) < uint64(hdr)+size {
				return nil // held back until it is whole
			}
			if err := g.checkCommand(avail[hdr : hdr+int(size)]); err != nil {
				return err
			}
			g.check += hdr + int(size)
			g.closeMessage()
			continue
		}
		if !g.ready {
			return g.fail("a message before the handshake")
		}
		if size > uint64(g.lim.maxMessage) || g.msgBytes+int(size) > g.lim.maxMessage {
			return g.fail(fmt.Sprintf("a message larger than %d bytes", g.lim.maxMessage))
		}
		g.msgFrames++
		if g.msgFrames > maxFrames {
			return g.fail(fmt.Sprintf("a message of more than %d frames", maxFrames))
		}
		g.msgBytes += int(size)
		if flags&zmtpFlagMore != 0 {
			g.inMsg = true
		} else {
			g.inMsg, g.msgBytes, g.msgFrames = false, 0, 0
		}
		g.bodyLeft = size
		g.check += hdr
		g.closeMessage()
	}
	return nil
}

// closeMessage ends the open message's bound once its last frame (or
// the command) has passed whole; silence until the next frame is not
// bounded.
func (g *guardConn) closeMessage() {
	if g.open && !g.inMsg && g.bodyLeft == 0 {
		g.open = false
		_ = g.Conn.SetReadDeadline(time.Time{})
	}
}

// checkCommand checks a whole command: a name, and for READY well-formed
// metadata (the first command must be READY).
func (g *guardConn) checkCommand(body []byte) error {
	if len(body) == 0 || int(body[0]) > len(body)-1 || body[0] == 0 {
		return g.fail("a malformed command")
	}
	name := string(body[1 : 1+int(body[0])])
	if !g.ready {
		if name != zmq4.CmdReady {
			return g.fail("a first command other than READY")
		}
		if !validMetadata(body[1+int(body[0]):]) {
			return g.fail("malformed READY metadata")
		}
		g.ready = true
		_ = g.Conn.SetReadDeadline(time.Time{})
	}
	return nil
}

// validMetadata reports whether p is a sequence of ZMTP properties: a
// name of 1…255 bytes after its length byte, a 4-byte big-endian value
// length and the value, with nothing left over.
func validMetadata(p []byte) bool {
	for len(p) > 0 {
		n := int(p[0])
		if n == 0 || len(p) < 1+n+4 {
			return false
		}
		p = p[1+n:]
		v := binary.BigEndian.Uint32(p)
		p = p[4:]
		if uint64(v) > uint64(len(p)) {
			return false
		}
		p = p[v:]
	}
	return true
}
