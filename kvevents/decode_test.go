package kvevents

import (
	"errors"
	"runtime"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/prefix"
)

func pack(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestPayloadDecodeRPLACE4 (R-PLACE-4): both encodings of each event,
// hashes as integers and bytes, media, group_idx, unknown types and
// members, and the refusals that refuse a message whole.
func TestPayloadDecodeRPLACE4(t *testing.T) {
	toks := make([]uint32, 32)
	for i := range toks {
		toks[i] = uint32(i)
	}
	hashBytes := []byte{9, 9, 9, 0, 0, 0, 0, 0, 0, 0, 42}
	data := pack(t, []any{1.5, []any{
		[]any{"BlockStored", []any{uint64(1 << 63), hashBytes}, nil, toks, 16, nil, "CPU_PINNED"},
		map[string]any{"type": "BlockRemoved", "block_hashes": []any{-1}, "medium": "DISK", "future_member": map[string]any{"x": []any{1}}},
		map[string]any{"type": "BlockStored", "block_hashes": []any{5}, "parent_block_hash": 7, "token_ids": toks[:16], "block_size": 16, "group_idx": 1},
		[]any{"SomethingNew", 1, 2},
		[]any{"AllBlocksCleared"},
		[]any{"BlockStored", []any{1}, nil, toks[:15], 16, nil, nil},
	}, 3})
	var p Payload
	if err := p.Decode(data); err != nil {
		t.Fatal(err)
	}
	if p.Rank != 3 || len(p.Events) != 3 || p.SkippedGroup != 1 || p.SkippedType != 1 || p.RefusedStored != 1 {
		t.Fatalf("rank %d, %d events, skipped group %d type %d, refused %d", p.Rank, len(p.Events), p.SkippedGroup, p.SkippedType, p.RefusedStored)
	}
	s := p.Events[0]
	if s.Kind != EventStored || s.Medium != bus.KVCPU || s.BlockSize != 16 || len(s.Tokens) != 32 ||
		s.Hashes[0] != 1<<63 || s.Hashes[1] != 42 || s.Salts[0] != 0 || s.Salts[1] != 0 {
		t.Fatalf("stored %+v", s)
	}
	if r := p.Events[1]; r.Kind != EventRemoved || r.Medium != bus.KVDisk || r.Hashes[0] != ^uint64(0) {
		t.Fatalf("removed %+v", r)
	}
	if p.Events[2].Kind != EventCleared {
		t.Fatalf("cleared %+v", p.Events[2])
	}

	// extra_keys: one entry per block, its msgpack bytes in the salt.
	data = pack(t, map[string]any{"ts": 1, "events": []any{
		map[string]any{"type": "BlockStored", "block_hashes": []any{1, 2}, "token_ids": toks, "block_size": 16,
			"lora_name": "a", "extra_keys": []any{[]any{"s"}, nil}},
	}})
	if err := p.Decode(data); err != nil {
		t.Fatal(err)
	}
	if e := p.Events[0]; e.Salts[0] != prefix.BlockSalt("a", []byte{0x91, 0xa1, 's'}) || e.Salts[1] != prefix.BlockSalt("a", nil) {
		t.Fatalf("salts %x", e.Salts)
	}

	for name, bad := range map[string][]byte{
		"not msgpack":      {0xc1},
		"a string":         pack(t, "x"),
		"trailing bytes":   append(pack(t, []any{1, []any{}}), 0),
		"rank 64":          pack(t, []any{1, []any{}, 64}),
		"one member":       pack(t, []any{1}),
		"no events":        pack(t, map[string]any{"ts": 1}),
		"a non-tag":        pack(t, []any{1, []any{[]any{1}}}),
		"cut short":        pack(t, []any{1, []any{[]any{"BlockStored", []any{1, 2, 3}}}})[:12],
		"too many events":  append([]byte{0x92, 0x01, 0xdd, 0, 1, 0, 1}, make([]byte, 70000)...),
		"a removal of map": pack(t, []any{1, []any{[]any{"BlockRemoved", map[string]any{}}}}),
	} {
		err := p.Decode(bad)
		if name == "a removal of map" {
			if err != nil || p.RefusedRemoved != 1 {
				t.Errorf("%s: %v, refused removals %d, want 1", name, err, p.RefusedRemoved)
			}
			continue
		}
		if !errors.Is(err, ErrPayload) {
			t.Errorf("%s: %v, want ErrPayload", name, err)
		}
	}
}

// FuzzPayloadDecode: no input panics Decode or yields an event that
// breaks its shape.
func FuzzPayloadDecode(f *testing.F) {
	toks := make([]uint32, 16)
	f.Add(pack(f, []any{1.5, []any{[]any{"BlockStored", []any{1}, nil, toks, 16, nil, "GPU", "l", []any{[]any{"x"}}}}, 0}))
	f.Add(pack(f, map[string]any{"ts": 1, "events": []any{map[string]any{"type": "BlockRemoved", "block_hashes": []any{[]byte{1}}}}}))
	f.Add(pack(f, []any{1, []any{[]any{"AllBlocksCleared"}}, nil}))
	f.Fuzz(func(t *testing.T, data []byte) {
		var p Payload
		if err := p.Decode(data); err != nil {
			return
		}
		for _, e := range p.Events {
			switch e.Kind {
			case EventStored:
				if e.BlockSize < 1 || e.BlockSize > prefix.MaxTokenBlockSize || len(e.Tokens) != len(e.Hashes)*e.BlockSize || len(e.Salts) != len(e.Hashes) || len(e.Hashes) == 0 {
					t.Fatalf("stored event of bad shape: %+v", e)
				}
			case EventRemoved:
				if len(e.Hashes) == 0 {
					t.Fatal("a removal without hashes")
				}
			case EventCleared:
			default:
				t.Fatalf("event kind %d", e.Kind)
			}
		}
	})
}

// TestParseSource: RANK=ENDPOINT or ENDPOINT, and what is refused.
func TestParseSource(t *testing.T) {
	for in, want := range map[string]Source{
		"tcp://127.0.0.1:5557":  {Rank: 0, Endpoint: "tcp://127.0.0.1:5557"},
		"3=tcp://h:5560":        {Rank: 3, Endpoint: "tcp://h:5560"},
		"ipc:///run/kv=1.sock":  {Rank: 0, Endpoint: "ipc:///run/kv=1.sock"},
		"63=ipc:///run/kv.sock": {Rank: 63, Endpoint: "ipc:///run/kv.sock"},
	} {
		r, ep, err := ParseSource(in)
		if err != nil || r != want.Rank || ep != want.Endpoint {
			t.Errorf("%q: %d %q %v, want %+v", in, r, ep, err, want)
		}
	}
	for _, in := range []string{"", "64=tcp://h:1", "-1=tcp://h:1", "x=tcp://h:1", "udp://h:1", "tcp://", "h:5557"} {
		if _, _, err := ParseSource(in); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}

// TestBlockMapMemory measures the map of one rank at DefaultMaxBlocks
// blocks, the figure DefaultMaxBlocks' doc states (6.7 MiB).
func TestBlockMapMemory(t *testing.T) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	m := make(map[uint64]block)
	for i := uint64(0); i < DefaultMaxBlocks; i++ {
		m[i*0x9e3779b97f4a7c15] = block{key: i, media: 1}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	mib := float64(after.HeapAlloc-before.HeapAlloc) / (1 << 20)
	t.Logf("%d blocks: %.1f MiB (%.0f bytes a block)", len(m), mib, mib*(1<<20)/float64(len(m)))
	if mib > 8 {
		t.Fatalf("%.1f MiB for %d blocks, above the documented bound", mib, len(m))
	}
	runtime.KeepAlive(m)
}
