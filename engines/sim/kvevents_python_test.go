package sim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// debianPython is Debian's interpreter, the one python3-zmq and
// python3-msgpack install for (not a pyenv python3 earlier on PATH).
const debianPython = "/usr/bin/python3"

// needPythonDecoder skips the test when Debian's python3 with zmq and
// msgpack is missing, except in CI (CI=true), where it fails: .ci/run
// installs them.
func needPythonDecoder(t *testing.T) {
	t.Helper()
	out, err := exec.Command(debianPython, "-c", "import zmq, msgpack; print(zmq.zmq_version())").CombinedOutput()
	if err == nil {
		return
	}
	msg := fmt.Sprintf("the independent KV event decoder needs %s with python3-zmq and python3-msgpack (apt-get install -y python3-zmq python3-msgpack): %v: %s", debianPython, err, bytes.TrimSpace(out))
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// pyNode is one decoded value as testdata/kvevents_decode.py describes
// it: its Python type, and its value, keys or members.
type pyNode struct {
	T string          `json:"t"`
	V json.RawMessage `json:"v"`
	K []string        `json:"k"`
}

// list returns a list node's members, failing on another type.
func (n pyNode) list(t *testing.T, what string) []pyNode {
	t.Helper()
	if n.T != "list" {
		t.Fatalf("%s: Python %s, want list", what, n.T)
	}
	var out []pyNode
	if err := json.Unmarshal(n.V, &out); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return out
}

// uint returns an int node's value, failing on another type.
func (n pyNode) uint(t *testing.T, what string) uint64 {
	t.Helper()
	if n.T != "int" {
		t.Fatalf("%s: Python %s, want int", what, n.T)
	}
	v, err := strconv.ParseUint(string(n.V), 10, 64)
	if err != nil {
		t.Fatalf("%s: %s is not a uint64: %v", what, n.V, err)
	}
	return v
}

// str returns a str node's value, failing on another type.
func (n pyNode) str(t *testing.T, what string) string {
	t.Helper()
	if n.T != "str" {
		t.Fatalf("%s: Python %s, want str", what, n.T)
	}
	var s string
	_ = json.Unmarshal(n.V, &s)
	return s
}

// uints returns a list of ints.
func (n pyNode) uints(t *testing.T, what string) []uint64 {
	t.Helper()
	var out []uint64
	for i, m := range n.list(t, what) {
		out = append(out, m.uint(t, fmt.Sprintf("%s[%d]", what, i)))
	}
	return out
}

// pyMessage is one line of the decoder's output.
type pyMessage struct {
	Ready     bool    `json:"ready"`
	Endpoint  string  `json:"endpoint"`
	Timeout   bool    `json:"timeout"`
	Frames    int     `json:"frames"`
	Topic     string  `json:"topic"`
	SeqLen    int     `json:"seq_len"`
	Seq       int64   `json:"seq"`
	Delimiter *string `json:"delimiter"`
	Payload   *pyNode `json:"payload"`
	raw       string
}

// lockedBuffer is a bytes.Buffer safe for a writer and a reader at once.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// pyDecoder runs testdata/kvevents_decode.py with args and hands out its
// lines.
type pyDecoder struct {
	lines chan pyMessage
	cmd   *exec.Cmd
	errs  *lockedBuffer
}

func startPyDecoder(t *testing.T, args ...string) *pyDecoder {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	cmd := exec.CommandContext(ctx, debianPython, append([]string{"testdata/kvevents_decode.py"}, args...)...)
	d := &pyDecoder{lines: make(chan pyMessage, 64), cmd: cmd, errs: new(lockedBuffer)}
	cmd.Stderr = d.errs
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(d.lines)
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			var m pyMessage
			if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
				m = pyMessage{raw: sc.Text()}
			}
			m.raw = sc.Text()
			d.lines <- m
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = cmd.Wait()
	})
	return d
}

