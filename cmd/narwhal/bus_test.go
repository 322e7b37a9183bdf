package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// cmdTestBound bounds every wait of these tests: generous next to what the
// commands need (milliseconds), short enough that a hang fails quickly.
const cmdTestBound = 10 * time.Second

// runningCmd is a command run in-process by a test.
type runningCmd struct {
	stdout, stderr *testkit.LockedBuffer
	cancel         context.CancelFunc
	errc           chan error
	once           sync.Once
	err            error
}

// startCmd runs run(ctx, args, stdout, stderr) in a goroutine until stop.
func startCmd(t *testing.T, run func(context.Context, []string, io.Writer, io.Writer) error, args ...string) *runningCmd {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &runningCmd{stdout: &testkit.LockedBuffer{}, stderr: &testkit.LockedBuffer{}, cancel: cancel, errc: make(chan error, 1)}
	go func() { c.errc <- run(ctx, args, c.stdout, c.stderr) }()
	t.Cleanup(func() { c.stop(t) })
	return c
}

// waitStderr waits until stderr holds want, failing the test when the
// command ends first.
func (c *runningCmd) waitStderr(t *testing.T, want string) {
	t.Helper()
	testkit.WaitFor(t, cmdTestBound, "stderr "+strconv.Quote(want), func() bool {
		select {
		case err := <-c.errc:
			c.errc <- err
			t.Fatalf("command ended early: %v\nstderr: %s", err, c.stderr)
		default:
		}
		return strings.Contains(c.stderr.String(), want)
	})
}

// stop cancels the command's context, as SIGINT does, and returns what it
// returned, failing the test when it does not return within cmdTestBound.
func (c *runningCmd) stop(t *testing.T) error {
	t.Helper()
	c.once.Do(func() {
		c.cancel()
		select {
		case c.err = <-c.errc:
		case <-time.After(cmdTestBound):
			t.Fatalf("command did not stop within %v after cancel", cmdTestBound)
		}
	})
	return c.err
}

// busLine is the line `narwhal bus` prints when it serves.
var busLine = regexp.MustCompile(`^bus listening on (nats://127\.0\.0\.1:[0-9]+) \(data (.+)\)$`)

// startBusCmd runs `narwhal bus --listen 127.0.0.1:0 --data data` and
// returns it with the URL its line names.
func startBusCmd(t *testing.T, data string) (*runningCmd, string) {
	t.Helper()
	c := startCmd(t, runBus, "--listen", "127.0.0.1:0", "--data", data)
	var m []string
	testkit.WaitFor(t, cmdTestBound, "the bus listening line", func() bool {
		select {
		case err := <-c.errc:
			c.errc <- err
			t.Fatalf("narwhal bus ended early: %v\nstderr: %s", err, c.stderr)
		default:
		}
		if lines := c.stdout.Lines(); len(lines) > 0 {
			if m = busLine.FindStringSubmatch(lines[0]); m == nil {
				t.Fatalf("narwhal bus printed %q", lines[0])
			}
			return true
		}
		return false
	})
	if want, _ := filepath.Abs(data); m[2] != want {
		t.Errorf("line names data %q, want %q", m[2], want)
	}
	return c, m[1]
}

