package meshview

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
)

// failingClient is an HTTP client whose every dial fails as net.Dialer
// does when the socket call returns errno.
func failingClient(call string, errno syscall.Errno) *http.Client {
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError(call, errno)}
	}}}
}

// TestRouterOutOfDescriptorsKeepsEngineModelsRFAIL9 proves that a model
// listing the router could not send for lack of its own descriptors
// (EMFILE) makes no engine unreachable (behaviour.md R-FAIL-9): the
// engine keeps the models it listed and stays placeable; a listing the
// engine refused (ECONNREFUSED) still makes it unreachable.
func TestRouterOutOfDescriptorsKeepsEngineModelsRFAIL9(t *testing.T) {
	for _, c := range []struct {
		errno syscall.Errno
		call  string
		want  string
	}{
		{syscall.EMFILE, "socket", ""},
		{syscall.ECONNREFUSED, "connect", "unreachable: connection refused"},
	} {
		cfg := config.Default()
		cfg.Router.ID = "rt-test"
		cfg.Fleet = []config.EngineSpec{{ID: "p1", URL: "http://127.0.0.1:9", Role: connector.RolePrefill, Connector: "nixl"}}
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		v, err := New(Options{Config: &cfg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registry: prometheus.NewRegistry(),
			HTTPClient: failingClient(c.call, c.errno), Context: context.Background(), Go: func(func()) bool { return false }})
		if err != nil {
			t.Fatal(err)
		}
		m := v.Fleet().Member("p1")
		v.noteModels(m, []string{testModel}, nil)
		v.refreshMember(context.Background(), m)
		if got := m.Unplaceable(nowNano()); got != c.want {
			t.Errorf("%v: after a failed listing p1 is %q, want %q", c.errno, got, c.want)
		}
		if got := m.Models(); len(got) != 1 || got[0] != testModel {
			t.Errorf("%v: p1's models %v, want [%s] kept", c.errno, got, testModel)
		}
	}
}
