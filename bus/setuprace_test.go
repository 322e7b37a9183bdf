package bus

import (
	"errors"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// TestNotReadyYetIsACreateRaceRBUS8 proves that set-up on a cluster
// (R-BUS-8: every server of a cluster runs it at once, and says it
// listens only once the stream and the buckets exist) tries again when a
// bucket's stream, just created or just found, answers "stream not
// found" for a moment — nats-server does while the new stream's replicas
// are placed, and `narwhal bus` exited on it — and that no other error is
// taken for one.
func TestNotReadyYetIsACreateRaceRBUS8(t *testing.T) {
	notFound := &jetstream.APIError{Code: 404, ErrorCode: jetstream.JSErrCodeStreamNotFound, Description: "stream not found"}
	wrapped := fmt.Errorf("bus: bucket %s: %w", RoutersBucket, notReadyYet(notFound))
	if !errors.Is(wrapped, errCreateRace) {
		t.Errorf("%v: not marked as a create race, so set-up gives up on it", wrapped)
	}
	if !errors.Is(wrapped, jetstream.ErrStreamNotFound) {
		t.Errorf("%v: the server's error is lost", wrapped)
	}
	other := &jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeBadRequest, Description: "bad request"}
	if err := notReadyYet(other); errors.Is(err, errCreateRace) || err != error(other) {
		t.Errorf("notReadyYet(%v) = %v, want it unchanged", other, err)
	}
}
