//! MTP speculative decoding as explicit steps: **propose** (k drafts from the MTP head, a chain) →
//! **verify** (one target forward over `[root, d1..dk]`, then the acceptance rule) → **commit** (keep `m + 1`
//! tokens: KV by length, GDN state by snapshot lane `m`, MTP KV by the draft extend). This file holds the
//! types and the acceptance rules; the engine drives the forwards.

use serde::Serialize;

use crate::sampler::{argmax, probs, Sampler, SamplingParams};

/// Speculation settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// Draft tokens per round (MTP forwards per round), 1..=8.
    pub draft_steps: usize,
}

pub const MAX_DRAFT_STEPS: usize = 8;

/// Drafts proposed for one sequence, with the draft distributions they were drawn from (sampling only).
#[derive(Debug, Clone, Default)]
pub struct Proposal {
    pub drafts: Vec<u32>,
    /// `q_i` over the vocabulary for each draft (empty for greedy, where drafts are argmaxes).
    pub draft_probs: Vec<Vec<f32>>,
}

/// The outcome of verifying a proposal: `accepted` drafts (m) plus one target token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    /// `d1..dm, b`: the accepted drafts and the correction (or bonus) token from row m.
    pub emitted: Vec<u32>,
}

/// Greedy acceptance: accept `d_{i+1}` while `argmax(l_i) == d_{i+1}`; the last token is `argmax(l_m)`.
/// `target_logits` holds `drafts.len() + 1` rows.
pub fn verify_greedy(drafts: &[u32], target_logits: &[f32], vocab: usize) -> Verdict {
    let row = |i: usize| &target_logits[i * vocab..(i + 1) * vocab];
    let mut emitted = Vec::with_capacity(drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        let t = argmax(row(i));
        if t != d {
            emitted.push(t);
            return Verdict { accepted: i, emitted };
        }
        emitted.push(d);
    }
    emitted.push(argmax(row(drafts.len())));
    Verdict { accepted: drafts.len(), emitted }
}

/// Speculative sampling: accept `d_i` with probability `min(1, p_i(d_i) / q_i(d_i))`; on rejection draw from
/// the normalised residual `max(0, p_i − q_i)`; if every draft is accepted draw the bonus from `p_k`.
/// `p_i` is the target's distribution under the request's own temperature / top-k / top-p / min-p, so the
/// emitted tokens are distributed exactly as sampling the target alone.
pub fn verify_sampling(
    proposal: &Proposal,
    target_logits: &[f32],
    vocab: usize,
    params: &SamplingParams,
    sampler: &mut Sampler,
) -> Verdict {
    let mut emitted = Vec::with_capacity(proposal.drafts.len() + 1);
    for (i, (&d, q)) in proposal.drafts.iter().zip(&proposal.draft_probs).enumerate() {
        let p = probs(&target_logits[i * vocab..(i + 1) * vocab], params);
        let (pd, qd) = (p[d as usize] as f64, q[d as usize] as f64);
        if qd > 0.0 && sampler.uniform() < (pd / qd).min(1.0) {
            emitted.push(d);
            continue;
        }
        let mut residual: Vec<f32> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
        let mass: f32 = residual.iter().sum();
        let token = if mass > 0.0 {
            residual.iter_mut().for_each(|r| *r /= mass);
            sampler.sample_from(&residual)
        } else {
            sampler.sample_from(&p)
        };
        emitted.push(token);
        return Verdict { accepted: i, emitted };
    }
    let k = proposal.drafts.len();
    let p = probs(&target_logits[k * vocab..(k + 1) * vocab], params);
    emitted.push(sampler.sample_from(&p));
    Verdict { accepted: k, emitted }
}

/// Acceptance counters, per request and in aggregate.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SpecStats {
    /// Verify forwards that carried at least one draft.
    pub verify_steps: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Tokens emitted per verify step, bonus included (1..=k+1).
    pub acceptance_length: f64,
    /// Accepted drafts / drafted.
    pub acceptance_rate: f64,
    /// `[i]` = rounds whose draft at position i + 1 was accepted.
    pub accepted_per_position: Vec<usize>,
}

impl SpecStats {
    pub fn new(draft_steps: usize) -> Self {
        SpecStats { accepted_per_position: vec![0; draft_steps], ..Default::default() }
    }

    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.verify_steps += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        for hit in self.accepted_per_position.iter_mut().take(accepted) {
            *hit += 1;
        }
        self.refresh();
    }

    pub fn merge(&mut self, other: &SpecStats) {
        self.verify_steps += other.verify_steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        if self.accepted_per_position.len() < other.accepted_per_position.len() {
            self.accepted_per_position.resize(other.accepted_per_position.len(), 0);
        }
        for (a, b) in self.accepted_per_position.iter_mut().zip(&other.accepted_per_position) {
            *a += b;
        }
        self.refresh();
    }

    fn refresh(&mut self) {
        let steps = self.verify_steps.max(1) as f64;
        self.acceptance_length = if self.verify_steps == 0 { 0.0 } else { (self.accepted + self.verify_steps) as f64 / steps };
        self.acceptance_rate = if self.drafted == 0 { 0.0 } else { self.accepted as f64 / self.drafted as f64 };
    }
}

/// Draw draft `i`: argmax for greedy, else a sample from the draft distribution (kept for verification).
pub fn draw_draft(logits: &[f32], params: &SamplingParams, sampler: &mut Sampler, proposal: &mut Proposal) {
    if params.is_greedy() {
        proposal.drafts.push(argmax(logits));
    } else {
        let q = probs(logits, params);
        proposal.drafts.push(sampler.sample_from(&q));
        proposal.draft_probs.push(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_hot_rows(tokens: &[u32], vocab: usize) -> Vec<f32> {
        let mut l = vec![0.0; tokens.len() * vocab];
        for (i, &t) in tokens.iter().enumerate() {
            l[i * vocab + t as usize] = 5.0;
        }
        l
    }

    #[test]
    fn greedy_accepts_longest_matching_prefix_plus_one() {
        let vocab = 10;
        let target = one_hot_rows(&[4, 5, 6, 7], vocab);
        assert_eq!(verify_greedy(&[4, 5, 6], &target, vocab), Verdict { accepted: 3, emitted: vec![4, 5, 6, 7] });
        assert_eq!(verify_greedy(&[4, 9, 6], &target, vocab), Verdict { accepted: 1, emitted: vec![4, 5] });
        assert_eq!(verify_greedy(&[1, 5, 6], &target, vocab), Verdict { accepted: 0, emitted: vec![4] });
        assert_eq!(verify_greedy(&[], &target[..vocab], vocab), Verdict { accepted: 0, emitted: vec![4] });
    }

    #[test]
    fn stats_count_bonus_in_acceptance_length() {
        let mut s = SpecStats::new(3);
        s.record(3, 3);
        s.record(3, 0);
        s.record(0, 0); // no drafts: not a verify step
        assert_eq!((s.verify_steps, s.drafted, s.accepted), (2, 6, 3));
        assert_eq!(s.accepted_per_position, vec![1, 1, 1]);
        assert!((s.acceptance_length - 2.5).abs() < 1e-12);
        assert!((s.acceptance_rate - 0.5).abs() < 1e-12);
    }
}
