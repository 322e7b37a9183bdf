package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/narwhalmesh/narwhal/breaker"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
)

func init() {
	commands["preflight"] = command{
		summary: "check every engine against engine_contract and probe every role-permitted KV transfer (--config FILE)",
		run: func(ctx context.Context, args []string) error {
			return runPreflight(ctx, args, os.Stdout)
		},
	}
}

// preflightCheck is one engine's lifecycle check.
type preflightCheck struct {
	engine *engines.Engine
	model  string // the model its transfers use; "" when unknown
	took   time.Duration
	err    error
}

// preflightTransfer is one probed producer → consumer transfer.
type preflightTransfer struct {
	producer, consumer *engines.Engine
	took               time.Duration
	err                error
}

// runPreflight is `narwhal preflight --config FILE [--parallel N]` (SPEC
// R-PRE-1): it needs no bus. First every engine is checked — GET /health
// 200 and, with engine_contract, breaker.CheckContract (served model,
// engine kind and version, connector); without a contract, a model list
// from GET /v1/models. Then every role-permitted KV transfer is probed with
// breaker.ProbeTransfer: each prefill-capable engine to each
// decode-capable engine, same-worker for `both` engines, with each leg
// bounded by engine.first_token_timeout_s. Two tables go to out (engine
// checks: engine, role, result, time, error; transfers: producer, consumer,
// result, time, error). It returns an error naming every failing engine
// and pair when anything failed, so the process exits non-zero.
func runPreflight(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("preflight", flag.ContinueOnError)
	path := fs.String("config", "", "YAML configuration file with the fleet and, optionally, engine_contract (docs/configuration.md)")
	par := fs.Int("parallel", 8, "how many checks and transfers run at once")
	if err := fs.Parse(args); err != nil {
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
	if len(cfg.Fleet) == 0 {
		return errors.New("config: fleet: at least one engine is required")
	}
	fleet := make([]*engines.Engine, 0, len(cfg.Fleet))
	for _, spec := range cfg.Fleet {
		conn, err := connector.Lookup(spec.Connector)
		if err != nil {
			return fmt.Errorf("fleet engine %s: %w", spec.ID, err)
		}
		fleet = append(fleet, &engines.Engine{ID: spec.ID, URL: strings.TrimRight(spec.URL, "/"), Role: spec.Role, Connector: conn})
	}
	client := breaker.NewProbeClient(cfg)
	defer client.CloseIdleConnections()
	ftt := cfg.Engine.FirstTokenTimeout()

	checks := make([]*preflightCheck, len(fleet))
	for i, e := range fleet {
		checks[i] = &preflightCheck{engine: e}
	}
	preflightBounded(*par, len(checks), func(i int) {
		c := checks[i]
		start := time.Now()
		c.model, c.err = preflightEngine(ctx, client, c.engine, cfg.EngineContract, ftt)
		c.took = time.Since(start)
	})
	model := make(map[string]string, len(checks))
	for _, c := range checks {
		model[c.engine.ID] = c.model
	}

	var transfers []*preflightTransfer
	for _, p := range fleet {
		for _, c := range fleet {
			if p.Role.CanPrefill() && c.Role.CanDecode() {
				transfers = append(transfers, &preflightTransfer{producer: p, consumer: c})
			}
		}
	}
	preflightBounded(*par, len(transfers), func(i int) {
		tr := transfers[i]
		m := model[tr.producer.ID]
		if m == "" {
			m = model[tr.consumer.ID]
		}
		if cfg.EngineContract != nil && cfg.EngineContract.Model != "" {
			m = cfg.EngineContract.Model
		}
		start := time.Now()
		if m == "" {
			tr.err = errors.New("no model known for either engine (see the engine checks)")
		} else {
			tctx, cancel := context.WithTimeout(ctx, 3*ftt+cfg.Engine.DecodeReadTimeout())
			tr.err = breaker.ProbeTransfer(tctx, client, tr.producer, tr.consumer, m)
			cancel()
		}
		tr.took = time.Since(start)
	})

	var failed []string
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	kind := "health, /v1/models"
	if cfg.EngineContract != nil {
		kind = "health, engine_contract"
	}
	fmt.Fprintf(tw, "ENGINE\tROLE\tCHECK\tRESULT\tTIME\tERROR\n")
	for _, c := range checks {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", c.engine.ID, c.engine.Role, kind, preflightResult(c.err), c.took.Round(time.Millisecond), preflightLine(c.err))
		if c.err != nil {
			failed = append(failed, "engine "+c.engine.ID)
		}
	}
	fmt.Fprintf(tw, "\nPRODUCER\tCONSUMER\tRESULT\tTIME\tERROR\n")
	for _, tr := range transfers {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", tr.producer.ID, tr.consumer.ID, preflightResult(tr.err), tr.took.Round(time.Millisecond), preflightLine(tr.err))
		if tr.err != nil {
			failed = append(failed, tr.producer.ID+" -> "+tr.consumer.ID)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(failed) > 0 {
		fmt.Fprintf(out, "\npreflight FAILED: %s\n", strings.Join(failed, ", "))
		return fmt.Errorf("preflight failed: %s", strings.Join(failed, ", "))
	}
	fmt.Fprintf(out, "\npreflight ok: %d engines, %d transfers\n", len(checks), len(transfers))
	return nil
}

// preflightEngine runs one engine's checks, each bounded by timeout, and
// returns the model its transfers use (the contract's, else the first it
// serves).
func preflightEngine(ctx context.Context, client *engines.Client, e *engines.Engine, contract *config.Contract, timeout time.Duration) (string, error) {
	httpc := client.HTTPClient()
	cctx, cancel := context.WithTimeout(ctx, timeout)
	err := breaker.CheckHealth(cctx, httpc, e)
	cancel()
	if err != nil {
		return "", err
	}
	cctx, cancel = context.WithTimeout(ctx, timeout)
	defer cancel()
	models, err := breaker.ServedModels(cctx, httpc, e)
	if err != nil {
		return "", err
	}
	model := models[0].ID
	if contract != nil {
		if contract.Model != "" {
			model = contract.Model
		}
		if err := breaker.CheckContract(cctx, httpc, e, contract); err != nil {
			return model, err
		}
	}
	return model, nil
}

// preflightBounded calls fn(0…n-1), at most par at a time, and waits for all.
func preflightBounded(par, n int, fn func(i int)) {
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			fn(i)
		})
	}
	wg.Wait()
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
