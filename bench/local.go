package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
)

// LocalConfig configures the in-process engines of a local run.
type LocalConfig struct {
	// Prefill and Decode are the numbers of simulators of each role; 0
	// means 2.
	Prefill, Decode int
	// Model is the served model; "" means "narwhal-sim".
	Model string
	// TTFT and ITL are the simulators' artificial latencies (sim.Config);
	// zero means none.
	TTFT, ITL time.Duration
	// IDPrefix is prepended to every engine id ("prefill-1", …), so that
	// several local fleets have distinct ids.
	IDPrefix string
	// PrefillPerToken is the simulators' prefill compute time per uncached
	// prompt token; zero means none.
	PrefillPerToken time.Duration
	// BlockSize, KVCacheBlocks and MaxNumSeqs are the simulators' prefix
	// cache block size in tokens, cache capacity in blocks and running
	// request bound (sim.Config); zero means the simulator's defaults.
	BlockSize, KVCacheBlocks, MaxNumSeqs int
	// KVEvents makes every prefill simulator publish its cache's KV events
	// (sim.Config.KVEvents) on a free port of 127.0.0.1
	// (sim.Server.KVEventsAddr).
	KVEvents bool
}

// LocalEngines are simulated engines (engines/sim) serving on loopback in
// this process: the fleet of `narwhal bench --local`.
type LocalEngines struct {
	// Model is the model every simulator serves.
	Model string
	// Sims are the simulators, prefill ones first.
	Sims []*sim.Server
	// Prefill and Decode are the simulators as the engine client sees
	// them (nixl connector).
	Prefill, Decode []engines.Engine
	// Specs is the fleet for a router configuration (behaviour.md §14).
	Specs []config.EngineSpec
}

// StartLocal starts the simulators of cfg on 127.0.0.1 (free ports). On
// error, whatever was started is closed.
func StartLocal(cfg LocalConfig) (*LocalEngines, error) {
	if cfg.Prefill <= 0 {
		cfg.Prefill = 2
	}
	if cfg.Decode <= 0 {
		cfg.Decode = 2
	}
	if cfg.Model == "" {
		cfg.Model = "narwhal-sim"
	}
	conn, err := connector.Lookup(connector.DefaultName)
	if err != nil {
		return nil, err
	}
	l := &LocalEngines{Model: cfg.Model}
	add := func(role connector.Role, i int) error {
		id := cfg.IDPrefix + string(role) + "-" + strconv.Itoa(i)
		s, err := sim.New(simConfig(cfg, string(role), id))
		if err != nil {
			return err
		}
		l.Sims = append(l.Sims, s)
		url, err := s.Start("127.0.0.1:0")
		if err != nil {
			return err
		}
		e := engines.Engine{ID: id, URL: url, Role: role, Connector: conn}
		if role == connector.RolePrefill {
			l.Prefill = append(l.Prefill, e)
		} else {
			l.Decode = append(l.Decode, e)
		}
		l.Specs = append(l.Specs, config.EngineSpec{ID: id, URL: url, Role: role, Connector: connector.DefaultName})
		return nil
	}
	for i := 1; i <= cfg.Prefill; i++ {
		if err := add(connector.RolePrefill, i); err != nil {
			l.Close()
			return nil, err
		}
	}
	for i := 1; i <= cfg.Decode; i++ {
		if err := add(connector.RoleDecode, i); err != nil {
			l.Close()
			return nil, err
		}
	}
	return l, nil
}

// simConfig is the simulator configuration of one engine of cfg.
func simConfig(cfg LocalConfig, role, id string) sim.Config {
	c := sim.Config{
		Role: role, EngineID: id, Model: cfg.Model, TTFT: cfg.TTFT, ITL: cfg.ITL,
		PrefillPerToken: cfg.PrefillPerToken,
		BlockSize:       cfg.BlockSize, KVCacheBlocks: cfg.KVCacheBlocks, MaxNumSeqs: cfg.MaxNumSeqs,
	}
	if cfg.KVEvents && role == string(connector.RolePrefill) {
		c.KVEvents = "tcp://127.0.0.1:0"
	}
	return c
}

// Floor returns a FloorTarget over the simulators.
func (l *LocalEngines) Floor() (*FloorTarget, error) { return NewFloorTarget(l.Prefill, l.Decode) }

// Close stops every simulator.
func (l *LocalEngines) Close() {
	for _, s := range l.Sims {
		s.Close()
	}
}

// RouterConfigYAML returns a router configuration file (behaviour.md §14) for
// fleet: the behaviour.md §11 defaults, the given router id, logging at "error"
// so that a benchmarked router stays quiet, and the fleet.
func RouterConfigYAML(routerID string, fleet []config.EngineSpec) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "router:\n  id: %s\n  log_level: error\nfleet:\n", routerID)
	for _, e := range fleet {
		conn := e.Connector
		if conn == "" {
			conn = connector.DefaultName
		}
		fmt.Fprintf(&b, "  - id: %s\n    url: %q\n    role: %s\n    connector: %s\n", e.ID, e.URL, e.Role, conn)
	}
	return b.Bytes()
}

