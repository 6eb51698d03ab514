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
    fixture_json(name, "reference.json")
}

/// `file` of fixture `name`, parsed; a test failure naming the file when it is missing or malformed.
fn fixture_json<T: serde::de::DeserializeOwned>(name: &str, file: &str) -> T {
    let path = fixture(name).join(file);
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

/// `bf16_yardstick.json` of a bf16 fixture (`tools/fixtures/bf16_yardstick.py`): how far transformers' own
/// bf16 forward lands from the f32 oracle, per case (max |bf16 - f32| / max |f32|; the file also holds it per
/// position).
#[derive(Debug, Deserialize)]
pub struct Yardstick {
    pub cases: Vec<YardstickCase>,
}

#[derive(Debug, Deserialize)]
pub struct YardstickCase {
    pub name: String,
    pub max_rel_err: f32,
}

pub fn bf16_yardstick(name: &str) -> Yardstick {
    fixture_json(name, "bf16_yardstick.json")
}

/// Per position, max |got - want| / max |want| over the whole matrix (the scale is the matrix's largest
/// reference logit, as in [`max_errors`]).
pub fn per_position_rel_errors(got: &[Vec<f32>], want: &[Vec<f32>]) -> Vec<f32> {
    let (_, scale) = max_errors(got, want);
    got.iter()
        .zip(want)
        .map(|(g, w)| g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max) / scale.max(1e-12))
        .collect()
}