// next returns the decoder's next line, failing when it ends or prints
// something else than a message.
func (d *pyDecoder) next(t *testing.T) pyMessage {
	t.Helper()
	select {
	case m, ok := <-d.lines:
		if !ok {
			t.Fatalf("the Python decoder ended: %s", d.errs.String())
		}
		if m.Timeout {
			t.Fatalf("the Python decoder timed out waiting for a message")
		}
		return m
	case <-time.After(20 * time.Second):
		t.Fatalf("no line from the Python decoder: %s", d.errs.String())
	}
	return pyMessage{}
}

// waitSubscribed waits until the PUB socket of s has a subscriber (the
// Python SUB's subscription arrived), so no message is lost to ZeroMQ's
// slow joiner.
func waitSubscribed(t *testing.T, s *Server) {
	t.Helper()
	p := s.publisher()
	testkit.WaitFor(t, 10*time.Second, "the Python subscriber's subscription", func() bool {
		return len(p.pub.(zmq4.Topics).Topics()) > 0
	})
}

// tokenize posts body to /tokenize and returns its tokens.
func tokenize(t *testing.T, c *http.Client, url string, body any) []uint64 {
	t.Helper()
	resp := post(t, c, url+"/tokenize", body)
	b := readBody(t, resp)
	var out struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint64 `json:"tokens"`
	}
	if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 || out.Count != len(out.Tokens) {
		t.Fatalf("/tokenize %d %s", resp.StatusCode, b)
	}
	return out.Tokens
}

// chainOf is the sim's block hashes of tokens.
func chainOf(tokens []uint64, blockSize int) []uint64 {
	ids := make([]uint32, len(tokens))
	for i, v := range tokens {
		ids[i] = uint32(v)
	}
	return appendBlockHashes(nil, ids, blockSize)
}

// wantEvent is what one event must hold.
type wantEvent struct {
	tag    string
	hashes []uint64
	parent *uint64
	tokens []uint64
}

// checkBatch checks a message's frames and payload against vLLM's
// layout (format, flavor) and events.
func checkBatch(t *testing.T, m pyMessage, format, flavor, topic string, seq int64, events []wantEvent) {
	t.Helper()
	if m.Frames != 3 || m.SeqLen != 8 || m.Seq != seq || m.Topic != topic || m.Payload == nil {
		t.Fatalf("message %s: want 3 frames, topic %q, an 8-byte sequence %d and a payload", m.raw, topic, seq)
	}
	batch := m.Payload.list(t, "payload")
	if len(batch) != 3 || batch[0].T != "float" {
		t.Fatalf("payload %s: want [float ts, [events], rank]", m.raw)
	}
	var ts float64
	_ = json.Unmarshal(batch[0].V, &ts)
	if now := float64(time.Now().UnixNano()) / 1e9; ts < now-60 || ts > now+1 {
		t.Fatalf("ts %v is not now (%v) in seconds", ts, now)
	}
	if got := batch[2].uint(t, "data_parallel_rank"); got != 0 {
		t.Fatalf("data_parallel_rank %d, want 0", got)
	}
	evs := batch[1].list(t, "events")
	if len(evs) != len(events) {
		t.Fatalf("%d events, want %d: %s", len(evs), len(events), m.raw)
	}
	for i, want := range events {
		checkEvent(t, evs[i], format, flavor, want)
	}
}

