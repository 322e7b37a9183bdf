package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
)

// TestAgentSurvivesHostilePublisherRPLACE4 (R-PLACE-4): a publisher that
// sends garbage — messages of 1 and 2 frames, a 7-byte sequence, bytes
// that are not msgpack, msgpack that is not a batch, arrays that claim
// 2^32 members, values nested 100000 deep, 10^6 token ids for one block,
// a message larger than the 4 MiB bound, a parent loop, a payload of
// another rank, more blocks than the bound — cannot stop the agent or
// grow its map past the bound, and good events that follow still reach
// the routers.
func TestAgentSurvivesHostilePublisherRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	kb := startBus(t, "e1")
	py := startPublisher(t)
	pub, _ := py.open(false)
	_, reg := runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: pub}}, MaxBlocks: 8})
	py.subscribed(1)

	py.do(map[string]any{"op": "raw", "frames": []string{"00"}})
	py.do(map[string]any{"op": "raw", "frames": []string{"", "0000000000000000"}})
	py.do(map[string]any{"op": "raw", "frames": []string{"", "01020304050607", "90"}})
	for _, payload := range []string{
		"ffff",                             // not msgpack
		"a568656c6c6f",                     // "hello"
		"ddffffffff",                       // an array of 2^32-1 members, none there
		"93cb0000000000000000ddffffffff00", // [ts, <2^32-1 events>, 0]
		"93cb0000000000000000" + "9192a158" + strings.Repeat("91", 100000) + "00" + "00", // [ts, [["X", <nested 100000 deep>]], 0]
		"93cb00000000000000009191ab426c6f636b53746f72656405",                             // [ts, [["BlockStored"]], 5]: rank 5 on rank 0's endpoint
	} {
		py.do(map[string]any{"op": "send_payload", "hex": payload})
	}
	// 10^6 token ids for one block of 16: refused, counted.
	py.send("map", false, map[string]any{"type": "BlockStored", "block_hashes": []any{50}, "parent_block_hash": nil,
		"token_ids": map[string]any{"repeat": 1, "n": 1_000_000}, "block_size": 16, "lora_id": nil, "medium": "GPU"})
	// A parent loop and a hash stored twice in one chain.
	py.send("array", false, stored([]any{60}, 60, tokens(0, 16), nil))
	py.send("array", false, stored([]any{61, 61}, nil, tokens(0, 32), nil))
	// More blocks than the bound (8): the map stops at it.
	py.send("array", false, stored([]any{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, nil, tokens(0, 12*16), nil))
	testkit.WaitFor(t, waitBound, "the over-bound chain counted", func() bool {
		return series(t, reg, "narwhal_agent_kv_events_total", "outcome", outOverBound) == 1
	})
	// A block chained on one the bound refused (SGLang sends one event
	// per block) is over the bound too, not of an unknown parent.
	parentless := series(t, reg, "narwhal_agent_kv_events_total", "outcome", outUnknownParent)
	py.send("array", false, stored([]any{13}, 12, tokens(12*16, 16), nil))
	testkit.WaitFor(t, waitBound, "the block after the bound counted over it", func() bool {
		return series(t, reg, "narwhal_agent_kv_events_total", "outcome", outOverBound) == 2
	})
	if v := series(t, reg, "narwhal_agent_kv_events_total", "outcome", outUnknownParent); v != parentless {
		t.Errorf("unknown_parent went from %v to %v on a block after the bound", parentless, v)
	}
	if v := series(t, reg, "narwhal_agent_kv_blocks", "rank", "0"); v > 8 {
		t.Fatalf("narwhal_agent_kv_blocks = %v, above the bound of 8", v)
	}

	// A message above 4 MiB ends the connection before zmq4 reads it;
	// the agent connects again.
	py.do(map[string]any{"op": "send_payload", "hex": "90", "times": 5 << 20})
	py.subscribed(2)
	testkit.WaitFor(t, waitBound, "the oversized message's connection refused", func() bool {
		return series(t, reg, "narwhal_agent_kv_connections_total", "outcome", connRefused) >= 1
	})

	// Good events still arrive.
	py.send("map", false, map[string]any{"type": "AllBlocksCleared"})
	good := tokens(500, 32)
	py.send("map", false, stored([]any{70, 71}, nil, good, nil))
	want := prefix.AppendTokenKeys(nil, good, 16, 0)
	testkit.WaitFor(t, waitBound, "the good chain after the garbage", func() bool {
		k := kb.got.keys(bus.KVStored, bus.KVGPU)
		return len(k) >= 2 && slices.Equal(k[len(k)-2:], want)
	})
	for _, c := range []struct {
		name, outcome string
		atLeast       float64
	}{
		{"narwhal_agent_kv_messages_total", msgFrames, 3},
		{"narwhal_agent_kv_messages_total", msgRefused, 5},
		{"narwhal_agent_kv_messages_total", msgRankMismatch, 1},
		{"narwhal_agent_kv_events_total", outRefused, 2},
		{"narwhal_agent_kv_events_total", outUnknownParent, 1},
	} {
		if v := series(t, reg, c.name, "outcome", c.outcome); v < c.atLeast {
			t.Errorf("%s{outcome=%q} = %v, want >= %v", c.name, c.outcome, v, c.atLeast)
		}
	}
	if kb.got.count(bus.KVLost, 0) == 0 {
		t.Error("no KVLost for messages the agent could not read")
	}
}

