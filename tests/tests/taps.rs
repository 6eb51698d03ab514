//! Taps (`nextn_engine::models::tap`): what the GPU = CPU layer-by-layer test reads. On the CPU: off by
//! default, and while recording, every block's residual stream in forward order, rows × hidden each, the
//! last one being what the final norm and LM head turn into the logits.

use nextn_engine::backend::select::logits_on;
use nextn_engine::models::tap;
use nextn_engine::{Device, ModelSource};
use nextn_tests::{fixture, greedy_deficits, reference};

#[test]
fn taps_record_every_block_in_forward_order_only_while_started() {
    let name = "qwen3_5_moe_bf16";
    let source = || ModelSource::open(&fixture(name)).unwrap();
    let cfg = source().config().clone();
    let tokens = &reference(name).cases[0].input_ids;
    // Off by default: a forward records nothing.
    logits_on(Device::Cpu, source(), tokens).unwrap();
    assert!(tap::stop().is_empty(), "taps recorded without start()");

    tap::start();
    let logits = logits_on(Device::Cpu, source(), tokens).unwrap();
    let taps = tap::stop();
    let residual: Vec<&(String, Vec<f32>)> = taps.iter().filter(|(n, _)| n.contains(".x ") || n == "embed").collect();
    let want: Vec<String> = std::iter::once("embed".to_string())
        .chain((0..cfg.num_hidden_layers).flat_map(|i| [format!("L{i}.x after mixer"), format!("L{i}.x after moe")]))
        .collect();
    assert_eq!(residual.iter().map(|t| t.0.clone()).collect::<Vec<_>>(), want);
    for (n, v) in &residual {
        assert_eq!(v.len(), tokens.len() * cfg.hidden_size, "{n}");
    }
    // Each block adds to the stream: no two consecutive residual taps are equal.
    for w in residual.windows(2) {
        assert_ne!(w[0].1, w[1].1, "{} -> {}", w[0].0, w[1].0);
    }
    // Recording changes nothing: the same logits as a forward without taps.
    assert_eq!(logits, logits_on(Device::Cpu, source(), tokens).unwrap());
}

#[test]
fn greedy_deficits_are_zero_at_the_argmax_and_the_gap_below_it() {
    let logits = vec![vec![0.0, 0.0], vec![1.0, 4.0, -2.0], vec![3.0, -1.0, 2.0]];
    // Row 1 predicts generated[0], row 2 generated[1] (prompt of 2 tokens).
    let d = greedy_deficits(&logits, 2, &[1, 2]);
    assert_eq!(d, vec![0.0, (3.0 - 2.0) / 3.0]);
}
