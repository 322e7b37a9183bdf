//go:build !unix

package router

// descriptorLimit is 0 (unknown) where there is no RLIMIT_NOFILE:
// server.max_connections then defaults to config.DefaultMaxConnections.
func descriptorLimit() uint64 { return 0 }
