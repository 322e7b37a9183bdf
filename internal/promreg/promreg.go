// Package promreg registers Prometheus collectors that several parts of
// one process may create under the same names (a router and its
// in-process breaker, two publishers on one registry), so that they share
// one series instead of failing.
package promreg

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Register registers c on reg and returns it, or returns the collector
// already registered under the same descriptors when it is of c's type.
// When another kind of collector holds the name, c is returned
// unregistered: it still counts, but only locally.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
	}
	return c
}
