package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/fleet"
	"github.com/narwhalmesh/narwhal/schemas"
)

func init() {
	commands["fleet"] = command{
		summary: "the live fleet: list, add, drain, undrain, remove (docs/fleet.md)",
		run:     withOutput(runFleet),
	}
}

// fleetWriter is the "by" of the entries `narwhal fleet` writes.
const fleetWriter = "narwhal-fleet"

// fleetOpTimeout bounds one bus operation of `narwhal fleet`.
const fleetOpTimeout = 5 * time.Second

// runFleet is `narwhal fleet list|add|drain|undrain|remove` (behaviour.md §14,
// R-FLEET-1…3). It talks to the bus only — NARWHAL_NATS_URL (default
// nats://127.0.0.1:4222) with the bus section's credential and TLS
// variables — and changes KV bucket narwhal_fleet, which needs the admin
// credential (list needs a viewer's). Every change is revision-checked
// against what it read, and invalid input changes nothing.
func runFleet(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	usage := func() {
		fmt.Fprintln(stderr, "usage: narwhal fleet list [--json]")
		fmt.Fprintln(stderr, "       narwhal fleet add --id ID --url URL --role prefill|decode|both [--connector C] [--prefill-slots N] [--decode-slots N] [--api-key-env VAR]")
		fmt.Fprintln(stderr, "       narwhal fleet drain ID [--wait] [--timeout DUR]")
		fmt.Fprintln(stderr, "       narwhal fleet undrain ID")
		fmt.Fprintln(stderr, "       narwhal fleet remove ID [--force]")
	}
	if len(args) == 0 {
		usage()
		return reported(errors.New("no subcommand"), 2)
	}
	sub, rest := args[0], args[1:]
	fs := flag.NewFlagSet("narwhal fleet "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var run func(ctx context.Context, st *fleet.Store, b *bus.Bus) error
	var positional []string
	oneID := func() (string, error) { return checkOneID(positional) }
	switch sub {
	case "list":
		asJSON := fs.Bool("json", false, "print one JSON object per engine, one per line (nothing for an empty fleet)")
		run = func(ctx context.Context, st *fleet.Store, b *bus.Bus) error {
			return fleetList(ctx, st, b, stdout, *asJSON)
		}
	case "add":
		spec := config.EngineSpec{}
		fs.StringVar(&spec.ID, "id", "", "the engine's `ID` (letters, digits, '-' and '_')")
		fs.StringVar(&spec.URL, "url", "", "the engine's http(s) base `URL`")
		fs.StringVar((*string)(&spec.Role), "role", "", "prefill, decode or both")
		fs.StringVar(&spec.Connector, "connector", connector.DefaultName, "the KV connector: "+strings.Join(connector.Names(), ", "))
		fs.IntVar(&spec.BootstrapPort, "bootstrap-port", 0, "a prefill SGLang engine's bootstrap `PORT` (connector sglang)")
		fs.IntVar(&spec.PrefillSlots, "prefill-slots", 0, "prefill phases at once (0: no limit)")
		fs.IntVar(&spec.DecodeSlots, "decode-slots", 0, "decode phases at once (0: no limit)")
		fs.StringVar(&spec.APIKeyEnv, "api-key-env", "", "the environment `VAR` every process reads the engine's API key from")
		run = func(ctx context.Context, st *fleet.Store, _ *bus.Bus) error {
			if err := fleetAdd(ctx, st, spec, time.Now()); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "engine %s added: joining; placeable once the breaker's checks pass (watch: narwhal events --kind probe --engine %s)\n", spec.ID, spec.ID)
			return nil
		}
	case "drain":
		wait := fs.Bool("wait", false, "wait until the engine is drained")
		timeout := fs.Duration("timeout", 0, "with --wait: give up after `DUR` (0: wait for the breaker, which declares a drain over after membership.drain_timeout_s)")
		run = func(ctx context.Context, st *fleet.Store, _ *bus.Bus) error {
			id, err := oneID()
			if err != nil {
				return err
			}
			state, err := fleetDrain(ctx, st, id, time.Now())
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "engine %s %s: no new attempt goes there; running ones finish\n", id, state)
			if !*wait {
				return nil
			}
			return fleetWaitDrained(ctx, st, id, *timeout, stdout)
		}
	case "undrain":
		run = func(ctx context.Context, st *fleet.Store, _ *bus.Bus) error {
			id, err := oneID()
			if err != nil {
				return err
			}
			state, err := fleetUndrain(ctx, st, id, time.Now())
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "engine %s %s\n", id, state)
			return nil
		}
	case "remove":
		force := fs.Bool("force", false, "remove the engine even while it is not drained (its running attempts still finish)")
		run = func(ctx context.Context, st *fleet.Store, _ *bus.Bus) error {
			id, err := oneID()
			if err != nil {
				return err
			}
			if err := fleetRemove(ctx, st, id, *force); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "engine %s removed from the fleet\n", id)
			return nil
		}
	case "-h", "--help", "help":
		usage()
		return nil
	default:
		usage()
		return reported(fmt.Errorf("unknown subcommand %q", sub), 2)
	}
	// Flags may follow the engine id (`narwhal fleet remove d1 --force`).
	var ids []string
	for {
		if err := parseFlags(fs, rest); err != nil {
			return err
		}
		if fs.NArg() == 0 {
			break
		}
		ids = append(ids, fs.Arg(0))
		rest = fs.Args()[1:]
	}
	positional = ids
	if (sub == "list" || sub == "add") && len(ids) > 0 {
		return fmt.Errorf("unexpected arguments %q", ids)
	}
	busCfg, err := toolBus()
	if err != nil {
		return err
	}
	// The least credential that does: a refused connection names its file.
	role := bus.RoleAdmin
	if sub == "list" {
		role = bus.RoleViewer
	}
	// NATS drops a write the credential may not do, which would fail by
	// its timeout only: the server's permissions violation ends the
	// command at once instead, said once (behaviour.md R-BUS-8).
	ctx, deny := context.WithCancelCause(ctx)
	defer deny(nil)
	opts := busOptions(busCfg, "narwhal-fleet", role, slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	opts.PermissionDenied = func(err error) { deny(err) }
	cctx, cancel := context.WithTimeout(ctx, defaultEventsConnectBound)
	b, err := bus.Connect(cctx, opts)
	cancel()
	if err != nil {
		return fmt.Errorf("bus %s: %w", redactNATSURL(busCfg.URL), err)
	}
	defer b.Close()
	bctx, bcancel := context.WithTimeout(ctx, fleetOpTimeout)
	st, err := fleet.Bind(bctx, b)
	bcancel()
	if err == nil {
		err = run(ctx, st, b)
	}
	if perm := b.PermissionError(); err != nil && perm != nil {
		return fleetDenied(sub, positional, busCfg.Creds, perm)
	}
	return err
}

