//! GPU = CPU for whole models (design invariant 4): the CUDA backend against the CPU reference on the
//! committed qwen3_5_moe fixtures and the bundled model. Prints "skipped: no CUDA device" where there is none.
//!
//! The GPU keeps activations (and the residual stream) in bf16; the CPU reference computes in f32 and matches
//! transformers' f32 forward to 2e-3. bf16 rounding flips near-tie decisions — an MoE row's top-k experts,
//! a greedy argmax — after which the two runs legitimately part: on these fixtures transformers' own bf16
//! forward lands up to 0.30 of max |logit| from its f32 oracle (`bf16_yardstick.json`). So the checks are:
//! - layer by layer (`gpu_layer_by_layer_matches_cpu`, the sharp one): every residual-stream tap within
//!   [`RESIDUAL_TOL`] of the CPU on the rows no routing flip has reached, and every routing flip a near tie
//!   (the CPU's top-k margin within what the GPU's own router error can flip);
//! - logits: the median position within [`LOGIT_TOL`], the worst no worse than transformers in bf16;
//! - generation loops: the CPU judges the GPU's own sequence, teacher-forced (`nextn_tests::GreedyTally`): on
//!   the trained bundled model every token is the CPU's argmax over the same context or within
//!   `nextn_tests::TIE_TOL` of it; on the random fixtures, where a routing flip moves every later position,
//!   at least `nextn_tests::AGREE_MIN` of the tokens are the CPU's argmax;
//! - MTP on the GPU equals plain decoding on the GPU, token for token.
#![cfg(feature = "cuda")]

use nextn_engine::backend::select::make_backend;
use nextn_engine::spec::SpecConfig;
use nextn_engine::{CacheGeometry, Device, Engine, EngineConfig, ModelSource, SamplingParams};
use nextn_tests::{assert_tracks_cpu_greedy, bf16_yardstick, fixture, median, per_position_rel_errors, reference, GreedyTally};

/// The median position's logits: a few bf16 ulps of the largest logit.
const LOGIT_TOL: f32 = 3e-2;
/// The residual stream on rows no routing flip has reached. On the random 4-layer fixtures bf16 drift about
/// doubles per layer (measured on an H200: 3e-3 after layer 0, 3e-2 on the worst row by layer 2); a wrong op
/// moves rows by O(max |x|).
const RESIDUAL_TOL: f32 = 6e-2;
fn gpu() -> bool {
    match nextn_engine::backend::cuda::probe(0) {
        Ok(name) => {
            eprintln!("CUDA device 0: {name}");
            true
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            false
        }
    }
}