// RouterProcessOptions configure StartRouterProcess.
type RouterProcessOptions struct {
	// Exe is the narwhal binary; "" means os.Executable().
	Exe string
	// ID is the router's router.id; "" means "narwhal-bench". Routers
	// sharing a bus need distinct ids.
	ID string
	// Fleet is the router's fleet.
	Fleet []config.EngineSpec
	// Env is added to this process's environment for the child (e.g.
	// "NARWHAL_ROUTER_LOG_LEVEL=error").
	Env []string
	// ReadyTimeout bounds the wait for GET /readyz to answer 200; 0 means
	// 20 s.
	ReadyTimeout time.Duration
}

// RouterProcess is a router running as a child process
// (`narwhal router --config FILE --listen 127.0.0.1:PORT`, behaviour.md §14), so
// that its CPU time can be read apart from the bench's (ProcessCPU).
type RouterProcess struct {
	// URL is the router's base URL.
	URL string
	cmd *exec.Cmd
	dir string

	stderr tailBuffer
	exited chan struct{}
	err    error // the child's exit, valid after exited is closed
}

// StartRouterProcess writes a configuration for opts.Fleet to a temporary
// file, starts the router on a free loopback port and waits until its
// /readyz answers 200. It fails, with the tail of the child's stderr, when
// the child cannot start, exits, or is not ready in time. Stop it with
// Stop.
func StartRouterProcess(ctx context.Context, opts RouterProcessOptions) (*RouterProcess, error) {
	exe := opts.Exe
	if exe == "" {
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, err
		}
	}
	dir, err := os.MkdirTemp("", "narwhal-bench-")
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "router.yaml")
	id := opts.ID
	if id == "" {
		id = "narwhal-bench"
	}
	if err := os.WriteFile(path, RouterConfigYAML(id, opts.Fleet), 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	ready := opts.ReadyTimeout
	if ready <= 0 {
		ready = 20 * time.Second
	}
	// A free port can be taken between our probe and the child's bind;
	// try a few.
	var lastErr error
	for try := 0; try < 3; try++ {
		port, err := freePort()
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		p := &RouterProcess{URL: "http://127.0.0.1:" + strconv.Itoa(port), dir: dir, exited: make(chan struct{})}
		p.cmd = exec.Command(exe, "router", "--config", path, "--listen", "127.0.0.1:"+strconv.Itoa(port))
		p.cmd.Env = append(os.Environ(), opts.Env...)
		p.cmd.Stdout = &p.stderr
		p.cmd.Stderr = &p.stderr
		if err := p.cmd.Start(); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("start router: %w", err)
		}
		go func() {
			p.err = p.cmd.Wait()
			close(p.exited)
		}()
		if lastErr = p.waitReady(ctx, ready); lastErr == nil {
			return p, nil
		}
		p.kill()
		if ctx.Err() != nil {
			break
		}
	}
	os.RemoveAll(dir)
	return nil, lastErr
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// waitReady polls GET /readyz every 20 ms until it answers 200, the child
// exits, ctx ends or the bound passes.
func (p *RouterProcess) waitReady(ctx context.Context, bound time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+"/readyz", nil)
		if resp, err := client.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-p.exited: // nil (never ready) when there is no child
			return fmt.Errorf("router exited before it was ready (%v): %s", p.err, p.stderr.String())
		case <-ctx.Done():
			return fmt.Errorf("router not ready at %s/readyz within %s: %s", p.URL, bound, p.stderr.String())
		case <-tick.C:
		}
	}
}

// WaitReady polls GET baseURL/readyz every 20 ms until it answers 200
// (R-API-2: the router can serve both phases), ctx ends or bound passes.
func WaitReady(ctx context.Context, baseURL string, bound time.Duration) error {
	p := &RouterProcess{URL: strings.TrimRight(baseURL, "/")}
	return p.waitReady(ctx, bound)
}

// PID returns the child's process id.
func (p *RouterProcess) PID() int { return p.cmd.Process.Pid }

// Output returns the last 64 KiB the child wrote to stdout and stderr.
func (p *RouterProcess) Output() string { return p.stderr.String() }

// Stop asks the router to shut down (SIGTERM), waits up to 15 s for it to
// exit, then kills it, and removes its configuration file. It returns
// nil after a clean exit.
func (p *RouterProcess) Stop() error {
	defer os.RemoveAll(p.dir)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		return p.err
	case <-time.After(15 * time.Second):
		p.kill()
		return errors.New("router did not stop within 15s; killed")
	}
}

func (p *RouterProcess) kill() {
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// tailBuffer keeps the last 64 KiB written to it; safe for concurrent
// use.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - 64<<10; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.buf))
}
