package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// embeddedReadyTimeout bounds how long StartEmbedded waits for the server
// to accept clients.
const embeddedReadyTimeout = 10 * time.Second

// EmbeddedOptions configures an in-process NATS server with JetStream
// (behaviour.md R-BUS-4).
type EmbeddedOptions struct {
	// Dir is the JetStream store directory (NARWHAL_DATA_DIR). When empty,
	// a new temporary directory is used and removed by Shutdown.
	Dir string
	// Host is the client listen address; "127.0.0.1" when empty.
	Host string
	// Port is the client port: -1 picks a random free port, 0 opens no
	// TCP listener at all (in-process connections only, see
	// ConnectOptions.Embedded).
	Port int
	// Log receives the server's notices, warnings and errors; nil keeps
	// the server silent.
	Log *slog.Logger
	// LeaseTTL is the TTL of the breaker's lease bucket that the set-up
	// creates (breaker.lease_ttl_s); 0 means DefaultLeaseTTL.
	LeaseTTL time.Duration
	// AuthDir, when set, is a directory WriteCredentials made: the server
	// enforces its decentralised JWT auth (auth.conf: the operator, the
	// accounts), so only the role credentials of that directory connect
	// (R-BUS-8), and with Cluster its routes present and require
	// route.secret. The in-process set-up then uses its admin.creds.
	// The account JWTs go to a full resolver in Dir/jwt (ResolverDir),
	// preloaded from auth.conf, which keeps pushed updates (a
	// revocation, R-BUS-11) across restarts and shares them with the
	// cluster's other servers.
	AuthDir string
	// ServerName names the server in a cluster (nats-server's
	// server_name); "narwhal" when empty. Every server of a cluster needs
	// its own.
	ServerName string
	// Cluster, when set, is the HOST:PORT this server listens on for the
	// other servers of its JetStream cluster (nats-server's cluster
	// listen); empty: a single server.
	Cluster string
	// Routes are the other servers' cluster URLs, e.g.
	// "nats://h2:6222" (nats-server's routes); used with Cluster.
	Routes []string
	// NoSetup leaves the stream and the buckets to the caller (Setup, or
	// Connect with ConnectOptions.Setup), e.g. to wait for a cluster or
	// to set up with the admin credential. Without it StartEmbedded sets
	// everything up in-process, as the admin of its own server (R-BUS-8).
	NoSetup bool
}

// Embedded is a running in-process NATS server with JetStream enabled.
type Embedded struct {
	srv      *server.Server
	tempDir  string // removed on Shutdown; "" when the caller gave Dir
	listens  bool
	shutdown sync.Once
}

