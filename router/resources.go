package router

import (
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/narwhalmesh/narwhal/engines"
)

// resourceWindow is how long after the last router_resources fault the
// router reports itself unready (behaviour.md R-FAIL-9).
const resourceWindow = 5 * time.Second

// resourceFaults is what the router knows of its own resource faults
// (engines.KindRouterResources, behaviour.md R-FAIL-9): the counter of
// narwhal_router_resource_errors_total and the last fault, which keeps
// /readyz unready for window after it.
type resourceFaults struct {
	window time.Duration // resourceWindow; tests shorten it
	errors *prometheus.CounterVec

	mu       sync.Mutex
	last     time.Time // the last fault, zero for none
	resource string    // its resource (engines.Resource*)
	message  string    // its fault's message
	logged   time.Time // the last warning logged
}

// newResourceFaults registers narwhal_router_resource_errors_total on reg,
// every kind at zero.
func newResourceFaults(reg prometheus.Registerer) *resourceFaults {
	r := &resourceFaults{window: resourceWindow, errors: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "narwhal_router_resource_errors_total",
		Help: "Engine legs that could not start because the router itself ran out of something, by kind: emfile, enfile (file descriptors), enobufs, enomem (kernel buffers, memory), eaddrnotavail (local ports), pool (its own connection pool); counted against no engine.",
	}, []string{"kind"})}
	for _, k := range engines.Resources {
		r.errors.WithLabelValues(k)
	}
	reg.MustRegister(r.errors)
	return r
}

// note counts f, a router_resources fault, and starts (or extends) the
// unready window at now — except for a wait at a full connection pool
// (engines.ResourcePool): the pool is one engine's, filled by legs that
// engine has not answered yet, so the router is no less able to serve the
// rest of the fleet, and leaving its load balancer would only move the
// same requests to another router's full pool. It reports whether a
// warning should be logged: at most one a second.
func (r *resourceFaults) note(f *engines.Fault, now time.Time) (logIt bool) {
	r.errors.WithLabelValues(f.Resource).Inc()
	r.mu.Lock()
	defer r.mu.Unlock()
	if f.Resource != engines.ResourcePool {
		r.last, r.resource, r.message = now, f.Resource, f.Message
	}
	if now.Sub(r.logged) >= time.Second {
		r.logged = now
		return true
	}
	return false
}

// problem is the /readyz problem while the last fault is younger than the
// window at now, naming what ran out; "" otherwise.
func (r *resourceFaults) problem(now time.Time) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.last.IsZero() || now.Sub(r.last) >= r.window {
		return ""
	}
	return fmt.Sprintf("router out of local resources (%s) %.1f s ago: %s", r.resource, now.Sub(r.last).Seconds(), r.message)
}

// resourceFault records a leg that could not start because the router ran
// out of something of its own (behaviour.md R-FAIL-9): counted in
// narwhal_router_resource_errors_total, /readyz unready for the window,
// a warning logged at most once a second; nothing is published and no
// engine is counted, quarantined or blamed.
func (c *call) resourceFault(f *engines.Fault) {
	rt := c.rt
	if rt.resources.note(f, time.Now()) {
		rt.log.Warn("router out of local resources: engine leg not started", "request_id", c.id, "kind", f.Resource,
			"phase", f.Phase, "engine_id", f.EngineID, "err", f.Cause)
	}
}
