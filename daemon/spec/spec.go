// Package spec embeds the OpenAPI 3.1 description of protocol v1, the
// machine-readable contract shared with the Python client.
package spec

import _ "embed"

// JSON is daemon/spec/openapi.json.
//
//go:embed openapi.json
var JSON []byte
