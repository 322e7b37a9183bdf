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

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
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
	var run func(ctx context.Context, kv jetstream.KeyValue, b *bus.Bus) error
	var positional []string
	oneID := func() (string, error) { return checkOneID(positional) }
	switch sub {
	case "list":
		asJSON := fs.Bool("json", false, "print one JSON object per engine")
		run = func(ctx context.Context, kv jetstream.KeyValue, b *bus.Bus) error {
			return fleetList(ctx, kv, b, stdout, *asJSON)
		}
	case "add":
		spec := schemas.FleetEntry{}
		fs.StringVar(&spec.EngineID, "id", "", "the engine's `ID` (letters, digits, '-' and '_')")
		fs.StringVar(&spec.URL, "url", "", "the engine's http(s) base `URL`")
		fs.StringVar(&spec.Role, "role", "", "prefill, decode or both")
		fs.StringVar(&spec.Connector, "connector", connector.DefaultName, "the KV connector: "+strings.Join(connector.Names(), ", "))
		fs.IntVar(&spec.BootstrapPort, "bootstrap-port", 0, "a prefill SGLang engine's bootstrap `PORT` (connector sglang)")
		fs.IntVar(&spec.PrefillSlots, "prefill-slots", 0, "prefill phases at once (0: no limit)")
		fs.IntVar(&spec.DecodeSlots, "decode-slots", 0, "decode phases at once (0: no limit)")
		fs.StringVar(&spec.APIKeyEnv, "api-key-env", "", "the environment `VAR` every process reads the engine's API key from")
		run = func(ctx context.Context, kv jetstream.KeyValue, _ *bus.Bus) error {
			if err := fleetAdd(ctx, kv, spec, time.Now()); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "engine %s added: joining; placeable once the breaker's checks pass (watch: narwhal events --kind probe --engine %s)\n", spec.EngineID, spec.EngineID)
			return nil
		}
	case "drain":
		wait := fs.Bool("wait", false, "wait until the engine is drained")
		timeout := fs.Duration("timeout", 0, "with --wait: give up after `DUR` (0: wait for the breaker, which declares a drain over after membership.drain_timeout_s)")
		run = func(ctx context.Context, kv jetstream.KeyValue, _ *bus.Bus) error {
			id, err := oneID()
			if err != nil {
				return err
			}
			state, err := fleetDrain(ctx, kv, id, time.Now())
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "engine %s %s: no new attempt goes there; running ones finish\n", id, state)
			if !*wait {
				return nil
			}
			return fleetWaitDrained(ctx, kv, id, *timeout, stdout)
		}
	case "undrain":
		run = func(ctx context.Context, kv jetstream.KeyValue, _ *bus.Bus) error {
			id, err := oneID()
			if err != nil {
				return err
			}
			state, err := fleetUndrain(ctx, kv, id, time.Now())
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "engine %s %s\n", id, state)
			return nil
		}
	case "remove":
		force := fs.Bool("force", false, "remove the engine even while it is not drained (its running attempts still finish)")
		run = func(ctx context.Context, kv jetstream.KeyValue, _ *bus.Bus) error {
			id, err := oneID()
			if err != nil {
				return err
			}
			if err := fleetRemove(ctx, kv, id, *force); err != nil {
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
	cctx, cancel := context.WithTimeout(ctx, defaultEventsConnectBound)
	b, err := bus.Connect(cctx, busOptions(busCfg, "narwhal-fleet", slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))))
	cancel()
	if err != nil {
		return fmt.Errorf("bus %s: %w", redactNATSURL(busCfg.URL), err)
	}
	defer b.Close()
	bctx, bcancel := context.WithTimeout(ctx, fleetOpTimeout)
	kv, err := b.BindBucket(bctx, bus.FleetBucket)
	bcancel()
	if err != nil {
		return err
	}
	err = run(ctx, kv, b)
	if perm := b.PermissionError(); err != nil && perm != nil {
		return fmt.Errorf("%w (%v: changing the fleet takes the admin credential)", err, perm)
	}
	return err
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
// is given, naming the flag: its id, URL, role, connector and slots.
func checkFleetSpec(e schemas.FleetEntry) error {
	var errs []error
	if !config.ValidID(e.EngineID) || len(e.EngineID) > 128 {
		errs = append(errs, fmt.Errorf("--id %q: want 1 to 128 letters, digits, '-' and '_'", e.EngineID))
	}
	if u, err := url.Parse(e.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		errs = append(errs, fmt.Errorf("--url %q: want an absolute http or https base URL such as http://10.1.2.3:8000", e.URL))
	}
	if !connector.Role(e.Role).Valid() {
		errs = append(errs, fmt.Errorf("--role %q: want %s, %s or %s", e.Role, connector.RolePrefill, connector.RoleDecode, connector.RoleBoth))
	}
	if !slices.Contains(connector.Names(), e.Connector) {
		errs = append(errs, fmt.Errorf("--connector %q: want one of %s", e.Connector, strings.Join(connector.Names(), ", ")))
	}
	if field, problem := connector.CheckEngine(e.Connector, connector.Role(e.Role), e.BootstrapPort); field != "" && field != "connector" && connector.Role(e.Role).Valid() {
		errs = append(errs, fmt.Errorf("--%s: %s", strings.ReplaceAll(field, "_", "-"), problem))
	}
	if e.PrefillSlots < 0 {
		errs = append(errs, fmt.Errorf("--prefill-slots %d: want >= 0", e.PrefillSlots))
	}
	if e.DecodeSlots < 0 {
		errs = append(errs, fmt.Errorf("--decode-slots %d: want >= 0", e.DecodeSlots))
	}
	return errors.Join(errs...)
}

