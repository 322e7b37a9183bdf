package engines

import (
	"errors"
	"net"
	"os"
	"strings"
	"syscall"
)

// What the router ran out of when a leg could not start
// (Fault.Resource of a KindRouterResources fault, behaviour.md R-FAIL-9);
// they are the kind label of narwhal_router_resource_errors_total
// (docs/observability.md).
const (
	// ResourceEMFILE: the process's own descriptor limit (RLIMIT_NOFILE)
	// is reached ("too many open files").
	ResourceEMFILE = "emfile"
	// ResourceENFILE: the host's file table is full.
	ResourceENFILE = "enfile"
	// ResourceENOBUFS: the kernel has no buffer space for a new socket.
	ResourceENOBUFS = "enobufs"
	// ResourceEADDRNOTAVAIL: no local port (or address) is left to
	// connect from ("cannot assign requested address").
	ResourceEADDRNOTAVAIL = "eaddrnotavail"
	// ResourceENOMEM: the kernel could not allocate memory for the socket.
	ResourceENOMEM = "enomem"
	// ResourcePool: the leg's timer ran out while it waited for a
	// connection of the router's own bounded pool (PrefillConnsPerEngine
	// per engine) — no connection to the engine was even tried.
	ResourcePool = "pool"
)

// Resources lists every Resource* value, for metrics created at zero.
var Resources = []string{ResourceEMFILE, ResourceENFILE, ResourceENOBUFS, ResourceEADDRNOTAVAIL, ResourceENOMEM, ResourcePool}

// errPoolFull marks a leg whose timer ran out while it waited at its
// pool's bound (connPool.get).
var errPoolFull = errors.New("the router's connection pool for the engine is full")

// localErrnos are the errors of a socket, bind or connect that say the
// router ran out of something of its own, with their Resource values.
var localErrnos = []struct {
	errno    syscall.Errno
	resource string
	what     string
}{
	{syscall.EMFILE, ResourceEMFILE, "out of file descriptors, RLIMIT_NOFILE"},
	{syscall.ENFILE, ResourceENFILE, "the host's file table is full"},
	{syscall.ENOBUFS, ResourceENOBUFS, "no socket buffer space"},
	{syscall.EADDRNOTAVAIL, ResourceEADDRNOTAVAIL, "no local port left"},
	{syscall.ENOMEM, ResourceENOMEM, "out of kernel memory"},
}

// RouterResource reports what the router itself ran out of when err ended
// a leg before anything was sent: a Resource* value, or "" when err is not
// the router's own (behaviour.md R-FAIL-9). It looks through the whole
// error chain (errors.Is), so a dial's *net.OpError wrapping an
// *os.SyscallError wrapping EMFILE is ResourceEMFILE. A failed name
// lookup (*net.DNSError) keeps only the text of its cause: its resolver's
// socket failing with one of these errnos is found in that text, and a
// lookup that failed for no reason it says ("no such host" while the
// resolver could not even read its files) is the router's when the router
// cannot open a descriptor right now.
func RouterResource(err error) string {
	if err == nil {
		return ""
	}
	if errors.Is(err, errPoolFull) {
		return ResourcePool
	}
	for _, e := range localErrnos {
		if errors.Is(err, e.errno) {
			return e.resource
		}
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		for _, e := range localErrnos {
			if strings.HasSuffix(dns.Err, e.errno.Error()) {
				return e.resource
			}
		}
		return descriptorShortage()
	}
	return ""
}

// descriptorShortage opens and closes os.DevNull to tell whether the
// process can open a descriptor now: the Resource* value of the errno
// that refused it, or "" when it could.
func descriptorShortage() string {
	f, err := os.Open(os.DevNull)
	if err == nil {
		f.Close()
		return ""
	}
	for _, e := range localErrnos {
		if errors.Is(err, e.errno) {
			return e.resource
		}
	}
	return ""
}

// resourceFault is the KindRouterResources fault of a leg of phase towards
// engineID that could not start because the router ran out of resource;
// err is the dial's (or the pool's) error. EngineID names the engine the
// leg was for, for logs only: the fault blames nobody.
func resourceFault(phase, engineID, resource string, err error) *Fault {
	what := "no room in its own connection pool"
	for _, e := range localErrnos {
		if e.resource == resource {
			what = e.what
		}
	}
	f := NewFault(KindRouterResources, phase, engineID, 0,
		"router out of local resources ("+resource+", "+what+"): "+err.Error())
	f.Resource = resource
	f.Cause = err
	return f
}
