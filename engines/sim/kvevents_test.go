package sim

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"reflect"
	"syscall"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// decodeBatch decodes a payload with msgpack's generic decoder.
func decodeBatch(t *testing.T, payload []byte) []any {
	t.Helper()
	dec := msgpack.NewDecoder(bytes.NewReader(payload))
	v, err := dec.DecodeInterface()
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	if _, err := dec.DecodeInterface(); err != io.EOF {
		t.Fatalf("bytes after the batch: %v", err)
	}
	batch, ok := unsignedInts(v).([]any)
	if !ok {
		t.Fatalf("batch is %T", v)
	}
	return batch
}

// unsignedInts returns v with every msgpack integer (decoded as the
// smallest Go type that holds it) as a uint64; the encoder writes no
// negative one.
func unsignedInts(v any) any {
	switch x := v.(type) {
	case []any:
		for i := range x {
			x[i] = unsignedInts(x[i])
		}
	case map[string]any:
		for k := range x {
			x[k] = unsignedInts(x[k])
		}
	case int8:
		return uint64(x)
	case int16:
		return uint64(x)
	case int32:
		return uint64(x)
	case int64:
		return uint64(x)
	case uint8:
		return uint64(x)
	case uint16:
		return uint64(x)
	case uint32:
		return uint64(x)
	}
	return v
}

// TestKVEventEncoderFormats: each format and flavor encodes a change as
// vLLM (or SGLang) does: evictions first, one BlockStored per contiguous
// run of new blocks with its parent and token ids (SGLang: one per
// block), the members in their declaration order, a float64 ts and the
// rank last (nil when negative).
func TestKVEventEncoderFormats(t *testing.T) {
	hashes := []uint64{11, 22, 33, 1 << 63}
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	ch := &kvChange{removed: []uint64{99, 98}, stored: []int32{0, 2, 3}, hashes: hashes, tokens: tokens, blockSize: 2}
	cases := []struct {
		format, flavor string
		rank           int
		want           []any
	}{
		{KVEventsArray, KVEventsVLLM, 0, []any{1.5, []any{
			[]any{"BlockRemoved", []any{uint64(99), uint64(98)}, "GPU"},
			[]any{"BlockStored", []any{uint64(11)}, nil, []any{uint64(1), uint64(2)}, uint64(2), nil, "GPU", nil},
			[]any{"BlockStored", []any{uint64(33), uint64(1 << 63)}, uint64(22), []any{uint64(5), uint64(6), uint64(7), uint64(8)}, uint64(2), nil, "GPU", nil},
		}, uint64(0)}},
		{KVEventsMap, KVEventsVLLM, -1, []any{1.5, []any{
			map[string]any{"type": "BlockRemoved", "block_hashes": []any{uint64(99), uint64(98)}, "medium": "GPU", "group_idx": uint64(0)},
			map[string]any{"type": "BlockStored", "block_hashes": []any{uint64(11)}, "parent_block_hash": nil, "token_ids": []any{uint64(1), uint64(2)},
				"block_size": uint64(2), "lora_id": nil, "medium": "GPU", "lora_name": nil, "extra_keys": []any{nil}, "group_idx": uint64(0), "kv_cache_spec_kind": "full_attention"},
			map[string]any{"type": "BlockStored", "block_hashes": []any{uint64(33), uint64(1 << 63)}, "parent_block_hash": uint64(22), "token_ids": []any{uint64(5), uint64(6), uint64(7), uint64(8)},
				"block_size": uint64(2), "lora_id": nil, "medium": "GPU", "lora_name": nil, "extra_keys": []any{nil, nil}, "group_idx": uint64(0), "kv_cache_spec_kind": "full_attention"},
		}, nil}},
		{KVEventsArray, KVEventsSGLang, 3, []any{1.5, []any{
			[]any{"BlockRemoved", []any{uint64(99)}, "GPU"},
			[]any{"BlockRemoved", []any{uint64(98)}, "GPU"},
			[]any{"BlockStored", []any{uint64(11)}, nil, []any{uint64(1), uint64(2)}, uint64(2), nil, "GPU"},
			[]any{"BlockStored", []any{uint64(33)}, uint64(22), []any{uint64(5), uint64(6)}, uint64(2), nil, "GPU"},
			[]any{"BlockStored", []any{uint64(1 << 63)}, uint64(33), []any{uint64(7), uint64(8)}, uint64(2), nil, "GPU"},
		}, uint64(3)}},
	}
	for _, tc := range cases {
		payload := newKVEventEncoder(tc.format, tc.flavor, tc.rank).encode(1.5, ch)
		if payload[0] != 0x93 || payload[1] != 0xcb {
			t.Fatalf("%s/%s: payload starts % x, want a 3-array and a float64", tc.format, tc.flavor, payload[:2])
		}
		if got := decodeBatch(t, payload); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s/%s:\n got %#v\nwant %#v", tc.format, tc.flavor, got, tc.want)
		}
	}
	// Map members keep vLLM's declaration order on the wire.
	payload := newKVEventEncoder(KVEventsMap, KVEventsVLLM, 0).encode(1, ch)
	order := []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
	last := 0
	stored := payload[bytes.Index(payload, []byte("BlockStored")):]
	for _, k := range order[1:] {
		i := bytes.Index(stored, []byte(k))
		if i < last {
			t.Fatalf("member %q out of vLLM's order in % x", k, stored)
		}
		last = i
	}
	cleared := decodeBatch(t, newKVEventEncoder(KVEventsMap, KVEventsVLLM, 0).encode(2, &kvChange{cleared: true}))
	if !reflect.DeepEqual(cleared[1], []any{map[string]any{"type": "AllBlocksCleared"}}) {
		t.Fatalf("cleared: %#v", cleared)
	}
	cleared = decodeBatch(t, newKVEventEncoder(KVEventsArray, KVEventsVLLM, 0).encode(2, &kvChange{cleared: true}))
	if !reflect.DeepEqual(cleared[1], []any{[]any{"AllBlocksCleared"}}) {
		t.Fatalf("cleared: %#v", cleared)
	}
}