// fleetDenied is the one-line error of a `narwhal fleet` subcommand the
// credential creds (NARWHAL_NATS_CREDS) may not do: the server's
// permissions violation perm, and the credential it takes — the admin's
// (admin.creds of `narwhal bus creds`) for a change, the viewer's for list
// (behaviour.md R-BUS-8).
func fleetDenied(sub string, ids []string, creds string, perm error) error {
	what, file := "changing the fleet", bus.CredsFile(bus.RoleAdmin)
	if sub == "list" {
		what, file = "reading the fleet", bus.CredsFile(bus.RoleViewer)
	}
	if creds == "" {
		creds = "(none)"
	}
	return fmt.Errorf("%s: the bus denied it to NARWHAL_NATS_CREDS=%s (%v): %s takes the credential %s of narwhal bus creds",
		strings.Join(append([]string{sub}, ids...), " "), creds, perm, what, file)
}

// checkOneID returns the one engine id a subcommand takes.
func checkOneID(args []string) (string, error) {
	if len(args) != 1 {
		return "", fmt.Errorf("want exactly one engine id, got %d arguments", len(args))
	}
	id := args[0]
	if !config.ValidID(id) {
		return "", fmt.Errorf("engine id %q: letters, digits, '-' and '_' only", id)
	}
	return id, nil
}