/// The median of `xs` (the upper one of an even count); 0 for none.
pub fn median(xs: &[f32]) -> f32 {
    let mut v = xs.to_vec();
    v.sort_by(f32::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// How far below the best token each generated token lies under an oracle's teacher-forced logits:
/// `logits` are the oracle's rows of one forward over `prompt + generated` (row `prompt_len - 1 + j`
/// predicts `generated[j]`); per generated token, (max - logit of the token) / max |row|. 0 where the
/// token is the oracle's argmax.
pub fn greedy_deficits(logits: &[Vec<f32>], prompt_len: usize, generated: &[u32]) -> Vec<f32> {
    generated
        .iter()
        .enumerate()
        .map(|(j, &tok)| {
            let row = &logits[prompt_len - 1 + j];
            let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let scale = row.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-12);
            (best - row[tok as usize]) / scale
        })
        .collect()
}

/// A generated token's deficit (see [`greedy_deficits`]) allowed where a bf16 engine running a trained model
/// (the bundled one) is judged by the f32 CPU oracle: bf16 noise picks the runner-up only at a near tie,
/// while a token from a wrong forward lies ~1 max |logit| below the best.
pub const TIE_TOL: f32 = 0.3;

/// The share of generated tokens that must be the CPU oracle's argmax where a bf16 engine runs the random
/// fixtures. There bf16 rounding flips near-tie top-k routing (router margins down to 3e-4) and a flipped row
/// moves its logits by up to 0.3 of max |logit| (transformers' own bf16 run does the same,
/// `bf16_yardstick.json`), and the token mixers carry that to every later position: single tokens can then
/// lie far below the best, so a per-token bound means nothing, but a wrong forward or a corrupted cache
/// restore loses the track everywhere (random tokens match the argmax 1 time in the vocabulary size).
pub const AGREE_MIN: f32 = 0.8;

/// Generated sequences judged by the CPU oracle: one teacher-forced CPU forward over each prompt + output,
/// counting the tokens that are the CPU's argmax over the same context and the worst deficit.
#[derive(Debug, Default)]
pub struct GreedyTally {
    pub exact: usize,
    pub total: usize,
    pub worst: f32,
}

impl GreedyTally {
    /// Judges `generated` (greedy from `prompt` on the model in `dir`), prints one line, returns the worst
    /// deficit of this sequence.
    pub fn judge(&mut self, dir: &Path, prompt: &[u32], generated: &[u32], what: &str) -> f32 {
        use nextn_engine::{Device, ModelSource};
        let seq: Vec<u32> = prompt.iter().chain(&generated[..generated.len().saturating_sub(1)]).copied().collect();
        let source = ModelSource::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let logits = nextn_engine::backend::select::logits_on(Device::Cpu, source, &seq).unwrap_or_else(|e| panic!("cpu: {e}"));
        let deficits = greedy_deficits(&logits, prompt.len(), generated);
        let exact = deficits.iter().filter(|&&d| d == 0.0).count();
        let worst = deficits.iter().copied().fold(0.0f32, f32::max);
        eprintln!("{what}: {exact} of {} tokens the CPU's argmax, worst deficit {worst:.3e} {deficits:.2?}", deficits.len());
        self.exact += exact;
        self.total += deficits.len();
        self.worst = self.worst.max(worst);
        worst
    }

    /// At least [`AGREE_MIN`] of all judged tokens were the CPU's argmax.
    pub fn assert_mostly_tracks(&self, what: &str) {
        let share = self.exact as f32 / self.total.max(1) as f32;
        eprintln!("{what}: {} of {} tokens ({share:.3}) the CPU's argmax, worst deficit {:.3e}", self.exact, self.total, self.worst);
        assert!(self.total > 0, "{what}: nothing judged");
        assert!(share >= AGREE_MIN, "{what}: only {share:.3} of the tokens track the CPU's greedy choice (< {AGREE_MIN})");
    }
}

/// `generated` judged by the CPU oracle (see [`GreedyTally`]), every token within [`TIE_TOL`] of the best:
/// for trained models, whose margins bf16 noise rarely crosses.
pub fn assert_tracks_cpu_greedy(dir: &Path, prompt: &[u32], generated: &[u32], what: &str) {
    let worst = GreedyTally::default().judge(dir, prompt, generated, what);
    assert!(worst <= TIE_TOL, "{what}: a token lies {worst:.3} of max |logit| below the CPU's best (> {TIE_TOL})");
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

/// A greedy MTP cycle to check a backend's [`nextn_engine::Backend::mtp_cycle_greedy`] against: two sequences
/// (state slots 0 and 1, block tables `tables`) prefilled with `prompts` and their MTP KV filled by a draft extend
/// over the prompt, then a verify of 3 drafts each built from the model's own greedy continuation (read off earlier
/// verifies, each from a fresh prefill: a verify may advance the conv windows until its commit): `wrong[j]` = the
/// index of sequence j's first wrong draft (3: none), so sequence j accepts `wrong[j]` drafts. Leaves the backend
/// as just after the prefill and returns the verify step.
pub fn greedy_cycle_verify(b: &mut dyn nextn_engine::Backend, prompts: [&[u32]; 2], tables: &[Vec<u32>], block_size: usize, wrong: [usize; 2]) -> nextn_engine::sched::step::StepCtx {
    use nextn_engine::models::MtpInput;
    use nextn_engine::sched::step::{Hiddens, StepCtx};
    let vocab = b.config().vocab_size as u32;
    // Prefill both (each prompt's last row gives its first token g0), then the MTP's KV over each prompt: row p is
    // (token at p + 1, hidden at p).
    let prefill = |b: &mut dyn nextn_engine::Backend| {
        let mut ctx = StepCtx { block_size, hiddens: Hiddens::Keep, ..Default::default() };
        for (j, p) in prompts.iter().enumerate() {
            b.reset_slot(j);
            ctx.push_seq(p, 0, &tables[j], j, |i| i + 1 == p.len());
        }
        let (_, g0) = b.execute_argmax(&ctx).unwrap();
        let mut extend = StepCtx { block_size, ..Default::default() };
        let mut kept = Vec::new();
        for (j, p) in prompts.iter().enumerate() {
            let next: Vec<u32> = p[1..].iter().copied().chain([g0[j]]).collect();
            extend.push_seq(&next, 0, &tables[j], 0, |_| false);
            kept.extend(ctx.seqs[j].rows.clone());
        }
        b.mtp_draft(&extend, MtpInput::Step(&kept), &[], None, true).unwrap();
        g0
    };
    let g0 = prefill(b);
    let verify_of = |drafts: &[Vec<u32>; 2]| {
        let mut v = StepCtx { block_size, hiddens: Hiddens::Keep, ..Default::default() };
        for (j, p) in prompts.iter().enumerate() {
            let tokens: Vec<u32> = [g0[j]].into_iter().chain(drafts[j].iter().copied()).collect();
            v.push_seq(&tokens, p.len(), &tables[j], j, |_| true);
            v.seqs[j].snapshot = true;
        }
        v
    };
    let mut drafts = [vec![0u32; 3], vec![0u32; 3]];
    for i in 0..3 {
        let (_, target) = b.execute_argmax(&verify_of(&drafts)).unwrap();
        for j in 0..2 {
            drafts[j][i] = target[j * 4 + i];
        }
        prefill(b);
    }
    for j in 0..2 {
        if let Some(d) = drafts[j].get_mut(wrong[j]) {
            *d = (*d + 1) % vocab;
        }
    }
    verify_of(&drafts)
}

/// The cycle as the engine ran it before the fused call: the verify's argmax ids, acceptance on the host, then the
/// [`nextn_engine::spec::Speculator`]'s propose from each sequence's committed rows (kept on the backend).
pub fn greedy_cycle_by_speculator(b: &mut dyn nextn_engine::Backend, verify: &nextn_engine::sched::step::StepCtx, tables: &[Vec<u32>]) -> nextn_engine::backend::GreedyCycle {
    use nextn_engine::cache::blocks::SeqId;
    use nextn_engine::spec::{verify_greedy_ids, DraftRows, SpecConfig, Speculator};
    let (_, target) = b.execute_argmax(verify).unwrap();
    let mut rows = DraftRows::default();
    let mut accepted = Vec::new();
    for (j, seq) in verify.seqs.iter().enumerate() {
        let r = seq.rows.start;
        let k = seq.rows.len() - 1;
        let a = verify_greedy_ids(&verify.tokens[r + 1..=r + k], &target[r..=r + k]).accepted;
        let id = SeqId(j as u64);
        for i in 0..=a {
            rows.push_kept(id, target[r + i], r + i, verify.positions[r] + i);
        }
        rows.want_drafts(id, k);
        rows.set_table(id, tables[j].clone());
        accepted.push(a);
    }
    let speculator = Speculator::new(SpecConfig { draft_steps: 3 }, None);
    let proposals = speculator.propose(b, &rows, verify.block_size).unwrap();
    let drafts = proposals.into_iter().map(|(_, p)| p.drafts).collect();
    nextn_engine::backend::GreedyCycle { target, accepted, drafts }
}
