// Package chaos injects engine faults between a router and its engines
// (behaviour.md R-CHAOS-1), so that the router's timeouts, error mapping, retries
// and the breaker's ejection and readmission can be proven against any
// OpenAI-compatible engine — the simulator or a real vLLM.
//
// A Proxy is a transparent streaming reverse proxy in front of one engine.
// It injects faults by rewriting traffic, never by asking the engine: it
// refuses or delays connections, holds headers or chunks, cuts streams,
// writes error frames and [DONE] markers, answers error statuses in the
// engine's place and corrupts the handoff descriptors of prefill
// responses. Which faults are armed lives in the JetStream KV bucket
// narwhal_chaos (see Store): key <engine_id>.<fault_id>, value a Fault as
// JSON. Every proxy watches its engine's keys, so `narwhal chaos arm` on
// any machine reaches it at once, a restarted proxy picks armed faults up,
// and a fault that nobody disarms ends at its expiry. Every arm, disarm and
// injection is published as a schemas.Chaos event on
// narwhal.events.chaos.<engine_id>.
//
// A Scenario is a timed list of arm and disarm steps, read from YAML and
// played against a Store (`narwhal chaos run`).
//
// docs/chaos.md describes the catalogue and what a client behind a router
// sees for each fault.
package chaos
