package kvevents

import (
	"slices"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
)

// TestAgentRepublishesBothEncodingsRPLACE4 (R-PLACE-4): an independent
// publisher (libzmq and msgpack in Python) sends vLLM's events in the
// older tagged-array encoding and the newer maps, with hashes as
// integers and as bytes, SGLang's CPU_PINNED medium, a LoRA adapter and
// extra_keys; the agent republishes them on the bus under the engine's
// own credential, and a router decodes keys equal to
// prefix.AppendTokenKeys of the tokens, removals of the right keys and
// the right media.
func TestAgentRepublishesBothEncodingsRPLACE4(t *testing.T) {
	testkit.CheckLeaks(t)
	kb := startBus(t, "e1")
	py := startPublisher(t)
	pub, _ := py.open(false)
	br, reg := runAgent(t, kb, Config{Sources: []Source{{Rank: 0, Endpoint: pub}}})
	py.subscribed(1)

	chain := tokens(100, 48)
	want := prefix.AppendTokenKeys(nil, chain, 16, 0)
	byteHash := map[string]any{"b": "00112233445566778899aabbccddeeff0102030405060708"}
	py.send("array", false, stored([]any{1, 2}, nil, chain[:32], nil))
	py.send("map", false, stored([]any{byteHash}, 2, chain[32:], nil))
	testkit.WaitFor(t, waitBound, "three stored GPU keys", func() bool { return len(kb.got.keys(bus.KVStored, bus.KVGPU)) == 3 })
	if got := kb.got.keys(bus.KVStored, bus.KVGPU); !slices.Equal(got, want) {
		t.Fatalf("stored keys %x, want AppendTokenKeys' %x", got, want)
	}

	// SGLang offloads to pinned host memory: the same block on the CPU.
	py.send("map", false, stored([]any{1}, nil, chain[:16], map[string]any{"medium": "CPU_PINNED"}))
	// A LoRA adapter and a cache salt in extra_keys (as vLLM encodes a
	// tuple: a msgpack array), and an adapter known by number only.
	py.send("map", false, stored([]any{10}, nil, chain[:16], map[string]any{"lora_name": "ad", "extra_keys": []any{[]any{"salt1"}}}))
	py.send("array", false, stored([]any{11}, nil, chain[:16], map[string]any{"lora_id": 3}))
	testkit.WaitFor(t, waitBound, "the CPU key and the salted ones", func() bool {
		return len(kb.got.keys(bus.KVStored, bus.KVCPU)) == 1 && len(kb.got.keys(bus.KVStored, bus.KVGPU)) == 5
	})
	if got := kb.got.keys(bus.KVStored, bus.KVCPU); !slices.Equal(got, want[:1]) {
		t.Fatalf("CPU_PINNED keys %x, want %x", got, want[:1])
	}
	saltedRaw := []byte{0x91, 0xa5, 's', 'a', 'l', 't', '1'} // ["salt1"], written by hand
	gpu := kb.got.keys(bus.KVStored, bus.KVGPU)
	if want := prefix.TokenBlockKey(0, chain[:16], prefix.BlockSalt("ad", saltedRaw)); gpu[3] != want {
		t.Fatalf("the LoRA block's key %x, want %x (BlockSalt of the adapter and the entry's msgpack)", gpu[3], want)
	}
	if gpu[4] == want[0] || gpu[4] == gpu[3] {
		t.Fatalf("a block of an adapter known by number only got key %x, one a router's request could match", gpu[4])
	}

	// Removals name the engine's hashes; the router gets our keys.
	py.send("array", false, removed("GPU", 2), removed("CPU_PINNED", 1))
	py.send("map", false, map[string]any{"type": "AllBlocksCleared"})
	testkit.WaitFor(t, waitBound, "the removals and the clear", func() bool { return kb.got.count(bus.KVCleared, 0) == 1 })
	if got := kb.got.keys(bus.KVRemoved, bus.KVGPU); !slices.Equal(got, want[1:2]) {
		t.Fatalf("removed GPU keys %x, want %x", got, want[1:2])
	}
	if got := kb.got.keys(bus.KVRemoved, bus.KVCPU); !slices.Equal(got, want[:1]) {
		t.Fatalf("removed CPU keys %x, want %x", got, want[:1])
	}
	kb.got.check(t, br.Epoch())
	if n := kb.got.count(bus.KVLost, 0); n != 0 {
		t.Fatalf("%d KVLost ops for a publisher that lost nothing", n)
	}
	if v := series(t, reg, "narwhal_agent_kv_blocks", "rank", "0"); v != 0 {
		t.Fatalf("narwhal_agent_kv_blocks = %v after AllBlocksCleared, want 0", v)
	}
	if v := series(t, reg, "narwhal_agent_kv_events_total", "rank", "0", "outcome", "applied"); v != 8 {
		t.Fatalf("applied events = %v, want 8", v)
	}
}
