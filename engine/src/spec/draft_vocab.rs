//! Reduced draft vocabularies (`--draft-vocab FILE|N`): which token ids the MTP draft steps score.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The file beside a model that lists its draft vocabulary: token ids, most frequent first, one per line
/// (`#` comments and blank lines are skipped). `nextn draft-vocab` writes it from a corpus.
pub const DRAFT_VOCAB_FILE: &str = "draft_vocab.txt";

/// A reduced draft vocabulary: the MTP draft steps score only these token ids, through a gathered slice of
/// the LM head, so a draft step reads `N × H` head weights instead of `vocab × H` (Qwen3.6: 32K of 248K rows,
/// ≈ 128 MB instead of ≈ 1 GB in bf16). Verify still scores the full vocabulary, so greedy output is
/// unchanged and speculative sampling still draws from the target distribution; only the acceptance length
/// can drop, when the target's token is outside the subset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftVocab {
    ids: Vec<u32>,
    /// Where it came from, for reports ("models/x/draft_vocab.txt, first 512", "ids 0..512 (dummy weights)").
    source: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DraftVocabError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}: `{text}` is not a token id")]
    Parse { path: PathBuf, line: usize, text: String },
    #[error("draft vocabulary ({origin}): token id {id} is outside the model's vocabulary of {vocab}")]
    OutOfRange { origin: String, id: u32, vocab: usize },
    #[error("draft vocabulary ({origin}): token id {id} is listed twice")]
    Duplicate { origin: String, id: u32 },
    #[error("draft vocabulary ({origin}) is empty")]
    Empty { origin: String },
    #[error("--draft-vocab {n}: {path} lists only {have} token ids")]
    TooFew { n: usize, path: PathBuf, have: usize },
    #[error(
        "--draft-vocab {n}: {path} does not exist; make it with `nextn draft-vocab --model DIR --corpus FILE`, \
         or pass the path of a token-id file"
    )]
    Missing { n: usize, path: PathBuf },
    #[error("--draft-vocab {n}: a size needs a model directory holding {DRAFT_VOCAB_FILE}; pass a file path instead")]
    NoModelDir { n: usize },
}

impl DraftVocab {
    /// Checks every id is in `0..vocab` and listed once.
    pub fn new(ids: Vec<u32>, vocab: usize, source: impl Into<String>) -> Result<Self, DraftVocabError> {
        let source = source.into();
        if ids.is_empty() {
            return Err(DraftVocabError::Empty { origin: source });
        }
        let mut seen = vec![false; vocab];
        for &id in &ids {
            match seen.get_mut(id as usize) {
                None => return Err(DraftVocabError::OutOfRange { origin: source, id, vocab }),
                Some(true) => return Err(DraftVocabError::Duplicate { origin: source, id }),
                Some(s) => *s = true,
            }
        }
        Ok(DraftVocab { ids, source })
    }

    /// The first `n` token ids (benchmarks on dummy weights, where token identity carries no meaning).
    pub fn first_ids(n: usize, vocab: usize) -> Result<Self, DraftVocabError> {
        Self::new((0..n.min(vocab) as u32).collect(), vocab, format!("ids 0..{} (dummy weights)", n.min(vocab)))
    }

    /// `--draft-vocab FILE|N`: a number takes the first N ids of `model_dir/draft_vocab.txt`; anything else
    /// is the path of a token-id file, used whole.
    pub fn resolve(arg: &str, model_dir: Option<&Path>, vocab: usize) -> Result<Self, DraftVocabError> {
        let Ok(n) = arg.trim().parse::<usize>() else {
            let path = PathBuf::from(arg);
            let ids = read_token_ids(&path)?;
            return Self::new(ids, vocab, path.display().to_string());
        };
        let dir = model_dir.ok_or(DraftVocabError::NoModelDir { n })?;
        let path = dir.join(DRAFT_VOCAB_FILE);
        if !path.exists() {
            return Err(DraftVocabError::Missing { n, path });
        }
        let mut ids = read_token_ids(&path)?;
        if ids.len() < n {
            return Err(DraftVocabError::TooFew { n, path, have: ids.len() });
        }
        if n == 0 {
            return Err(DraftVocabError::Empty { origin: format!("{}, first 0", path.display()) });
        }
        ids.truncate(n);
        Self::new(ids, vocab, format!("{}, first {n}", path.display()))
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// Token ids of draft-head positions (what an argmax over the draft head's rows picked): through `dv`'s ids,
/// or the positions themselves when the draft head is the whole LM head.
pub fn draft_tokens(dv: Option<&DraftVocab>, positions: Vec<u32>) -> Vec<u32> {
    match dv {
        Some(dv) => positions.iter().map(|&p| dv.ids[p as usize]).collect(),
        None => positions,
    }
}

/// Token ids of a draft-vocabulary file (see [`DRAFT_VOCAB_FILE`]), in file order.
pub fn read_token_ids(path: &Path) -> Result<Vec<u32>, DraftVocabError> {
    let text = std::fs::read_to_string(path).map_err(|source| DraftVocabError::Io { path: path.to_path_buf(), source })?;
    let mut ids = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.split('#').next().unwrap_or("").trim();
        if t.is_empty() {
            continue;
        }
        let id = t.parse::<u32>().map_err(|_| DraftVocabError::Parse { path: path.to_path_buf(), line: i + 1, text: t.to_string() })?;
        ids.push(id);
    }
    Ok(ids)
}

/// Token ids ranked for a draft vocabulary: `always` first (end-of-turn ids: a draft must be able to
/// propose stopping), then by count, most frequent first, ties by lower id.
pub fn rank_by_frequency(counts: &HashMap<u32, u64>, always: &[u32]) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for &id in always {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    let mut rest: Vec<(u32, u64)> = counts.iter().map(|(&id, &c)| (id, c)).filter(|(id, _)| !out.contains(id)).collect();
    rest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    out.extend(rest.into_iter().map(|(id, _)| id));
    out
}
