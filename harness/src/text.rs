//! Text matching for the skill router and FAQ retrieval: a small tokenizer (lowercase words with a light
//! suffix stemmer and a stop list; CJK runs as character unigrams + bigrams, so Chinese comments match Chinese
//! triggers without a segmenter) and Okapi BM25 over a handful of short documents.

use std::collections::{BTreeMap, HashMap};

const STOP_WORDS: &[&str] = &[
    "a", "an", "the", "and", "or", "but", "is", "are", "was", "were", "be", "been", "am", "do", "does", "did", "i",
    "me", "my", "you", "your", "we", "our", "it", "its", "this", "that", "these", "those", "to", "of", "in", "on",
    "at", "for", "with", "from", "by", "as", "so", "if", "can", "could", "will", "would", "should", "have", "has",
    "had", "what", "which", "who", "how", "there", "here", "any", "some", "please", "pls", "just", "about", "also",
    "than", "then", "them", "they", "he", "she", "him", "her", "us", "not", "no", "yes", "get", "got", "one",
];

fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x3040..=0x30FF      // kana
        | 0x3400..=0x4DBF    // CJK ext A
        | 0x4E00..=0x9FFF    // CJK unified
        | 0xAC00..=0xD7AF    // hangul
        | 0xF900..=0xFAFF) // compatibility ideographs
}

/// The language a text is written in, as far as the host's replies care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    En,
    Zh,
}

/// `Zh` when CJK characters are at least half of the text's units, a unit being a CJK character or a word of
/// other letters: a Chinese sentence that quotes English names or codes (`这款卫衣有Oat、Charcoal、Forest Green可选`,
/// `LIVE20还能用吗`) is Chinese, an English one that names `羽绒服` is English (counting letters instead made the
/// first one English: its names have more letters than it has characters). `None` for a text without letters
/// (`👍`, `666`).
pub fn language_of(text: &str) -> Option<Language> {
    let (mut cjk, mut words, mut in_word) = (0usize, 0usize, false);
    for c in text.chars() {
        let letter = c.is_alphabetic() && !is_cjk(c);
        cjk += usize::from(is_cjk(c));
        words += usize::from(letter && !in_word);
        in_word = letter;
    }
    match cjk + words {
        0 => None,
        units => Some(if 2 * cjk >= units { Language::Zh } else { Language::En }),
    }
}

/// Strip common English inflections so `ships`, `shipped`, `shipping` → `ship`; `sizes`, `size` → `siz`.
fn stem(word: &str) -> String {
    if word.len() <= 3 || !word.is_ascii() || word.bytes().any(|b| b.is_ascii_digit()) {
        return word.to_string();
    }
    let mut w = word.to_string();
    if w.ends_with("ies") && w.len() > 4 {
        w.truncate(w.len() - 3);
        w.push('y');
    } else if w.ends_with("ing") && w.len() > 5 {
        w.truncate(w.len() - 3);
    } else if w.ends_with("ed") && w.len() > 4 {
        w.truncate(w.len() - 2);
    } else if w.ends_with('s') && !w.ends_with("ss") && !w.ends_with("us") {
        w.truncate(w.len() - 1);
    }
    // Undouble a final consonant left by a stripped suffix (shipp → ship, fitt → fit).
    let b = w.as_bytes();
    if b.len() >= 4 && b[b.len() - 1] == b[b.len() - 2] && !b"aeiouls".contains(&b[b.len() - 1]) {
        w.pop();
    }
    if w.len() > 3 && w.ends_with('e') {
        w.pop();
    }
    w
}

/// Tokens of `text`: stemmed lowercase words (stop words dropped), and for CJK runs every character and every
/// pair of adjacent characters.
pub fn tokenize(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut cjk: Vec<char> = Vec::new();
    let flush_word = |word: &mut String, out: &mut Vec<String>| {
        if !word.is_empty() {
            let w = std::mem::take(word);
            if !STOP_WORDS.contains(&w.as_str()) {
                out.push(stem(&w));
            }
        }
    };
    let flush_cjk = |cjk: &mut Vec<char>, out: &mut Vec<String>| {
        for (i, c) in cjk.iter().enumerate() {
            out.push(c.to_string());
            if let Some(next) = cjk.get(i + 1) {
                out.push(format!("{c}{next}"));
            }
        }
        cjk.clear();
    };
    for c in text.chars() {
        if is_cjk(c) {
            flush_word(&mut word, &mut out);
            cjk.push(c);
        } else if c.is_alphanumeric() {
            flush_cjk(&mut cjk, &mut out);
            word.extend(c.to_lowercase());
        } else {
            flush_word(&mut word, &mut out);
            flush_cjk(&mut cjk, &mut out);
        }
    }
    flush_word(&mut word, &mut out);
    flush_cjk(&mut cjk, &mut out);
    out
}

/// Whether `needle` occurs in `hay` other than inside an ASCII word: `cures` is not found in `secures`, while
/// CJK needles match anywhere. Case-sensitive; lowercase both sides first.
pub fn contains_phrase(hay: &str, needle: &str) -> bool {
    if needle.is_empty() {
        return false;
    }
    let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let (first, last) = (needle.chars().next(), needle.chars().next_back());
    hay.match_indices(needle).any(|(i, m)| {
        let glued_before = word(first) && word(hay[..i].chars().next_back());
        let glued_after = word(last) && word(hay[i + m.len()..].chars().next());
        !(glued_before || glued_after)
    })
}

/// Okapi BM25 over a fixed set of documents (k1 = 1.2, b = 0.75, the non-negative IDF variant).
#[derive(Debug, Clone)]
pub struct Bm25 {
    docs: Vec<HashMap<String, u32>>,
    doc_len: Vec<f32>,
    avg_len: f32,
    doc_freq: HashMap<String, u32>,
}