// checkFleetSpec returns what is wrong with an engine `narwhal fleet add`
// is given, naming the flag: every problem specFlagProblems finds
// (config.EngineSpec.Validate is the rule) and a URL with a query or a
// fragment, which a base URL does not have, joined (errors.Join).
func checkFleetSpec(e config.EngineSpec) error {
	ps := specFlagProblems(e, fleetAddFlags)
	if u, err := url.Parse(e.URL); err == nil && (u.RawQuery != "" || u.Fragment != "") && !hasFlagProblem(ps, "url") {
		i := 0 // after the id's problem, as Validate orders them
		if hasFlagProblem(ps, "id") {
			i = 1
		}
		ps = slices.Insert(ps, i, flagProblem{field: "url", flag: fleetAddFlags["url"], problem: "has a query or a fragment"})
	}
	var errs []error
	for _, p := range ps {
		// The wording is fleet add's own, kept from before config's rule
		// was the one it applies: config words each problem for a key of
		// a configuration file, fleet add for the flag its user typed.
		switch {
		case p.field == "id":
			errs = append(errs, fmt.Errorf("%s %q: want 1 to 128 letters, digits, '-' and '_'", p.flag, e.ID))
		case p.field == "url":
			errs = append(errs, fmt.Errorf("%s %q: want an absolute http or https base URL such as http://10.1.2.3:8000", p.flag, e.URL))
		case p.field == "role" && !e.Role.Valid():
			errs = append(errs, fmt.Errorf("%s %q: want %s, %s or %s", p.flag, e.Role, connector.RolePrefill, connector.RoleDecode, connector.RoleBoth))
		case p.field == "connector" && !slices.Contains(connector.Names(), e.Connector):
			errs = append(errs, fmt.Errorf("%s %q: want one of %s", p.flag, e.Connector, strings.Join(connector.Names(), ", ")))
		case p.field == "prefill_slots":
			errs = append(errs, fmt.Errorf("%s %d: want >= 0", p.flag, e.PrefillSlots))
		case p.field == "decode_slots":
			errs = append(errs, fmt.Errorf("%s %d: want >= 0", p.flag, e.DecodeSlots))
		default: // the connector's own rule (connector.CheckEngine): config's problem
			errs = append(errs, fmt.Errorf("%s: %s", p.flag, p.problem))
		}
	}
	return errors.Join(errs...)
}

// fleetAddFlags names the flag of `narwhal fleet add` that sets each
// field of an engine spec config.EngineSpec.Validate reports (its YAML
// key).
var fleetAddFlags = map[string]string{
	"id": "--id", "url": "--url", "role": "--role", "connector": "--connector",
	"bootstrap_port": "--bootstrap-port", "prefill_slots": "--prefill-slots", "decode_slots": "--decode-slots",
}

// fleetAdd adds engine spec to the fleet in state joining (behaviour.md
// R-FLEET-2): the breaker probes it and makes it active. It refuses an
// invalid spec or an id the fleet holds already, changing nothing.
func fleetAdd(ctx context.Context, st *fleet.Store, spec config.EngineSpec, now time.Time) error {
	if err := checkFleetSpec(spec); err != nil {
		return err
	}
	spec.URL = strings.TrimRight(spec.URL, "/")
	entry := fleet.NewJoining(spec, schemas.SourceCommand, fleetWriter, "added with narwhal fleet add", now)
	if err := fleet.Check(entry); err != nil {
		return fmt.Errorf("engine %s: %w", spec.ID, err)
	}
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	if _, err := st.Create(ctx, entry); err != nil {
		if errors.Is(err, fleet.ErrExists) {
			cur, _, gerr := fleetGet(ctx, st, spec.ID)
			if gerr == nil {
				return fmt.Errorf("engine %s is already in the fleet (%s, %s, %s): remove it first, or choose another id", spec.ID, cur.State, cur.Role, cur.URL)
			}
			return fmt.Errorf("engine %s is already in the fleet: remove it first, or choose another id", spec.ID)
		}
		return fmt.Errorf("add engine %s: %w", spec.ID, err)
	}
	return nil
}

