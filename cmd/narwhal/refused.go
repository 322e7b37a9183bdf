package main

import (
	"context"
	"errors"

	"github.com/narwhalmesh/narwhal/bus"
)

// untilRefused returns a context derived from ctx that ends once the bus
// revokes or refuses b's credential (bus.Bus.CredentialRefused,
// behaviour.md R-BUS-11), with that *bus.CredentialRefusedError as its
// cause, so that a command stops and exits non-zero naming it instead of
// retrying for ever (docs/security.md, "Revoking a credential"). stop releases it.
func untilRefused(ctx context.Context, b *bus.Bus) (_ context.Context, stop func()) {
	rctx, cancel := context.WithCancelCause(ctx)
	go func() {
		select {
		case <-b.Refused():
			cancel(b.CredentialRefused())
		case <-rctx.Done():
		}
	}()
	return rctx, func() { cancel(context.Canceled) }
}

// refusedCause returns the *bus.CredentialRefusedError that ended ctx (a
// context of untilRefused), or nil when ctx has not ended for it.
func refusedCause(ctx context.Context) error {
	var refused *bus.CredentialRefusedError
	if errors.As(context.Cause(ctx), &refused) {
		return refused
	}
	return nil
}
