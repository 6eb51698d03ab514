//! The FAQ: `faq.jsonl`, one `{"q": ..., "a": ...}` object per line, retrieved per comment with BM25 over the
//! question (weighted double) and the answer.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Location};
use crate::text::{self, Bm25};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaqEntry {
    pub q: String,
    pub a: String,
    /// 1-based line in `faq.jsonl`.
    #[serde(skip_deserializing)]
    pub line: usize,
}

/// A retrieved FAQ entry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaqHit {
    pub line: usize,
    pub q: String,
    pub a: String,
    pub score: f32,
}

#[derive(Debug, Clone)]
pub struct Faq {
    entries: Vec<FaqEntry>,
    index: Bm25,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    q: String,
    a: String,
    #[serde(default)]
    #[allow(dead_code)]
    tags: Vec<String>,
}

/// Parse `faq.jsonl` text; `path` is used in errors. Blank lines and lines starting with `//` are skipped.
pub fn parse_faq(path: &Path, text: &str) -> Result<Vec<FaqEntry>, HarnessError> {
    let mut entries = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with("//") {
            continue;
        }
        let raw: RawEntry = serde_json::from_str(trimmed).map_err(|e| {
            HarnessError::parse(Location::line(path, line_no), format!("expected {{\"q\": ..., \"a\": ...}}: {e}"))
        })?;
        if raw.q.trim().is_empty() || raw.a.trim().is_empty() {
            return Err(HarnessError::invalid(Location::line(path, line_no), "`q` and `a` must be non-empty"));
        }
        entries.push(FaqEntry { q: raw.q, a: raw.a, line: line_no });
    }
    Ok(entries)
}

impl Faq {
    pub fn new(entries: Vec<FaqEntry>) -> Self {
        let docs: Vec<String> = entries.iter().map(|e| format!("{} {} {}", e.q, e.q, e.a)).collect();
        Faq { index: Bm25::new(&docs), entries }
    }

    /// Load `path`; a missing file is an empty FAQ.
    pub fn load(path: &Path, display: &Path) -> Result<Self, HarnessError> {
        if !path.exists() {
            return Ok(Faq::new(Vec::new()));
        }
        let text = std::fs::read_to_string(path).map_err(|e| HarnessError::io(path, e))?;
        Ok(Faq::new(parse_faq(display, &text)?))
    }

    pub fn entries(&self) -> &[FaqEntry] {
        &self.entries
    }

    /// The best `k` entries for `query` scoring at least `min_score`, best first.
    pub fn search(&self, query: &str, k: usize, min_score: f32) -> Vec<FaqHit> {
        self.index
            .search(&text::query(query, 1.0), k, min_score)
            .into_iter()
            .map(|(i, score)| {
                let e = &self.entries[i];
                FaqHit { line: e.line, q: e.q.clone(), a: e.a.clone(), score }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_faq_line_names_its_line() {
        let text = "{\"q\":\"a\",\"a\":\"b\"}\n\n{\"q\":\"x\"}\n";
        let e = parse_faq(Path::new("faq.jsonl"), text).unwrap_err();
        assert!(e.to_string().starts_with("faq.jsonl:3:"), "{e}");
        let e = parse_faq(Path::new("faq.jsonl"), "{\"q\":\"\",\"a\":\"b\"}").unwrap_err();
        assert!(e.to_string().contains("non-empty"), "{e}");
    }

    #[test]
    fn bm25_ranks_the_matching_faq_first() {
        let text = concat!(
            "{\"q\":\"How long does shipping take?\",\"a\":\"Orders ship within 48 hours.\"}\n",
            "{\"q\":\"Can I return an item?\",\"a\":\"7-day no-reason returns.\"}\n",
            "{\"q\":\"Is the fabric cotton?\",\"a\":\"See the product specs.\"}\n",
        );
        let faq = Faq::new(parse_faq(Path::new("faq.jsonl"), text).unwrap());
        let hits = faq.search("when will my order be shipped", 3, 0.0);
        assert_eq!(hits[0].line, 1);
        let hits = faq.search("can I return it", 3, 0.0);
        assert_eq!(hits[0].line, 2);
    }
}