// StartEmbedded starts a NATS server with JetStream in this process, waits
// until it accepts clients (behaviour.md R-BUS-4) and, unless opts.NoSetup, creates
// the stream and every bucket in-process with one replica (Setup; the
// embedded server is its own admin, R-BUS-8). It returns an error when the
// store directory cannot be created, the options are rejected (e.g. the
// port is taken), the server is not ready within 10 s or the set-up fails
// within 10 s. The caller owns the server and must call Shutdown.
func StartEmbedded(opts EmbeddedOptions) (*Embedded, error) {
	e := &Embedded{listens: opts.Port != 0}
	dir := opts.Dir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "narwhal-nats-")
		if err != nil {
			return nil, fmt.Errorf("bus: embedded store: %w", err)
		}
		dir, e.tempDir = tmp, tmp
	}
	host := opts.Host
	if host == "" {
		host = "127.0.0.1"
	}
	sopts := &server.Options{}
	if opts.AuthDir != "" {
		// The account JWTs live in a full resolver under the store
		// directory: a pushed revocation outlives a restart (R-BUS-11).
		parsed, err := authServerOptions(opts.AuthDir, filepath.Join(dir, ResolverDir))
		if err != nil {
			e.removeTemp()
			return nil, err
		}
		sopts = parsed
		// Until a server owns it (its Shutdown closes it), the resolver
		// is closed on every early return.
		defer func() {
			if e.srv == nil {
				parsed.AccountResolver.Close()
			}
		}()
	}
	sopts.ServerName = opts.ServerName
	if sopts.ServerName == "" {
		sopts.ServerName = "narwhal"
	}
	sopts.Host, sopts.Port, sopts.DontListen = host, opts.Port, opts.Port == 0
	// A listening server that sets itself up opens its client port only
	// once the stream and buckets exist: a client dialling meanwhile (a
	// router started first, retrying) would otherwise find the bus half
	// set up and give up on it as never set up. A clustered server listens
	// at once: nats-server starts its routes only after the client port.
	listenLater := e.listens && !opts.NoSetup && opts.Cluster == ""
	if listenLater {
		sopts.DontListen = true
	}
	sopts.JetStream, sopts.StoreDir = true, dir
	sopts.NoSigs, sopts.NoLog = true, true
	if opts.Cluster != "" {
		chost, cport, err := splitHostPort(opts.Cluster)
		if err != nil {
			e.removeTemp()
			return nil, fmt.Errorf("bus: cluster address: %w", err)
		}
		sopts.Cluster = server.ClusterOpts{Name: ClusterName, Host: chost, Port: cport}
		sopts.Routes = server.RoutesFromStr(strings.Join(opts.Routes, ","))
		if opts.AuthDir != "" {
			// With a credential set, the cluster port too wants a
			// password: route.secret, presented on every route.
			raw, err := os.ReadFile(filepath.Join(opts.AuthDir, RouteSecretFile))
			if err != nil {
				e.removeTemp()
				return nil, fmt.Errorf("bus: --auth %s: %w", opts.AuthDir, err)
			}
			secret := strings.TrimSpace(string(raw))
			sopts.Cluster.Username, sopts.Cluster.Password = RouteUser, secret
			for _, r := range sopts.Routes {
				r.User = url.UserPassword(RouteUser, secret)
			}
		}
	} else if len(opts.Routes) > 0 {
		e.removeTemp()
		return nil, errors.New("bus: routes need a cluster address of this server")
	}
	srv, err := server.NewServer(sopts)
	if err != nil {
		e.removeTemp()
		return nil, fmt.Errorf("bus: embedded server: %w", err)
	}
	// The server's fatal errors (a port it cannot listen on) end the wait
	// for it at once, instead of after embeddedReadyTimeout.
	fatal := make(chan string, 1)
	logger := slogServerLogger{l: opts.Log, fatal: fatal}
	if logger.l == nil {
		logger.l = slog.New(slog.DiscardHandler)
	}
	srv.SetLogger(logger, false, false)
	e.srv = srv
	srv.Start()
	if err := waitReady(srv, fatal, host, opts); err != nil {
		e.Shutdown()
		return nil, err
	}
	if !srv.JetStreamEnabled() {
		e.Shutdown()
		return nil, errors.New("bus: embedded server started without JetStream")
	}
	if !opts.NoSetup {
		ctx, cancel := context.WithTimeout(context.Background(), embeddedReadyTimeout)
		defer cancel()
		co := ConnectOptions{Embedded: e, Name: "narwhal-setup", Setup: &SetupOptions{Replicas: 1, LeaseTTL: opts.LeaseTTL}}
		if opts.AuthDir != "" {
			co.CredsFile = filepath.Join(opts.AuthDir, CredsFile(RoleAdmin))
		}
		b, err := Connect(ctx, co)
		if err != nil {
			e.Shutdown()
			return nil, fmt.Errorf("bus: embedded server set-up: %w", err)
		}
		b.Close()
	}
	if listenLater {
		ready := make(chan struct{})
		go srv.AcceptLoop(ready)
		<-ready
		if srv.Addr() == nil {
			e.Shutdown()
			select {
			case msg := <-fatal:
				return nil, listenError(msg, host, opts)
			default:
			}
			return nil, fmt.Errorf("bus: embedded server: cannot listen on %s", net.JoinHostPort(host, strconv.Itoa(opts.Port)))
		}
	}
	return e, nil
}

// ListenError is StartEmbedded's error when the server cannot listen on
// one of its ports, returned as soon as the server says so. It wraps
// syscall.EADDRINUSE when another process holds the address.
type ListenError struct {
	// Port is "client" (EmbeddedOptions.Host and Port) or "cluster"
	// (EmbeddedOptions.Cluster).
	Port string
	// Addr is the HOST:PORT the server could not listen on.
	Addr string
	// Cause is the server's own message.
	Cause string
}

