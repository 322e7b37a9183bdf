package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/nats-io/nats.go"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/prefix"
)

// TestAgentKVEventsBadFlags: the KV event flags are checked before
// anything touches the bus.
func TestAgentKVEventsBadFlags(t *testing.T) {
	base := []string{"--engine-url", "http://127.0.0.1:1", "--id", "d1", "--role", "decode"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--kv-events", "127.0.0.1:5557"}, "want tcp://HOST:PORT or ipc://PATH"},
		{[]string{"--kv-events", "64=tcp://h:1"}, "the rank before '=' must be 0…63"},
		{[]string{"--kv-events", "tcp://h:1", "--kv-events-bind", "0=tcp://127.0.0.1:2"}, "rank 0 has a publisher already"},
		{[]string{"--kv-events", "tcp://h:1", "--kv-events-replay", "1=tcp://h:2"}, "no --kv-events or --kv-events-bind of rank 1"},
		{[]string{"--kv-events-replay", "tcp://h:2"}, "need --kv-events or --kv-events-bind"},
		{[]string{"--kv-events", "tcp://h:1", "--kv-events-max-blocks", "0"}, "--kv-events-max-blocks must be >= 1"},
		{[]string{"--kv-events", "tcp://h:1", "--kv-events-checkpoint", "-1s"}, "--kv-events-checkpoint must be >= 0"},
		{[]string{"--kv-events-checkpoint", "5s"}, "need --kv-events or --kv-events-bind"},
		{[]string{"--kv-events", ""}, "empty value"},
	} {
		var out, errOut bytes.Buffer
		err := runAgent(context.Background(), append(append([]string(nil), base...), tc.args...), &out, &errOut)
		if err == nil || !strings.Contains(err.Error()+errOut.String(), tc.want) {
			t.Errorf("narwhal agent %v: %v, want %q", tc.args, err, tc.want)
		}
	}
}

// TestAgentKVEventsRPLACE4 (R-PLACE-4, R-BUS-11): `narwhal agent
// --kv-events-bind` on a bus that enforces credentials, with the engine's
// own credential: a publisher that connects out sends vLLM's events, a
// router receives the batch on narwhal.kv.<id>, and --metrics serves the
// agent's KV series.
func TestAgentKVEventsRPLACE4(t *testing.T) {
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Dir: t.TempDir(), Port: -1, AuthDir: dir})
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	t.Setenv("NARWHAL_NATS_CREDS", bustest.Identity(t, dir, bus.RoleEngine, "d7"))
	router := bustest.Connect(t, emb, bus.ConnectOptions{Name: "router-r1", Role: bus.RoleRouter, ID: "r1",
		CredsFile: bustest.Identity(t, dir, bus.RoleRouter, "r1")})
	got := make(chan []byte, 64)
	sub, err := router.Conn().Subscribe(bus.KVSubjectPrefix+"*", func(m *nats.Msg) {
		if m.Subject == bus.KVSubject("d7") {
			got <- m.Data
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()

	engine := simtestStart(t)
	kvEP, metricsAddr := "tcp://"+freeAddr(t), freeAddr(t)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var out, errOut testkit.LockedBuffer
	done := make(chan error, 1)
	go func() {
		done <- runAgent(ctx, []string{"--engine-url", engine, "--id", "d7", "--role", "decode", "--drain-timeout", "1s",
			"--kv-events-bind", kvEP, "--metrics", metricsAddr}, &out, &errOut)
	}()
	testkit.WaitFor(t, 10*time.Second, "the agent registered", func() bool { return strings.Contains(out.String(), "registered d7") })

	pub := zmq4.NewPub(context.Background())
	defer pub.Close()
	testkit.WaitFor(t, 10*time.Second, "the publisher connected to the agent", func() bool { return pub.Dial(kvEP) == nil })
	toks := make([]uint32, 16)
	for i := range toks {
		toks[i] = uint32(40 + i)
	}
	payload, err := msgpack.Marshal([]any{1.0, []any{[]any{"BlockStored", []any{7}, nil, toks, 16, nil, "GPU"}}, 0})
	if err != nil {
		t.Fatal(err)
	}
	want := prefix.AppendTokenKeys(nil, toks, 16, 0)[0]
	var seq uint64
	var data []byte
	// A subscription reaches a PUB a moment after it connects: send
	// until one arrives (each a new sequence, the same block again).
	testkit.WaitFor(t, 10*time.Second, "the router's batch", func() bool {
		var s [8]byte
		binary.BigEndian.PutUint64(s[:], seq)
		seq++
		_ = pub.Send(zmq4.NewMsgFrom([]byte("kv@d7"), s[:], payload))
		select {
		case data = <-got:
			return true
		case <-time.After(50 * time.Millisecond):
			return false
		}
	})
	h, ops, err := bus.ParseKVBatch(data)
	if err != nil {
		t.Fatal(err)
	}
	if string(h.EngineID) != "d7" || len(ops) == 0 || ops[0].Op != bus.KVStored || ops[0].Keys[0] != want {
		t.Fatalf("batch %+v %+v, want d7's stored key %x", h, ops, want)
	}
	resp, err := http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if !strings.Contains(string(body), `narwhal_agent_kv_events_total{outcome="applied",rank="0"}`) {
		t.Fatalf("/metrics has no applied KV events:\n%s", body)
	}
	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the agent: %v\n%s", err, errOut.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not stop")
	}
}

// simtestStart starts a decode simulator d7 and returns its URL.
func simtestStart(t *testing.T) string {
	t.Helper()
	engine, err := sim.New(sim.Config{Role: sim.RoleDecode, EngineID: "d7", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	ln := simtestListener(t)
	if _, err := engine.Start(ln); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = engine.Close() })
	return "http://" + ln
}
