package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// chaosTestBus starts an embedded NATS server on a free TCP port, points
// NARWHAL_NATS_URL at it for the test, and collects the chaos events
// published on it (each validated against its schema).
func chaosTestBus(t *testing.T) *chaosEvents {
	t.Helper()
	emb := bustest.Start(t)
	t.Setenv("NARWHAL_NATS_URL", emb.ClientURL())
	nc, err := nats.Connect(emb.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	ev := &chaosEvents{}
	if _, err := nc.Subscribe("narwhal.events.chaos.>", func(m *nats.Msg) {
		var c schemas.Chaos
		err := bus.ValidateEvent(m.Data)
		if err == nil {
			err = json.Unmarshal(m.Data, &c)
		}
		ev.mu.Lock()
		defer ev.mu.Unlock()
		if err != nil {
			ev.invalid = append(ev.invalid, err.Error())
			return
		}
		ev.list = append(ev.list, c)
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return ev
}

// chaosEvents are the chaos events seen on a test bus.
type chaosEvents struct {
	mu      sync.Mutex
	list    []schemas.Chaos
	invalid []string
}

// wait waits for n events and returns them as "action engine/fault_id".
func (e *chaosEvents) wait(t *testing.T, n int) []string {
	t.Helper()
	var got []schemas.Chaos
	testkit.WaitFor(t, cmdTestBound, fmt.Sprintf("%d chaos events", n), func() bool {
		e.mu.Lock()
		got = append(got[:0], e.list...)
		invalid := e.invalid
		e.mu.Unlock()
		if len(invalid) > 0 {
			t.Fatalf("invalid chaos events: %v", invalid)
		}
		return len(got) >= n
	})
	out := make([]string, len(got))
	for i, ev := range got {
		out[i] = ev.Action + " " + ev.EngineID + "/" + ev.FaultID
	}
	return out
}

// chaosCmd runs `narwhal chaos args…` in-process and returns its stdout.
func chaosCmd(t *testing.T, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()
	var stdout, stderr bytes.Buffer
	err := runChaos(ctx, args, &stdout, &stderr)
	return stdout.String(), err
}

// mustChaos is chaosCmd for a command that must succeed.
func mustChaos(t *testing.T, args ...string) string {
	t.Helper()
	out, err := chaosCmd(t, args...)
	if err != nil {
		t.Fatalf("narwhal chaos %s: %v", strings.Join(args, " "), err)
	}
	return out
}

// TestChaosArmListDisarm proves the arm, list and disarm round trip of
// `narwhal chaos` over NARWHAL_NATS_URL (R-CHAOS-1): what arm stores, list
// shows as a table, disarm removes; each change is an event on
// narwhal.events.chaos.<engine_id>.
func TestChaosArmListDisarm(t *testing.T) {
	testkit.CheckLeaks(t)
	events := chaosTestBus(t)

	if out := mustChaos(t, "list"); out != "no faults armed\n" {
		t.Errorf("empty list: %q", out)
	}
	out := mustChaos(t, "arm", "--engine", "decode-1", "--fault", "http-status", "--param", "code=503", "--count", "2", "--for", "1m")
	if !regexp.MustCompile(`^armed decode-1/http-status phase=any prob=1 count=2 left=2 code=503 expires=\S+Z\n$`).MatchString(out) {
		t.Errorf("arm printed %q", out)
	}
	mustChaos(t, "arm", "--engine", "prefill-1", "--fault", "first-token-delay", "--id", "slow", "--phase", "decode",
		"--prob", "0.25", "--param", "delay_ms=100", "--for", "30m")

	out = mustChaos(t, "list")
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != 3 {
		t.Fatalf("list: %q", out)
	}
	header := strings.Fields(lines[0])
	if strings.Join(header, " ") != "ENGINE FAULT PHASE PROB COUNT LEFT EXPIRES PARAMS" {
		t.Errorf("header %q", lines[0])
	}
	for i, want := range []*regexp.Regexp{
		regexp.MustCompile(`^decode-1\s+http-status\s+any\s+1\s+2 of 2\s+\S+Z \(in 1m0s\)\s+code=503$`),
		regexp.MustCompile(`^prefill-1\s+first-token-delay \(id slow\)\s+decode\s+0\.25\s+unlimited\s+\S+Z \(in (30m0s|29m59s)\)\s+delay_ms=100$`),
	} {
		if !want.MatchString(lines[i+1]) {
			t.Errorf("row %d %q, want %s", i+1, lines[i+1], want)
		}
	}
	if out := mustChaos(t, "list", "--engine", "prefill-1"); strings.Count(out, "\n") != 2 || !strings.Contains(out, "prefill-1") {
		t.Errorf("list --engine prefill-1: %q", out)
	}

	if out := mustChaos(t, "disarm", "--engine", "decode-1"); !strings.HasPrefix(out, "disarmed decode-1/http-status ") || strings.Count(out, "\n") != 1 {
		t.Errorf("disarm --engine: %q", out)
	}
	if out := mustChaos(t, "list"); strings.Contains(out, "decode-1") || !strings.Contains(out, "prefill-1") {
		t.Errorf("list after disarm: %q", out)
	}
	if out := mustChaos(t, "disarm", "--all"); !strings.HasPrefix(out, "disarmed prefill-1/first-token-delay (id slow) ") {
		t.Errorf("disarm --all: %q", out)
	}
	if out := mustChaos(t, "list"); out != "no faults armed\n" {
		t.Errorf("list after disarm --all: %q", out)
	}
	if out := mustChaos(t, "disarm", "--all"); out != "nothing armed\n" {
		t.Errorf("second disarm --all: %q", out)
	}
	got := events.wait(t, 4)
	want := []string{"arm decode-1/http-status", "arm prefill-1/slow", "disarm decode-1/http-status", "disarm prefill-1/slow"}
	if strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Errorf("events %v, want %v", got, want)
	}
}

// TestChaosCommandErrors proves bad invocations fail with a message and
// touch nothing.
func TestChaosCommandErrors(t *testing.T) {
	testkit.CheckLeaks(t)
	chaosTestBus(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "subcommand is required"},
		{[]string{"explode"}, `unknown subcommand "explode"`},
		{[]string{"arm", "--fault", "http-status"}, "--engine and --fault are required"},
		{[]string{"arm", "--engine", "d1", "--fault", "meteor"}, `unknown fault "meteor"`},
		{[]string{"arm", "--engine", "d1", "--fault", "trickle"}, "delay_ms is required"},
		{[]string{"arm", "--engine", "d1", "--fault", "http-status", "--param", "code"}, "want KEY=VALUE"},
		{[]string{"arm", "--engine", "d1", "--fault", "http-status", "--prob", "3"}, "probability"},
		{[]string{"arm", "--engine", "d1", "--fault", "http-status", "--for", "0s"}, "--for must be > 0"},
		{[]string{"arm", "--engine", "d.1", "--fault", "http-status"}, "engine id"},
		{[]string{"disarm"}, "want one of --engine ID and --all"},
		{[]string{"disarm", "--all", "--engine", "d1"}, "want one of --engine ID and --all"},
		{[]string{"disarm", "--all", "--id", "x"}, "--id needs --engine"},
		{[]string{"list", "extra"}, "unexpected arguments"},
		{[]string{"run"}, "want one scenario FILE"},
		{[]string{"run", filepath.Join(t.TempDir(), "missing.yaml")}, "no such file"},
		{[]string{"proxy", "--target", "http://127.0.0.1:1"}, "--target and --engine-id are required"},
		{[]string{"proxy", "--target", "ftp://x", "--engine-id", "d1"}, "want an http:// or https:// base URL"},
	} {
		if _, err := chaosCmd(t, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("narwhal chaos %s: %v, want an error containing %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
	if out := mustChaos(t, "list"); out != "no faults armed\n" {
		t.Errorf("a failed command armed something: %q", out)
	}
}

// TestChaosUnreachableBus proves the commands give up after
// --connect-timeout when the bus is not there.
func TestChaosUnreachableBus(t *testing.T) {
	testkit.CheckLeaks(t)
	t.Setenv("NARWHAL_NATS_URL", "nats://127.0.0.1:1")
	start := time.Now()
	_, err := chaosCmd(t, "list", "--connect-timeout", "300ms")
	if err == nil || !strings.Contains(err.Error(), "bus nats://127.0.0.1:1") {
		t.Errorf("error %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("gave up after %v", d)
	}
}

// TestChaosProxyCommand proves `narwhal chaos proxy`: it serves a chaos
// proxy for its engine, applies what `narwhal chaos arm` arms, publishes
// the injection, and stops cleanly on cancel (SIGINT).
func TestChaosProxyCommand(t *testing.T) {
	testkit.CheckLeaks(t)
	events := chaosTestBus(t)
	simURL := simtest.Start(t, sim.Config{EngineID: "decode-1", Model: "m"}).URL()

	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stdout := &testkit.LockedBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- runChaos(ctx, []string{"proxy", "--target", simURL, "--engine-id", "decode-1", "--listen", "127.0.0.1:0"}, stdout, io.Discard)
	}()
	line := regexp.MustCompile(`^chaos proxy decode-1 listening on (http://127\.0\.0\.1:[0-9]+) -> ` + regexp.QuoteMeta(simURL) + "\n$")
	var proxyURL string
	testkit.WaitFor(t, cmdTestBound, "the proxy's listening line", func() bool {
		if m := line.FindStringSubmatch(stdout.String()); m != nil {
			proxyURL = m[1]
		}
		return proxyURL != ""
	})

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: cmdTestBound}
	status := func() int {
		req, _ := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`))
		req.Header.Set("X-Request-Id", "cli-1")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := status(); got != 200 {
		t.Errorf("nothing armed: HTTP %d", got)
	}
	mustChaos(t, "arm", "--engine", "decode-1", "--fault", "http-status", "--param", "code=429", "--count", "1")
	testkit.WaitFor(t, cmdTestBound, "the armed fault to strike", func() bool { return status() == 429 })
	if got := status(); got != 200 {
		t.Errorf("after the count: HTTP %d", got)
	}
	// The arm and the injection come from two publishers (the CLI's and the
	// proxy's): the stream orders them by arrival, which nothing fixes.
	if got := events.wait(t, 2); !(slices.Contains(got, "arm decode-1/http-status") && slices.Contains(got, "inject decode-1/http-status")) {
		t.Errorf("events %v", got)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("proxy returned %v", err)
		}
	case <-time.After(cmdTestBound):
		t.Fatal("proxy did not stop")
	}
}

// TestChaosRunCommand proves `narwhal chaos run FILE`: it prints the
// scenario, each step as it runs, and its end.
func TestChaosRunCommand(t *testing.T) {
	testkit.CheckLeaks(t)
	events := chaosTestBus(t)
	file := filepath.Join(t.TempDir(), "scenario.yaml")
	if err := os.WriteFile(file, []byte(`steps:
  - at: 0s
    arm: {engine: decode-1, fault: first-token-delay, phase: decode, params: {delay_ms: 5000}, for: 30s}
  - at: 150ms
    disarm: {engine: decode-1}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	out := mustChaos(t, "run", file, "--until", "200ms")
	want := regexp.MustCompile(`^scenario \S+scenario.yaml: 2 steps
\+0\.0[0-9]{2}s arm decode-1/first-token-delay phase=decode prob=1 count=unlimited delay_ms=5000 expires=\S+Z
\+0\.(1[5-9]|[2-9][0-9])[0-9]s disarm decode-1: decode-1/first-token-delay
scenario done
$`)
	if !want.MatchString(out) {
		t.Errorf("run printed:\n%s", out)
	}
	if got := events.wait(t, 2); strings.Join(got, ", ") != "arm decode-1/first-token-delay, disarm decode-1/first-token-delay" {
		t.Errorf("events %v", got)
	}
}

// TestDevBus proves the bus of `narwhal dev`: without --chaos it listens
// on TCP and the configuration's bus.url names it (for the router, as the
// banner does for `narwhal events` and `narwhal chaos` in another
// terminal), runs the dev breaker and opens no fault store; with --chaos
// (enableChaos) each simulator gets a proxy that applies what the CLI
// arms, and the banner says how to arm, every command spelled one way;
// closing stops it all without touching the environment.
func TestDevBus(t *testing.T) {
	testkit.CheckLeaks(t)
	t.Setenv("NARWHAL_NATS_URL", "")
	os.Unsetenv("NARWHAL_NATS_URL")
	t.Setenv("NARWHAL_DATA_DIR", t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer cancel()
	log := slog.New(slog.DiscardHandler)
	cfg, err := config.Parse(nil)
	if err != nil {
		t.Fatal(err)
	}
	db, err := startDevBus(ctx, cfg, log, -1)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			db.close()
		}
	}()
	url := cfg.Bus.URL
	if !regexp.MustCompile(`^nats://127\.0\.0\.1:[0-9]+$`).MatchString(url) {
		t.Fatalf("bus.url %q", url)
	}
	if v, ok := os.LookupEnv("NARWHAL_NATS_URL"); ok {
		t.Fatalf("NARWHAL_NATS_URL set to %q", v)
	}
	simURL := simtest.Start(t, sim.Config{EngineID: "decode-1", Model: "m"}).URL()

	// Without --chaos: the breaker runs (the leak check proves close
	// stopped it), no fault store is open, the banner has no chaos part.
	cfg.Fleet = []config.EngineSpec{{ID: "decode-1", URL: simURL, Role: connector.RoleBoth, Connector: connector.DefaultName}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := db.startBreaker(ctx, cfg, log); err != nil {
		t.Fatal(err)
	}
	if db.chaos != nil {
		t.Error("dev without --chaos opened the fault store")
	}
	// Its metrics are on the registry the dev router serves.
	mfs, err := db.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
	}
	for _, want := range []string{"narwhal_breaker_leader", "narwhal_breaker_events_total", "narwhal_breaker_probes_total"} {
		if !slices.Contains(names, want) {
			t.Errorf("the dev router's registry lacks the dev breaker's %s (has %v)", want, names)
		}
	}
	var banner bytes.Buffer
	writeDevBanner(&banner, "http://127.0.0.1:8080", "narwhal", db, config.Auth{})
	if strings.Contains(banner.String(), "chaos") || !strings.Contains(banner.String(), "\nNARWHAL_NATS_URL="+url+" narwhal events\n") {
		t.Errorf("banner without --chaos:\n%s", banner.String())
	}

	// With --chaos.
	if err := db.enableChaos(ctx); err != nil {
		t.Fatal(err)
	}
	proxyURL, err := db.front(ctx, "decode-1", simURL, log)
	if err != nil {
		t.Fatal(err)
	}
	banner.Reset()
	writeDevBanner(&banner, "http://127.0.0.1:8080", "go run ./cmd/narwhal", db, config.Auth{})
	for _, want := range []string{"export NARWHAL_NATS_URL=" + url, "\ngo run ./cmd/narwhal chaos arm --engine decode-1 --fault http-status --param code=503\n",
		"\nNARWHAL_NATS_URL=" + url + " go run ./cmd/narwhal events\n", proxyURL + " -> " + simURL} {
		if !strings.Contains(banner.String(), want) {
			t.Errorf("banner lacks %q:\n%s", want, banner.String())
		}
	}
	if n, m := strings.Count(banner.String(), "narwhal chaos "), strings.Count(banner.String(), "go run ./cmd/narwhal chaos "); n != m || n != 3 {
		t.Errorf("banner spells narwhal two ways (%d chaos commands, %d with go run):\n%s", n, m, banner.String())
	}
	t.Setenv("NARWHAL_NATS_URL", url) // as the banner says
	mustChaos(t, "arm", "--engine", "decode-1", "--fault", "http-status", "--param", "code=503")
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	testkit.WaitFor(t, cmdTestBound, "the armed 503", func() bool {
		resp, err := (&http.Client{Transport: tr}).Post(proxyURL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi","max_tokens":1}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode == 503
	})
	db.close()
	closed = true
}

// TestSpellSelf checks how the dev banner spells the binary: as `go run`
// built it, or as it was started.
func TestSpellSelf(t *testing.T) {
	for _, c := range []struct{ exe, arg0, want string }{
		{"/tmp/go-build1234567/b001/exe/narwhal", "/tmp/go-build1234567/b001/exe/narwhal", "go run ./cmd/narwhal"},
		{"/usr/local/bin/narwhal", "narwhal", "narwhal"},
		{"/home/u/narwhal/bin/narwhal", "./bin/narwhal", "./bin/narwhal"},
		{"/home/u/go-builds/narwhal", "narwhal", "narwhal"},
		// A second `go run` runs the executable it cached in GOCACHE.
		{"/root/.cache/go-build/96/966fe088ee019be9da354c600d1d3b5a8d11f919bb200635a89fb55094e0b79d-d/narwhal",
			"/root/.cache/go-build/96/966fe088ee019be9da354c600d1d3b5a8d11f919bb200635a89fb55094e0b79d-d/narwhal", "go run ./cmd/narwhal"},
		{"/opt/96/not-a-hash-d/narwhal", "narwhal", "narwhal"},
	} {
		if got := spellSelf(c.exe, c.arg0); got != c.want {
			t.Errorf("spellSelf(%q, %q) = %q, want %q", c.exe, c.arg0, got, c.want)
		}
	}
}

// TestChaosArmWarnsWhenNoProxyServes proves that `narwhal chaos arm` for an
// engine no chaos proxy serves still arms the fault (a proxy started later
// loads it) but warns on stderr, naming the engines the proxies on the bus
// do serve; arming for a served engine prints no warning.
func TestChaosArmWarnsWhenNoProxyServes(t *testing.T) {
	testkit.CheckLeaks(t)
	chaosTestBus(t)
	armed := func(engine string) (stdout, stderr string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), cmdTestBound)
		defer cancel()
		var out, errOut bytes.Buffer
		if err := runChaos(ctx, []string{"arm", "--engine", engine, "--fault", "http-status"}, &out, &errOut); err != nil {
			t.Fatalf("arm %s: %v", engine, err)
		}
		return out.String(), errOut.String()
	}

	// No proxy at all.
	out, warn := armed("decode-9")
	if !strings.HasPrefix(out, "armed decode-9/http-status ") || !strings.Contains(warn, "warning: no chaos proxy serves engine decode-9") || !strings.Contains(warn, "no chaos proxy answered") {
		t.Errorf("no proxy: stdout %q, stderr %q", out, warn)
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	for _, id := range []string{"decode-2", "decode-1"} {
		stdout := &testkit.LockedBuffer{}
		go func() {
			done <- runChaos(ctx, []string{"proxy", "--target", "http://127.0.0.1:1", "--engine-id", id, "--listen", "127.0.0.1:0"}, stdout, io.Discard)
		}()
		testkit.WaitFor(t, cmdTestBound, "proxy "+id+" listening", func() bool { return strings.Contains(stdout.String(), "listening") })
	}
	defer func() {
		cancel()
		for range 2 {
			if err := <-done; err != nil {
				t.Errorf("proxy: %v", err)
			}
		}
	}()

	out, warn = armed("decode-9")
	if !strings.HasPrefix(out, "armed decode-9/http-status ") || !strings.Contains(warn, "warning: no chaos proxy serves engine decode-9 (proxies serve decode-1, decode-2)") {
		t.Errorf("two proxies, another engine: stdout %q, stderr %q", out, warn)
	}
	if out, warn = armed("decode-1"); !strings.HasPrefix(out, "armed decode-1/http-status ") || warn != "" {
		t.Errorf("a served engine: stdout %q, stderr %q", out, warn)
	}
	if list := mustChaos(t, "list"); !strings.Contains(list, "decode-9") || !strings.Contains(list, "decode-1") {
		t.Errorf("not armed:\n%s", list)
	}

	// A scenario warns once per unserved engine it arms, before its steps.
	file := filepath.Join(t.TempDir(), "scenario.yaml")
	if err := os.WriteFile(file, []byte(`steps:
  - {at: 0s, arm: {engine: decode-7, fault: http-status}}
  - {at: 0s, arm: {engine: decode-2, fault: http-status}}
  - {at: 0s, arm: {engine: decode-7, fault: trickle, params: {delay_ms: 5}}}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithTimeout(context.Background(), cmdTestBound)
	defer rcancel()
	var runOut, errOut bytes.Buffer
	if err := runChaos(rctx, []string{"run", file}, &runOut, &errOut); err != nil {
		t.Fatal(err)
	}
	if want := "warning: no chaos proxy serves engine decode-7 (proxies serve decode-1, decode-2); the fault strikes once a proxy for it starts\n"; errOut.String() != want {
		t.Errorf("run's warnings %q, want %q", errOut.String(), want)
	}
}
