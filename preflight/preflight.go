// Package preflight checks a fleet before it serves (behaviour.md R-PRE-1): every
// engine against its health endpoint and the pinned engine_contract (or,
// without one, its model list), then every role-permitted KV transfer with
// a real one-token prefill and a real decode. It needs no bus. Run returns
// a Report; `narwhal preflight` prints it.
package preflight

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/probe"
	"github.com/narwhalmesh/narwhal/fleet"
)

// DefaultParallel is how many checks and transfers Run runs at once when
// Options.Parallel is 0.
const DefaultParallel = 8

// Options tune Run.
type Options struct {
	// Parallel is how many checks (then transfers) run at once; 0 means
	// DefaultParallel, a negative value is an error.
	Parallel int
}

// Check is one engine's lifecycle check.
type Check struct {
	// Engine is the checked engine.
	Engine *engines.Engine
	// Model is the model its transfers use: the contract's, else the first
	// the engine serves; "" when unknown.
	Model string
	// Took is how long the check ran.
	Took time.Duration
	// Err is why the check failed; nil when it passed.
	Err error
}

// Transfer is one probed producer → consumer KV transfer.
type Transfer struct {
	// Producer runs the prefill leg, Consumer the decode leg; they are the
	// same engine for a same-worker transfer of a `both` engine.
	Producer, Consumer *engines.Engine
	// Took is how long the probe ran.
	Took time.Duration
	// Err is why the transfer failed; nil when it passed.
	Err error
}

// Report is the outcome of Run: the engine checks in fleet order, then the
// transfers (producers in fleet order, each with its consumers in fleet
// order).
type Report struct {
	// CheckKind says what each engine check covered: "health,
	// engine_contract" or "health, /v1/models".
	CheckKind string
	Checks    []Check
	Transfers []Transfer
}

// Failed names every failed check ("engine <id>") and transfer
// ("<producer> -> <consumer>"), in report order; nil when all passed.
func (r *Report) Failed() []string {
	var out []string
	for _, c := range r.Checks {
		if c.Err != nil {
			out = append(out, "engine "+c.Engine.ID)
		}
	}
	for _, t := range r.Transfers {
		if t.Err != nil {
			out = append(out, t.Producer.ID+" -> "+t.Consumer.ID)
		}
	}
	return out
}

// Run checks every engine of cfg.Fleet, each step bounded by
// engine.first_token_timeout_s: GET /health 200, then the served models
// (GET /v1/models) and, with engine_contract, probe.CheckContract (served
// model, engine kind and version, connector). Then it probes every
// role-permitted KV transfer with breaker.ProbeTransfer — each
// prefill-capable engine to each decode-capable engine, same-worker for
// `both` engines — bounded by three first-token timeouts plus one decode
// read timeout. A transfer uses the contract's model, else one its engines
// serve.
//
// Failed checks and transfers are in the Report, not in the error: Run
// returns an error only when it cannot start (an empty fleet, an unknown
// connector, a bad Options.Parallel).
func Run(ctx context.Context, cfg *config.Config, opts Options) (*Report, error) {
	par := opts.Parallel
	switch {
	case par == 0:
		par = DefaultParallel
	case par < 0:
		return nil, fmt.Errorf("parallel %d: must be at least 1", par)
	}
	if len(cfg.Fleet) == 0 {
		return nil, errors.New("config: fleet: at least one engine is required")
	}
	configured, err := fleet.Engines(cfg.Fleet)
	if err != nil {
		return nil, err
	}
	members := make([]*engines.Engine, len(configured))
	for i := range configured {
		members[i] = &configured[i]
	}
	client := probe.NewClient(cfg)
	defer client.CloseIdleConnections()
	ftt := cfg.Engine.FirstTokenTimeout()

	r := &Report{CheckKind: "health, /v1/models"}
	if cfg.EngineContract != nil {
		r.CheckKind = "health, engine_contract"
	}
	r.Checks = make([]Check, len(members))
	for i, e := range members {
		r.Checks[i].Engine = e
	}
	bounded(par, len(r.Checks), func(i int) {
		c := &r.Checks[i]
		start := time.Now()
		c.Model, c.Err = probe.CheckLifecycle(ctx, client.HTTPClient(), c.Engine, cfg.EngineContract, ftt)
		c.Took = time.Since(start)
	})
	model := make(map[string]string, len(r.Checks))
	for _, c := range r.Checks {
		model[c.Engine.ID] = c.Model
	}

	for _, p := range members {
		for _, c := range members {
			// Engines of different connectors cannot hand off KV: no
			// transfer between them is permitted (config validation
			// refuses a fleet where that leaves an engine unpaired).
			if p.Role.CanPrefill() && c.Role.CanDecode() && p.Connector.Name() == c.Connector.Name() {
				r.Transfers = append(r.Transfers, Transfer{Producer: p, Consumer: c})
			}
		}
	}
	bounded(par, len(r.Transfers), func(i int) {
		tr := &r.Transfers[i]
		m := model[tr.Producer.ID]
		if m == "" {
			m = model[tr.Consumer.ID]
		}
		if cfg.EngineContract != nil && cfg.EngineContract.Model != "" {
			m = cfg.EngineContract.Model
		}
		start := time.Now()
		if m == "" {
			tr.Err = errors.New("no model known for either engine (see the engine checks)")
		} else {
			tctx, cancel := context.WithTimeout(ctx, 3*ftt+cfg.Engine.DecodeReadTimeout())
			tr.Err = probe.Transfer(tctx, client, tr.Producer, tr.Consumer, m)
			cancel()
		}
		tr.Took = time.Since(start)
	})
	return r, nil
}

// bounded calls fn(0…n-1), at most par at a time, and waits for all.
func bounded(par, n int, fn func(i int)) {
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