// Error names the address, e.g. "bus: cannot listen for clients on
// 127.0.0.1:4222: the address is already in use (another process listens
// there)".
func (e *ListenError) Error() string {
	what := "for clients"
	if e.Port == "cluster" {
		what = "for the cluster's servers"
	}
	if e.inUse() {
		return "bus: cannot listen " + what + " on " + e.Addr + ": the address is already in use (another process listens there)"
	}
	return "bus: cannot listen " + what + " on " + e.Addr + ": " + e.Cause
}

// Unwrap returns syscall.EADDRINUSE when the address is in use, else nil.
func (e *ListenError) Unwrap() error {
	if e.inUse() {
		return syscall.EADDRINUSE
	}
	return nil
}

func (e *ListenError) inUse() bool { return strings.Contains(e.Cause, "address already in use") }

// waitReady waits until srv accepts connections (at most
// embeddedReadyTimeout), or returns a *ListenError as soon as the server
// reports a fatal error of a port.
func waitReady(srv *server.Server, fatal <-chan string, host string, opts EmbeddedOptions) error {
	deadline := time.Now().Add(embeddedReadyTimeout)
	for {
		select {
		case msg := <-fatal:
			return listenError(msg, host, opts)
		default:
		}
		if srv.ReadyForConnections(20 * time.Millisecond) {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("bus: embedded server not ready for connections within " + embeddedReadyTimeout.String())
		}
	}
}

// listenError is the *ListenError of the server's fatal message msg.
func listenError(msg, host string, opts EmbeddedOptions) error {
	if strings.Contains(msg, "router port") {
		return &ListenError{Port: "cluster", Addr: opts.Cluster, Cause: msg}
	}
	if strings.Contains(msg, "listening on port") {
		return &ListenError{Port: "client", Addr: net.JoinHostPort(host, strconv.Itoa(opts.Port)), Cause: msg}
	}
	return errors.New("bus: embedded server: " + msg)
}

// ClusterName is the name of the JetStream cluster a clustered embedded
// server joins (nats-server's cluster name); every server of one mesh's
// cluster uses it.
const ClusterName = "narwhal"

// splitHostPort splits a HOST:PORT with a numeric port; an empty host is
// every interface.
func splitHostPort(hp string) (string, int, error) {
	host, p, err := net.SplitHostPort(hp)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("%q: port must be 0…65535", hp)
	}
	if host == "" {
		host = "0.0.0.0"
	}
	return host, port, nil
}

// ClientURL returns the nats:// URL other processes connect to, e.g.
// "nats://127.0.0.1:41234", or "" when the server has no TCP listener
// (Port 0).
func (e *Embedded) ClientURL() string {
	if !e.listens {
		return ""
	}
	return e.srv.ClientURL()
}

// Server returns the underlying nats-server, e.g. for in-process
// connections or to stop it in tests.
func (e *Embedded) Server() *server.Server { return e.srv }

// Shutdown stops the server, waits until it has stopped, and removes the
// store directory when StartEmbedded created it. It is safe to call more
// than once.
func (e *Embedded) Shutdown() {
	e.shutdown.Do(func() {
		e.srv.Shutdown()
		e.srv.WaitForShutdown()
		e.removeTemp()
	})
}

func (e *Embedded) removeTemp() {
	if e.tempDir != "" {
		_ = os.RemoveAll(e.tempDir)
	}
}

// slogServerLogger adapts a slog.Logger to nats-server's Logger; the
// first fatal message also goes to fatal (never blocking).
type slogServerLogger struct {
	l     *slog.Logger
	fatal chan<- string
}

func (a slogServerLogger) Noticef(format string, v ...any) {
	a.l.Info(fmt.Sprintf(format, v...), "component", "nats")
}

func (a slogServerLogger) Warnf(format string, v ...any) {
	a.l.Warn(fmt.Sprintf(format, v...), "component", "nats")
}

func (a slogServerLogger) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	a.l.Error(msg, "component", "nats")
	select {
	case a.fatal <- msg:
	default:
	}
}

func (a slogServerLogger) Errorf(format string, v ...any) {
	a.l.Error(fmt.Sprintf(format, v...), "component", "nats")
}

func (a slogServerLogger) Debugf(format string, v ...any) {
	a.l.Debug(fmt.Sprintf(format, v...), "component", "nats")
}

func (a slogServerLogger) Tracef(format string, v ...any) {
	a.l.Debug(fmt.Sprintf(format, v...), "component", "nats")
}
