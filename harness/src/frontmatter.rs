//! A minimal YAML front-matter reader for `SKILL.md`: the block between a leading `---` line and the next `---`
//! line, holding flat `key: value` pairs, inline lists `[a, b]`, block lists (`- item` lines), block scalars
//! (`|` keeps newlines, `>` folds them) and one level of nested map (`metadata:` followed by indented
//! `key: value` lines). Anything else is an error that names the line (1-based, counted in the whole file).

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

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start_matches([' ', '\t']).len()
}

fn is_blank_or_comment(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
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
    let mut fields: Vec<Field> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let lineno = first_line + i;
        if is_blank_or_comment(line) {
            i += 1;
            continue;
        }
        if indent_of(line) > 0 {
            return Err(err(lineno, "unexpected indentation (nested values need a parent `key:` line)"));
        }
        let (key, rest) = split_key(line, lineno)?;
        if fields.iter().any(|f| f.key == key) {
            return Err(err(lineno, format!("duplicate key `{key}`")));
        }
        // The indented lines that belong to this key.
        let mut j = i + 1;
        while j < lines.len() && (lines[j].trim().is_empty() || indent_of(lines[j]) > 0) {
            j += 1;
        }
        let children: Vec<(usize, &str)> = (i + 1..j).map(|k| (first_line + k, lines[k])).collect();
        let value = match rest {
            "|" | ">" | "|-" | ">-" => block_scalar(&children, rest.starts_with('|')),
            "" => nested(&children, lineno)?,
            _ => {
                if let Some((n, _)) = children.iter().find(|(_, l)| !is_blank_or_comment(l)) {
                    return Err(err(
                        *n,
                        format!("`{key}` already has a value on line {lineno}; unexpected indented line"),
                    ));
                }
                scalar_or_inline_list(rest, lineno)?
            }
        };
        fields.push(Field { key: key.to_string(), value, line: lineno });
        i = j;
    }
    Ok(fields)
}

fn split_key(line: &str, lineno: usize) -> Result<(&str, &str), FmError> {
    let Some(colon) = line.find(':') else {
        return Err(err(lineno, format!("expected `key: value`, found `{}`", line.trim())));
    };
    let key = line[..colon].trim();
    if key.is_empty() || !key.chars().all(|c| c.is_alphanumeric() || c == '_' || c == '-' || c == '.') {
        return Err(err(lineno, format!("invalid key `{key}` (letters, digits, `_`, `-`, `.`)")));
    }
    let rest = &line[colon + 1..];
    if !rest.is_empty() && !rest.starts_with([' ', '\t']) {
        return Err(err(lineno, format!("expected a space after `{key}:`")));
    }
    Ok((key, rest.trim()))
}

fn block_scalar(children: &[(usize, &str)], keep_newlines: bool) -> YamlValue {
    let parts: Vec<&str> = children.iter().map(|(_, l)| l.trim()).collect();
    let text = if keep_newlines {
        parts.join("\n").trim_end().to_string()
    } else {
        parts.iter().filter(|p| !p.is_empty()).copied().collect::<Vec<_>>().join(" ")
    };
    YamlValue::Str(text)
}

/// An empty-valued key: a block list, a nested map, or nothing (an empty string).
fn nested(children: &[(usize, &str)], lineno: usize) -> Result<YamlValue, FmError> {
    let items: Vec<(usize, &str)> =
        children.iter().filter(|(_, l)| !is_blank_or_comment(l)).map(|&(n, l)| (n, l.trim())).collect();
    let Some(&(_, first)) = items.first() else {
        return Ok(YamlValue::Str(String::new()));
    };
    if first.starts_with("- ") || first == "-" {
        let mut list = Vec::new();
        for (n, item) in items {
            let Some(v) = item.strip_prefix('-') else {
                return Err(err(n, "expected a `- item` line in this list"));
            };
            list.push(scalar(v.trim(), n)?);
        }
        return Ok(YamlValue::List(list));
    }
    let depth = indent_of(children.iter().find(|(_, l)| !is_blank_or_comment(l)).map(|(_, l)| *l).unwrap_or(""));
    let mut map: Vec<(String, YamlValue)> = Vec::new();
    let mut k = 0;
    let raw: Vec<(usize, &str)> = children.iter().filter(|(_, l)| !is_blank_or_comment(l)).copied().collect();
    while k < raw.len() {
        let (n, line) = raw[k];
        if indent_of(line) != depth {
            return Err(err(n, "inconsistent indentation in nested map"));
        }
        let (key, rest) = split_key(line.trim_start(), n)?;
        if map.iter().any(|(k2, _)| k2 == key) {
            return Err(err(n, format!("duplicate key `{key}`")));
        }
        let mut m = k + 1;
        while m < raw.len() && indent_of(raw[m].1) > depth {
            m += 1;
        }
        let value = if rest.is_empty() && m > k + 1 {
            let mut list = Vec::new();
            for &(n2, item) in &raw[k + 1..m] {
                let Some(v) = item.trim().strip_prefix('-') else {
                    return Err(err(n2, "only lists may be nested inside a nested map (`- item` lines)"));
                };
                list.push(scalar(v.trim(), n2)?);
            }
            YamlValue::List(list)
        } else if m > k + 1 {
            return Err(err(raw[k + 1].0, format!("`{key}` already has a value; unexpected indented line")));
        } else {
            scalar_or_inline_list(rest, n)?
        };
        map.push((key.to_string(), value));
        k = m;
    }
    let _ = lineno;
    Ok(YamlValue::Map(map))
}