// fleetAdd adds engine spec to the fleet in state joining (behaviour.md
// R-FLEET-2): the breaker probes it and makes it active. It refuses an
// invalid spec or an id the fleet holds already, changing nothing.
func fleetAdd(ctx context.Context, kv jetstream.KeyValue, spec schemas.FleetEntry, now time.Time) error {
	if err := checkFleetSpec(spec); err != nil {
		return err
	}
	now = now.UTC()
	spec.Schema, spec.State, spec.Since, spec.At = schemas.SchemaFleetEntry, schemas.FleetJoining, now, now
	spec.Source, spec.By, spec.Reason = schemas.SourceCommand, fleetWriter, "added with narwhal fleet add"
	spec.URL = strings.TrimRight(spec.URL, "/")
	data, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	if err := bus.ValidateFleetEntry(data); err != nil {
		return fmt.Errorf("engine %s: %w", spec.EngineID, err)
	}
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	if _, err := kv.Create(ctx, spec.EngineID, data); err != nil {
		if errors.Is(err, jetstream.ErrKeyExists) {
			cur, _, gerr := fleetGet(ctx, kv, spec.EngineID)
			if gerr == nil {
				return fmt.Errorf("engine %s is already in the fleet (%s, %s, %s): remove it first, or choose another id", spec.EngineID, cur.State, cur.Role, cur.URL)
			}
			return fmt.Errorf("engine %s is already in the fleet: remove it first, or choose another id", spec.EngineID)
		}
		return fmt.Errorf("add engine %s: %w", spec.EngineID, err)
	}
	return nil
}

// errNotInFleet says an id names no engine of the fleet.
var errNotInFleet = errors.New("not in the fleet")

// fleetGet reads engine id's entry and its revision. It returns an error
// wrapping errNotInFleet for a missing or deleted key, and a clear error
// for a value that is not a fleet entry for id.
func fleetGet(ctx context.Context, kv jetstream.KeyValue, id string) (schemas.FleetEntry, uint64, error) {
	var e schemas.FleetEntry
	kve, err := kv.Get(ctx, id)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
		return e, 0, fmt.Errorf("engine %s: %w (narwhal fleet list shows the fleet)", id, errNotInFleet)
	}
	if err != nil {
		return e, 0, fmt.Errorf("engine %s: %w", id, err)
	}
	if err := bus.ValidateFleetEntry(kve.Value()); err != nil {
		return e, 0, fmt.Errorf("engine %s: its entry is not valid (%v): remove it with --force", id, err)
	}
	if err := json.Unmarshal(kve.Value(), &e); err != nil || e.EngineID != id {
		return e, 0, fmt.Errorf("engine %s: its entry names another engine: remove it with --force", id)
	}
	return e, kve.Revision(), nil
}

// fleetSetState writes engine id's entry in state next, revision-checked.
func fleetSetState(ctx context.Context, kv jetstream.KeyValue, cur schemas.FleetEntry, rev uint64, next, reason string, now time.Time) error {
	now = now.UTC()
	cur.State, cur.Since, cur.At, cur.By, cur.Reason = next, now, now, fleetWriter, reason
	data, err := json.Marshal(cur)
	if err != nil {
		return err
	}
	if _, err := kv.Update(ctx, cur.EngineID, data, rev); err != nil {
		if errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists) {
			return fmt.Errorf("engine %s changed meanwhile: run the command again", cur.EngineID)
		}
		return fmt.Errorf("engine %s: %w", cur.EngineID, err)
	}
	return nil
}

// fleetDrain makes engine id draining (behaviour.md R-FLEET-3) and returns its
// state afterwards. An engine already draining or drained is left as it
// is; an unknown id is an error.
func fleetDrain(ctx context.Context, kv jetstream.KeyValue, id string, now time.Time) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	cur, rev, err := fleetGet(ctx, kv, id)
	if err != nil {
		return "", err
	}
	switch cur.State {
	case schemas.FleetDraining:
		return "is already draining", nil
	case schemas.FleetDrained:
		return "is already drained", nil
	}
	if err := fleetSetState(ctx, kv, cur, rev, schemas.FleetDraining, "drained with narwhal fleet drain", now); err != nil {
		return "", err
	}
	return "draining", nil
}

