package bus

import "time"

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
