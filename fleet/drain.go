package fleet

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// ReportsIgnored counts the values of narwhal_routers ReadReports
// ignored, by why.
type ReportsIgnored struct {
	// Invalid: not a router report (not schema narwhal.router.v1, R-BUS-9).
	Invalid int
	// RouterIDMismatch: a valid report whose router_id is not its key:
	// one router speaking for another (behaviour.md R-BUS-11).
	RouterIDMismatch int
}

// Total is how many values were ignored.
func (n ReportsIgnored) Total() int { return n.Invalid + n.RouterIDMismatch }

// ReadReports returns every valid router in-flight report of KV bucket
// narwhal_routers on b (behaviour.md R-FLEET-3), and how many values it
// ignored for not being one (not schema narwhal.router.v1, R-BUS-9), or
// for a router_id that is not the key (R-BUS-11). A router that stopped
// has no key: the bucket's TTL removed it with its legs. It reads through
// one watch's first, full delivery (bus.WatchKeys: by direct gets, no
// consumer, with a role's credential, R-BUS-11), which every credential
// that reads the bucket may do.
func ReadReports(ctx context.Context, b *bus.Bus) (reports []schemas.RouterReport, ignored ReportsIgnored, err error) {
	all, err := readAll(ctx, b, bus.RoutersBucket)
	if err != nil {
		return nil, ReportsIgnored{}, fmt.Errorf("fleet: read the routers' reports: %w", err)
	}
	reports, ignored = parseReports(all)
	return reports, ignored, nil
}

// ReadReportsOwn is ReadReports through a consumer of b's own name for
// purpose bus.PurposeReports (behaviour.md R-BUS-11: the only consumer
// of bucket narwhal_routers an engine's credential may make), which it
// deletes again. An engine that drains itself reads the reports so.
func ReadReportsOwn(ctx context.Context, b *bus.Bus) (reports []schemas.RouterReport, ignored ReportsIgnored, err error) {
	all, err := bus.ReadBucket(ctx, b, bus.RoutersBucket, b.ConsumerName(bus.PurposeReports))
	if err != nil {
		return nil, ReportsIgnored{}, fmt.Errorf("fleet: read the routers' reports: %w", err)
	}
	reports, ignored = parseReports(all)
	return reports, ignored, nil
}

// parseReports sorts the values of narwhal_routers into valid reports and
// ignored ones.
func parseReports(all []jetstream.KeyValueEntry) (reports []schemas.RouterReport, ignored ReportsIgnored) {
	for _, kve := range all {
		var r schemas.RouterReport
		switch {
		case bus.ValidateRouterReport(kve.Value()) != nil || json.Unmarshal(kve.Value(), &r) != nil:
			ignored.Invalid++
		case r.RouterID != kve.Key():
			ignored.RouterIDMismatch++
		default:
			reports = append(reports, r)
		}
	}
	return reports, ignored
}

// WithoutReports is what DrainDone answers when no router reports at
// all.
type WithoutReports bool

// The two answers of DrainDone without any report; each caller names the
// one it needs.
const (
	// DoneWithoutReports: no report means no router is running, so no
	// leg can be in flight and the drain is over at once (docs/fleet.md:
	// "With no router running, a drain ends at once"). The leading
	// breaker, the judge of every drain, decides so.
	DoneWithoutReports WithoutReports = true
	// BusyWithoutReports: no report is no word from any router, and the
	// drain goes on. An engine draining itself (package membership,
	// `narwhal agent` on SIGTERM) waits so: it cannot tell no router
	// from routers it does not hear yet, and the breaker's word (state
	// drained, given at once when no router runs) or its own bound ends
	// its wait instead.
	BusyWithoutReports WithoutReports = false
)

// DrainDone reports whether every router is done with draining engine
// id (behaviour.md R-FLEET-3): every report lists id among its draining
// engines with zero legs in flight. A report that does not list id is
// from a router that has not seen the drain yet: it counts as busy. With
// no report at all it answers none. The drain timeout
// (membership.drain_timeout_s) is the leading breaker's and is not
// judged here.
func DrainDone(id string, reports []schemas.RouterReport, none WithoutReports) bool {
	if len(reports) == 0 {
		return bool(none)
	}
	for _, r := range reports {
		if legs, listed := r.Draining[id]; !listed || legs != 0 {
			return false
		}
	}
	return true
}
