//! A JSON Schema validator for the subset MCP tools use: `type` (object, string, integer, number, boolean,
//! array, null; or a list of them), `properties`, `required`, `enum`, `minimum`/`maximum`,
//! `minLength`/`maxLength`, `additionalProperties` (false or a schema), `items`. Other keywords are ignored.
//!
//! `coerce` repairs the usual model slips before validation: numbers and booleans sent as strings, whole floats
//! for integers, a scalar where an array is expected, a JSON object sent as a string, enum values in the wrong
//! case, and `null` for optional properties (dropped).

use serde_json::{Map, Value};

/// One validation failure: a JSON path (`$.size`, `$.items[0]`) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

const TYPES: [&str; 7] = ["object", "string", "integer", "number", "boolean", "array", "null"];

fn type_names(schema: &Value) -> Vec<&str> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

fn is_integer(v: &Value) -> bool {
    v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0 && f.is_finite())
}

fn has_type(v: &Value, t: &str) -> bool {
    match t {
        "object" => v.is_object(),
        "string" => v.is_string(),
        "integer" => v.is_number() && is_integer(v),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "array" => v.is_array(),
        "null" => v.is_null(),
        _ => true,
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 { format!("{}…", s.chars().take(40).collect::<String>()) } else { s }
}

/// Every way `value` fails `schema` (empty when it is valid).
pub fn validate(schema: &Value, value: &Value) -> Vec<SchemaError> {
    let mut errors = Vec::new();
    validate_at(schema, value, "$", &mut errors);
    errors
}

fn validate_at(schema: &Value, value: &Value, path: &str, errors: &mut Vec<SchemaError>) {
    let mut fail = |message: String| errors.push(SchemaError { path: path.to_string(), message });
    let types = type_names(schema);
    if !types.is_empty() && !types.iter().any(|t| has_type(value, t)) {
        fail(format!("expected {}, got {} {}", types.join(" or "), kind(value), short(value)));
        return;
    }
    if let Some(Value::Array(options)) = schema.get("enum")
        && !options.contains(value)
    {
        let opts: Vec<String> = options.iter().map(Value::to_string).collect();
        fail(format!("{} is not one of {}", short(value), opts.join(", ")));
    }
    if let Some(x) = value.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
            && x < min
        {
            fail(format!("{x} is less than the minimum {min}"));
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
            && x > max
        {
            fail(format!("{x} is more than the maximum {max}"));
        }
    }
    if let Some(s) = value.as_str() {
        let n = s.chars().count() as u64;
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && n < min
        {
            fail(format!("string of {n} characters is shorter than minLength {min}"));
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && n > max
        {
            fail(format!("string of {n} characters is longer than maxLength {max}"));
        }
    }
    if let Some(obj) = value.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(required)) = schema.get("required") {
            for name in required.iter().filter_map(Value::as_str) {
                if !obj.contains_key(name) {
                    errors.push(SchemaError {
                        path: path.to_string(),
                        message: format!("missing required property `{name}`"),
                    });
                }
            }
        }
        for (key, v) in obj {
            let child = format!("{path}.{key}");
            match props.and_then(|p| p.get(key)) {
                Some(sub) => validate_at(sub, v, &child, errors),
                None => match schema.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        let known: Vec<&str> =
                            props.map(|p| p.keys().map(String::as_str).collect()).unwrap_or_default();
                        errors.push(SchemaError {
                            path: child,
                            message: format!("unknown property `{key}` (known: {})", known.join(", ")),
                        });
                    }
                    Some(sub @ Value::Object(_)) => validate_at(sub, v, &child, errors),
                    _ => {}
                },
            }
        }
    }
    if let (Some(items), Some(arr)) = (schema.get("items"), value.as_array()) {
        for (i, v) in arr.iter().enumerate() {
            validate_at(items, v, &format!("{path}[{i}]"), errors);
        }
    }
}

