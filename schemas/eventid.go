package schemas

import (
	"crypto/rand"
	"encoding/base64"
)

// NewEventID returns a new event id (Envelope.ID): 16 bytes from
// crypto/rand, 22 characters of unpadded URL-safe base64. The id is also
// the JetStream message id, and the stream drops a second message with an
// id it saw within its duplicate window whoever publishes it, so ids must
// not be predictable: a sequential id (a NUID) seen once lets any
// credential that may publish an event kind publish the next ids first and
// silence the process that owns them (behaviour.md R-BUS-10, R-BUS-11).
func NewEventID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on supported platforms
	return base64.RawURLEncoding.EncodeToString(b[:])
}
