//! The YAML front matter of `SKILL.md`: the block between a leading `---` line and the next `---` line, parsed
//! with a real YAML parser (`serde_yaml_ng`), so what `check` accepts is exactly what YAML accepts. The top level
//! must be a mapping with string keys; scalars (strings, numbers, booleans) become [`YamlValue::Str`], sequences
//! of scalars [`YamlValue::List`], mappings [`YamlValue::Map`]. Errors name the line (1-based, counted in the
//! whole file).

/// A front-matter value.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(untagged)]
pub enum YamlValue {
    Str(String),
    List(Vec<String>),
    Map(Vec<(String, YamlValue)>),
}

impl YamlValue {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            YamlValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A list as strings; a scalar becomes a one-item list (an empty scalar an empty list).
    pub fn as_list(&self) -> Option<Vec<String>> {
        match self {
            YamlValue::List(l) => Some(l.clone()),
            YamlValue::Str(s) if s.is_empty() => Some(Vec::new()),
            YamlValue::Str(s) => Some(vec![s.clone()]),
            YamlValue::Map(_) => None,
        }
    }

    pub fn get(&self, key: &str) -> Option<&YamlValue> {
        match self {
            YamlValue::Map(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

/// One top-level front-matter field and the line it is on.
#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    pub key: String,
    pub value: YamlValue,
    pub line: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FrontMatter {
    pub fields: Vec<Field>,
    /// Everything after the closing `---`.
    pub body: String,
    /// The 1-based file line on which `body` starts.
    pub body_line: usize,
}

impl FrontMatter {
    pub fn get(&self, key: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.key == key)
    }
}

/// A front-matter syntax error: the 1-based line and what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct FmError {
    pub line: usize,
    pub message: String,
}

fn err(line: usize, message: impl Into<String>) -> FmError {
    FmError { line, message: message.into() }
}

/// Parse `---\n<front matter>\n---\n<body>`.
pub fn parse(text: &str) -> Result<FrontMatter, FmError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let lines: Vec<&str> = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)).collect();
    if lines.first().map(|l| l.trim_end()) != Some("---") {
        return Err(err(1, "expected `---` on the first line to open the front matter"));
    }
    let close = lines
        .iter()
        .enumerate()
        .skip(1)
        .find(|(_, l)| l.trim_end() == "---")
        .map(|(i, _)| i)
        .ok_or_else(|| err(1, "front matter opened with `---` is never closed by a `---` line"))?;
    let fields = parse_block(&lines[1..close], 2)?;
    let body = lines[close + 1..].join("\n");
    Ok(FrontMatter { fields, body, body_line: close + 2 })
}

/// Parse the lines between the fences; `first_line` is the file line number of `lines[0]`.
fn parse_block(lines: &[&str], first_line: usize) -> Result<Vec<Field>, FmError> {
    let yaml = lines.join("\n");
    if yaml.trim().is_empty() {
        return Ok(Vec::new());
    }
    let value: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).map_err(|e| {
        let text = e.to_string();
        // The parser places a duplicate key at the mapping's start and a missing `:` on the line after the
        // key: point at the line a person has to fix instead.
        let yaml_line = duplicate_key_line(lines, &text)
            .map(|i| i + 1)
            .or_else(|| simple_key_line(&text))
            .or_else(|| e.location().map(|l| l.line()));
        let line = yaml_line.map_or(first_line, |l| first_line + l.saturating_sub(1));
        let mut message = format!("invalid YAML: {e}");
        if message.contains("could not find expected ':'") {
            message.push_str(" (expected `key: value`)");
        }
        err(line, message)
    })?;
    let serde_yaml_ng::Value::Mapping(map) = value else {
        return Err(err(first_line, "the front matter must be a mapping of `key: value` lines"));
    };
    let mut fields = Vec::new();
    for (k, v) in map {
        let key = scalar_text(&k).ok_or_else(|| err(first_line, "front-matter keys must be plain strings"))?;
        let line = top_level_line(lines, &key).map_or(first_line, |i| first_line + i);
        let value = convert(&v).map_err(|m| err(line, format!("`{key}`: {m}")))?;
        fields.push(Field { key, value, line });
    }
    Ok(fields)
}