/// The checkpoint in `dir`, opened: each backend loads it its own way (the CPU on the host, CUDA straight
/// to the device).
fn source(dir: &std::path::Path) -> ModelSource {
    ModelSource::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn bundled_dir() -> Option<std::path::PathBuf> {
    let dir = nextn_tests::tests_dir().join("../models/nextn-live-tiny");
    dir.join("model.safetensors").exists().then_some(dir)
}

/// Every position's logits of `tokens` in one forward on `device`.
fn logits_on(device: Device, dir: &std::path::Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    nextn_engine::backend::select::logits_on(device, source(dir), tokens).unwrap_or_else(|e| panic!("{device}: {e}"))
}

fn greedy_on(device: Device, dir: &std::path::Path, prompt: &[u32], n: usize, spec: Option<usize>) -> Vec<u32> {
    let cfg = EngineConfig { spec: spec.map(|k| SpecConfig { draft_steps: k }), ..Default::default() };
    greedy_with(device, dir, prompt, n, cfg)
}

/// `n` greedy tokens from `prompt` on an engine configured by `cfg`.
fn greedy_with(device: Device, dir: &std::path::Path, prompt: &[u32], n: usize, cfg: EngineConfig) -> Vec<u32> {
    let mut e = Engine::on_device(device, source(dir), None, Vec::new(), cfg).unwrap();
    let params = SamplingParams { max_new_tokens: n, ignore_eos: true, ..SamplingParams::greedy() };
    e.generate(prompt.to_vec(), params, |_| {}).unwrap().token_ids
}

const FIXTURES: [&str; 2] = ["qwen3_5_moe_bf16", "qwen3_5_moe_per_expert_bf16"];

#[test]
fn gpu_logits_match_cpu_on_fixtures() {
    if !gpu() {
        return;
    }
    for name in FIXTURES {
        let yardstick = bf16_yardstick(name);
        for case in &reference(name).cases {
            let cpu = logits_on(Device::Cpu, &fixture(name), &case.input_ids);
            let gpu = logits_on(Device::Cuda(0), &fixture(name), &case.input_ids);
            let rel = per_position_rel_errors(&gpu, &cpu);
            let (mid, worst) = (median(&rel), rel.iter().copied().fold(0.0f32, f32::max));
            let hf = yardstick.cases.iter().find(|c| c.name == case.name).expect("yardstick case").max_rel_err;
            eprintln!("{name}/{}: GPU vs CPU rel err median {mid:.3e}, worst {worst:.3e} (transformers bf16: {hf:.3e})", case.name);
            assert!(mid <= LOGIT_TOL, "{name}/{}: median rel err {mid} > {LOGIT_TOL}", case.name);
            assert!(worst <= LOGIT_TOL.max(1.5 * hf), "{name}/{}: worst rel err {worst} > 1.5 x transformers' bf16 {hf}", case.name);
        }
    }
}

#[test]
fn gpu_greedy_tracks_cpu_and_mtp_is_lossless_on_gpu() {
    if !gpu() {
        return;
    }
    let mut tally = GreedyTally::default();
    for name in FIXTURES {
        for case in &reference(name).cases {
            let n = case.greedy_ids.len();
            let gpu = greedy_on(Device::Cuda(0), &fixture(name), &case.input_ids, n, None);
            tally.judge(&fixture(name), &case.input_ids, &gpu, &format!("{name}/{} GPU greedy", case.name));
            // Speculation needs an MTP head (the per-expert fixture has none: the engine rejects MTP there).
            if !source(&fixture(name)).has_mtp() {
                continue;
            }
            for k in 1..=4 {
                let spec = greedy_on(Device::Cuda(0), &fixture(name), &case.input_ids, n, Some(k));
                assert_eq!(spec, gpu, "{name}/{} k={k}: MTP on GPU changed the greedy output", case.name);
            }
        }
    }
    tally.assert_mostly_tracks("GPU greedy on the fixtures");
}

/// The taps (named intermediate buffers, see `nextn_engine::models::tap`) of two steps on `device`: a
/// prefill of all but the last token, then a decode step of the last.
fn tapped_steps(device: Device, dir: &std::path::Path, tokens: &[u32]) -> Vec<(String, Vec<f32>)> {
    use nextn_engine::models::tap;
    use nextn_engine::sched::step::StepCtx;
    const BLOCK: usize = 16;
    let geo = CacheGeometry { num_blocks: tokens.len().div_ceil(BLOCK).max(1), block_size: BLOCK, num_slots: 1, lanes: 0 };
    let mut b = make_backend(device, source(dir), geo).unwrap_or_else(|e| panic!("{device}: {e}"));
    let table: Vec<u32> = (0..geo.num_blocks as u32).collect();
    b.reset_slot(0);
    let n = tokens.len();
    let mut taps = Vec::new();
    for (what, range) in [("prefill", 0..n - 1), ("decode", n - 1..n)] {
        let mut ctx = StepCtx { block_size: BLOCK, ..Default::default() };
        ctx.push_seq(&tokens[range.clone()], range.start, &table, 0, |_| true);
        tap::start();
        let (_, logits) = b.execute(&ctx).unwrap_or_else(|e| panic!("{device} {what}: {e}"));
        let mut step = tap::stop();
        step.push(("logits".into(), logits));
        taps.extend(step.into_iter().map(|(name, v)| (format!("{what} {name}"), v)));
    }
    taps
}

/// Rows whose top-k expert set differs between two `[rows, experts]` router logit matrices, each with the
/// first's margin (k-th minus (k+1)-th logit) and the row's max |a - b|.
fn routing_flips(a: &[f32], b: &[f32], experts: usize, top_k: usize) -> Vec<(usize, f32, f32)> {
    let order = |r: &[f32]| {
        let mut i: Vec<usize> = (0..r.len()).collect();
        i.sort_by(|&x, &y| r[y].total_cmp(&r[x]));
        i
    };
    let mut flips = Vec::new();
    for (row, (ar, br)) in a.chunks(experts).zip(b.chunks(experts)).enumerate() {
        let (ao, bo) = (order(ar), order(br));
        let (mut sa, mut sb) = (ao[..top_k].to_vec(), bo[..top_k].to_vec());
        sa.sort();
        sb.sort();
        if sa != sb {
            let err = ar.iter().zip(br).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            flips.push((row, ar[ao[top_k - 1]] - ar[ao[top_k]], err));
        }
    }
    flips
}

/// Where the GPU and the CPU part ways, block by block: every tapped intermediate of a prefill and a decode
/// step side by side, one line each. Checked: each routing difference is a near tie (the CPU's top-k margin
/// at most twice the row's router error: only then can the GPU's logits order the two experts the other
/// way), and the residual stream and logits within [`RESIDUAL_TOL`] on clean rows — rows before the first
/// flipped one (a flipped row's output differs by design, and the token mixers carry it to later rows), and
/// in the decode step the layers up to the prefill's first flip.
#[test]
fn gpu_layer_by_layer_matches_cpu() {
    if !gpu() {
        return;
    }
    let mut models: Vec<(String, std::path::PathBuf, Vec<u32>)> =
        FIXTURES.iter().map(|n| (n.to_string(), fixture(n), reference(n).cases[0].input_ids.clone())).collect();
    if let Some(dir) = bundled_dir() {
        models.push(("bundled".into(), dir, (1..40).collect()));
    }
    let mut bad = Vec::new();
    for (name, dir, tokens) in &models {
        let cfg = source(dir).config().clone();
        let (hidden, vocab, experts, top_k, layers) =
            (cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers);
        let cpu = tapped_steps(Device::Cpu, dir, tokens);
        let gpu = tapped_steps(Device::Cuda(0), dir, tokens);
        assert_eq!(
            cpu.iter().map(|t| &t.0).collect::<Vec<_>>(),
            gpu.iter().map(|t| &t.0).collect::<Vec<_>>(),
            "{name}: the backends tapped different buffers"
        );
        // The first flipped row of the current step, and the layer of the prefill's first flip.
        let (mut clean_rows, mut prefill_flip_layer, mut layer) = (usize::MAX, None::<usize>, 0usize);
        let mut prefill_logits_rows_checked = 0;
        for ((tap, c), (_, g)) in cpu.iter().zip(&gpu) {
            let (step, what) = tap.split_once(' ').expect("step and name");
            if what == "embed" {
                (layer, clean_rows) = (0, usize::MAX);
            } else if let Some(l) = what.strip_prefix('L').and_then(|r| r.split('.').next()).and_then(|l| l.parse().ok()) {
                layer = l;
            } else if what == "logits" {
                layer = layers;
            }
            let n = c.len().min(g.len());
            let err = c[..n].iter().zip(&g[..n]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            let scale = c[..n].iter().map(|a| a.abs()).fold(0.0f32, f32::max).max(1e-6);
            let mut line = format!("{name} {tap:<34} rel {:.3e}  max|cpu| {scale:.3}", err / scale);
            if c.len() != g.len() {
                line += &format!("  (lengths cpu {} gpu {})", c.len(), g.len());
            }
            if what == "moe.router" && experts > 0 {
                for (row, margin, row_err) in routing_flips(&c[..n], &g[..n], experts, top_k) {
                    line += &format!("  routing differs at row {row} (cpu margin {margin:.2e}, router err {row_err:.2e})");
                    if margin > 2.0 * row_err {
                        bad.push(format!("{name} {tap} row {row}: routing differs with margin {margin} > 2 x router err {row_err}"));
                    }
                    clean_rows = clean_rows.min(row);
                    if step == "prefill" {
                        prefill_flip_layer.get_or_insert(layer);
                    }
                }
            }
            let cols = if what == "logits" { vocab } else { hidden };
            let residual = what.contains(".x ") || what == "logits" || what == "embed";
            let decode_reached = step == "decode" && prefill_flip_layer.is_some_and(|l| layer > l);
            if residual && n % cols == 0 && !decode_reached {
                let rows = (n / cols).min(clean_rows);
                let clean_err = c[..rows * cols].iter().zip(&g[..rows * cols]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                line += &format!("  clean rows {rows}: rel {:.3e}", clean_err / scale);
                if clean_err > RESIDUAL_TOL * scale {
                    bad.push(format!("{name} {tap}: rel err {} on the {rows} clean rows", clean_err / scale));
                }
                if step == "prefill" && what == "logits" {
                    prefill_logits_rows_checked = rows;
                }
            }
            eprintln!("{line}");
        }
        // A flip in the first rows would leave nothing checked.
        if prefill_logits_rows_checked < tokens.len() / 4 {
            bad.push(format!("{name}: only {prefill_logits_rows_checked} prefill rows checked"));
        }
    }
    assert!(bad.is_empty(), "GPU differs from CPU beyond bf16: {bad:#?}");
}

#[test]
fn bundled_model_gpu_equals_cpu() {
    if !gpu() {
        return;
    }
    let Some(dir) = bundled_dir() else {
        eprintln!("skipped: no bundled model at models/nextn-live-tiny");
        return;
    };
    let prompt: Vec<u32> = (1..40).collect();
    let rel = per_position_rel_errors(&logits_on(Device::Cuda(0), &dir, &prompt), &logits_on(Device::Cpu, &dir, &prompt));
    eprintln!("bundled: GPU vs CPU rel err median {:.3e}, worst {:.3e}", median(&rel), rel.iter().copied().fold(0.0f32, f32::max));
    assert!(median(&rel) <= LOGIT_TOL, "bundled: median rel err {} > {LOGIT_TOL}", median(&rel));
    let plain = greedy_on(Device::Cuda(0), &dir, &prompt, 48, None);
    assert_tracks_cpu_greedy(&dir, &prompt, &plain, "bundled GPU greedy");
    assert_eq!(greedy_on(Device::Cuda(0), &dir, &prompt, 48, Some(3)), plain, "bundled: MTP on GPU changed the output");
}

/// The reduced draft head on the GPU: the draft steps' LM head is the full head's rows of the draft vocabulary,
/// gathered on the device, so its logits are the full head's at those ids (the same GEMV per row), and greedy
/// decoding with MTP over the bundled model's own draft vocabulary equals plain decoding on the GPU.
#[test]
fn gpu_draft_head_is_the_full_head_gathered_and_mtp_stays_lossless() {
    use nextn_engine::spec::{read_token_ids, DraftVocab};
    if !gpu() {
        return;
    }
    let Some(dir) = bundled_dir() else {
        eprintln!("skipped: no bundled model at models/nextn-live-tiny");
        return;
    };
    let cfg = source(&dir).config().clone();
    let (vocab, h) = (cfg.vocab_size, cfg.hidden_size);
    let geo = CacheGeometry { num_blocks: 4, block_size: 16, num_slots: 1, lanes: 0 };
    let mut b = make_backend(Device::Cuda(0), source(&dir), geo).unwrap();
    assert!(b.reduces_draft_head());
    let hidden: Vec<f32> = (0..3 * h).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let ids = read_token_ids(&dir.join("draft_vocab.txt")).unwrap();
    let dv = DraftVocab::new(ids[..256].to_vec(), vocab, "bundled, first 256").unwrap();
    let rows = [2usize, 0];
    let full = b.logits_of(&hidden, &rows).unwrap();
    let want: Vec<f32> = full.chunks(vocab).flat_map(|r| dv.ids().iter().map(|&id| r[id as usize]).collect::<Vec<_>>()).collect();
    assert_eq!(b.draft_logits_of(&hidden, &rows, Some(&dv)).unwrap(), want, "gathered head differs from the full head's rows");

    let prompt: Vec<u32> = (1..40).collect();
    let plain = greedy_on(Device::Cuda(0), &dir, &prompt, 48, None);
    let cfg = EngineConfig { spec: Some(SpecConfig { draft_steps: 3 }), draft_vocab: Some(dv), ..Default::default() };
    let reduced = greedy_with(Device::Cuda(0), &dir, &prompt, 48, cfg);
    assert_eq!(reduced, plain, "MTP with a draft vocabulary on the GPU changed the output");
}

/// The bf16 MTP fixture on the GPU with `blocks` KV blocks of 16 (one state slot, 4 snapshot lanes), and the
/// block table covering them.
fn mtp_fixture_on_gpu(blocks: usize) -> (Box<dyn nextn_engine::Backend>, Vec<u32>) {
    let geo = CacheGeometry { num_blocks: blocks, block_size: 16, num_slots: 1, lanes: 4 };
    let b = make_backend(Device::Cuda(0), source(&fixture("qwen3_5_moe_bf16")), geo).unwrap();
    (b, (0..blocks as u32).collect())
}

/// The host argmax of each `width`-wide row of `logits`, checked against the device's ids: the same id, or
/// (kernels that sum in another order) an id whose logit is within a hair of the row's largest.
fn assert_argmax_of(ids: &[u32], logits: &[f32], width: usize, to_token: impl Fn(u32) -> u32, what: &str) {
    assert_eq!(ids.len(), logits.len() / width, "{what}: one id per row");
    for (r, (row, &id)) in logits.chunks(width).zip(ids).enumerate() {
        let host = nextn_engine::sample::argmax(row);
        let best = row[host as usize];
        let at = (0..width as u32).find(|&p| to_token(p) == id).unwrap_or_else(|| panic!("{what} row {r}: id {id} not in the head"));
        assert!(
            to_token(host) == id || row[at as usize] >= best - 1e-4 * best.abs().max(1.0),
            "{what} row {r}: device argmax {id} (logit {}) vs host {} (logit {best})",
            row[at as usize],
            to_token(host)
        );
    }
}

/// Greedy on the device: `execute_argmax` and `mtp_draft(greedy)` send back the argmax ids of what `execute`
/// and `mtp_draft(logits)` send back as logits (the full head and a reduced draft vocabulary); a forward that
/// keeps or drops its hiddens returns none; the draft extend from the kept rows (`MtpInput::Step`) and a draft
/// step from the previous one's (`MtpInput::Draft`) equal the same hiddens passed from the host.
#[test]
fn gpu_argmax_path_equals_the_logits_path() {
    use nextn_engine::backend::HeadRows;
    use nextn_engine::models::MtpInput;
    use nextn_engine::sched::step::{Hiddens, StepCtx};
    use nextn_engine::spec::DraftVocab;
    if !gpu() {
        return;
    }
    let (mut b, table) = mtp_fixture_on_gpu(4);
    let (vocab, h) = (b.config().vocab_size, b.config().hidden_size);
    let tokens: Vec<u32> = reference("qwen3_5_moe_bf16").cases[0].input_ids.iter().take(12).copied().collect();
    let mut ctx = StepCtx { block_size: 16, ..Default::default() };
    ctx.push_seq(&tokens, 0, &table, 0, |i| i % 3 == 2);
    b.reset_slot(0);
    let (hidden, logits) = b.execute(&ctx).unwrap();
    b.reset_slot(0);
    let (hidden_a, ids) = b.execute_argmax(&ctx).unwrap();
    assert_eq!(hidden_a, hidden, "the argmax step's hiddens");
    assert_argmax_of(&ids, &logits, vocab, |p| p, "execute_argmax");
    for mode in [Hiddens::Drop, Hiddens::Keep] {
        b.reset_slot(0);
        ctx.hiddens = mode;
        let (none, ids_b) = b.execute_argmax(&ctx).unwrap();
        assert!(none.is_empty(), "{mode:?} returned {} values", none.len());
        assert_eq!(ids_b, ids, "{mode:?}");
    }
    if !b.has_mtp() {
        return;
    }
    // The draft extend over rows 1..11 (token at p + 1, hidden at p), drafting from two of its rows.
    let rows: Vec<usize> = (1..11).collect();
    let mut extend = StepCtx { block_size: 16, ..Default::default() };
    let next: Vec<u32> = rows.iter().map(|&p| tokens[p + 1]).collect();
    extend.push_seq(&next, rows[0], &table, 0, |_| false);
    let host: Vec<f32> = rows.iter().flat_map(|&r| hidden[r * h..(r + 1) * h].iter().copied()).collect();
    let picks = [rows.len() - 1, 3];
    let half = DraftVocab::first_ids(vocab / 2, vocab).unwrap();
    for dv in [None, Some(&half)] {
        let what = format!("mtp_draft, draft vocabulary {}", dv.map_or(vocab, DraftVocab::len));
        let HeadRows::Logits(dl) = b.mtp_draft(&extend, MtpInput::Host(&host), &picks, dv, false).unwrap() else { panic!("{what}: logits") };
        let HeadRows::Argmax(ids) = b.mtp_draft(&extend, MtpInput::Host(&host), &picks, dv, true).unwrap() else { panic!("{what}: argmax") };
        assert_argmax_of(&ids, &dl, dv.map_or(vocab, DraftVocab::len), |p| dv.map_or(p, |d| d.ids()[p as usize]), &what);
        let HeadRows::Logits(kept) = b.mtp_draft(&extend, MtpInput::Step(&rows), &picks, dv, false).unwrap() else { panic!("{what}: logits") };
        // The kept rows are the bf16 hiddens the host copy was made from: the same input, the same logits.
        assert_eq!(kept, dl, "{what}: extend from the kept rows");
    }
    // A draft step at position 11 from the extend's row 3, chained on the device and from the host.
    let hm = b.mtp_forward(&extend, &host).unwrap();
    let mut step = StepCtx { block_size: 16, ..Default::default() };
    step.push_seq(&[tokens[5]], 11, &table, 0, |_| false);
    b.mtp_draft(&extend, MtpInput::Step(&rows), &picks, None, true).unwrap();
    let HeadRows::Logits(chained) = b.mtp_draft(&step, MtpInput::Draft(&[3]), &[0], None, false).unwrap() else { panic!("logits") };
    let HeadRows::Logits(direct) = b.mtp_draft(&step, MtpInput::Host(&hm[3 * h..4 * h]), &[0], None, false).unwrap() else { panic!("logits") };
    assert_eq!(chained, direct, "draft step from the previous draft step's kept row");
}

/// A greedy propose chained on the device (`mtp_propose_greedy`: each draft becomes the next step's token without
/// leaving the device, one transfer at the end) drafts what the same steps give one `mtp_draft` at a time with the
/// tokens passed from the host, with the full head and a reduced draft vocabulary.
#[test]
fn gpu_greedy_propose_on_the_device_equals_step_by_step() {
    use nextn_engine::backend::HeadRows;
    use nextn_engine::models::MtpInput;
    use nextn_engine::sched::step::{Hiddens, StepCtx};
    use nextn_engine::spec::DraftVocab;
    if !gpu() {
        return;
    }
    let (mut b, table) = mtp_fixture_on_gpu(4);
    let vocab = b.config().vocab_size;
    if !b.has_mtp() {
        return;
    }
    let tokens: Vec<u32> = reference("qwen3_5_moe_bf16").cases[0].input_ids.iter().take(12).copied().collect();
    let mut ctx = StepCtx { block_size: 16, hiddens: Hiddens::Keep, ..Default::default() };
    ctx.push_seq(&tokens, 0, &table, 0, |i| i + 1 == tokens.len());
    b.reset_slot(0);
    b.execute_argmax(&ctx).unwrap();
    // The extend over positions 6..11 drafts from its last row; 3 chained steps at positions 12, 13, 14.
    let rows: Vec<usize> = (6..11).collect();
    let mut extend = StepCtx { block_size: 16, ..Default::default() };
    let next: Vec<u32> = rows.iter().map(|&p| tokens[p + 1]).collect();
    extend.push_seq(&next, rows[0], &table, 0, |_| false);
    let picks = [rows.len() - 1];
    let chain: Vec<StepCtx> = (1..4)
        .map(|s| {
            let mut c = StepCtx { block_size: 16, ..Default::default() };
            c.push_seq(&[0], rows[rows.len() - 1] + s, &table, 0, |_| false);
            c
        })
        .collect();
    let half = DraftVocab::first_ids(vocab / 2, vocab).unwrap();
    for dv in [None, Some(&half)] {
        let on_device = b.mtp_propose_greedy(&extend, MtpInput::Step(&rows), &picks, &chain, dv).unwrap();
        let one = |rows: HeadRows| match rows {
            HeadRows::Argmax(ids) => ids,
            HeadRows::Logits(_) => panic!("argmax asked for"),
        };
        let mut by_step = vec![one(b.mtp_draft(&extend, MtpInput::Step(&rows), &picks, dv, true).unwrap())];
        for (s, c) in chain.iter().enumerate() {
            let mut c = c.clone();
            c.tokens.clone_from(&by_step[s]);
            let input = if s == 0 { MtpInput::Draft(&picks) } else { MtpInput::Draft(&[0]) };
            by_step.push(one(b.mtp_draft(&c, input, &[0], dv, true).unwrap()));
        }
        assert_eq!(on_device, by_step, "draft vocabulary {:?}", dv.map(DraftVocab::len));
    }
}

/// The kept hiddens survive a workspace that grows between the forward that kept them and the draft step that
/// reads them (70 kept rows, then a draft extend with more picks than the workspace was made for): the extend from
/// the kept rows equals the same hiddens passed from the host.
#[test]
fn gpu_kept_hiddens_survive_a_growing_workspace() {
    use nextn_engine::backend::HeadRows;
    use nextn_engine::models::MtpInput;
    use nextn_engine::sched::step::{Hiddens, StepCtx};
    if !gpu() {
        return;
    }
    let (mut b, table) = mtp_fixture_on_gpu(8);
    let (vocab, h) = (b.config().vocab_size, b.config().hidden_size);
    if !b.has_mtp() {
        return;
    }
    let tokens: Vec<u32> = (0..71).map(|i| (i * 37 % (vocab - 1) + 1) as u32).collect();
    let mut ctx = StepCtx { block_size: 16, ..Default::default() };
    ctx.push_seq(&tokens[..70], 0, &table, 0, |i| i == 69);
    b.reset_slot(0);
    let (hidden, _) = b.execute(&ctx).unwrap();
    b.reset_slot(0);
    ctx.hiddens = Hiddens::Keep;
    b.execute(&ctx).unwrap();
    let rows: Vec<usize> = (0..70).collect();
    let mut extend = StepCtx { block_size: 16, ..Default::default() };
    extend.push_seq(&tokens[1..71], 0, &table, 0, |_| false);
    let picks: Vec<usize> = (0..70).step_by(3).collect(); // 24 picks: more than the 16 the workspace starts with
    let HeadRows::Logits(kept) = b.mtp_draft(&extend, MtpInput::Step(&rows), &picks, None, false).unwrap() else { panic!("logits") };
    let HeadRows::Logits(host) = b.mtp_draft(&extend, MtpInput::Host(&hidden[..70 * h]), &picks, None, false).unwrap() else { panic!("logits") };
    assert_eq!(kept, host, "the extend from kept rows after the workspace grew");
}

#[test]
fn cuda_device_errors_are_typed() {
    // A device that does not exist: a clear error, not a panic.
    let r = make_backend(
        Device::Cuda(99),
        source(&fixture("qwen3_5_moe_bf16")),
        CacheGeometry { num_blocks: 4, block_size: 16, num_slots: 1, lanes: 0 },
    );
    let msg = r.err().expect("device 99 cannot exist").to_string();
    assert!(msg.contains("cuda") && (msg.contains("device") || msg.contains("driver")), "{msg}");
}

/// What the kernels handle is checked before any upload (no GPU needed): the real model, the bundled one and every
/// fixture pass on a Hopper; a model or GPU outside it gets every reason named.
#[test]
fn models_outside_the_kernels_are_refused_before_upload() {
    use nextn_engine::backend::cuda::support::unsupported;
    use nextn_engine::config::ModelConfig;
    let root = nextn_tests::tests_dir().join("..");
    let real = ModelConfig::from_path(&root.join("configs/qwen3.6-35b-a3b.json")).unwrap();
    let mut dirs = vec![root.join("models/nextn-live-tiny")];
    dirs.extend(["qwen3_5_moe", "qwen3_5_moe_bf16"].map(fixture));
    for cfg in std::iter::once(real.clone()).chain(dirs.iter().map(|d| ModelConfig::from_path(d).unwrap())) {
        assert_eq!(unsupported(&cfg, (9, 0)), Vec::<String>::new(), "{cfg:?}");
    }
    let mut odd = real.clone();
    odd.head_dim = 96;
    odd.num_experts = 1024;
    odd.vocab_size = 500_000;
    if let Some(la) = odd.linear_attention.as_mut() {
        la.key_head_dim = 192;
        la.conv_kernel_dim = 3;
    }
    let why = unsupported(&odd, (8, 0));
    for what in ["compute capability 8.0", "head_dim 96", "linear_key_head_dim 192", "linear_conv_kernel_dim 3", "1024 experts", "vocab_size 500000"] {
        assert!(why.iter().any(|w| w.contains(what)), "{what} not named in {why:?}");
    }
    assert_eq!(why.len(), 6, "{why:?}");
    assert_eq!(unsupported(&real, (10, 0)), Vec::<String>::new(), "a newer GPU runs the compute_90 PTX");
}

/// The greedy MTP cycle on the device (`mtp_cycle_greedy`: verify, acceptance from the verify's own tokens, the
/// draft extend over every verify row, chained draft steps moved by the device's accepted counts, one transfer)
/// gives what the verify then the speculator's propose give on the same device, for two sequences of a batch
/// accepting 3/1 and 0/2 drafts, with the full head and a reduced draft vocabulary (against `cycle_apart`), and with
/// keyed draws in place of the argmax (a sampled request's cycle).
#[test]
fn gpu_greedy_cycle_on_the_device_equals_verify_then_propose() {
    use nextn_engine::backend::cycle_apart;
    use nextn_engine::sample::keyed::KeyedDraw;
    use nextn_engine::spec::DraftVocab;
    use nextn_tests::{greedy_cycle_by_speculator, greedy_cycle_verify};
    if !gpu() {
        return;
    }
    let geo = CacheGeometry { num_blocks: 4, block_size: 16, num_slots: 2, lanes: 4 };
    let mut b = make_backend(Device::Cuda(0), source(&fixture("qwen3_5_moe_bf16")), geo).unwrap();
    if !b.has_mtp() {
        return;
    }
    let cases = &reference("qwen3_5_moe_bf16").cases;
    let prompts: [&[u32]; 2] = [&cases[0].input_ids[..9], &cases[1 % cases.len()].input_ids[..7]];
    let tables: Vec<Vec<u32>> = vec![vec![0, 1], vec![2, 3]];
    let half = DraftVocab::first_ids(b.config().vocab_size / 2, b.config().vocab_size).unwrap();
    for wrong in [[3, 1], [0, 2]] {
        let verify = greedy_cycle_verify(b.as_mut(), prompts, &tables, 16, wrong);
        let on_device = b.mtp_cycle_greedy(&verify, &tables, None, &[]).unwrap();
        assert_eq!(greedy_cycle_verify(b.as_mut(), prompts, &tables, 16, wrong).tokens, verify.tokens);
        let apart = greedy_cycle_by_speculator(b.as_mut(), &verify, &tables);
        assert_eq!(on_device.accepted, wrong.to_vec(), "{wrong:?}");
        assert_eq!(on_device, apart, "{wrong:?}");
        greedy_cycle_verify(b.as_mut(), prompts, &tables, 16, wrong);
        let on_device = b.mtp_cycle_greedy(&verify, &tables, Some(&half), &[]).unwrap();
        greedy_cycle_verify(b.as_mut(), prompts, &tables, 16, wrong);
        let apart = cycle_apart(b.as_mut(), &verify, &tables, Some(&half), &[]).unwrap();
        assert_eq!(on_device, apart, "{wrong:?}, draft vocabulary {}", half.len());
        // Keyed draws (sampled requests): the verify's rows drawn on the device, acceptance on the drawn ids.
        let params = SamplingParams { temperature: 1.0, top_p: 0.95, ..SamplingParams::greedy() };
        let draws: Vec<KeyedDraw> = (0..verify.num_rows()).map(|r| KeyedDraw::new(&params, 31 + r as u64 / 4, verify.positions[r] as u64 + 1)).collect();
        greedy_cycle_verify(b.as_mut(), prompts, &tables, 16, wrong);
        let on_device = b.mtp_cycle_greedy(&verify, &tables, None, &draws).unwrap();
        greedy_cycle_verify(b.as_mut(), prompts, &tables, 16, wrong);
        let apart = cycle_apart(b.as_mut(), &verify, &tables, None, &draws).unwrap();
        assert_eq!(on_device, apart, "{wrong:?}, keyed draws");
    }
}

/// A bf16 fixture backend on the GPU with the given graph mode.
fn graphed_backend(mode: nextn_engine::backend::cuda::graphs::GraphMode, geo: CacheGeometry) -> nextn_engine::backend::cuda::CudaBackend {
    let mut b = nextn_engine::backend::cuda::CudaBackend::new(0, source(&fixture("qwen3_5_moe_bf16")), geo).unwrap();
    b.set_graph_mode(mode);
    b
}

/// CUDA graphs replay what they captured: greedy decode steps (1 row, hiddens dropped) and verifies (4 rows,
/// snapshot lanes, hiddens kept, lane 1 committed after each) through captured graphs give the same ids as the same
/// bucketed steps run eagerly, step after step across a context bucket's edge (240 → 300 tokens, 20 decode + verify
/// pairs); the graphs are captured once per shape and bucket and replayed for the rest.
#[test]
fn gpu_graph_replay_equals_eager() {
    use nextn_engine::backend::cuda::graphs::GraphMode;
    use nextn_engine::sched::step::{Hiddens, StepCtx};
    use nextn_engine::Backend;
    if !gpu() {
        return;
    }
    let geo = CacheGeometry { num_blocks: 32, block_size: 16, num_slots: 1, lanes: 4 };
    let mut graphed = graphed_backend(GraphMode::Capture, geo);
    let mut eager = graphed_backend(GraphMode::Eager, geo);
    let vocab = graphed.config().vocab_size;
    let table: Vec<u32> = (0..32).collect();
    let prompt: Vec<u32> = (0..240).map(|i| 1 + (i * 7919 % (vocab - 1)) as u32).collect();
    let mut ids = Vec::new();
    for b in [&mut graphed, &mut eager] {
        b.reset_slot(0);
        let mut ctx = StepCtx { block_size: 16, hiddens: Hiddens::Drop, ..Default::default() };
        ctx.push_seq(&prompt, 0, &table, 0, |i| i + 1 == prompt.len());
        ids.push(b.execute_argmax(&ctx).unwrap().1);
    }
    assert_eq!(ids[0], ids[1], "prefill");
    let (mut len, mut next) = (prompt.len(), ids[0][0]);
    while len < 300 {
        // A decode step, then a verify of 3 drafts (the last token repeated) that commits one of them.
        let mut step = StepCtx { block_size: 16, hiddens: Hiddens::Drop, ..Default::default() };
        step.push_seq(&[next], len, &table, 0, |_| true);
        let mut verify = StepCtx { block_size: 16, hiddens: Hiddens::Keep, ..Default::default() };
        let mut got = Vec::new();
        for b in [&mut graphed, &mut eager] {
            let d = b.execute_argmax(&step).unwrap().1;
            let mut v = StepCtx { block_size: 16, hiddens: Hiddens::Keep, ..Default::default() };
            v.push_seq(&[d[0], d[0], d[0], d[0]], len + 1, &table, 0, |_| true);
            v.seqs[0].snapshot = true;
            let t = b.execute_argmax(&v).unwrap().1;
            b.commit_lane(0, 1);
            verify = v;
            got.push((d, t));
        }
        assert_eq!(got[0], got[1], "context {len}");
        len = verify.positions[0] + 2;
        next = got[0].1[1];
    }
    let (mode, captured, replayed) = graphed.graph_stats();
    assert_eq!(mode, GraphMode::Capture);
    // A shape's first step warms up eagerly, its second is captured. Decode and verify in the 256 bucket (the decode
    // warmed twice: the first verify made the snapshot lanes, and new buffers drop the graphs), both in the 512
    // bucket: 5 warm-ups, 4 captures, and the other 31 of the 40 steps replay.
    assert_eq!(captured, 4, "graphs captured");
    assert_eq!(replayed, 31, "replays");
    assert_eq!(eager.graph_stats().1, 0);
}

/// The engine with CUDA graphs generates what it generates without them: greedy MTP generation on the bf16 fixture
/// (decode and verify steps graphed, the greedy cycle's verify, draft extend and chained draft steps too) gives the
/// same tokens and acceptance as the same bucketed steps run eagerly.
#[test]
fn gpu_engine_with_graphs_generates_as_eager() {
    use nextn_engine::backend::cuda::graphs::GraphMode;
    if !gpu() {
        return;
    }
    let dir = fixture("qwen3_5_moe_bf16");
    let case = &reference("qwen3_5_moe_bf16").cases[0];
    let run = |mode: GraphMode| {
        let mcfg = nextn_engine::ModelConfig::from_path(&dir.join("config.json")).unwrap();
        let has_mtp = mcfg.mtp_num_hidden_layers > 0;
        let cfg = EngineConfig { spec: has_mtp.then_some(SpecConfig { draft_steps: 3 }), ..Default::default() };
        let dir = dir.clone();
        let make = move |blocks, block_size, slots, lanes| -> Result<Box<dyn nextn_engine::Backend>, nextn_engine::BackendError> {
            let geo = CacheGeometry { num_blocks: blocks, block_size, num_slots: slots, lanes };
            let mut b = nextn_engine::backend::cuda::CudaBackend::new(0, source(&dir), geo)?;
            b.set_graph_mode(mode);
            Ok(Box::new(b))
        };
        let mut e = Engine::with_backend(&mcfg, has_mtp, make, None, Vec::new(), cfg).unwrap();
        let params = SamplingParams { max_new_tokens: 40, ..SamplingParams::greedy() };
        e.generate(case.input_ids.clone(), params, |_| {}).unwrap()
    };
    let (graphed, eager) = (run(GraphMode::Capture), run(GraphMode::Eager));
    assert_eq!(graphed.token_ids, eager.token_ids);
    assert_eq!(graphed.spec.map(|s| s.accepted), eager.spec.map(|s| s.accepted));
}

/// Greedy MTP cycles through graphs (the verify, the draft extend and each chained draft step captured on a shape's
/// second cycle, replayed after) equal the same cycles run eagerly: two sequences accepting 3 and 1 drafts, four
/// cycles each from the same prefilled state.
#[test]
fn gpu_graphed_greedy_cycles_equal_eager() {
    use nextn_engine::backend::cuda::graphs::GraphMode;
    use nextn_engine::Backend;
    use nextn_tests::greedy_cycle_verify;
    if !gpu() {
        return;
    }
    let geo = CacheGeometry { num_blocks: 4, block_size: 16, num_slots: 2, lanes: 4 };
    let mut graphed = graphed_backend(GraphMode::Capture, geo);
    let mut eager = graphed_backend(GraphMode::Eager, geo);
    if !graphed.has_mtp() {
        return;
    }
    let cases = &reference("qwen3_5_moe_bf16").cases;
    let prompts: [&[u32]; 2] = [&cases[0].input_ids[..9], &cases[1 % cases.len()].input_ids[..7]];
    let tables: Vec<Vec<u32>> = vec![vec![0, 1], vec![2, 3]];
    for round in 0..4 {
        let mut got = Vec::new();
        for b in [&mut graphed, &mut eager] {
            let verify = greedy_cycle_verify(b, prompts, &tables, 16, [3, 1]);
            got.push(b.mtp_cycle_greedy(&verify, &tables, None, &[]).unwrap());
        }
        assert_eq!(got[0], got[1], "round {round}");
        assert_eq!(got[0].accepted, vec![3, 1], "round {round}");
    }
    let (_, captured, replayed) = graphed.graph_stats();
    // Every verify (greedy_cycle_verify's three and the cycle's) has one shape. Round 0: the verifies warm up,
    // capture, replay (1); the cycle's chain_ids / cycle_rows allocation then drops that graph, and its 4 stages warm
    // up. Round 1: the verifies capture again and replay (2), the cycle's verify replays (1), the extend and the two
    // draft steps capture. Rounds 2-3: 7 replays each. So 5 captures, 1 + 3 + 7 + 7 = 18 replays; fewer means a
    // stage's capture failed (its stderr line says why).
    assert_eq!((captured, replayed), (5, 18), "captures and replays of 4 cycles of 4 graphed stages");
}

/// Sampled steps draw on the device (`execute_sample`): each row's id is the keyed draw
/// (`nextn_engine::sample::keyed`, the host reference of `sample_f32`) of the logits `execute` sends back for the
/// same step (all but a rare draw within an ulp of a boundary), eager with hiddens returned or kept, and through
/// captured graphs (1-row decode steps, 4-row verifies) the same ids as eager.
#[test]
fn gpu_sample_path_draws_the_keyed_reference_of_the_logits_path() {
    use nextn_engine::backend::cuda::graphs::GraphMode;
    use nextn_engine::sample::keyed::{self, KeyedDraw};
    use nextn_engine::sched::step::{Hiddens, StepCtx};
    use nextn_engine::Backend;
    if !gpu() {
        return;
    }
    let (mut b, table) = mtp_fixture_on_gpu(4);
    let vocab = b.config().vocab_size;
    let tokens: Vec<u32> = reference("qwen3_5_moe_bf16").cases[0].input_ids.iter().take(12).copied().collect();
    let mut ctx = StepCtx { block_size: 16, ..Default::default() };
    ctx.push_seq(&tokens, 0, &table, 0, |_| true);
    let params = SamplingParams { temperature: 1.0, top_p: 0.95, min_p: 0.01, ..SamplingParams::greedy() };
    b.reset_slot(0);
    let (hidden, logits) = b.execute(&ctx).unwrap();
    let (mut equal, mut differ) = (0, Vec::new());
    for seed in 0..32u64 {
        let draws: Vec<KeyedDraw> = (0..tokens.len()).map(|i| KeyedDraw::new(&params, seed, i as u64 + 1)).collect();
        let want: Vec<u32> = logits.chunks(vocab).zip(&draws).map(|(row, d)| keyed::sample(row, d)).collect();
        for mode in [Hiddens::Return, Hiddens::Keep] {
            ctx.hiddens = mode;
            b.reset_slot(0);
            let (h, ids) = b.execute_sample(&ctx, &draws).unwrap();
            assert_eq!(h.is_empty(), mode == Hiddens::Keep, "{mode:?}");
            if mode == Hiddens::Return {
                assert_eq!(h, hidden, "the sampled step's hiddens");
            }
            equal += ids.iter().zip(&want).filter(|(a, b)| a == b).count();
            for (i, (&a, &b)) in ids.iter().zip(&want).enumerate().filter(|(_, (a, b))| a != b) {
                if differ.len() < 5 {
                    let row = &logits[i * vocab..(i + 1) * vocab];
                    differ.push(format!("seed {seed} row {i}: got {a} (z {}) want {b} (z {})", row[a as usize], row[b as usize]));
                }
            }
        }
    }
    let total = 32 * 2 * tokens.len();
    eprintln!("execute_sample: {equal} of {total} device draws equal the host reference over execute's logits");
    assert!(equal * 100 >= total * 99, "{equal} of {total}; first differing: {differ:?}");

    // Graphs: sampled decode and verify steps, captured and replayed, against the same steps eager.
    let geo = CacheGeometry { num_blocks: 8, block_size: 16, num_slots: 1, lanes: 4 };
    let run = |mode: GraphMode| -> (Vec<Vec<u32>>, usize) {
        let mut g = graphed_backend(mode, geo);
        let table: Vec<u32> = (0..8).collect();
        g.reset_slot(0);
        let mut out = Vec::new();
        let mut prefill = StepCtx { block_size: 16, hiddens: Hiddens::Drop, ..Default::default() };
        prefill.push_seq(&tokens, 0, &table, 0, |i| i == tokens.len() - 1);
        out.push(g.execute_sample(&prefill, &[KeyedDraw::new(&params, 9, tokens.len() as u64)]).unwrap().1);
        let mut p = tokens.len();
        for step in 0..12 {
            let last = *out.last().unwrap().last().unwrap();
            if step % 2 == 0 {
                let mut d = StepCtx { block_size: 16, hiddens: Hiddens::Drop, ..Default::default() };
                d.push_seq(&[last], p, &table, 0, |_| true);
                out.push(g.execute_sample(&d, &[KeyedDraw::new(&params, 9, p as u64 + 1)]).unwrap().1);
                p += 1;
            } else {
                let mut v = StepCtx { block_size: 16, hiddens: Hiddens::Keep, ..Default::default() };
                v.push_seq(&[last, 5, 6, 7], p, &table, 0, |_| true);
                v.seqs[0].snapshot = true;
                let draws: Vec<KeyedDraw> = (0..4).map(|i| KeyedDraw::new(&params, 9, (p + i + 1) as u64)).collect();
                out.push(g.execute_sample(&v, &draws).unwrap().1);
                g.commit_lane(0, 0);
                p += 1;
            }
        }
        let (_, captured, replayed) = g.graph_stats();
        eprintln!("{mode:?}: {captured} graphs captured, {replayed} replays");
        (out, replayed)
    };
    let ((graphed, replayed), (eager, _)) = (run(GraphMode::Capture), run(GraphMode::Eager));
    assert_eq!(graphed, eager, "graphed sampled steps equal eager");
    assert!(replayed > 0, "sampled steps replayed through graphs");
}
