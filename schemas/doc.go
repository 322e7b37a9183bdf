// Package schemas holds Narwhal's wire types: the subset of the OpenAI
// request and response shapes the router reads, the OpenAI/vLLM error body,
// and the bus events with their JSON Schema files (behaviour.md R-API-3, R-BUS-3).
//
// It imports the standard library only, so every other package may use it.
package schemas
