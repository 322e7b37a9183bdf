package sglang

import (
	// CheckEngine's table judges nixl entries too.
	_ "github.com/narwhalmesh/narwhal/engines/connector/nixl"
)
