package main

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCheckArgsAcceptsWithoutStarting proves the hidden --check-args of
// behaviour.md §14's long-running commands: accepted flags, environment and
// configuration exit 0 without connecting or listening. Each case is built
// so that a real start could not return 0 at once: the listen port is
// taken (a start fails), or the bus and engine are unreachable (a start
// waits for ever), or the data directory would be created.
func TestCheckArgsAcceptsWithoutStarting(t *testing.T) {
	dir := t.TempDir()
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadURL := "nats://" + dead.Addr().String()
	dead.Close() // nothing listens there now
	cfg := filepath.Join(dir, "mesh.yaml")
	if err := os.WriteFile(cfg, []byte("engine:\n  first_token_timeout_s: 2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	auth := filepath.Join(dir, "auth")
	if err := os.MkdirAll(auth, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(auth, "auth.conf"), []byte("# server side\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("NARWHAL_NATS_URL", deadURL)
	data := filepath.Join(dir, "never-created")
	for _, args := range [][]string{
		{"router", "--check-args", "--config", cfg, "--listen", taken.Addr().String()},
		{"breaker", "--config", cfg, "--metrics", taken.Addr().String(), "--check-args"},
		{"dashboard", "--check-args", "--listen", taken.Addr().String(), "--config", cfg},
		{"agent", "--check-args", "--engine-url", "http://" + taken.Addr().String(), "--id", "p-0", "--role", "prefill", "--drained-file", filepath.Join(dir, "drained")},
		{"bus", "--check-args", "--listen", taken.Addr().String(), "--data", data, "--auth", auth,
			"--name", "bus-0", "--cluster", "127.0.0.1:0", "--routes", "nats://bus-1:6222,nats://bus-2:6222", "--config", cfg},
	} {
		var stderr bytes.Buffer
		if code := run(args, &stderr); code != 0 {
			t.Errorf("%q: exit %d, want 0: %s", args, code, stderr.String())
		}
	}
	if _, err := os.Stat(data); !os.IsNotExist(err) {
		t.Errorf("bus --check-args touched --data: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "drained")); !os.IsNotExist(err) {
		t.Errorf("agent --check-args wrote --drained-file: %v", err)
	}
}

// TestCheckArgsRefusesWithExit2 proves that --check-args reports what a
// real start would refuse — an unknown flag, a missing required flag, an
// invalid setting of the file or the environment (behaviour.md §11: the
// message names the key), a missing --auth DIR — with exit status 2 and a
// message, and that commands without it refuse it before doing anything.
func TestCheckArgsRefusesWithExit2(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("engine:\n  first_token_timeout_s: -3\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "good.yaml")
	if err := os.WriteFile(good, []byte("engine:\n  first_token_timeout_s: 2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	credsOut := filepath.Join(dir, "creds")
	cases := []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"router", "--check-args", "--config", good, "--no-such-flag"}, nil, "no-such-flag"},
		{[]string{"router", "--check-args"}, nil, "--config is required"},
		{[]string{"router", "--check-args", "--config", bad}, map[string]string{"NARWHAL_NATS_URL": "nats://x:4222"}, "first_token_timeout_s"},
		{[]string{"router", "--check-args", "--config", good}, map[string]string{"NARWHAL_NATS_URL": "nats://x:4222", "NARWHAL_ENGINE_FIRST_TOKEN_TIMEOUT_S": "soon"}, "FIRST_TOKEN_TIMEOUT"},
		{[]string{"router", "--check-args", "--config", filepath.Join(dir, "missing.yaml")}, nil, "missing.yaml"},
		{[]string{"breaker", "--check-args", "--config", good}, map[string]string{"NARWHAL_NATS_URL": ""}, "NARWHAL_NATS_URL"},
		{[]string{"agent", "--check-args", "--engine-url", "http://e:8000", "--role", "decode"}, nil, "--id"},
		{[]string{"agent", "--check-args", "--engine-url", "http://e:8000", "--id", "d-0", "--role", "decode", "--drain-timeout", "0s"}, nil, "--drain-timeout"},
		{[]string{"dashboard", "--check-args", "--connect-timeout", "-1s"}, nil, "--connect-timeout"},
		{[]string{"bus", "--check-args", "--routes", "nats://b:6222"}, nil, "--cluster"},
		{[]string{"bus", "--check-args", "--auth", filepath.Join(dir, "no-auth")}, nil, "--auth"},
		{[]string{"bus", "creds", "--check-args", "--out", credsOut}, nil, "not supported"},
		{[]string{"fleet", "list", "--check-args"}, nil, "not supported"},
	}
	for _, c := range cases {
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		stderr, restore := captureStderr(t)
		var buf bytes.Buffer
		code := run(c.args, &buf)
		msg := buf.String() + restore()
		if code != 2 || !strings.Contains(msg, c.want) {
			t.Errorf("%q: exit %d, message %q; want 2 naming %q", c.args, code, msg, c.want)
		}
		_ = stderr
		for k := range c.env {
			os.Unsetenv(k)
		}
	}
	if _, err := os.Stat(credsOut); !os.IsNotExist(err) {
		t.Errorf("bus creds --check-args wrote %s: %v", credsOut, err)
	}
}

// captureStderr redirects os.Stderr (where a flag set without its own
// output prints its parse error) to a pipe until restore, which returns
// what was written.
func captureStderr(t *testing.T) (*os.File, func() string) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stderr
	os.Stderr = w
	done := make(chan string)
	go func() {
		var b bytes.Buffer
		_, _ = b.ReadFrom(r)
		done <- b.String()
	}()
	return w, func() string {
		os.Stderr = old
		w.Close()
		s := <-done
		r.Close()
		return s
	}
}
