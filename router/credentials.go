package router

import (
	"github.com/narwhalmesh/narwhal/engines"
)

// credentialFault handles an engine fault of kind engine_unauthorized:
// the engine refuses the router's credentials, and the mesh view keeps
// it out of placement until its /v1/models accepts them
// (meshview.View.RefuseCredentials).
func (rt *Router) credentialFault(f *engines.Fault) {
	if f.Kind != engines.KindEngineUnauthorized {
		return
	}
	rt.mesh.RefuseCredentials(rt.fleet().Member(f.EngineID), f.UpstreamStatus, f.Phase)
}