// TestKVEventsNeverBlockAPrefill: a publisher that cannot send (its
// subscriber never answers the dial) holds at most its queue's bound;
// prefills go on at full speed, the oldest batches are dropped and
// counted on /metrics.
func TestKVEventsNeverBlockAPrefill(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nobody listens there: the PUB socket keeps redialing
	s, url := startEngine(t, Config{BlockSize: 2, KVEventsConnect: "tcp://" + addr})
	c := newClient(t)
	start := time.Now()
	tokens := make([]uint32, 2)
	for i := range kvEventsQueue + 100 {
		tokens[0], tokens[1] = uint32(i), 7
		hashes := appendBlockHashes(nil, tokens, 2)
		s.cache.lookup(hashes, tokens, 3, 2, true)
	}
	u := completion(t, c, url, words("p", 9))
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("%d prefills took %v with a stuck publisher", kvEventsQueue+101, took)
	}
	if u.PromptTokens != 9 {
		t.Fatalf("usage %+v", u)
	}
	if got := s.KVEventsDropped(); got != 101 {
		t.Fatalf("dropped %d batches, want the 101 beyond the queue's %d", got, kvEventsQueue)
	}
	if got := scrape(t, c, url, "narwhal_sim_kv_events_dropped_total"); got != 101 {
		t.Fatalf("narwhal_sim_kv_events_dropped_total %v, want 101", got)
	}
	if got := scrape(t, c, url, "narwhal_sim_kv_events_published_total"); got != 0 {
		t.Fatalf("published %v batches with no subscriber", got)
	}
}

// TestKVEventQueueDropsOldest: the queue keeps the newest batches in
// order.
func TestKVEventQueueDropsOldest(t *testing.T) {
	q := newKVEventQueue(3)
	for i := range 5 {
		q.push([]byte{byte(i)})
	}
	var got []byte
	for {
		p, ok := q.pop()
		if !ok {
			break
		}
		got = append(got, p...)
	}
	if !bytes.Equal(got, []byte{2, 3, 4}) || q.dropped.Load() != 2 {
		t.Fatalf("kept %v, dropped %d: want [2 3 4] and 2", got, q.dropped.Load())
	}
}

// waitClosed reads conn until the other end closes it (an end of file or
// a reset), failing after 10 s.
func waitClosed(t *testing.T, conn net.Conn, who string) {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := io.Copy(io.Discard, conn)
	if err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("the sim kept the connection of %s: %v", who, err)
	}
}