// zmtpGreetingBytes is a ZMTP 3.0 greeting of the NULL mechanism.
func zmtpGreetingBytes() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	return g
}

// zmtpCommand frames a command body (short form).
func zmtpCommand(body []byte) []byte { return append([]byte{zmtpFlagCmd, byte(len(body))}, body...) }

// readyOf is a READY command body with the given raw metadata.
func readyOf(meta []byte) []byte { return append([]byte("\x05READY"), meta...) }

// pubMetadata is READY metadata of a PUB socket.
var pubMetadata = []byte("\x0bSocket-Type\x00\x00\x00\x03PUB")

// TestAgentGuardsZMTPRPLACE4 (R-PLACE-4): on the agent's bound endpoint,
// peers that say nothing, send a bad greeting, a READY whose metadata
// would make zmq4 index past its end (a panic), a frame header claiming
// 2^62 bytes (zmq4 would allocate it), a message of 17 frames, or a
// message, a frame header or a command begun and never finished (a
// trickle: the bound here 300 ms) are each cut off, and a real publisher that connects afterwards is
// read.
func TestAgentGuardsZMTPRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	kb := startBus(t, "e1")
	ep := freeEndpoint(t)
	_, reg := runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: ep, Bind: true}}, MessageWait: 300 * time.Millisecond})
	addr := strings.TrimPrefix(ep, "tcp://")
	var dialed net.Conn
	testkit.WaitFor(t, waitBound, "the agent's bound endpoint", func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			dialed = c
		}
		return err == nil
	})
	_ = dialed.Close()

	long := make([]byte, 9)
	long[0] = zmtpFlagLong
	binary.BigEndian.PutUint64(long[1:], 1<<62)
	var many []byte
	for i := 0; i < 17; i++ {
		many = append(many, zmtpFlagMore, 1, 'x')
	}
	handshake := append(zmtpGreetingBytes(), zmtpCommand(readyOf(pubMetadata))...)
	attacks := []struct {
		name string
		send []byte
	}{
		{"silence", nil},
		{"bad greeting", make([]byte, 64)},
		{"truncated READY metadata", append(zmtpGreetingBytes(), zmtpCommand(readyOf([]byte{0x01}))...)},
		{"READY metadata value past the end", append(zmtpGreetingBytes(), zmtpCommand(readyOf([]byte("\x01a\x00\x00\x00\x09x")))...)},
		{"a 2^62-byte frame", append(slices.Clone(handshake), long...)},
		{"a message of 17 frames", append(slices.Clone(handshake), many...)},
		// A frame of 100 bytes of which 10 come, then nothing: a trickling
		// publisher's message never ends.
		{"a message never finished", append(append(slices.Clone(handshake), 0, 100), make([]byte, 10)...)},
		// A frame header begun (4 of a long header's 9 bytes), and a
		// command begun: held open the same way.
		{"a frame header never finished", append(slices.Clone(handshake), zmtpFlagLong, 0, 0, 0)},
		{"a command never finished", append(slices.Clone(handshake), zmtpFlagCmd, 0xff, 4, 'P', 'I', 'N', 'G')},
	}
	before := series(t, reg, "narwhal_agent_kv_connections_total", "outcome", connRefused)
	for _, a := range attacks {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("%s: %v", a.name, err)
		}
		defer c.Close()
		if _, err := c.Write(a.send); err != nil {
			t.Fatalf("%s: %v", a.name, err)
		}
		if a.send == nil {
			continue // cut off at the handshake bound
		}
		// The agent closes the connection: a read ends.
		_ = c.SetReadDeadline(time.Now().Add(waitBound))
		if _, err := bytesUntilEOF(c); err != nil {
			t.Fatalf("%s: the agent did not close the connection: %v", a.name, err)
		}
	}
	testkit.WaitFor(t, waitBound, "every attack refused", func() bool {
		return series(t, reg, "narwhal_agent_kv_connections_total", "outcome", connRefused)-before >= float64(len(attacks))
	})

	py := startPublisher(t)
	py.do(map[string]any{"op": "open", "endpoint": ep, "bind": false})
	py.subscribed(1)
	good := tokens(7, 16)
	py.send("array", false, stored([]any{1}, nil, good, nil))
	testkit.WaitFor(t, waitBound, "the real publisher's event", func() bool {
		return slices.Equal(kb.got.keys(bus.KVStored, bus.KVGPU), prefix.AppendTokenKeys(nil, good, 16, 0))
	})
}

