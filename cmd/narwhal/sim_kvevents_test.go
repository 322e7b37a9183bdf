package main

import (
	"context"
	"reflect"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/engines/sim"
)

// TestSimKVEventsFlags: the --kv-events flags set the simulator's KV
// event settings (docs/simulator.md), settings that make no sense are
// refused with a message naming them, and with a free port the simulator
// binds its PUB and replay sockets, starts and stops.
func TestSimKVEventsFlags(t *testing.T) {
	var cfg sim.Config
	fs, _ := newSimFlags(&cfg)
	args := []string{"--kv-events", "tcp://*:5557", "--kv-events-replay", "tcp://*:5558", "--kv-events-topic", "kv@h:8000@m",
		"--kv-events-format", "array", "--kv-events-flavor", "sglang", "--kv-events-rank", "2", "--kv-events-buffer", "7"}
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	want := sim.Config{KVEvents: "tcp://*:5557", KVEventsReplay: "tcp://*:5558", KVEventsTopic: "kv@h:8000@m",
		KVEventsFormat: sim.KVEventsArray, KVEventsFlavor: sim.KVEventsSGLang, KVEventsRank: 2, KVEventsBuffer: 7}
	got := sim.Config{KVEvents: cfg.KVEvents, KVEventsReplay: cfg.KVEventsReplay, KVEventsTopic: cfg.KVEventsTopic,
		KVEventsFormat: cfg.KVEventsFormat, KVEventsFlavor: cfg.KVEventsFlavor, KVEventsRank: cfg.KVEventsRank, KVEventsBuffer: cfg.KVEventsBuffer}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("flags set %+v, want %+v", got, want)
	}

	base := []string{"--listen", "127.0.0.1:0", "--engine-id", "k1", "--model", "m"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--kv-events-replay", "tcp://127.0.0.1:0"}, "need a KV events endpoint"},
		{[]string{"--kv-events", "ipc:///tmp/kv"}, "tcp://HOST:PORT"},
		{[]string{"--kv-events", "tcp://127.0.0.1:0", "--kv-events-connect", "tcp://127.0.0.1:1"}, "not both"},
		{[]string{"--kv-events", "tcp://127.0.0.1:0", "--kv-events-format", "json"}, "format"},
		{[]string{"--kv-events", "tcp://127.0.0.1:0", "--kv-events-flavor", "sglang", "--kv-events-format", "map"}, "tagged arrays"},
	} {
		err := runSim(context.Background(), append(append([]string(nil), base...), c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("narwhal sim %v: %v, want an error about %q", c.args, err, c.want)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := runSim(ctx, append(base, "--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0")); err != nil {
		t.Fatalf("narwhal sim --kv-events: %v", err)
	}
}
