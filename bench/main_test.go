package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/router"
)

// childRouterEnv makes the test binary act as `narwhal router --config F
// --listen ADDR` (an in-process router.Router, no bus), so that
// StartRouterProcess can be tested without building the narwhal binary.
const childRouterEnv = "NARWHAL_BENCH_TEST_ROUTER"

func TestMain(m *testing.M) {
	if os.Getenv(childRouterEnv) == "1" {
		if err := childRouter(os.Args[1:]); err != nil {
			fmt.Fprintln(os.Stderr, "test router:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	// fasthttp (the router's front end) leaves two goroutines of its own
	// behind after a server stops: the shared date updater and a worker
	// pool's idle sweeper, which sleeps out its period. Everything else
	// the tests start must be gone.
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
	)
}

// childRouter serves a router for `router --config F --listen ADDR` until
// SIGTERM or SIGINT.
func childRouter(args []string) error {
	if len(args) == 0 || args[0] != "router" {
		return fmt.Errorf("want the router subcommand, got %q", args)
	}
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	path := fs.String("config", "", "")
	listen := fs.String("listen", "", "")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	rt, ln, err := serveRouter(cfg, *listen)
	if err != nil {
		return err
	}
	_ = ln
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return rt.Shutdown(sctx)
}

// serveRouter starts a router for cfg on listen, with events discarded
// and logs silenced.
func serveRouter(cfg *config.Config, listen string) (*router.Router, net.Listener, error) {
	rt, err := router.New(router.Options{
		Config:        cfg,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		ShutdownGrace: time.Second,
	})
	if err != nil {
		return nil, nil, err
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, nil, err
	}
	go func() {
		if err := rt.Serve(ln); err != nil {
			fmt.Fprintln(os.Stderr, "test router serve:", err)
		}
	}()
	return rt, ln, nil
}

// localStack is in-process sims and an in-process router over them.
type localStack struct {
	engines *LocalEngines
	url     string
}

// startStack starts sims configured by sc and a router over them; both
// stop at the end of the test (router first).
func startStack(t *testing.T, sc LocalConfig) *localStack {
	t.Helper()
	l, err := StartLocal(sc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	cfg := config.Default()
	cfg.Router.ID = "bench-test"
	cfg.Fleet = l.Specs
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	rt, err := router.New(router.Options{
		Config:        &cfg,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		ShutdownGrace: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- rt.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := rt.Shutdown(ctx); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("router shutdown: %v", err)
		}
		if err := <-errc; err != nil {
			t.Errorf("router serve: %v", err)
		}
	})
	s := &localStack{engines: l, url: "http://" + ln.Addr().String()}
	if err := WaitReady(context.Background(), s.url, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	return s
}
