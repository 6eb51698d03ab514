//! MTP speculative decoding as explicit steps: **propose** (k drafts from the MTP head, a chain) →
//! **verify** (one target forward over `[root, d1..dk]`, then the acceptance rule) → **commit** (keep `m + 1`
//! tokens: KV by length, GDN state by snapshot lane `m`, MTP KV by the draft extend). This module holds the
//! types and the acceptance rules; [`Speculator`] runs propose (and picks the acceptance rule of verify) for
//! the engine and the cycle benchmark; the engine schedules the verify forward and commits.

mod draft_vocab;
mod speculator;

pub use draft_vocab::{draft_tokens, rank_by_frequency, read_token_ids, DraftVocab, DraftVocabError, DRAFT_VOCAB_FILE};
pub use speculator::{DraftRows, Speculator};

use serde::Serialize;

use crate::sample::{argmax, probs, Sampler, SamplingParams};

/// Speculation settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// Draft tokens per round (MTP forwards per round), 1..=8.
    pub draft_steps: usize,
}

impl SpecConfig {
    /// Rows one verify carries: the root (the last committed token) and the drafts. It is also the number
    /// of GDN snapshot lanes a state slot needs (one state per verify row) and the KV positions a sequence
    /// reserves past its length.
    pub fn verify_rows(&self) -> usize {
        self.draft_steps + 1
    }
}

pub const MAX_DRAFT_STEPS: usize = 8;

/// Drafts proposed for one sequence, with the draft distributions they were drawn from, if any.
#[derive(Debug, Clone, Default)]
pub struct Proposal {
    pub drafts: Vec<u32>,
    /// `q_i` over the vocabulary for each draft when the drafts were sampled from the draft head (a caller's
    /// own proposal, [`crate::Engine::inject_proposal`]); empty for deterministic drafts — the draft head's
    /// argmaxes, which is what [`Speculator::propose`] drafts for every request.
    pub draft_probs: Vec<Vec<f32>>,
}

/// The outcome of verifying a proposal: `accepted` drafts (m) plus one target token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    /// `d1..dm, b`: the accepted drafts and the correction (or bonus) token from row m.
    pub emitted: Vec<u32>,
}