/// The 1-based YAML line of "while scanning a simple key at line N" in a parser message.
fn simple_key_line(message: &str) -> Option<usize> {
    let rest = message.split("while scanning a simple key at line ").nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// For a "duplicate entry with key \"k\"" error, the index of the second line that opens top-level `k`.
fn duplicate_key_line(lines: &[&str], message: &str) -> Option<usize> {
    let key = message.split("duplicate entry with key \"").nth(1)?.split('"').next()?;
    let first = top_level_line(lines, key)?;
    top_level_line(&lines[first + 1..], key).map(|i| first + 1 + i)
}

/// The index of the line that opens top-level `key` (no indentation, `key:`, maybe quoted).
fn top_level_line(lines: &[&str], key: &str) -> Option<usize> {
    lines.iter().position(|l| {
        let l = l.trim_end();
        [format!("{key}:"), format!("\"{key}\":"), format!("'{key}':")].iter().any(|p| l.starts_with(p.as_str()))
    })
}

fn scalar_text(v: &serde_yaml_ng::Value) -> Option<String> {
    use serde_yaml_ng::Value as Y;
    match v {
        Y::String(s) => Some(s.clone()),
        Y::Number(n) => Some(n.to_string()),
        Y::Bool(b) => Some(b.to_string()),
        Y::Null => Some(String::new()),
        Y::Tagged(t) => scalar_text(&t.value),
        Y::Sequence(_) | Y::Mapping(_) => None,
    }
}

fn convert(v: &serde_yaml_ng::Value) -> Result<YamlValue, String> {
    use serde_yaml_ng::Value as Y;
    match v {
        Y::Sequence(items) => items
            .iter()
            .map(|i| scalar_text(i).ok_or_else(|| "list items must be plain values, not lists or maps".to_string()))
            .collect::<Result<Vec<_>, _>>()
            .map(YamlValue::List),
        Y::Mapping(m) => {
            let mut out = Vec::new();
            for (k, v) in m {
                let key = scalar_text(k).ok_or("map keys must be plain strings")?;
                out.push((key, convert(v)?));
            }
            Ok(YamlValue::Map(out))
        }
        Y::Tagged(t) => convert(&t.value),
        scalar => Ok(YamlValue::Str(scalar_text(scalar).unwrap_or_default())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_scalars_lists_maps_and_block_scalars() {
        let text = "---\nname: size-and-fit\ndescription: \"Sizing: which size\" # c\nversion: '1.0'\n\
                    tags: [a, \"b, c\", d]\nexamples:\n  - one\n  - two\nmetadata:\n  triggers: [size, fit]\n  owner: ops\n  \
                    more:\n    - x\nlong: >-\n  folded\n  text\n---\nBody line\n";
        let fm = parse(text).unwrap();
        assert_eq!(fm.get("name").unwrap().value, YamlValue::Str("size-and-fit".into()));
        assert_eq!(fm.get("description").unwrap().value.as_str(), Some("Sizing: which size"));
        assert_eq!(fm.get("version").unwrap().value.as_str(), Some("1.0"));
        assert_eq!(fm.get("tags").unwrap().value.as_list().unwrap(), vec!["a", "b, c", "d"]);
        assert_eq!(fm.get("examples").unwrap().value.as_list().unwrap(), vec!["one", "two"]);
        let meta = &fm.get("metadata").unwrap().value;
        assert_eq!(meta.get("triggers").unwrap().as_list().unwrap(), vec!["size", "fit"]);
        assert_eq!(meta.get("owner").unwrap().as_str(), Some("ops"));
        assert_eq!(meta.get("more").unwrap().as_list().unwrap(), vec!["x"]);
        assert_eq!(fm.get("long").unwrap().value.as_str(), Some("folded text"));
        assert_eq!(fm.get("metadata").unwrap().line, 9);
        assert_eq!(fm.body, "Body line\n");
        assert_eq!(fm.body_line, 18);
        assert_eq!(parse("---\nversion: 1\n---\n").unwrap().get("version").unwrap().value.as_str(), Some("1"));
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("name: x\n---\n", 1, "first line"),
            ("---\nname: x\n", 1, "never closed"),
            ("---\nname: x\nname: y\n---\n", 3, "duplicate"),
            ("---\ntags: [a, b\n---\n", 2, "invalid YAML"),
            ("---\nname: \"open\n---\n", 2, "invalid YAML"),
            ("---\nname: x\nkey: a: b\n---\n", 3, "invalid YAML"),
            ("---\nname: x\ndescription: [unclosed\nversion: 1\n---\n", 3, "invalid YAML"),
            ("---\n- a\n- b\n---\n", 2, "mapping"),
            ("---\nlist:\n  - [a, b]\n---\n", 2, "list items"),
        ];
        for (text, line, needle) in cases {
            let e = parse(text).unwrap_err();
            assert!((line..=line + 1).contains(&e.line), "{text:?}: line {} not near {line}: {e:?}", e.line);
            assert!(e.message.contains(needle), "{text:?}: {e:?}");
        }
    }
}
