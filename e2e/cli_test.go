package e2e

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCLIErrorsOnce runs the real binary with bad input and checks that
// each failure is said once, in the command's own words: the flag
// package's message after an unknown flag is not repeated by the binary
// (exit status 2, as for any usage error) and the usage names the command
// as typed ("Usage of narwhal router:"); a failed preflight says so on its
// last line only (exit 1); and a chaos error does not repeat the command's
// prefix ("narwhal chaos: chaos: …").
func TestCLIErrorsOnce(t *testing.T) {
	for _, args := range [][]string{
		{"dev", "--bogus"},
		{"router", "--bogus"},
		{"breaker", "--bogus"},
		{"bus", "--bogus"},
		{"bus", "setup", "--bogus"},
		{"sim", "--bogus"},
		{"events", "--bogus"},
		{"dashboard", "--bogus"},
		{"preflight", "--bogus"},
		{"bench", "--bogus"},
		{"chaos", "arm", "--bogus"},
		{"chaos", "list", "--bogus"},
		{"chaos", "disarm", "--bogus"},
		{"chaos", "run", "--bogus"},
		{"chaos", "proxy", "--bogus"},
	} {
		out, code := runNarwhal(t, args...)
		if n := strings.Count(out, "flag provided but not defined: -bogus"); n != 1 || code != 2 {
			t.Errorf("narwhal %s: exit %d, the flag error %d times, want exit 2 and once:\n%s", strings.Join(args, " "), code, n, out)
		}
		// The usage names the command as it is typed.
		cmd := "narwhal " + strings.Join(args[:len(args)-1], " ")
		if !strings.Contains(out, "Usage of "+cmd+":") && !strings.Contains(out, "usage: "+cmd+" ") {
			t.Errorf("%s --bogus: the usage does not name %q:\n%s", cmd, cmd, out)
		}
	}

	// A fleet whose only engine refuses connections.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	cfg := filepath.Join(t.TempDir(), "narwhal.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("engine:\n  first_token_timeout_s: 1\nfleet:\n  - {id: b1, url: 'http://%s', role: both}\n", addr)), 0o600); err != nil {
		t.Fatal(err)
	}
	out, code := runNarwhal(t, "preflight", "--config", cfg)
	if n := strings.Count(strings.ToLower(out), "preflight failed"); n != 1 || code != 1 || !strings.Contains(out, "preflight FAILED: engine b1, b1 -> b1\n") {
		t.Errorf("failed preflight: exit %d, said %d times, want exit 1 and once:\n%s", code, n, out)
	}

	scenario := filepath.Join(t.TempDir(), "scenario.yaml")
	if err := os.WriteFile(scenario, []byte("steps: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, code = runNarwhal(t, "chaos", "run", scenario)
	if code != 1 || strings.Contains(out, "chaos: chaos:") || !strings.Contains(out, "narwhal chaos: scenario: no steps") {
		t.Errorf("chaos run with no steps: exit %d:\n%s", code, out)
	}
}