// bytesUntilEOF reads c until it ends and returns what it read; an error
// other than EOF (a deadline) is returned.
func bytesUntilEOF(c net.Conn) ([]byte, error) {
	var buf bytes.Buffer
	p := make([]byte, 4096)
	for {
		n, err := c.Read(p)
		buf.Write(p[:n])
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				return buf.Bytes(), err
			}
			return buf.Bytes(), nil
		}
	}
}

// TestGuardBoundsThePublisherNotTheReaderRPLACE4: the message bound
// counts the time the guard waits on the socket, not the time the reader
// above it takes. A reader that pauses past the bound (zmq4's queue full
// behind a slow bus) while the next message has begun in the guard's
// buffer does not get a prompt publisher cut off; a publisher that then
// stalls in the middle of a message is, with the bound's reason.
func TestGuardBoundsThePublisherNotTheReaderRPLACE4(t *testing.T) {
	srv, cli := net.Pipe()
	defer cli.Close()
	const bound = 200 * time.Millisecond
	g := newGuardConn(srv, guardLimits{maxMessage: 1 << 20, handshake: time.Second, message: bound})
	defer g.Close()
	// The handshake, a message "abc", and the first byte of the next, a
	// 4-byte one; its other 3 bytes follow as soon as the guard reads.
	first := append(append(zmtpGreetingBytes(), zmtpCommand(readyOf(pubMetadata))...), 0, 3, 'a', 'b', 'c', 0, 4, 'w')
	wrote := make(chan error, 1)
	go func() {
		_, err := cli.Write(first)
		if err == nil {
			_, err = cli.Write([]byte("xyz"))
		}
		wrote <- err
	}()
	got := make([]byte, len(first))
	if _, err := io.ReadFull(g, got); err != nil || !bytes.Equal(got, first) {
		t.Fatalf("reading the first bytes: %v (%q)", err, got)
	}
	time.Sleep(2 * bound) // the reader above is slow: not the publisher's time
	rest := make([]byte, 3)
	if _, err := io.ReadFull(g, rest); err != nil || string(rest) != "xyz" {
		t.Fatalf("a prompt publisher's message was cut after the reader paused: %v (%q)", err, rest)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}

	go func() { _, _ = cli.Write([]byte{0, 5, 'q'}) }() // 1 of 5 bytes, then nothing
	failed := make(chan error, 1)
	go func() {
		buf := make([]byte, 16)
		for {
			if _, err := g.Read(buf); err != nil {
				failed <- err
				return
			}
		}
	}()
	select {
	case err := <-failed:
		var ge *guardError
		if !errors.As(err, &ge) || !strings.Contains(ge.reason, "not whole") {
			t.Fatalf("a stalled message ended the read with %v, want the message bound", err)
		}
	case <-time.After(10 * bound):
		t.Fatal("a message stalled in its middle was not cut off")
	}
}

// TestGuardBufferGrowsOnlyForACommand: a guarded connection idle after
// its handshake holds a 4 KiB buffer; a 40 KiB command (held until
// whole) grows it and passes whole to the reader.
func TestGuardBufferGrowsOnlyForACommand(t *testing.T) {
	srv, cli := net.Pipe()
	defer cli.Close()
	g := newGuardConn(srv, guardLimits{maxMessage: 1 << 20, handshake: time.Second, message: time.Second})
	defer g.Close()
	hs := append(zmtpGreetingBytes(), zmtpCommand(readyOf(pubMetadata))...)
	go func() { _, _ = cli.Write(hs) }()
	got := make([]byte, len(hs))
	if _, err := io.ReadFull(g, got); err != nil {
		t.Fatal(err)
	}
	if len(g.buf) != guardBufStart {
		t.Fatalf("an idle connection's buffer is %d bytes, want %d", len(g.buf), guardBufStart)
	}
	body := append([]byte("\x04PING"), bytes.Repeat([]byte{7}, 40<<10)...)
	cmd := make([]byte, 9, 9+len(body))
	cmd[0] = zmtpFlagCmd | zmtpFlagLong
	binary.BigEndian.PutUint64(cmd[1:], uint64(len(body)))
	cmd = append(cmd, body...)
	go func() { _, _ = cli.Write(cmd) }()
	got = make([]byte, len(cmd))
	if _, err := io.ReadFull(g, got); err != nil || !bytes.Equal(got, cmd) {
		t.Fatalf("a 40 KiB command: %v", err)
	}
}
