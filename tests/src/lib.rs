//! Shared helpers for the integration tests: locating fixtures, reading their HF references, scratch dirs.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The `tests/` crate directory: `$NEXTN_TESTS_DIR` when set (test binaries carried to another machine,
/// e.g. by bench/gpu/), else where it was built.
pub fn tests_dir() -> PathBuf {
    std::env::var_os("NEXTN_TESTS_DIR").map(PathBuf::from).unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf())
}

/// `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    tests_dir().join("fixtures").join(name)
}

/// The model fixtures written by `tools/fixtures/generate.py`, with the dtype of their weights.
pub const MODEL_FIXTURES: [(&str, WeightsDtype); 7] = [
    ("qwen3_5_moe", WeightsDtype::F32),
    ("qwen3_5_moe_per_expert", WeightsDtype::F32),
    ("qwen3_moe", WeightsDtype::F32),
    ("qwen3_5_moe_bf16", WeightsDtype::Half),
    ("qwen3_5_moe_per_expert_bf16", WeightsDtype::Half),
    ("qwen3_moe_bf16", WeightsDtype::Half),
    ("qwen3_moe_f16", WeightsDtype::Half),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsDtype {
    F32,
    /// bf16 / f16 weights: the reference is the f32 forward of the rounded weights.
    Half,
}

impl WeightsDtype {
    /// Allowed max |error| as a fraction of max |reference logit| (the parity bar of the engine-foundation issue).
    pub fn tolerance(self) -> f32 {
        match self {
            WeightsDtype::F32 => 1e-4,
            WeightsDtype::Half => 2e-3,
        }
    }
}

/// `reference.json` of a model fixture.
#[derive(Debug, Deserialize)]
pub struct Reference {
    pub transformers: String,
    pub torch: String,
    pub weights_dtype: String,
    pub cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
pub struct Case {
    pub name: String,
    pub input_ids: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    pub greedy_ids: Vec<u32>,
}

pub fn reference(name: &str) -> Reference {
    let path = fixture(name).join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// max |a - b| and max |b| over two equally shaped logit matrices.
pub fn max_errors(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "number of positions");
    let mut err = 0.0f32;
    let mut scale = 0.0f32;
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "vocab size");
        for (a, b) in g.iter().zip(w) {
            err = err.max((a - b).abs());
            scale = scale.max(b.abs());
        }
    }
    (err, scale)
}

/// A scratch directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("nextn-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
    /// A copy of every file of fixture `name` in a fresh scratch dir.
    pub fn copy_of(name: &str) -> Self {
        let tmp = TempDir::new(name);
        for entry in std::fs::read_dir(fixture(name)).expect("fixture dir") {
            let entry = entry.expect("dir entry");
            std::fs::copy(entry.path(), tmp.0.join(entry.file_name())).expect("copy fixture file");
        }
        tmp
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// χ² statistic of observed counts against expected probabilities (cells with p > 0).
pub fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .filter(|(_, p)| **p > 0.0)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

/// How many outputs start with each `(t1, t2, p)` cell's pair, and the cells' probabilities `p` (for
/// [`chi_square`]); an output starting with a pair outside the cells is a test failure.
pub fn first_pair_counts<'a>(outputs: impl IntoIterator<Item = &'a [u32]>, cells: &[(u32, u32, f64)]) -> (Vec<usize>, Vec<f64>) {
    let mut counts = vec![0usize; cells.len()];
    for ids in outputs {
        let cell = cells.iter().position(|&(a, b, _)| ids[..2] == [a, b]).expect("a token outside the support");
        counts[cell] += 1;
    }
    (counts, cells.iter().map(|c| c.2).collect())
}
