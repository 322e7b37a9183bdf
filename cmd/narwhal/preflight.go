package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/preflight"
)

func init() {
	commands["preflight"] = command{
		summary: "check every engine against engine_contract and probe every role-permitted KV transfer (--config FILE)",
		run: func(ctx context.Context, args []string) error {
			return runPreflight(ctx, args, os.Stdout)
		},
	}
}

// runPreflight is `narwhal preflight --config FILE [--parallel N]` (behaviour.md
// R-PRE-1): it loads the config, runs preflight.Run and prints its report
// to out as two tables (engine checks: engine, role, check, result, time,
// error; transfers: producer, consumer, result, time, error) and a last
// line, "preflight ok: …" or "preflight FAILED: <every failing engine and
// pair>". On a failure it returns an error that main does not print again
// (the last line said it), so the process exits 1; it returns an ordinary
// error for bad flags, a bad config or a report that cannot be written.
func runPreflight(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("narwhal preflight", flag.ContinueOnError)
	path := fs.String("config", "", "YAML configuration file with the fleet and, optionally, engine_contract")
	par := fs.Int("parallel", preflight.DefaultParallel, "how many checks and transfers run at once")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return errors.New("--config is required")
	}
	if *par < 1 {
		return errors.New("--parallel must be at least 1")
	}
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	r, err := preflight.Run(ctx, cfg, preflight.Options{Parallel: *par})
	if err != nil {
		return err
	}
	if err := writePreflightReport(out, r); err != nil {
		return err
	}
	if failed := r.Failed(); len(failed) > 0 {
		return reported(fmt.Errorf("preflight failed: %s", strings.Join(failed, ", ")), 1)
	}
	return nil
}

// writePreflightReport writes r as two aligned tables and its last line.
func writePreflightReport(out io.Writer, r *preflight.Report) error {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "ENGINE\tROLE\tCHECK\tRESULT\tTIME\tERROR\n")
	for _, c := range r.Checks {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", c.Engine.ID, c.Engine.Role, r.CheckKind, preflightResult(c.Err), c.Took.Round(time.Millisecond), preflightLine(c.Err))
	}
	fmt.Fprintf(tw, "\nPRODUCER\tCONSUMER\tRESULT\tTIME\tERROR\n")
	for _, tr := range r.Transfers {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", tr.Producer.ID, tr.Consumer.ID, preflightResult(tr.Err), tr.Took.Round(time.Millisecond), preflightLine(tr.Err))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	var err error
	if failed := r.Failed(); len(failed) > 0 {
		_, err = fmt.Fprintf(out, "\npreflight FAILED: %s\n", strings.Join(failed, ", "))
	} else {
		_, err = fmt.Fprintf(out, "\npreflight ok: %s, %s\n", counted(len(r.Checks), "engine"), counted(len(r.Transfers), "transfer"))
	}
	return err
}

// counted is n and noun, plural unless n is 1: "1 transfer", "4 transfers".
func counted(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}

func preflightResult(err error) string {
	if err != nil {
		return "FAIL"
	}
	return "ok"
}

// preflightLine renders err on one line ("-" for none): joined errors are
// separated by "; ".
func preflightLine(err error) string {
	if err == nil {
		return "-"
	}
	return strings.ReplaceAll(err.Error(), "\n", "; ")
}
