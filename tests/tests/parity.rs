//! The CPU forward against HF transformers (float32 oracle) on every committed fixture.
//! Run with `--nocapture` to see the parity numbers per fixture.

use nextn_engine::{LoadOptions, Model};
use nextn_tests::{fixture, max_errors, reference, MODEL_FIXTURES};

fn load(name: &str) -> Model {
    Model::load(&fixture(name), &LoadOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn logits_match_transformers_on_every_fixture() {
    for (name, dtype) in MODEL_FIXTURES {
        let model = load(name);
        let reference = reference(name);
        for case in &reference.cases {
            let got = model.logits(&case.input_ids).unwrap();
            let (err, scale) = max_errors(&got, &case.logits);
            let rel = err / scale;
            println!(
                "parity {name:<28} {:<5} weights={:<8} positions={:>3} max|err|={err:.3e} max|ref|={scale:.3} rel={rel:.3e} (bar {:.0e})",
                case.name,
                reference.weights_dtype,
                case.input_ids.len(),
                dtype.tolerance()
            );
            assert!(rel <= dtype.tolerance(), "{name}/{}: relative error {rel:.3e} over {:.0e}", case.name, dtype.tolerance());
        }
    }
}

#[test]
fn greedy_continuation_matches_transformers_on_every_fixture() {
    for (name, _) in MODEL_FIXTURES {
        let model = load(name);
        for case in &reference(name).cases {
            let got = model.greedy(&case.input_ids, case.greedy_ids.len()).unwrap();
            assert_eq!(got, case.greedy_ids, "{name}/{}", case.name);
            println!("greedy {name:<28} {:<5} {} tokens identical", case.name, got.len());
        }
    }
}

#[test]
fn both_checkpoint_layouts_give_identical_logits() {
    // The f32 pair holds bit-identical weights in the two layouts. (The bf16 pair does not: the fused bf16
    // fixture keeps A_log in f32, as mixed-dtype checkpoints do.)
    for (fused, per_expert) in [("qwen3_5_moe", "qwen3_5_moe_per_expert")] {
        let (a, b) = (load(fused), load(per_expert));
        for case in &reference(fused).cases {
            assert_eq!(a.logits(&case.input_ids).unwrap(), b.logits(&case.input_ids).unwrap(), "{fused} vs {per_expert}");
        }
    }
}

#[test]
fn incremental_prefill_and_decode_equal_one_full_forward() {
    for (name, _) in MODEL_FIXTURES {
        let model = load(name);
        let case = &reference(name).cases[0];
        let ids = &case.input_ids;
        let full = model.logits(ids).unwrap();
        for chunk in [1, 7, ids.len()] {
            let mut cache = model.new_seq_cache(ids.len());
            let mut rows = Vec::new();
            for (i, piece) in ids.chunks(chunk).enumerate() {
                let flat = model.forward(piece, i * chunk, &mut cache).unwrap();
                rows.extend(flat.chunks(model.config().vocab_size).map(<[f32]>::to_vec));
            }
            let (err, scale) = max_errors(&rows, &full);
            assert!(err <= 1e-4 * scale, "{name} chunk {chunk}: {err:.3e} vs max {scale:.3}");
        }
    }
}
