package spec

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// Doc is the parsed OpenAPI document, for tests that hold the handlers to
// it. The validator covers the JSON-schema subset the document uses: type
// (also lists like ["x","null"]), properties, required,
// additionalProperties, items, enum, $ref, oneOf, minimum, maximum,
// exclusiveMinimum, minItems.
type Doc struct {
	root map[string]any
}

// Load parses the embedded document.
func Load() (*Doc, error) {
	var root map[string]any
	if err := decode(JSON, &root); err != nil {
		return nil, err
	}
	return &Doc{root: root}, nil
}

func decode(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber() // keep integers distinguishable from other numbers
	return dec.Decode(v)
}

// DecodeValue parses JSON the way Validate expects it.
func DecodeValue(data []byte) (any, error) {
	var v any
	err := decode(data, &v)
	return v, err
}

// Operations lists every "METHOD /path" the document describes.
func (d *Doc) Operations() []string {
	var out []string
	paths, _ := d.root["paths"].(map[string]any)
	for p, item := range paths {
		for m := range item.(map[string]any) {
			if m != "parameters" {
				out = append(out, strings.ToUpper(m)+" "+p)
			}
		}
	}
	sort.Strings(out)
	return out
}

// resolve follows a local $ref like "#/components/schemas/X".
func (d *Doc) resolve(ref string) (map[string]any, error) {
	if !strings.HasPrefix(ref, "#/") {
		return nil, fmt.Errorf("unsupported $ref %q", ref)
	}
	var cur any = d.root
	for _, part := range strings.Split(ref[2:], "/") {
		m, ok := cur.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("bad $ref %q", ref)
		}
		if cur, ok = m[part]; !ok {
			return nil, fmt.Errorf("dangling $ref %q", ref)
		}
	}
	m, ok := cur.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("$ref %q is not an object", ref)
	}
	return m, nil
}

func (d *Doc) deref(m map[string]any) (map[string]any, error) {
	for {
		ref, ok := m["$ref"].(string)
		if !ok {
			return m, nil
		}
		var err error
		if m, err = d.resolve(ref); err != nil {
			return nil, err
		}
	}
}

// Schema returns components/schemas/name.
func (d *Doc) Schema(name string) (map[string]any, error) {
	return d.resolve("#/components/schemas/" + name)
}

// ResponseSchema is the schema of the body of a documented response.
func (d *Doc) ResponseSchema(path, method string, status int, contentType string) (map[string]any, error) {
	paths, _ := d.root["paths"].(map[string]any)
	item, ok := paths[path].(map[string]any)
	if !ok {
		return nil, fmt.Errorf("path %s not in spec", path)
	}
	op, ok := item[strings.ToLower(method)].(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%s %s not in spec", method, path)
	}
	responses, _ := op["responses"].(map[string]any)
	resp, ok := responses[strconv.Itoa(status)].(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%s %s: status %d not in spec", method, path, status)
	}
	resp, err := d.deref(resp)
	if err != nil {
		return nil, err
	}
	content, _ := resp["content"].(map[string]any)
	media, ok := content[contentType].(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%s %s %d: content type %s not in spec", method, path, status, contentType)
	}
	schema, _ := media["schema"].(map[string]any)
	return schema, nil
}

// Validate checks value (decoded with DecodeValue) against schema.
func (d *Doc) Validate(schema map[string]any, value any) error {
	return d.validate(schema, value, "$")
}

func typeOf(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case bool:
		return "boolean"
	case string:
		return "string"
	case []any:
		return "array"
	case map[string]any:
		return "object"
	case json.Number:
		if _, err := x.Int64(); err == nil {
			return "integer"
		}
		return "number"
	}
	return fmt.Sprintf("%T", v)
}

func typeMatches(want, got string) bool {
	return want == got || (want == "number" && got == "integer")
}

func num(v any) (float64, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return 0, false
	}
	f, err := n.Float64()
	return f, err == nil
}

func (d *Doc) validate(schema map[string]any, v any, at string) error {
	schema, err := d.deref(schema)
	if err != nil {
		return err
	}
	if alts, ok := schema["oneOf"].([]any); ok {
		matched := 0
		for _, a := range alts {
			if d.validate(a.(map[string]any), v, at) == nil {
				matched++
			}
		}
		if matched != 1 {
			return fmt.Errorf("%s: matches %d of oneOf, want exactly 1", at, matched)
		}
	}
	got := typeOf(v)
	if t, ok := schema["type"]; ok {
		var wants []string
		switch tt := t.(type) {
		case string:
			wants = []string{tt}
		case []any:
			for _, w := range tt {
				wants = append(wants, w.(string))
			}
		}
		ok := false
		for _, w := range wants {
			ok = ok || typeMatches(w, got)
		}
		if !ok {
			return fmt.Errorf("%s: type %s, want %v", at, got, wants)
		}
	}
	if enum, ok := schema["enum"].([]any); ok {
		found := false
		for _, e := range enum {
			found = found || fmt.Sprint(e) == fmt.Sprint(v) && typeOf(e) == got
		}
		if !found {
			return fmt.Errorf("%s: %v not in enum %v", at, v, enum)
		}
	}
	if f, ok := num(v); ok {
		if m, ok := num(schema["minimum"]); ok && f < m {
			return fmt.Errorf("%s: %v < minimum %v", at, f, m)
		}
		if m, ok := num(schema["maximum"]); ok && f > m {
			return fmt.Errorf("%s: %v > maximum %v", at, f, m)
		}
		if m, ok := num(schema["exclusiveMinimum"]); ok && f <= m {
			return fmt.Errorf("%s: %v <= exclusiveMinimum %v", at, f, m)
		}
	}
	switch x := v.(type) {
	case []any:
		if m, ok := num(schema["minItems"]); ok && float64(len(x)) < m {
			return fmt.Errorf("%s: %d items < minItems %v", at, len(x), m)
		}
		if items, ok := schema["items"].(map[string]any); ok {
			for i, e := range x {
				if err := d.validate(items, e, fmt.Sprintf("%s[%d]", at, i)); err != nil {
					return err
				}
			}
		}
	case map[string]any:
		props, _ := schema["properties"].(map[string]any)
		if req, ok := schema["required"].([]any); ok {
			for _, r := range req {
				if _, ok := x[r.(string)]; !ok {
					return fmt.Errorf("%s: missing required %q", at, r)
				}
			}
		}
		for k, val := range x {
			if ps, ok := props[k].(map[string]any); ok {
				if err := d.validate(ps, val, at+"."+k); err != nil {
					return err
				}
				continue
			}
			switch ap := schema["additionalProperties"].(type) {
			case bool:
				if !ap {
					return fmt.Errorf("%s: unexpected property %q", at, k)
				}
			case map[string]any:
				if err := d.validate(ap, val, at+"."+k); err != nil {
					return err
				}
			}
		}
	}
	return nil
}
