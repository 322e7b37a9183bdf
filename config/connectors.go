package config

import (
	// Connector names are validated against the registry: the connectors
	// Narwhal ships register there.
	_ "github.com/narwhalmesh/narwhal/engines/connector/all"
)
