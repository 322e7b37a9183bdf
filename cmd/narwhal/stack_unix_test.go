//go:build unix

package main

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestRouterRefusesMaxConnectionsBeforeTheBusRFAIL9 proves that a
// server.max_connections the descriptor limit cannot hold (behaviour.md
// R-API-7, R-FAIL-9) is refused at once, with the arithmetic, even while
// the bus is not there: the router does not first wait for the bus (for
// ever, by default) answering 503 "bus unreachable" with the real
// problem unsaid.
func TestRouterRefusesMaxConnectionsBeforeTheBusRFAIL9(t *testing.T) {
	testkit.CheckLeaks(t)
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		t.Fatal(err)
	}
	path, _ := preflightFleet(t, [][2]string{{"p1", "prefill"}, {"d1", "decode"}})
	t.Setenv("NARWHAL_NATS_URL", "nats://127.0.0.1:"+strconv.Itoa(freeTCPPort(t)))
	t.Setenv("NARWHAL_SERVER_MAX_CONNECTIONS", strconv.FormatUint((l.Cur-config.DescriptorRoom)/config.DescriptorsPerConnection+1, 10))
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = runRouter(ctx, cfg, "127.0.0.1:0", slog.New(slog.DiscardHandler), nil)
	if ctx.Err() != nil {
		t.Fatalf("runRouter waited for the bus (%v) instead of refusing server.max_connections %d under a limit of %d", err, cfg.Server.MaxConnections, l.Cur)
	}
	if err == nil || !strings.Contains(err.Error(), "leaves no descriptors for engine legs") {
		t.Fatalf("runRouter: %v, want the refusal of server.max_connections with its arithmetic", err)
	}
}
