package router

import (
	"github.com/narwhalmesh/narwhal/prefix"
	"github.com/narwhalmesh/narwhal/router/meshview"
)

// The request path's names for what it reads of the mesh view
// (router/meshview): a phase, one engine of the fleet, the fleet as of
// now.
type (
	phase  = meshview.Phase
	member = meshview.Member
	fleet  = meshview.Fleet
)

const (
	prefillPhase = meshview.Prefill
	decodePhase  = meshview.Decode
)

// meshView is all the request path reads of the mesh (a
// *meshview.View): the fleet as of now — its members, each one's
// eligibility (meshview.Member.Takes), load and reservations — and the
// prefix index's match of a prompt. What it writes is the request's
// own: the slots it reserves and releases on a member, the back-off or
// quarantine a fault calls for, the prompt it placed (RecordPrefix), an
// engine that refused the router's credentials. The watches of the bus
// and the engines that keep the view true are the view's own business
// (Router.JoinMesh, meshview.View.Start), not the request path's.
type meshView interface {
	// Fleet returns the fleet as of now.
	Fleet() *fleet
	// MatchPrefix returns how many leading blocks of hashes the prefix
	// index holds for engine engineID.
	MatchPrefix(engineID string, hashes []uint64) int
	// RecordPrefix records a prefix placement on engineID.
	RecordPrefix(engineID string, hashes []uint64)
	// TokenWork returns the model's learned bytes per token and mean
	// uncached prefill (0 until learned), for the cost (R-PLACE-3).
	TokenWork(model string) (prefix.TokenRatio, int64)
	// CorrectPrefix applies a producer's prefill usage to the index and
	// the learned figures (R-PLACE-3).
	CorrectPrefix(m *member, p *meshview.Prediction, u meshview.PrefillUsage)
	// IndexMode returns placement.index as the view keeps it
	// (config.IndexApproximate when it keeps no exact index, R-PLACE-4).
	IndexMode() string
	// ExactBlockSize returns engineID's tokens per KV block and whether
	// its exact index is exact.
	ExactBlockSize(engineID string) (int, bool)
	// MatchExact returns the leading blocks of keys engineID reports it
	// holds, and whether its exact index is exact.
	MatchExact(engineID string, keys []uint64) (prefix.ExactMatch, bool)
	// SharePlaced publishes a placement on m by its exact index for the
	// other routers' credit (R-PLACE-4), encoded into buf (returned),
	// and reports whether it was published.
	SharePlaced(m *member, keys []uint64, buf []byte) ([]byte, bool)
	// SharePlacedEnd publishes that the attempt of a placement shared
	// with SharePlaced ended (R-PLACE-4): count and last name its
	// prompt (bus.PlacedChain), completed says its prefill completed.
	SharePlacedEnd(m *member, count int, last uint64, completed bool)
	// RefuseCredentials keeps m out of placement until its /v1/models
	// accepts the router's credentials again.
	RefuseCredentials(m *member, status int, what string)
}

var _ meshView = (*meshview.View)(nil)