fn scalar_or_inline_list(rest: &str, lineno: usize) -> Result<YamlValue, FmError> {
    if let Some(inner) = rest.strip_prefix('[') {
        let inner = strip_comment(inner);
        let Some(inner) = inner.trim_end().strip_suffix(']') else {
            return Err(err(lineno, "inline list opened with `[` is not closed with `]` on the same line"));
        };
        let mut items = Vec::new();
        for part in split_commas(inner, lineno)? {
            let part = part.trim();
            if !part.is_empty() {
                items.push(scalar(part, lineno)?);
            }
        }
        return Ok(YamlValue::List(items));
    }
    Ok(YamlValue::Str(scalar(rest, lineno)?))
}

fn strip_comment(s: &str) -> &str {
    match s.find(" #") {
        Some(i) if !s[..i].contains(['"', '\'']) => &s[..i],
        _ => s,
    }
}

fn split_commas(s: &str, lineno: usize) -> Result<Vec<&str>, FmError> {
    let mut parts = Vec::new();
    let mut quote: Option<char> = None;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, ',') => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if quote.is_some() {
        return Err(err(lineno, "unterminated quote in inline list"));
    }
    parts.push(&s[start..]);
    Ok(parts)
}

/// A scalar: quoted (`"..."` with `\"`/`\\`/`\n` escapes, or `'...'` with `''`) or plain (a ` #` starts a
/// comment).
fn scalar(s: &str, lineno: usize) -> Result<String, FmError> {
    let s = s.trim();
    if let Some(inner) = s.strip_prefix('"') {
        let Some(end) = find_closing_double(inner) else {
            return Err(err(lineno, "unterminated double-quoted string"));
        };
        let tail = inner[end + 1..].trim();
        if !tail.is_empty() && !tail.starts_with('#') {
            return Err(err(lineno, format!("unexpected text after quoted string: `{tail}`")));
        }
        let mut out = String::new();
        let mut chars = inner[..end].chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                match chars.next() {
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some(other) => out.push(other),
                    None => {}
                }
            } else {
                out.push(c);
            }
        }
        return Ok(out);
    }
    if let Some(inner) = s.strip_prefix('\'') {
        let mut out = String::new();
        let mut chars = inner.char_indices().peekable();
        while let Some((_, c)) = chars.next() {
            if c == '\'' {
                if chars.peek().map(|&(_, n)| n) == Some('\'') {
                    chars.next();
                    out.push('\'');
                    continue;
                }
                let rest: String = chars.map(|(_, c)| c).collect();
                let rest = rest.trim();
                if !rest.is_empty() && !rest.starts_with('#') {
                    return Err(err(lineno, format!("unexpected text after quoted string: `{rest}`")));
                }
                return Ok(out);
            }
            out.push(c);
        }
        return Err(err(lineno, "unterminated single-quoted string"));
    }
    Ok(strip_comment(s).trim().to_string())
}

fn find_closing_double(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_scalars_lists_maps_and_block_scalars() {
        let text = "---\nname: size-and-fit\ndescription: \"Sizing: which size\" # c\nversion: '1.0'\n\
                    tags: [a, \"b, c\", d]\nexamples:\n  - one\n  - two\nmetadata:\n  triggers: [size, fit]\n  owner: ops\n  \
                    more:\n    - x\nlong: >\n  folded\n  text\n---\nBody line\n";
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
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("name: x\n---\n", 1, "first line"),
            ("---\nname: x\n", 1, "never closed"),
            ("---\nname: x\nno colon here\n---\n", 3, "key: value"),
            ("---\nname: x\nname: y\n---\n", 3, "duplicate"),
            ("---\n  name: x\n---\n", 2, "indentation"),
            ("---\ntags: [a, b\n---\n", 2, "not closed"),
            ("---\nname: \"open\n---\n", 2, "unterminated"),
            ("---\nname: x\n  - y\n---\n", 3, "already has a value"),
            ("---\nlist:\n  - a\n  b: c\n---\n", 4, "- item"),
        ];
        for (text, line, needle) in cases {
            let e = parse(text).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e:?}");
            assert!(e.message.contains(needle), "{text:?}: {e:?}");
        }
    }
}
