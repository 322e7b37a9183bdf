package connector

// Role is what an engine may do in a KV transfer (behaviour.md §0): the value of a
// fleet entry's role. Its names are defined here only; config validates
// against them.
type Role string

// Engine roles.
const (
	// RolePrefill: the engine only runs prefill legs (KV producer).
	RolePrefill Role = "prefill"
	// RoleDecode: the engine only runs decode legs (KV consumer).
	RoleDecode Role = "decode"
	// RoleBoth: the engine runs either leg, and same-worker decode.
	RoleBoth Role = "both"
)

// Roles lists every role, in the order prefill, decode, both.
func Roles() []Role { return []Role{RolePrefill, RoleDecode, RoleBoth} }

// Valid reports whether r is one of Roles.
func (r Role) Valid() bool { return r == RolePrefill || r == RoleDecode || r == RoleBoth }

// CanPrefill reports whether the role may produce KV (prefill or both).
func (r Role) CanPrefill() bool { return r == RolePrefill || r == RoleBoth }

// CanDecode reports whether the role may consume KV (decode or both).
func (r Role) CanDecode() bool { return r == RoleDecode || r == RoleBoth }

// DefaultName is the connector an engine gets when its fleet entry names
// none: nixl.
const DefaultName = "nixl"