/// `value` with the usual model slips repaired toward `schema` (see the module docs). Never fails; validate the
/// result.
pub fn coerce(schema: &Value, value: &Value) -> Value {
    let types = type_names(schema);
    let wants = |t: &str| types.contains(&t);
    let fits = types.is_empty() || types.iter().any(|t| has_type(value, t));
    let mut v = value.clone();
    if wants("integer") && value.is_f64() && is_integer(value) {
        // 2.0 for an integer: valid JSON Schema, but tools written in typed languages reject it.
        v = value.as_f64().map(|f| Value::from(f as i64)).unwrap_or(v);
    } else if !fits {
        v = match value {
            Value::String(s) => {
                let s = s.trim();
                if wants("integer")
                    && let Ok(i) = s.parse::<i64>()
                {
                    Value::from(i)
                } else if wants("number")
                    && let Some(n) = s.parse::<f64>().ok().and_then(serde_json::Number::from_f64)
                {
                    Value::Number(n)
                } else if wants("boolean") && s.eq_ignore_ascii_case("true") {
                    Value::Bool(true)
                } else if wants("boolean") && s.eq_ignore_ascii_case("false") {
                    Value::Bool(false)
                } else if (wants("object") && s.starts_with('{')) || (wants("array") && s.starts_with('[')) {
                    serde_json::from_str(s).unwrap_or_else(|_| value.clone())
                } else if wants("array") {
                    Value::Array(vec![value.clone()])
                } else {
                    value.clone()
                }
            }
            Value::Number(n) if wants("integer") && is_integer(value) => {
                n.as_f64().map(|f| Value::from(f as i64)).unwrap_or_else(|| value.clone())
            }
            Value::Number(_) | Value::Bool(_) if wants("string") => Value::String(value.to_string()),
            Value::Null | Value::Array(_) => value.clone(),
            _ if wants("array") => Value::Array(vec![value.clone()]),
            _ => value.clone(),
        };
    }
    if let (Some(Value::Array(options)), Value::String(s)) = (schema.get("enum"), &v)
        && !options.contains(&v)
    {
        let matches: Vec<&Value> =
            options.iter().filter(|o| o.as_str().is_some_and(|o| o.eq_ignore_ascii_case(s.trim()))).collect();
        if let [only] = matches[..] {
            v = only.clone();
        }
    }
    match &mut v {
        Value::Object(obj) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let required: Vec<&str> = schema
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut out = Map::new();
            for (key, child) in std::mem::take(obj) {
                let sub = props.and_then(|p| p.get(&key));
                if child.is_null()
                    && !required.contains(&key.as_str())
                    && sub.is_some_and(|s| !type_names(s).contains(&"null"))
                {
                    continue;
                }
                let child = match sub {
                    Some(sub) => coerce(sub, &child),
                    None => child,
                };
                out.insert(key, child);
            }
            *obj = out;
        }
        Value::Array(arr) => {
            if let Some(items) = schema.get("items") {
                for item in arr.iter_mut() {
                    *item = coerce(items, item);
                }
            }
        }
        _ => {}
    }
    v
}

/// Problems with a schema itself (for `harness check` and `tools.json` overrides): unknown types, malformed
/// keywords, `required` names that are not properties. Paths are JSON pointers into the schema.
pub fn check_schema(schema: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    check_at(schema, "", &mut problems);
    problems
}