const K1: f32 = 1.2;
const B: f32 = 0.75;

impl Bm25 {
    pub fn new<S: AsRef<str>>(docs: &[S]) -> Self {
        let mut doc_freq: HashMap<String, u32> = HashMap::new();
        let mut tf_docs = Vec::with_capacity(docs.len());
        let mut doc_len = Vec::with_capacity(docs.len());
        for doc in docs {
            let mut tf: HashMap<String, u32> = HashMap::new();
            let tokens = tokenize(doc.as_ref());
            doc_len.push(tokens.len() as f32);
            for t in tokens {
                *tf.entry(t).or_default() += 1;
            }
            for t in tf.keys() {
                *doc_freq.entry(t.clone()).or_default() += 1;
            }
            tf_docs.push(tf);
        }
        let avg_len =
            if doc_len.is_empty() { 1.0 } else { (doc_len.iter().sum::<f32>() / doc_len.len() as f32).max(1.0) };
        Bm25 { docs: tf_docs, doc_len, avg_len, doc_freq }
    }

    pub fn len(&self) -> usize {
        self.docs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    fn idf(&self, term: &str) -> f32 {
        let n = self.docs.len() as f32;
        let df = self.doc_freq.get(term).copied().unwrap_or(0) as f32;
        (1.0 + (n - df + 0.5) / (df + 0.5)).ln()
    }

    /// Score of every document for a weighted query (term → weight; a term's weight multiplies its BM25 part).
    pub fn scores(&self, query: &BTreeMap<String, f32>) -> Vec<f32> {
        self.docs
            .iter()
            .zip(&self.doc_len)
            .map(|(tf, &len)| {
                query
                    .iter()
                    .map(|(term, &w)| {
                        let f = tf.get(term).copied().unwrap_or(0) as f32;
                        if f == 0.0 {
                            return 0.0;
                        }
                        w * self.idf(term) * f * (K1 + 1.0) / (f + K1 * (1.0 - B + B * len / self.avg_len))
                    })
                    .sum()
            })
            .collect()
    }

    /// The top `k` documents with score ≥ `min_score`, best first (ties by document index, so the result is
    /// deterministic).
    pub fn search(&self, query: &BTreeMap<String, f32>, k: usize, min_score: f32) -> Vec<(usize, f32)> {
        let mut ranked: Vec<(usize, f32)> =
            self.scores(query).into_iter().enumerate().filter(|&(_, s)| s > 0.0 && s >= min_score).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked.truncate(k);
        ranked
    }
}

/// A query from text, each distinct token with weight `weight` (repeats do not add up: "size size size" is no
/// stronger than "size").
pub fn query(text: &str, weight: f32) -> BTreeMap<String, f32> {
    let mut q = BTreeMap::new();
    add_query(&mut q, text, weight);
    q
}

/// Weight of a single CJK character relative to a word or a CJK bigram: single characters are ambiguous
/// (什 in 什么颜色 and 什么时候), bigrams carry the meaning.
pub const CJK_UNIGRAM_WEIGHT: f32 = 0.3;

/// Add the tokens of `text` to `q`, keeping the larger weight for a token already there.
pub fn add_query(q: &mut BTreeMap<String, f32>, text: &str, weight: f32) {
    for t in tokenize(text) {
        let mut chars = t.chars();
        let single_cjk = matches!((chars.next(), chars.next()), (Some(c), None) if is_cjk(c));
        let tw = if single_cjk { weight * CJK_UNIGRAM_WEIGHT } else { weight };
        let w = q.entry(t).or_insert(0.0);
        *w = w.max(tw);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CJK characters against words of other letters: names and codes quoted in either language do not flip it.
    #[test]
    fn language_counts_characters_against_words() {
        assert_eq!(language_of("这款抓绒卫衣有Oat、Charcoal、Forest Green可选。"), Some(Language::Zh));
        assert_eq!(language_of("LIVE20还能用吗"), Some(Language::Zh));
        assert_eq!(language_of("Omar: 这件羽绒服现在什么价"), Some(Language::Zh));
        assert_eq!(language_of("is the 羽绒服 on sale tonight?"), Some(Language::En));
        assert_eq!(language_of("can I get the T恤 in M"), Some(Language::En));
        assert_eq!(language_of("The hoodie is 199 yuan"), Some(Language::En));
        assert_eq!(language_of("👍 666"), None);
    }

    #[test]
    fn stemmer_merges_inflections() {
        assert_eq!(tokenize("ships shipped shipping ship"), vec!["ship"; 4]);
        assert_eq!(tokenize("sizes size"), vec!["siz", "siz"]);
        assert_eq!(tokenize("Fits fitting"), vec!["fit", "fit"]);
        assert_eq!(tokenize("returns returned"), vec!["return", "return"]);
    }

    #[test]
    fn tokenizer_drops_stop_words_and_splits_cjk() {
        assert_eq!(tokenize("Is THE price ok?"), vec!["pric", "ok"]);
        assert_eq!(tokenize("尺码"), vec!["尺", "尺码", "码"]);
        assert_eq!(tokenize("M码偏小"), vec!["m", "码", "码偏", "偏", "偏小", "小"]);
    }

    #[test]
    fn bm25_prefers_the_document_with_the_rare_term() {
        let docs = ["red dress in cotton", "blue dress in silk", "shipping takes two days"];
        let bm = Bm25::new(&docs);
        let hits = bm.search(&query("silk dress", 1.0), 3, 0.0);
        assert_eq!(hits[0].0, 1);
        assert_eq!(hits.len(), 2, "the shipping doc shares no term");
        assert!(bm.search(&query("unrelated words", 1.0), 3, 0.0).is_empty());
    }
}
