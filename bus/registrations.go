package bus

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/schemas"
)

// Names of the engines' registrations (behaviour.md R-FLEET-4, R-FLEET-5):
// an engine announces itself on a subject of its own, which only its own
// credential may publish, into a stream the breaker reads; the breaker
// alone writes the fleet that routers place on.
const (
	// RegistrationsStream is the JetStream stream of registrations:
	// subjects RegistrationSubjectPrefix + "<engine_id>", the last message
	// of each subject kept (a schemas.Registration as JSON). It allows no
	// rollup, no purge and no delete of messages, so that no engine can
	// remove another's registration.
	RegistrationsStream = "NARWHAL_REGISTRATIONS"
	// RegistrationSubjectPrefix starts every registration subject:
	// narwhal.registrations.<engine_id>.
	RegistrationSubjectPrefix = "narwhal.registrations."
	// RegistrationsMaxAge is how long RegistrationsStream keeps an
	// engine's last registration: far beyond any registration TTL, so
	// that a breaker taking the lease over finds every live one.
	RegistrationsMaxAge = time.Hour
)

// RegistrationSubject returns the subject of engine id's registrations,
// narwhal.registrations.<id>.
func RegistrationSubject(id string) string { return RegistrationSubjectPrefix + id }

// MaxRegistrationValue is the largest registration the breaker accepts,
// in bytes; a larger one is ignored as invalid (R-BUS-9). It is also the
// stream's largest message.
const MaxRegistrationValue = 4096

// ErrRegistrationSubject is wrapped by ParseRegistration's error when the
// payload's engine_id is not the subject's last token: one engine
// speaking for another (R-FLEET-5).
var ErrRegistrationSubject = errors.New("engine_id is not the subject's engine id")

// ErrRegistrationKeyEnv is wrapped by ParseRegistration's error when the
// payload's api_key_env is neither empty nor schemas.EngineKeyEnv of its
// engine_id: an engine asking routers to send it another variable of
// theirs as a key (behaviour.md R-FLEET-5).
var ErrRegistrationKeyEnv = errors.New("api_key_env is not the engine id's key variable")

// ParseRegistration returns the registration payload holds for subject
// (narwhal.registrations.<engine_id>), or why it is not one: larger than
// MaxRegistrationValue, not schema-valid (narwhal.registration.v1), its
// engine_id is not the subject's (an error wrapping
// ErrRegistrationSubject), or its api_key_env is neither empty nor
// schemas.EngineKeyEnv(engine_id) (an error wrapping
// ErrRegistrationKeyEnv). The breaker judges every registration with it
// (behaviour.md R-FLEET-5, R-BUS-9).
func ParseRegistration(subject string, payload []byte) (schemas.Registration, error) {
	var r schemas.Registration
	id, ok := strings.CutPrefix(subject, RegistrationSubjectPrefix)
	if !ok || id == "" || strings.Contains(id, ".") {
		return r, fmt.Errorf("subject %q is not a registration subject", subject)
	}
	if len(payload) > MaxRegistrationValue {
		return r, fmt.Errorf("registration larger than %d bytes", MaxRegistrationValue)
	}
	if err := validateValue(schemas.SchemaRegistration, "registration", payload); err != nil {
		return r, err
	}
	if err := json.Unmarshal(payload, &r); err != nil {
		return r, err
	}
	if r.EngineID != id {
		return r, fmt.Errorf("registration of %s on the subject of %s: %w", r.EngineID, id, ErrRegistrationSubject)
	}
	if want := schemas.EngineKeyEnv(r.EngineID); r.APIKeyEnv != "" && r.APIKeyEnv != want {
		return r, fmt.Errorf("registration of %s names api_key_env %s, want %s or none: %w", r.EngineID, r.APIKeyEnv, want, ErrRegistrationKeyEnv)
	}
	return r, nil
}

// registrationsStreamConfig is stream NARWHAL_REGISTRATIONS as Setup
// creates it: the last registration of each engine, for
// RegistrationsMaxAge; no rollup, no purge and no message delete, so
// that no credential but the admin's removes a registration, and no
// per-message TTL (R-FLEET-5, R-BUS-7).
func registrationsStreamConfig(replicas int) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:              RegistrationsStream,
		Description:       "Narwhal registrations: each engine's last announcement of itself, read by the breaker",
		Subjects:          []string{RegistrationSubjectPrefix + "*"},
		Retention:         jetstream.LimitsPolicy,
		Discard:           jetstream.DiscardOld,
		Storage:           jetstream.FileStorage,
		MaxAge:            RegistrationsMaxAge,
		MaxBytes:          -1, // bounded by one registration of at most MaxRegistrationValue per engine
		Duplicates:        2 * time.Minute,
		MaxMsgsPerSubject: 1,
		MaxMsgSize:        MaxRegistrationValue,
		AllowRollup:       false,
		AllowDirect:       true, // read without a consumer (R-BUS-11)
		DenyDelete:        true,
		DenyPurge:         true,
		Replicas:          replicas,
	}
}