/// The target's rows of a verify: their logits, or (a greedy request, reduced by the backend) their argmax ids.
#[derive(Debug, Clone, Copy)]
pub enum TargetRows<'a> {
    Logits(&'a [f32]),
    Argmax(&'a [u32]),
    /// Ids drawn where the logits are ([`crate::backend::Backend::execute_sample`]): a draft is accepted iff its
    /// row drew it (probability p(d)), and the first id that differs is a draw from p without the draft, the
    /// residual (or the last row's, the bonus token): speculative sampling of deterministic drafts.
    Drawn(&'a [u32]),
}

/// Greedy acceptance: accept `d_{i+1}` while `argmax(l_i) == d_{i+1}`; the last token is `argmax(l_m)`.
/// `target_logits` holds `drafts.len() + 1` rows.
pub fn verify_greedy(drafts: &[u32], target_logits: &[f32], vocab: usize) -> Verdict {
    let argmaxes: Vec<u32> = target_logits.chunks(vocab).take(drafts.len() + 1).map(argmax).collect();
    verify_greedy_ids(drafts, &argmaxes)
}

/// [`verify_greedy`] on the rows' argmax ids (`drafts.len() + 1` of them).
pub fn verify_greedy_ids(drafts: &[u32], target: &[u32]) -> Verdict {
    let mut emitted = Vec::with_capacity(drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        if target[i] != d {
            emitted.push(target[i]);
            return Verdict { accepted: i, emitted };
        }
        emitted.push(d);
    }
    emitted.push(target[drafts.len()]);
    Verdict { accepted: drafts.len(), emitted }
}

/// Speculative sampling: accept `d_i` with probability `min(1, p_i(d_i) / q_i(d_i))`; on rejection draw from
/// the normalised residual `max(0, p_i − q_i)`; if every draft is accepted draw the bonus from `p_k`.
/// `p_i` is the target's distribution under the request's own temperature / top-k / top-p / min-p, so the
/// emitted tokens are distributed exactly as sampling the target alone. Without draft distributions
/// (`proposal.draft_probs` empty) the drafts are deterministic, `q_i` one-hot at `d_i`: accept with probability
/// `p_i(d_i)`, else draw from `p_i` with `d_i` removed.
pub fn verify_sampling(
    proposal: &Proposal,
    target_logits: &[f32],
    vocab: usize,
    params: &SamplingParams,
    sampler: &mut Sampler,
) -> Verdict {
    let mut emitted = Vec::with_capacity(proposal.drafts.len() + 1);
    for (i, &d) in proposal.drafts.iter().enumerate() {
        let p = probs(&target_logits[i * vocab..(i + 1) * vocab], params);
        let q = proposal.draft_probs.get(i);
        let (pd, qd) = (p[d as usize] as f64, q.map_or(1.0, |q| q[d as usize] as f64));
        if qd > 0.0 && sampler.uniform() < (pd / qd).min(1.0) {
            emitted.push(d);
            continue;
        }
        let mut residual: Vec<f32> = match q {
            Some(q) => p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect(),
            None => {
                let mut r = p.clone();
                r[d as usize] = 0.0;
                r
            }
        };
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Deterministic drafts (no draft distribution): whatever the draft, the first emitted token follows the
    /// target's distribution — a likely draft (accepted often), an unlikely one, one the target never emits.
    /// χ² over the 4 tokens, 3 degrees of freedom, significance 0.001: critical value 16.27. Fixed seeds.
    #[test]
    fn deterministic_drafts_keep_the_target_distribution() {
        let vocab = 5;
        let row = [1.2f32, 0.3, -0.4, 0.9, f32::NEG_INFINITY];
        let params = SamplingParams { temperature: 1.0, seed: Some(3), ..SamplingParams::greedy() };
        let p = probs(&row, &params);
        // The verify's two rows: row 0 scores the draft, row 1 (the bonus row) the same distribution.
        let target: Vec<f32> = row.iter().chain(row.iter()).copied().collect();
        let n = 40_000;
        for draft in [0u32, 2, 4] {
            let mut counts = [0usize; 5];
            let mut accepted = 0;
            for i in 0..n {
                let mut sampler = Sampler::new(SamplingParams { seed: Some(1000 + i), ..params.clone() });
                let proposal = Proposal { drafts: vec![draft], draft_probs: Vec::new() };
                let v = verify_sampling(&proposal, &target, vocab, &params, &mut sampler);
                counts[v.emitted[0] as usize] += 1;
                accepted += v.accepted;
                if v.accepted == 0 {
                    assert_ne!(v.emitted[0], draft, "a rejected draft is never the correction");
                }
            }
            assert_eq!(counts[4], 0, "a token the target never emits");
            let chi2: f64 = (0..4)
                .map(|t| {
                    let e = p[t] as f64 * n as f64;
                    (counts[t] as f64 - e).powi(2) / e
                })
                .sum();
            assert!(chi2 < 16.27, "draft {draft}: χ² = {chi2:.2}; counts {counts:?} vs p {p:?}");
            let rate = accepted as f64 / n as f64;
            assert!((rate - p[draft as usize] as f64).abs() < 0.02, "draft {draft}: accepted {rate:.3}, p(d) = {}", p[draft as usize]);
        }
    }

    #[test]
    fn draft_vocab_checks_ids_and_resolves_sizes_and_files() {
        assert!(matches!(DraftVocab::new(vec![], 10, "t"), Err(DraftVocabError::Empty { .. })));
        assert!(matches!(DraftVocab::new(vec![3, 10], 10, "t"), Err(DraftVocabError::OutOfRange { id: 10, .. })));
        assert!(matches!(DraftVocab::new(vec![3, 4, 3], 10, "t"), Err(DraftVocabError::Duplicate { id: 3, .. })));
        let dir = std::env::temp_dir().join(format!("nextn-draft-vocab-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(matches!(DraftVocab::resolve("2", Some(&dir), 10), Err(DraftVocabError::Missing { n: 2, .. })));
        std::fs::write(dir.join(DRAFT_VOCAB_FILE), "# most frequent first\n7\n2\n\n5 # comment\n").unwrap();
        let dv = DraftVocab::resolve("2", Some(&dir), 10).unwrap();
        assert_eq!(dv.ids(), &[7, 2]);
        assert!(matches!(DraftVocab::resolve("4", Some(&dir), 10), Err(DraftVocabError::TooFew { have: 3, .. })));
        assert!(matches!(DraftVocab::resolve("2", None, 10), Err(DraftVocabError::NoModelDir { n: 2 })));
        let whole = DraftVocab::resolve(dir.join(DRAFT_VOCAB_FILE).to_str().unwrap(), None, 10).unwrap();
        assert_eq!(whole.ids(), &[7, 2, 5]);
        std::fs::write(dir.join("bad.txt"), "1\nx2\n").unwrap();
        let bad = DraftVocab::resolve(dir.join("bad.txt").to_str().unwrap(), None, 10).unwrap_err();
        assert!(matches!(bad, DraftVocabError::Parse { line: 2, .. }), "{bad}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn frequency_rank_puts_required_ids_first_then_counts() {
        let counts: HashMap<u32, u64> = [(1, 5), (2, 9), (3, 5), (4, 1)].into_iter().collect();
        assert_eq!(rank_by_frequency(&counts, &[4, 8]), vec![4, 8, 2, 1, 3]);
    }

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
