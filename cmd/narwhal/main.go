// Command narwhal is Narwhal's single binary: a router mesh for
// disaggregated LLM serving. Each subcommand is one process role or tool
// (behaviour.md §14):
//
//	narwhal dev [--listen HOST:PORT] [--chaos]    the whole stack on one machine
//	narwhal router --config FILE --listen HOST:PORT
//	narwhal breaker --config FILE
//	narwhal bus --listen HOST:PORT --data DIR
//	narwhal sim --role prefill|decode|both --listen HOST:PORT --engine-id ID --model NAME
//	narwhal events [--kind K] [--engine ID] [--since DUR] [--json]
//	narwhal dashboard [--listen HOST:PORT]       the live fleet page
//	narwhal preflight --config FILE
//	narwhal chaos proxy|arm|list|disarm|run
//	narwhal bench
//	narwhal version (or narwhal --version)
//
// Run "narwhal <command> -h" for a command's flags; README.md and docs/
// say more.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"syscall"

	"github.com/narwhalmesh/narwhal/config"
)

// command is one subcommand: it parses its own flags from args and runs
// until ctx is cancelled (SIGINT/SIGTERM) or it fails.
type command struct {
	summary string
	run     func(ctx context.Context, args []string) error
	// checkArgs: the command honours the hidden --check-args (see
	// argsChecked); run strips the flag for it, and refuses it for others.
	checkArgs bool
}

// commands is filled by the init functions of this package's files.
var commands = map[string]command{}

// configUsage is the help of --config for the commands that run on a fleet.
const configUsage = "YAML configuration file (docs/configuration.md); environment NARWHAL_<SECTION>_<KEY> overrides it"

// loadMesh loads the configuration of a process that takes its engines
// from the live fleet (a router, a breaker): with a bus URL (a mesh, whose
// bucket narwhal_fleet lists the engines, behaviour.md R-FLEET-1) the file's
// fleet may be empty; without one it must list at least one engine, as
// as every other command that runs on a fleet.
func loadMesh(path string) (*config.Config, error) {
	if path == "" {
		return nil, errors.New("--config is required")
	}
	cfg, err := config.Load(path)
	if err != nil {
		return nil, err
	}
	if len(cfg.Fleet) == 0 && cfg.Bus.URL == "" {
		return nil, errors.New("config: fleet: at least one engine is required without a bus (NARWHAL_NATS_URL), whose live fleet could list them")
	}
	return cfg, nil
}

// withOutput turns a command that writes to the streams it is given (so
// that its tests can read them) into one that writes to the process's
// standard output and error.
func withOutput(run func(ctx context.Context, args []string, stdout, stderr io.Writer) error) func(context.Context, []string) error {
	return func(ctx context.Context, args []string) error { return run(ctx, args, os.Stdout, os.Stderr) }
}

func usage() {
	fmt.Fprintf(os.Stderr, "usage: narwhal <command> [flags]\n\ncommands:\n")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-10s %s\n", n, commands[n].summary)
	}
	fmt.Fprintf(os.Stderr, "\nRun 'narwhal <command> -h' for a command's flags.\n")
}

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

// run runs the command args[0] with args[1:] until it ends or
// SIGINT/SIGTERM, and returns the exit status: 0 on success (and for -h),
// 2 for a usage error (an unknown command, an unknown flag), 1 for any
// other failure. It prints an error to stderr as "narwhal <command>: …",
// unless the command already said it (see reported).
func run(args []string, stderr io.Writer) int {
	if len(args) < 1 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage()
		if len(args) < 1 {
			return 2
		}
		return 0
	}
	if args[0] == "--version" || args[0] == "-version" {
		fmt.Println(currentBuildStamp())
		return 0
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "narwhal: unknown command %q\n\n", args[0])
		usage()
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rest, check := stripCheckArgs(args[1:])
	if check {
		if !cmd.checkArgs {
			fmt.Fprintf(stderr, "narwhal %s: --check-args: not supported by this command\n", args[0])
			return 2
		}
		ctx = context.WithValue(ctx, checkArgsKey{}, true)
	}
	err := cmd.run(ctx, rest)
	switch {
	case errors.Is(err, errArgsChecked):
		return 0
	case err == nil, errors.Is(err, context.Canceled), errors.Is(err, flag.ErrHelp):
		return 0
	}
	if check {
		var r *reportedError
		if !errors.As(err, &r) {
			fmt.Fprintf(stderr, "narwhal %s: %v\n", args[0], err)
		}
		return 2
	}
	var r *reportedError
	if errors.As(err, &r) {
		return r.code
	}
	fmt.Fprintf(stderr, "narwhal %s: %v\n", args[0], err)
	return 1
}

// reportedError is the error of a command that has already told the user
// why it failed (the flag package's message and usage, a report's last
// line): run exits with code and prints nothing more.
type reportedError struct {
	err  error
	code int
}

func (e *reportedError) Error() string { return e.err.Error() }
func (e *reportedError) Unwrap() error { return e.err }

// reported marks err as already said to the user, to exit with code.
func reported(err error, code int) error { return &reportedError{err: err, code: code} }

// parseFlags parses args with fs (flag.ContinueOnError, which prints a
// parse error and the usage itself). It returns flag.ErrHelp for -h, and a
// parse error marked as reported, exit status 2.
func parseFlags(fs *flag.FlagSet, args []string) error {
	err := fs.Parse(args)
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return err
	}
	return reported(err, 2)
}

// checkArgsKey is the context key under which run marks a --check-args
// run.
type checkArgsKey struct{}

// errArgsChecked is what a command returns under --check-args once its
// flags, environment and configuration files are accepted, before it would
// connect or listen: run exits 0.
var errArgsChecked = errors.New("arguments accepted")

// stripCheckArgs returns args without every "--check-args" (or
// "-check-args") token, and whether there was one. The flag is hidden: it
// is not in any command's usage, and a command parses the rest with its
// own flag set, so that the check is that parsing, not a copy of it.
func stripCheckArgs(args []string) (rest []string, found bool) {
	rest = make([]string, 0, len(args))
	for _, a := range args {
		if a == "--check-args" || a == "-check-args" {
			found = true
			continue
		}
		rest = append(rest, a)
	}
	return rest, found
}

// argsChecked is called by a command that honours --check-args at the
// point where its flags, environment and configuration files are parsed
// and validated and nothing has connected, listened or written yet: under
// --check-args it returns errArgsChecked (run exits 0 without starting),
// otherwise nil. It is how Kubernetes manifests of this binary are checked
// without a cluster (docs/kubernetes.md).
func argsChecked(ctx context.Context) error {
	if v, _ := ctx.Value(checkArgsKey{}).(bool); v {
		return errArgsChecked
	}
	return nil
}