// checkEvent checks one event's encoding, member order and Python types.
func checkEvent(t *testing.T, ev pyNode, format, flavor string, want wantEvent) {
	t.Helper()
	var members []pyNode
	if format == KVEventsMap {
		if ev.T != "dict" {
			t.Fatalf("event is a Python %s, want dict", ev.T)
		}
		if err := json.Unmarshal(ev.V, &members); err != nil {
			t.Fatal(err)
		}
		var keys []string
		switch want.tag {
		case "BlockStored":
			keys = []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
		case "BlockRemoved":
			keys = []string{"type", "block_hashes", "medium", "group_idx"}
		default:
			keys = []string{"type"}
		}
		if !slices.Equal(ev.K, keys) {
			t.Fatalf("%s keys %q, want vLLM's %q", want.tag, ev.K, keys)
		}
	} else {
		members = ev.list(t, "event")
		n := map[string]int{"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}[want.tag]
		if flavor == KVEventsSGLang && want.tag == "BlockStored" {
			n = 7
		}
		if len(members) != n {
			t.Fatalf("%s has %d members, want %d", want.tag, len(members), n)
		}
	}
	if tag := members[0].str(t, "tag"); tag != want.tag {
		t.Fatalf("tag %q, want %q", tag, want.tag)
	}
	switch want.tag {
	case "BlockStored":
		if got := members[1].uints(t, "block_hashes"); !slices.Equal(got, want.hashes) {
			t.Fatalf("block_hashes %d, want %d", got, want.hashes)
		}
		switch {
		case want.parent == nil && members[2].T != "NoneType":
			t.Fatalf("parent_block_hash is a Python %s, want None for a prompt's first block", members[2].T)
		case want.parent != nil && members[2].uint(t, "parent_block_hash") != *want.parent:
			t.Fatalf("parent_block_hash %s, want %d", members[2].V, *want.parent)
		}
		if got := members[3].uints(t, "token_ids"); !slices.Equal(got, want.tokens) {
			t.Fatalf("token_ids %d, want /tokenize's %d", got, want.tokens)
		}
		if got := members[4].uint(t, "block_size"); got != 4 {
			t.Fatalf("block_size %d, want 4", got)
		}
		if members[5].T != "NoneType" || members[6].str(t, "medium") != "GPU" {
			t.Fatalf("lora_id %s, medium %s: want None, \"GPU\"", members[5].T, members[6].V)
		}
		if flavor == KVEventsSGLang {
			return
		}
		if members[7].T != "NoneType" {
			t.Fatalf("lora_name is a Python %s, want None", members[7].T)
		}
		if format == KVEventsMap {
			extra := members[8].list(t, "extra_keys")
			if len(extra) != len(want.hashes) || slices.ContainsFunc(extra, func(n pyNode) bool { return n.T != "NoneType" }) {
				t.Fatalf("extra_keys %s, want one None per block", members[8].V)
			}
			if members[9].uint(t, "group_idx") != 0 || members[10].str(t, "kv_cache_spec_kind") != "full_attention" {
				t.Fatalf("group_idx %s, kv_cache_spec_kind %s", members[9].V, members[10].V)
			}
		}
	case "BlockRemoved":
		if got := members[1].uints(t, "block_hashes"); !slices.Equal(got, want.hashes) {
			t.Fatalf("removed block_hashes %d, want %d", got, want.hashes)
		}
		if members[2].str(t, "medium") != "GPU" {
			t.Fatalf("medium %s, want GPU", members[2].V)
		}
		if format == KVEventsMap && members[3].uint(t, "group_idx") != 0 {
			t.Fatalf("group_idx %s, want 0", members[3].V)
		}
	}
}

// TestSimKVEventsDecodedByPythonRPLACE4: the simulator's KV events, in
// the older tagged-array encoding, as libzmq and msgpack (Debian's
// python3-zmq and python3-msgpack, not our Go code) read them: three
// frames with the topic and consecutive 8-byte sequence numbers from 0;
// a payload [float ts, [events], int rank]; BlockStored on a prefill with
// the /tokenize tokens of its full blocks, a None parent for a prompt's
// first block and the previous block's hash for a later one;
// BlockRemoved for the blocks evicted; AllBlocksCleared on POST
// /reset_prefix_cache; and the replay socket answering a DEALER from an
// earlier sequence with exactly the published batches, then vLLM's end
// marker: the events placement's exact index is built from.
func TestSimKVEventsDecodedByPythonRPLACE4(t *testing.T) {
	testKVEventsPython(t, KVEventsArray)
}

// TestSimKVEventsMapDecodedByPythonRPLACE4 is the same in current vLLM's
// encoding: maps with a "type" tag, members in vLLM's declaration order.
func TestSimKVEventsMapDecodedByPythonRPLACE4(t *testing.T) {
	testKVEventsPython(t, KVEventsMap)
}

func testKVEventsPython(t *testing.T, format string) {
	needPythonDecoder(t)
	const topic = "kv@127.0.0.1:8000@m"
	s, url := startEngine(t, Config{BlockSize: 4, KVCacheBlocks: 4, KVEvents: "tcp://127.0.0.1:0",
		KVEventsReplay: "tcp://127.0.0.1:0", KVEventsTopic: topic, KVEventsFormat: format})
	c := newClient(t)
	sub := startPyDecoder(t, "sub", "tcp://"+s.KVEventsAddr(), "kv@", "4", "15")
	if m := sub.next(t); !m.Ready {
		t.Fatalf("decoder: %s", m.raw)
	}
	waitSubscribed(t, s)

	// A completions prompt of 9 tokens: two full blocks of 4.
	a := completionBody(words("a", 9))
	aTokens := tokenize(t, c, url, a)
	aHashes := chainOf(aTokens, 4)
	completion(t, c, url, words("a", 9))
	checkBatch(t, sub.next(t), format, KVEventsVLLM, topic, 0,
		[]wantEvent{{tag: "BlockStored", hashes: aHashes, tokens: aTokens[:8]}})

	// A chat of 12 tokens (the role marker and 11 words): three new
	// blocks in a cache of four evict a's tail block first.
	b := chatBody(words("b", 11))
	bTokens := tokenize(t, c, url, b)
	bHashes := chainOf(bTokens, 4)
	if len(bTokens) != 12 || len(bHashes) != 3 {
		t.Fatalf("chat tokens %d, blocks %d: want 12 and 3", len(bTokens), len(bHashes))
	}
	resp := post(t, c, url+"/v1/chat/completions", chatBody(words("b", 11), "max_tokens", 1))
	if readBody(t, resp); resp.StatusCode != 200 {
		t.Fatalf("chat: %d", resp.StatusCode)
	}
	checkBatch(t, sub.next(t), format, KVEventsVLLM, topic, 1, []wantEvent{
		{tag: "BlockRemoved", hashes: aHashes[1:]},
		{tag: "BlockStored", hashes: bHashes, tokens: bTokens},
	})

	// a again: its head is cached, its second block is stored again under
	// its parent, evicting b's tail.
	completion(t, c, url, words("a", 9))
	checkBatch(t, sub.next(t), format, KVEventsVLLM, topic, 2, []wantEvent{
		{tag: "BlockRemoved", hashes: bHashes[2:]},
		{tag: "BlockStored", hashes: aHashes[1:], parent: &aHashes[0], tokens: aTokens[4:8]},
	})

	resp = post(t, c, url+"/reset_prefix_cache", "")
	if readBody(t, resp); resp.StatusCode != 200 {
		t.Fatalf("/reset_prefix_cache: %d", resp.StatusCode)
	}
	cleared := sub.next(t)
	checkBatch(t, cleared, format, KVEventsVLLM, topic, 3, []wantEvent{{tag: "AllBlocksCleared"}})
	if st := s.Stats(); st.PrefixCacheBlocks != 0 {
		t.Fatalf("%d blocks cached after the reset", st.PrefixCacheBlocks)
	}

	// Replay from sequence 1: batches 1, 2 and 3 as published, then the
	// end marker (-1, empty payload).
	rep := startPyDecoder(t, "replay", "tcp://"+s.KVEventsReplayAddr(), "1", "15")
	for seq := int64(1); seq <= 3; seq++ {
		m := rep.next(t)
		if m.Delimiter == nil || *m.Delimiter != "" || m.Frames != 3 || m.Seq != seq {
			t.Fatalf("replay answer %s: want [empty, sequence %d, payload]", m.raw, seq)
		}
		if seq == 3 && !bytes.Equal(m.Payload.V, cleared.Payload.V) {
			t.Fatalf("replayed batch 3 %s differs from the published %s", m.Payload.V, cleared.Payload.V)
		}
		if m.Payload == nil {
			t.Fatalf("replay answer %d has no payload", seq)
		}
	}
	if m := rep.next(t); m.Seq != -1 || m.Payload != nil || m.Frames != 3 || m.Delimiter == nil || *m.Delimiter != "" {
		t.Fatalf("replay end %s: want [empty, -1, empty]", m.raw)
	}
	if strings.Contains(sub.errs.String(), "Traceback") || strings.Contains(rep.errs.String(), "Traceback") {
		t.Fatalf("decoder errors: %s %s", sub.errs.String(), rep.errs.String())
	}
}

// TestSimKVEventsConnectDecodedByPython: with --kv-events-connect the
// simulator dials a subscriber that binds (as llm-d's simulator does),
// and that subscriber decodes its events.
func TestSimKVEventsConnectDecodedByPython(t *testing.T) {
	needPythonDecoder(t)
	sub := startPyDecoder(t, "bind-sub", "tcp://127.0.0.1:0", "", "1", "15")
	ready := sub.next(t)
	if !ready.Ready || !strings.HasPrefix(ready.Endpoint, "tcp://127.0.0.1:") {
		t.Fatalf("decoder: %s", ready.raw)
	}
	s, url := startEngine(t, Config{BlockSize: 4, KVEventsConnect: ready.Endpoint})
	if s.KVEventsAddr() != "" {
		t.Fatalf("a dialing publisher listens on %s", s.KVEventsAddr())
	}
	waitSubscribed(t, s)
	c := newClient(t)
	tokens := tokenize(t, c, url, completionBody(words("c", 5)))
	completion(t, c, url, words("c", 5))
	checkBatch(t, sub.next(t), KVEventsMap, KVEventsVLLM, "", 0,
		[]wantEvent{{tag: "BlockStored", hashes: chainOf(tokens, 4), tokens: tokens[:4]}})
}

// TestSimKVEventsSGLangDecodedByPython: in SGLang's flavor every block is
// its own BlockStored (parent the block before it) and BlockRemoved,
// tagged arrays without vLLM's later members.
func TestSimKVEventsSGLangDecodedByPython(t *testing.T) {
	needPythonDecoder(t)
	s, url := startEngine(t, Config{BlockSize: 4, KVCacheBlocks: 2, KVEvents: "tcp://127.0.0.1:0", KVEventsFlavor: KVEventsSGLang})
	sub := startPyDecoder(t, "sub", "tcp://"+s.KVEventsAddr(), "", "2", "15")
	if m := sub.next(t); !m.Ready {
		t.Fatalf("decoder: %s", m.raw)
	}
	waitSubscribed(t, s)
	c := newClient(t)
	tokens := tokenize(t, c, url, completionBody(words("g", 9)))
	h := chainOf(tokens, 4)
	completion(t, c, url, words("g", 9))
	checkBatch(t, sub.next(t), KVEventsArray, KVEventsSGLang, "", 0, []wantEvent{
		{tag: "BlockStored", hashes: h[:1], tokens: tokens[:4]},
		{tag: "BlockStored", hashes: h[1:2], parent: &h[0], tokens: tokens[4:8]},
	})
	other := tokenize(t, c, url, completionBody(words("o", 9)))
	o := chainOf(other, 4)
	completion(t, c, url, words("o", 9))
	checkBatch(t, sub.next(t), KVEventsArray, KVEventsSGLang, "", 1, []wantEvent{
		{tag: "BlockRemoved", hashes: h[1:2]},
		{tag: "BlockRemoved", hashes: h[:1]},
		{tag: "BlockStored", hashes: o[:1], tokens: other[:4]},
		{tag: "BlockStored", hashes: o[1:2], parent: &o[0], tokens: other[4:8]},
	})
}
