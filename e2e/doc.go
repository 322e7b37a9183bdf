// Package e2e holds Narwhal's end-to-end tests. They build the narwhal
// binary once and run it as separate processes — simulated engines
// (`narwhal sim`), a router (`narwhal router`) joined to an embedded NATS
// server that the tests read the bus events from, and the whole dev stack
// (`narwhal dev`) — and drive the router with the official OpenAI Go SDK
// (github.com/openai/openai-go/v3) and net/http, checking what the client
// sees against what each engine received (behaviour.md §1, §2, §9, §14). The
// cluster tests run a mesh — `narwhal bus`, three routers, two breakers and
// four simulators — through ejection, probes, readmission, a breaker crash
// and a bus restart, and run `narwhal events` and `narwhal preflight` as
// processes (behaviour.md §7, §8, §9, §13).
//
// The package has no code outside its tests. Run it with
//
//	go test -race -count=1 ./e2e/
package e2e
