//! Weights on the host: the [`Host`] family (matrices in their stored dtype, vectors widened to f32,
//! experts as per-expert views) and the load table's [`Load`] on a checkpoint's [`WeightLoader`].

use super::moe::Mlp;
use super::ops::{Family, Load};
use crate::weights::{Tensor, WeightLoader};

/// Weights on the host: matrices in their stored dtype, vectors widened to f32, experts as per-expert views.
pub struct Host;

impl Family for Host {
    type Mat = Tensor;
    type Vec = Vec<f32>;
    type Experts = Vec<Mlp<Host>>;
}

impl Load<Host> for WeightLoader<'_> {
    fn contains(&self, name: &str) -> bool {
        WeightLoader::contains(self, name)
    }
    fn ignore_prefix(&mut self, prefix: &str) {
        WeightLoader::ignore_prefix(self, prefix)
    }
    fn mat(&mut self, name: &str, rows: usize, cols: usize) -> Tensor {
        self.take(name, &[rows, cols])
    }
    fn vec(&mut self, name: &str, shape: &[usize]) -> Vec<f32> {
        self.take(name, shape).to_f32_vec()
    }
    /// Stacked experts are split into zero-copy per-expert views here, once.
    fn experts(&mut self, prefix: &str, experts: usize, inter: usize, hidden: usize) -> Vec<Mlp<Host>> {
        let stacked = format!("{prefix}mlp.experts.gate_up_proj");
        if !WeightLoader::contains(self, &stacked) {
            return (0..experts).map(|i| Mlp::load(self, &format!("{prefix}mlp.experts.{i}."), hidden, inter)).collect();
        }
        let gate_up = self.take(&stacked, &[experts, 2 * inter, hidden]);
        let down = self.take(&format!("{prefix}mlp.experts.down_proj"), &[experts, hidden, inter]);
        if gate_up.numel() == 0 || down.numel() == 0 {
            return Vec::new(); // problem already recorded
        }
        (0..experts)
            .map(|i| {
                let gu = gate_up.index0(i);
                Mlp {
                    gate_proj: gu.rows_range(0, inter),
                    up_proj: gu.rows_range(inter, 2 * inter),
                    down_proj: down.index0(i),
                    gate_up: Some(gu),
                }
            })
            .collect()
    }
}