// fleetGet reads engine id's entry and its revision. It returns an error
// wrapping fleet.ErrNotInFleet for a missing or deleted key, and a clear error
// (and revision 0) for a value that is not a fleet entry for id.
func fleetGet(ctx context.Context, st *fleet.Store, id string) (schemas.FleetEntry, uint64, error) {
	e, rev, err := st.Get(ctx, id)
	var invalid *fleet.InvalidError
	switch {
	case errors.Is(err, fleet.ErrNotInFleet):
		return e, 0, fmt.Errorf("engine %s: %w (narwhal fleet list shows the fleet)", id, fleet.ErrNotInFleet)
	case errors.As(err, &invalid):
		return e, 0, invalidEntry(id, invalid.Err)
	case err != nil:
		return e, 0, err
	}
	return e, rev, nil
}

// invalidEntry says that engine id's value is not a fleet entry for it,
// and why.
func invalidEntry(id string, why error) error {
	return fmt.Errorf("engine %s: its entry is not valid (%v): remove it with --force", id, why)
}

// fleetStep moves engine id's entry cur (read at revision rev) by step
// of the state machine (fleet.Apply) and writes it revision-checked.
// `narwhal fleet` writes without a per-key TTL: a registration that is
// alive renews its key with its TTL at once after another process's
// write (membership, R-FLEET-4).
func fleetStep(ctx context.Context, st *fleet.Store, cur schemas.FleetEntry, rev uint64, step fleet.Step, reason string, now time.Time) error {
	next, err := fleet.Apply(cur, step, fleetWriter, reason, now)
	if err != nil {
		return err
	}
	if _, err := st.Update(ctx, next, rev, 0); err != nil {
		if errors.Is(err, fleet.ErrChanged) {
			return fmt.Errorf("engine %s changed meanwhile: run the command again", cur.EngineID)
		}
		return err // fleet.Store's error names the engine
	}
	return nil
}

// fleetDrain makes engine id draining (behaviour.md R-FLEET-3) and returns its
// state afterwards. An engine already draining or drained is left as it
// is; an unknown id is an error.
func fleetDrain(ctx context.Context, st *fleet.Store, id string, now time.Time) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	cur, rev, err := fleetGet(ctx, st, id)
	if err != nil {
		return "", err
	}
	if _, ok := fleet.Next(cur.State, fleet.Drain); !ok {
		return "is already " + cur.State, nil // draining or drained
	}
	if err := fleetStep(ctx, st, cur, rev, fleet.Drain, "drained with narwhal fleet drain", now); err != nil {
		return "", err
	}
	return "draining", nil
}

// fleetUndrain puts a draining engine back to active, and a drained one
// to joining (it is checked again before it is placed: it may have been
// restarted as something else). Any other state is an error.
func fleetUndrain(ctx context.Context, st *fleet.Store, id string, now time.Time) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	cur, rev, err := fleetGet(ctx, st, id)
	if err != nil {
		return "", err
	}
	next, ok := fleet.Next(cur.State, fleet.Undrain)
	if !ok {
		return "", fmt.Errorf("engine %s is %s, not draining or drained: nothing to undo", id, cur.State)
	}
	if err := fleetStep(ctx, st, cur, rev, fleet.Undrain, "undrained with narwhal fleet undrain", now); err != nil {
		return "", err
	}
	if next == schemas.FleetJoining {
		return "joining: placeable once the breaker's checks pass", nil
	}
	return "active again", nil
}

// fleetRemove deletes engine id's key: routers place nothing more there,
// and running attempts finish (behaviour.md R-FLEET-1). Without force it refuses
// an engine that is not drained — or joining, which never took work
// (fleet.Removable).
func fleetRemove(ctx context.Context, st *fleet.Store, id string, force bool) error {
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	cur, rev, err := fleetGet(ctx, st, id)
	if err != nil && (!force || errors.Is(err, fleet.ErrNotInFleet)) {
		return err
	}
	if err == nil && !force && !fleet.Removable(cur.State) {
		return fmt.Errorf("engine %s is %s: drain it first (narwhal fleet drain %s --wait), or remove it with --force", id, cur.State, id)
	}
	if err := st.Delete(ctx, id, rev); err != nil {
		if errors.Is(err, fleet.ErrChanged) {
			return fmt.Errorf("engine %s changed meanwhile: run the command again", id)
		}
		return fmt.Errorf("remove engine %s: %w", id, err)
	}
	return nil
}

