package router

import (
	"log/slog"
	"testing"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestServeUnreadyWhyChanges proves that the stand-in says what the
// process waits for at the time of each request: "bus unreachable" first,
// then, once the bus answers but is not set up, the missing stream and the
// command that creates it (docs/mesh.md, "Start-up: what a process waits
// for").
func TestServeUnreadyWhyChanges(t *testing.T) {
	testkit.CheckLeaks(t)
	ln, base, client := unreadyListener(t)

	why := NewUnreadyWhy("bus unreachable")
	stop := ServeUnreadyWhy(ln, config.Server{}, why, slog.New(slog.DiscardHandler), &UnreadyAnswers{})
	defer stop()
	checkUnready(t, client, base, "bus unreachable")
	const missing = "stream NARWHAL_EVENTS does not exist: run narwhal bus setup"
	why.Set(missing)
	if why.String() != missing {
		t.Fatalf("String() = %q after Set(%q)", why.String(), missing)
	}
	checkUnready(t, client, base, missing)
}
