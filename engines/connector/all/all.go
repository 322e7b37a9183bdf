// Package all is the list of the connectors Narwhal ships: importing it
// registers each (connector.Register, from the connector's own init). A
// new connector is one package under engines/connector/ and one line
// here (docs/architecture.md, "How to add a connector").
package all

import (
	// Each line registers one connector.
	_ "github.com/narwhalmesh/narwhal/engines/connector/nixl"
	_ "github.com/narwhalmesh/narwhal/engines/connector/sglang"
	_ "github.com/narwhalmesh/narwhal/engines/connector/sharedstorage"
)