// natsClient connects a plain NATS client — not bus.Connect, which would
// set up the stream and the bucket itself — and closes it when the test
// ends.
func natsClient(t *testing.T, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// TestBusCommandKeepsStoreAcrossRestart proves R-BUS-4 and R-BUS-7 for
// `narwhal bus`: it serves NATS with JetStream on the port its line names,
// has set up stream NARWHAL_EVENTS (file storage, 24 h, 1 GiB, 2 min
// duplicate window) and bucket narwhal_placement before printing it, stops
// cleanly on cancel (SIGINT), and a restart on the same --data keeps the
// stream (same creation time), its events and the bucket's keys.
func TestBusCommandKeepsStoreAcrossRestart(t *testing.T) {
	testkit.CheckLeaks(t)
	data := filepath.Join(t.TempDir(), "store") // runBus creates it
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()

	first, url := startBusCmd(t, data)
	nc, js := natsClient(t, url)
	stream, err := js.Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatalf("stream set up by narwhal bus: %v", err)
	}
	info := stream.CachedInfo()
	if cfg := info.Config; len(cfg.Subjects) != 1 || cfg.Subjects[0] != "narwhal.events.>" ||
		cfg.Storage != jetstream.FileStorage || cfg.MaxAge != 24*time.Hour || cfg.MaxBytes != 1<<30 ||
		cfg.Duplicates != bus.StreamDuplicates {
		t.Errorf("stream config %+v", cfg)
	}
	kv, err := js.KeyValue(ctx, bus.PlacementBucket)
	if err != nil {
		t.Fatalf("bucket set up by narwhal bus: %v", err)
	}

	ev := testFailure("d1", "kept-1")
	payload, err := json.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	if err := bus.ValidateEvent(payload); err != nil {
		t.Fatal(err)
	}
	ack, err := js.Publish(ctx, ev.Subject(), payload, jetstream.WithMsgID(ev.ID))
	if err != nil {
		t.Fatal(err)
	}
	placement := []byte(`{"schema":"narwhal.eligibility.v1","eligible":false,"state":"ejected","streak":3}`)
	if _, err := kv.Put(ctx, "d1", placement); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	if err := first.stop(t); err != nil {
		t.Fatalf("narwhal bus returned %v on cancel, want nil", err)
	}

	_, url2 := startBusCmd(t, data)
	_, js2 := natsClient(t, url2)
	stream2, err := js2.Stream(ctx, bus.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	if got := stream2.CachedInfo().Created; !got.Equal(info.Created) {
		t.Errorf("stream created %v after restart, was %v: recreated", got, info.Created)
	}
	msg, err := stream2.GetMsg(ctx, ack.Sequence)
	if err != nil || !bytes.Equal(msg.Data, payload) || msg.Subject != ev.Subject() {
		t.Errorf("event after restart: %v %v", msg, err)
	}
	kv2, err := js2.KeyValue(ctx, bus.PlacementBucket)
	if err != nil {
		t.Fatal(err)
	}
	entry, err := kv2.Get(ctx, "d1")
	if err != nil || !bytes.Equal(entry.Value(), placement) {
		t.Errorf("placement key after restart: %v", err)
	}
	// The duplicate window survives too: the same event id is not stored
	// twice (R-BUS-3).
	again, err := js2.Publish(ctx, ev.Subject(), payload, jetstream.WithMsgID(ev.ID))
	if err != nil || !again.Duplicate {
		t.Errorf("re-published event after restart: %+v %v, want a duplicate", again, err)
	}
}

// TestBusCommandFlags checks `narwhal bus`'s flag errors and --listen
// reading.
func TestBusCommandFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--listen", "4222"},
		{"--listen", "127.0.0.1:99999"},
		{"--data", ""},
		{"extra"},
	} {
		if err := runBus(context.Background(), args, io.Discard, io.Discard); err == nil {
			t.Errorf("runBus %q: no error", args)
		}
	}
	for _, c := range []struct {
		listen string
		host   string
		port   int
	}{
		{"127.0.0.1:4222", "127.0.0.1", 4222},
		{"127.0.0.1:0", "127.0.0.1", -1},
		{":4222", "0.0.0.0", 4222},
		{"[::1]:4300", "::1", 4300},
	} {
		host, port, err := parseListen(c.listen)
		if err != nil || host != c.host || port != c.port {
			t.Errorf("parseListen(%q) = %q %d %v, want %q %d", c.listen, host, port, err, c.host, c.port)
		}
	}
}

// TestBusCommandBusyPortFailsAtOnce proves that `narwhal bus` on a port
// another process holds fails at once, naming the address in use and the
// flag that changes it (--listen for the client port, --cluster for the
// cluster's).
func TestBusCommandBusyPortFailsAtOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	taken := ln.Addr().String()
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"--listen", taken}, "--listen"},
		{[]string{"--listen", "127.0.0.1:0", "--name", "a", "--cluster", taken, "--routes", "nats://127.0.0.1:1"}, "--cluster"},
	} {
		start := time.Now()
		var stderr testkit.LockedBuffer
		err := runBus(context.Background(), append(c.args, "--data", t.TempDir()), io.Discard, &stderr)
		if d := time.Since(start); d > 3*time.Second {
			t.Errorf("%q: failed after %v, want at once", c.args, d)
		}
		if err == nil || !strings.Contains(err.Error(), taken+": the address is already in use") ||
			!strings.Contains(err.Error(), "choose another with "+c.flag+" HOST:PORT") {
			t.Errorf("%q: error %v, want one naming %s in use and %s", c.args, err, taken, c.flag)
		}
	}
}

// TestRedactNATSURL checks that messages never show a NATS password or
// token.
func TestRedactNATSURL(t *testing.T) {
	got := redactNATSURL("nats://u:secret@h1:4222,nats://tok@h2:4222,nats://h3:4222")
	if strings.Contains(got, "secret") || strings.Contains(got, "tok@") ||
		got != "nats://u:xxxxx@h1:4222,nats://xxxxx@h2:4222,nats://h3:4222" {
		t.Errorf("redactNATSURL = %q", got)
	}
}

// testFailure is bustest.SampleFailure (a decode first-token timeout of
// engine on router rt-1) at the present time.
func testFailure(engine, id string) *schemas.Failure {
	f := bustest.SampleFailure(engine, id)
	f.At = time.Now().UTC()
	return f
}
