package meshview

import (
	"net/http"
)

// Engines behind API keys (fleet[].api_key_env). An engine that answers
// 401 or 403 refuses the router's credentials: a configuration fault
// (engines.KindEngineUnauthorized), never a stream failure that ejects.
// While it lasts the engine is not placeable on this router: the model
// refresh asks its GET /v1/models, with the same credentials, every second,
// and the engine is placeable again once that answers 200.

// RefuseCredentials marks m as refusing the router's credentials after
// an HTTP status (401 or 403) on what ("prefill", "decode",
// "/v1/models"): it is not placeable until its /v1/models accepts them.
// The log line, at error level, is written once per episode, and each
// episode counted in narwhal_engine_credentials_refused_total. A nil m
// (an engine no longer in the fleet) is ignored, and an m that left the
// fleet is not counted (its series are deleted, R-FLEET-5).
func (v *View) RefuseCredentials(m *Member, status int, what string) {
	if m == nil || !m.refused.CompareAndSwap(false, true) {
		return
	}
	v.metrics.refused(m.ID, func() bool { return v.Fleet().byID[m.ID] != nil })
	hint := "the engine expects an API key: set fleet[].api_key_env for it"
	if !m.Credential.IsZero() {
		hint = "the engine does not accept the key in its fleet[].api_key_env variable"
	}
	v.log.Error("engine refused the router's credentials; not placeable on this router until its /v1/models accepts them",
		"engine_id", m.ID, "status", status, "on", what, "hint", hint)
}

// acceptCredentials clears the refusal once the engine answered 200.
func (v *View) acceptCredentials(m *Member) {
	if m.refused.CompareAndSwap(true, false) {
		v.log.Info("engine accepts the router's credentials again; placeable", "engine_id", m.ID)
	}
}

// refusal reports whether status is an engine's refusal of credentials.
func refusal(status int) bool {
	return status == http.StatusUnauthorized || status == http.StatusForbidden
}