// fleetWaitDrained waits until engine id is drained or gone
// (fleet.Store.WaitDrained), or timeout (when > 0) or ctx ends.
func fleetWaitDrained(ctx context.Context, st *fleet.Store, id string, timeout time.Duration, stdout io.Writer) error {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	e, gone, err := st.WaitDrained(ctx, id)
	switch {
	case err != nil && ctx.Err() != nil:
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return fmt.Errorf("engine %s not drained within %v", id, timeout)
		}
		return ctx.Err()
	case err != nil:
		return err
	case gone:
		fmt.Fprintf(stdout, "engine %s left the fleet\n", id)
	default:
		fmt.Fprintf(stdout, "engine %s drained: %s\n", id, e.Reason)
	}
	return nil
}

// fleetRow is one engine as `narwhal fleet list` shows it.
type fleetRow struct {
	schemas.FleetEntry
	// Eligible is the breaker's placement verdict (true without one).
	Eligible bool `json:"eligible"`
	// InFlight is the sum over the routers' reports of its legs in flight.
	InFlight int64 `json:"inflight"`
	// Models is every model the routers' reports say the engine listed,
	// sorted, without duplicates; empty until a router has read it.
	Models []string `json:"models"`
	// Invalid holds why the key's value is not a fleet entry, if it is not.
	Invalid string `json:"invalid,omitempty"`
}

// fleetList prints every engine of the fleet: id, URL, role, state,
// eligibility, legs in flight over the routers, source; with asJSON one
// JSON object per row and line (JSON Lines: nothing for an empty fleet).
// It reads only.
func fleetList(ctx context.Context, st *fleet.Store, b *bus.Bus, stdout io.Writer, asJSON bool) error {
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	listed, err := st.List(ctx)
	if err != nil {
		return err
	}
	inflight := map[string]int64{}
	models := map[string]map[string]bool{}
	{
		if reports, _, err := fleet.ReadReports(ctx, b); err == nil {
			for _, r := range reports {
				for id, n := range r.InFlight {
					inflight[id] += n
				}
				for id, ms := range r.Models {
					if models[id] == nil {
						models[id] = map[string]bool{}
					}
					for _, m := range ms {
						models[id][m] = true
					}
				}
			}
		}
	}
	var rows []fleetRow
	for _, l := range listed {
		id := l.ID
		row := fleetRow{Eligible: true, InFlight: inflight[id], Models: []string{}}
		for m := range models[id] {
			row.Models = append(row.Models, m)
		}
		sort.Strings(row.Models)
		row.FleetEntry = l.Entry
		row.EngineID = id
		if l.Invalid != nil {
			row.Invalid = invalidEntry(id, l.Invalid).Error()
		}
		if pe, err := b.Placement().Get(ctx, id); err == nil {
			var el schemas.Eligibility
			if bus.ValidatePlacement(pe.Value()) == nil && json.Unmarshal(pe.Value(), &el) == nil {
				row.Eligible = el.Eligible
			}
		}
		rows = append(rows, row)
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		for _, r := range rows {
			if err := enc.Encode(r); err != nil {
				return err
			}
		}
		return nil
	}
	tw := tabwriter.NewWriter(stdout, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tURL\tROLE\tSTATE\tELIGIBLE\tIN-FLIGHT\tMODELS\tSOURCE\tSINCE")
	for _, r := range rows {
		if r.Invalid != "" {
			fmt.Fprintf(tw, "%s\t-\t-\tinvalid\t-\t%d\t-\t-\t%s\n", r.EngineID, r.InFlight, r.Invalid)
			continue
		}
		ms := "-"
		if len(r.Models) > 0 {
			ms = strings.Join(r.Models, ",")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%t\t%d\t%s\t%s\t%s\n", r.EngineID, r.URL, r.Role, r.State, r.Eligible, r.InFlight, ms, r.Source, r.Since.Format(time.RFC3339))
	}
	return tw.Flush()
}