// fleetUndrain puts a draining engine back to active, and a drained one
// to joining (it is checked again before it is placed: it may have been
// restarted as something else). Any other state is an error.
func fleetUndrain(ctx context.Context, kv jetstream.KeyValue, id string, now time.Time) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	cur, rev, err := fleetGet(ctx, kv, id)
	if err != nil {
		return "", err
	}
	next := ""
	switch cur.State {
	case schemas.FleetDraining:
		next = schemas.FleetActive
	case schemas.FleetDrained:
		next = schemas.FleetJoining
	default:
		return "", fmt.Errorf("engine %s is %s, not draining or drained: nothing to undo", id, cur.State)
	}
	if err := fleetSetState(ctx, kv, cur, rev, next, "undrained with narwhal fleet undrain", now); err != nil {
		return "", err
	}
	if next == schemas.FleetJoining {
		return "joining: placeable once the breaker's checks pass", nil
	}
	return "active again", nil
}

// fleetRemove deletes engine id's key: routers place nothing more there,
// and running attempts finish (behaviour.md R-FLEET-1). Without force it refuses
// an engine that is not drained — or joining, which never took work.
func fleetRemove(ctx context.Context, kv jetstream.KeyValue, id string, force bool) error {
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	cur, rev, err := fleetGet(ctx, kv, id)
	if err != nil && (!force || errors.Is(err, errNotInFleet)) {
		return err
	}
	if err == nil && !force && cur.State != schemas.FleetDrained && cur.State != schemas.FleetJoining {
		return fmt.Errorf("engine %s is %s: drain it first (narwhal fleet drain %s --wait), or remove it with --force", id, cur.State, id)
	}
	var opts []jetstream.KVDeleteOpt
	if rev != 0 {
		opts = append(opts, jetstream.LastRevision(rev))
	}
	if err := kv.Delete(ctx, id, opts...); err != nil {
		if errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists) {
			return fmt.Errorf("engine %s changed meanwhile: run the command again", id)
		}
		return fmt.Errorf("remove engine %s: %w", id, err)
	}
	return nil
}

// fleetWaitDrained watches engine id until it is drained or gone, or
// timeout (when > 0) or ctx ends.
func fleetWaitDrained(ctx context.Context, kv jetstream.KeyValue, id string, timeout time.Duration, stdout io.Writer) error {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	w, err := kv.Watch(ctx, id)
	if err != nil {
		return fmt.Errorf("watch engine %s: %w", id, err)
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("engine %s not drained within %v", id, timeout)
			}
			return ctx.Err()
		case kve, ok := <-w.Updates():
			if !ok {
				return fmt.Errorf("watch of engine %s ended", id)
			}
			if kve == nil {
				continue
			}
			if kve.Operation() != jetstream.KeyValuePut {
				fmt.Fprintf(stdout, "engine %s left the fleet\n", id)
				return nil
			}
			var e schemas.FleetEntry
			if json.Unmarshal(kve.Value(), &e) == nil && e.State == schemas.FleetDrained {
				fmt.Fprintf(stdout, "engine %s drained: %s\n", id, e.Reason)
				return nil
			}
		}
	}
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
// eligibility, legs in flight over the routers, source. It reads only.
func fleetList(ctx context.Context, kv jetstream.KeyValue, b *bus.Bus, stdout io.Writer, asJSON bool) error {
	ctx, cancel := context.WithTimeout(ctx, fleetOpTimeout)
	defer cancel()
	lister, err := kv.ListKeys(ctx)
	if err != nil {
		return fmt.Errorf("list the fleet: %w", err)
	}
	var ids []string
	for k := range lister.Keys() {
		ids = append(ids, k)
	}
	sort.Strings(ids)
	inflight := map[string]int64{}
	models := map[string]map[string]bool{}
	if rk, err := b.BindBucket(ctx, bus.RoutersBucket); err == nil {
		if rl, err := rk.ListKeys(ctx); err == nil {
			for k := range rl.Keys() {
				kve, err := rk.Get(ctx, k)
				var r schemas.RouterReport
				if err != nil || bus.ValidateRouterReport(kve.Value()) != nil || json.Unmarshal(kve.Value(), &r) != nil {
					continue
				}
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
	for _, id := range ids {
		row := fleetRow{Eligible: true, InFlight: inflight[id], Models: []string{}}
		for m := range models[id] {
			row.Models = append(row.Models, m)
		}
		sort.Strings(row.Models)
		e, _, err := fleetGet(ctx, kv, id)
		if errors.Is(err, errNotInFleet) {
			continue
		}
		row.FleetEntry = e
		row.EngineID = id
		if err != nil {
			row.Invalid = err.Error()
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
