// Command narwhal is Narwhal's single binary: a router mesh for
// disaggregated LLM serving. Each subcommand is one process role or tool
// (SPEC §14):
//
//	narwhal dev [--listen HOST:PORT] [--chaos]    the whole stack on one machine
//	narwhal router --config FILE --listen HOST:PORT
//	narwhal breaker --config FILE
//	narwhal bus --listen HOST:PORT --data DIR
//	narwhal sim --role prefill|decode|both --listen HOST:PORT --engine-id ID --model NAME
//	narwhal events [--kind K] [--engine ID] [--since DUR] [--json]
//	narwhal preflight --config FILE
//	narwhal chaos proxy|arm|list|disarm|run
//	narwhal bench
//
// Run "narwhal <command> -h" for a command's flags; README.md and docs/
// say more.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"syscall"
)

// command is one subcommand: it parses its own flags from args and runs
// until ctx is cancelled (SIGINT/SIGTERM) or it fails.
type command struct {
	summary string
	run     func(ctx context.Context, args []string) error
}

// commands is filled by the init functions of this package's files.
var commands = map[string]command{}

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
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	cmd, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "narwhal: unknown command %q\n\n", os.Args[1])
		usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := cmd.run(ctx, os.Args[2:]); err != nil && !errors.Is(err, context.Canceled) {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintf(os.Stderr, "narwhal %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