fn check_at(schema: &Value, at: &str, problems: &mut Vec<String>) {
    let here = if at.is_empty() { "/" } else { at };
    let Some(obj) = schema.as_object() else {
        problems.push(format!("{here}: a schema must be a JSON object, found {}", kind(schema)));
        return;
    };
    match obj.get("type") {
        None => {}
        Some(Value::String(t)) if TYPES.contains(&t.as_str()) => {}
        Some(Value::Array(ts))
            if !ts.is_empty() && ts.iter().all(|t| t.as_str().is_some_and(|t| TYPES.contains(&t))) => {}
        Some(other) => problems.push(format!("{here}: unknown `type` {other} (expected one of {})", TYPES.join(", "))),
    }
    let props = obj.get("properties");
    match props {
        None => {}
        Some(Value::Object(p)) => {
            for (name, sub) in p {
                check_at(sub, &format!("{at}/properties/{name}"), problems);
            }
        }
        Some(_) => problems.push(format!("{here}: `properties` must be an object")),
    }
    match obj.get("required") {
        None => {}
        Some(Value::Array(r)) => {
            for name in r {
                match name.as_str() {
                    Some(n) if props.and_then(Value::as_object).is_some_and(|p| p.contains_key(n)) => {}
                    Some(n) => problems.push(format!("{here}: required property `{n}` is not listed in `properties`")),
                    None => problems.push(format!("{here}: `required` must list strings, found {name}")),
                }
            }
        }
        Some(_) => problems.push(format!("{here}: `required` must be an array of property names")),
    }
    match obj.get("enum") {
        None => {}
        Some(Value::Array(e)) if !e.is_empty() => {}
        Some(_) => problems.push(format!("{here}: `enum` must be a non-empty array")),
    }
    for key in ["minimum", "maximum"] {
        if obj.get(key).is_some_and(|v| !v.is_number()) {
            problems.push(format!("{here}: `{key}` must be a number"));
        }
    }
    for key in ["minLength", "maxLength"] {
        if obj.get(key).is_some_and(|v| !v.is_u64()) {
            problems.push(format!("{here}: `{key}` must be a non-negative integer"));
        }
    }
    match obj.get("additionalProperties") {
        None | Some(Value::Bool(_)) => {}
        Some(sub @ Value::Object(_)) => check_at(sub, &format!("{at}/additionalProperties"), problems),
        Some(_) => problems.push(format!("{here}: `additionalProperties` must be a boolean or a schema")),
    }
    if let Some(items) = obj.get("items") {
        check_at(items, &format!("{at}/items"), problems);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stock_schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "product_id": {"type": "string", "minLength": 1, "maxLength": 8},
                "size": {"type": "string", "enum": ["S", "M", "L"]},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                "weight": {"type": "number"},
                "gift": {"type": "boolean"},
                "colors": {"type": "array", "items": {"type": "string"}}
            },
            "required": ["product_id"],
            "additionalProperties": false
        })
    }

    #[test]
    fn valid_arguments_pass() {
        let args =
            json!({"product_id": "p1", "size": "M", "quantity": 2, "weight": 1.5, "gift": true, "colors": ["red"]});
        assert!(validate(&stock_schema(), &args).is_empty());
    }

    #[test]
    fn each_keyword_reports_its_violation() {
        let s = stock_schema();
        let cases = [
            (json!({}), "$", "missing required property `product_id`"),
            (json!({"product_id": 3}), "$.product_id", "expected string"),
            (json!({"product_id": ""}), "$.product_id", "shorter than minLength"),
            (json!({"product_id": "123456789"}), "$.product_id", "longer than maxLength"),
            (json!({"product_id": "p", "size": "XL"}), "$.size", "not one of"),
            (json!({"product_id": "p", "quantity": 0}), "$.quantity", "less than the minimum"),
            (json!({"product_id": "p", "quantity": 11}), "$.quantity", "more than the maximum"),
            (json!({"product_id": "p", "quantity": 1.5}), "$.quantity", "expected integer"),
            (json!({"product_id": "p", "gift": "maybe"}), "$.gift", "expected boolean"),
            (json!({"product_id": "p", "colors": [1]}), "$.colors[0]", "expected string"),
            (json!({"product_id": "p", "colour": "red"}), "$.colour", "unknown property"),
            (json!("p1"), "$", "expected object"),
        ];
        for (value, path, needle) in cases {
            let errs = validate(&s, &value);
            assert!(errs.iter().any(|e| e.path == path && e.message.contains(needle)), "{value}: {errs:?}");
        }
    }

    #[test]
    fn coercion_repairs_common_model_slips() {
        let s = stock_schema();
        let args =
            json!({"product_id": 42, "size": "m", "quantity": "3", "weight": "2.5", "gift": "TRUE", "colors": "red"});
        let fixed = coerce(&s, &args);
        assert_eq!(
            fixed,
            json!({"product_id": "42", "size": "M", "quantity": 3, "weight": 2.5, "gift": true, "colors": ["red"]})
        );
        assert!(validate(&s, &fixed).is_empty());
        // Whole floats become integers; nulls for optional properties are dropped.
        assert_eq!(
            coerce(&s, &json!({"product_id": "p", "quantity": 2.0, "size": null})),
            json!({"product_id": "p", "quantity": 2})
        );
        // Arguments sent as a JSON string.
        assert_eq!(coerce(&s, &json!("{\"product_id\": \"p\"}")), json!({"product_id": "p"}));
    }

    #[test]
    fn coercion_leaves_unrepairable_values_for_validation() {
        let s = stock_schema();
        let fixed = coerce(&s, &json!({"product_id": "p", "quantity": "three", "size": "xl"}));
        assert_eq!(fixed, json!({"product_id": "p", "quantity": "three", "size": "xl"}));
        assert_eq!(validate(&s, &fixed).len(), 2);
    }

    #[test]
    fn type_lists_accept_any_member() {
        let s = json!({"type": ["string", "null"]});
        assert!(validate(&s, &json!(null)).is_empty());
        assert!(validate(&s, &json!("x")).is_empty());
        assert_eq!(validate(&s, &json!(1)).len(), 1);
    }

    #[test]
    fn schema_check_finds_malformed_schemas() {
        assert!(check_schema(&stock_schema()).is_empty());
        let bad = json!({
            "type": "objekt",
            "properties": {"a": {"type": "string", "minLength": -1}, "b": "not a schema"},
            "required": ["a", "c"],
            "enum": [],
            "additionalProperties": 3
        });
        let problems = check_schema(&bad);
        for needle in [
            "unknown `type`",
            "/properties/a: `minLength`",
            "/properties/b: a schema must be",
            "`c` is not listed",
            "`enum`",
            "`additionalProperties`",
        ] {
            assert!(problems.iter().any(|p| p.contains(needle)), "{needle}: {problems:?}");
        }
    }
}