// TestKVEventsHostilePeer: a peer of the PUB socket that announces a
// frame of 1 TiB is cut off before zmq4 allocates it, and so is a SUB
// that sends messages other than subscriptions; the socket still
// publishes; settings that make no sense fail New.
func TestKVEventsHostilePeer(t *testing.T) {
	s, url := startEngine(t, Config{BlockSize: 2, KVEvents: "tcp://127.0.0.1:0"})
	conn, err := net.DialTimeout("tcp", s.KVEventsAddr(), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
	copy(greeting[12:], "NULL")
	frame := append([]byte{0x06}, binary.BigEndian.AppendUint64(nil, 1<<40)...) // a long command frame
	if _, err := conn.Write(append(greeting, frame...)); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, conn, "a peer announcing a 1 TiB frame")
	// A SUB that completes its handshake and then sends messages that are
	// not subscriptions (zmq4 would queue them for a reader a PUB never
	// has, parking the connection for good) is cut off too.
	sub, err := net.DialTimeout("tcp", s.KVEventsAddr(), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ready := []byte("\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB\x08Identity\x00\x00\x00\x00")
	stream := append(append(append([]byte{}, greeting...), 0x04, byte(len(ready))), ready...)
	for range 12 {
		stream = append(stream, 0x00, 1, 'x')
	}
	if _, err := sub.Write(stream); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, sub, "a SUB sending messages")

	// The engine still answers and still publishes.
	completion(t, newClient(t), url, words("h", 5))
	testkit.WaitFor(t, 5*time.Second, "the batch of the prefill after the hostile peer", func() bool {
		return s.publisher().published.Load() == 1
	})

	for _, bad := range []Config{
		{KVEvents: "tcp://127.0.0.1:0", KVEventsConnect: "tcp://127.0.0.1:1"},
		{KVEventsReplay: "tcp://127.0.0.1:0"},
		{KVEvents: "ipc:///tmp/x"},
		{KVEvents: "tcp://nohost"},
		{KVEvents: "tcp://127.0.0.1:0", KVEventsFormat: "json"},
		{KVEvents: "tcp://127.0.0.1:0", KVEventsFlavor: "trt"},
		{KVEvents: "tcp://127.0.0.1:0", KVEventsFlavor: KVEventsSGLang, KVEventsFormat: KVEventsMap},
		{KVEvents: "tcp://127.0.0.1:0", KVEventsBuffer: -1},
	} {
		bad.EngineID, bad.Model = "e", "m"
		if _, err := New(bad); err == nil {
			t.Errorf("New(%+v) succeeded", bad)
		}
	}
}

// TestGuardedConnFollowsFrames: the guard follows greeting, short and long
// frames split across reads, and lifts the handshake deadline after the
// first command.
func TestGuardedConnFollowsFrames(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	g := newGuardedConn(a, false)
	var stream []byte
	stream = append(stream, make([]byte, 64)...)              // greeting
	stream = append(stream, 0x04, 5, 'R', 'E', 'A', 'D', 'Y') // a short command
	stream = append(stream, 0x02, 0, 0, 0, 0, 0, 0, 1, 0)     // a long message of 256 bytes
	stream = append(stream, make([]byte, 256)...)             //
	stream = append(stream, 0x00, 2, 1, 'x')                  // a subscription
	stream = append(stream, 0x02, 0, 0, 0, 0, 0, 1, 0, 1)     // 65537 bytes: too large
	go func() {
		for i := 0; i < len(stream); i += 7 {
			if _, err := b.Write(stream[i:min(i+7, len(stream))]); err != nil {
				return
			}
		}
	}()
	buf := make([]byte, 7)
	read := 0
	for {
		n, err := g.Read(buf)
		read += n
		if err != nil {
			if err != errKVFrameTooLarge {
				t.Fatalf("read %d bytes, then %v; want errKVFrameTooLarge", read, err)
			}
			break
		}
		if read > 64+7 && g.handshake {
			t.Fatal("the handshake deadline outlived the peer's READY")
		}
	}
	if at := len(stream) - 9; read < at-7 || read >= len(stream) {
		t.Fatalf("read %d bytes around the oversized frame's header at %d", read, at)
	}
}
