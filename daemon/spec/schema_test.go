package spec

import "testing"

func TestDocumentReferencesResolve(t *testing.T) {
	d, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Operations()) == 0 {
		t.Fatal("no operations")
	}
	var walk func(v any)
	walk = func(v any) {
		switch x := v.(type) {
		case map[string]any:
			if ref, ok := x["$ref"].(string); ok {
				if _, err := d.resolve(ref); err != nil {
					t.Error(err)
				}
			}
			if x["type"] == "object" && x["properties"] != nil {
				if x["additionalProperties"] != false {
					t.Errorf("object schema without additionalProperties: false: %v", x["properties"])
				}
				if _, ok := x["required"]; !ok {
					t.Errorf("object schema without required: %v", x["properties"])
				}
			}
			for _, e := range x {
				walk(e)
			}
		case []any:
			for _, e := range x {
				walk(e)
			}
		}
	}
	walk(d.root)
}

func TestValidator(t *testing.T) {
	d, _ := Load()
	s, err := d.Schema("ExecResult")
	if err != nil {
		t.Fatal(err)
	}
	good := `{"exit_code":0,"signal":null,"stdout":"","stderr":"","timed_out":false,"truncated":false,"duration_seconds":0.1,"encoding":"utf-8"}`
	bad := map[string]string{
		"extra":    `{"exit_code":0,"signal":null,"stdout":"","stderr":"","timed_out":false,"truncated":false,"duration_seconds":0.1,"encoding":"utf-8","x":1}`,
		"missing":  `{"signal":null,"stdout":"","stderr":"","timed_out":false,"truncated":false,"duration_seconds":0.1,"encoding":"utf-8"}`,
		"type":     `{"exit_code":0.5,"signal":null,"stdout":"","stderr":"","timed_out":false,"truncated":false,"duration_seconds":0.1,"encoding":"utf-8"}`,
		"enum":     `{"exit_code":0,"signal":null,"stdout":"","stderr":"","timed_out":false,"truncated":false,"duration_seconds":0.1,"encoding":"latin1"}`,
		"minimum":  `{"exit_code":0,"signal":null,"stdout":"","stderr":"","timed_out":false,"truncated":false,"duration_seconds":-1,"encoding":"utf-8"}`,
		"nullable": `{"exit_code":0,"signal":3,"stdout":"","stderr":"","timed_out":false,"truncated":false,"duration_seconds":0.1,"encoding":"utf-8"}`,
	}
	v, _ := DecodeValue([]byte(good))
	if err := d.Validate(s, v); err != nil {
		t.Fatalf("good: %v", err)
	}
	for name, b := range bad {
		v, _ := DecodeValue([]byte(b))
		if d.Validate(s, v) == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	ev, _ := d.Schema("ExecEvent")
	for doc, ok := range map[string]bool{
		`{"event":"stdout","data":"x"}`: true,
		`{"event":"exit","exit_code":0,"signal":null,"timed_out":false,"truncated":false,"duration_seconds":0}`: true,
		`{"event":"exit","data":"x"}`: false,
	} {
		v, _ := DecodeValue([]byte(doc))
		if (d.Validate(ev, v) == nil) != ok {
			t.Errorf("%s: want valid=%v", doc, ok)
		}
	}
}
