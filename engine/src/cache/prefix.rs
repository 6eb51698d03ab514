//! Automatic prefix caching for the hybrid model: which prompt prefixes can be attached instead of prefilled.
//!
//! Two indexes, both plain CPU bookkeeping (no tensors):
//! - **KV blocks** (in [`crate::cache::blocks::BlockManager`]): a full prompt block is keyed by a hash chain,
//!   `key_i = H(key_{i-1}, tokens of block i [+ the token after it])`, seeded with the model's identity. With
//!   MTP the key also covers the first token of the next block, because the MTP layer's KV at a block's last
//!   position is computed from the token that follows it. Released blocks stay cached in an LRU until the
//!   free list runs dry.
//! - **GDN state checkpoints** (here): the conv window + recurrent state of every linear-attention layer at
//!   a block-aligned position, keyed by the chain key of the block that ends there, stored in extra state
//!   slots of the backend, `num_checkpoints` of them (a memory budget), evicted LRU. Linear attention has no
//!   per-token history, so a cached prefix is usable only up to its last checkpoint.
//!
//! Policy: during prefill a sequence saves a checkpoint at the end of its prompt's last full block, every
//! `checkpoint_every_blocks` blocks, and where its prompt branches off a cached one (the end of the cached
//! block chain it found past the last checkpoint; prefill chunks are cut at all of these). Admission attaches the longest prefix that
//! ends at a checkpoint, is strictly shorter than the prompt (one token is always computed for logits), and
//! whose blocks are all still cached.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use serde::Serialize;

/// Prefix-cache settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCacheConfig {
    /// Save a GDN state checkpoint every this many KV blocks of a prompt (besides its last full block).
    pub checkpoint_every_blocks: usize,
    /// Memory for GDN state checkpoints (one checkpoint = one state slot of every linear-attention layer).
    pub state_budget_bytes: usize,
}

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        PrefixCacheConfig { checkpoint_every_blocks: 16, state_budget_bytes: 1 << 30 }
    }
}

/// At most this many checkpoints, whatever the budget (the bookkeeping stays small).
pub const MAX_CHECKPOINTS: usize = 1024;

/// Key of a full block: the hash chain of every token up to its end (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockHash(pub u64);

/// Index of one checkpoint, `0..num_checkpoints`; the backend stores it in state slot `base + index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CheckpointId(pub u32);

impl CheckpointId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Counters, over the engine's lifetime.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PrefixCacheStats {
    /// Admitted requests that attached a cached prefix.
    pub hits: u64,
    /// Admitted requests that found none.
    pub misses: u64,
    /// Prompt tokens attached instead of prefilled.
    pub cached_prompt_tokens: u64,
    pub checkpoints_saved: u64,
    pub checkpoint_evictions: u64,
    /// Cached KV blocks reclaimed for new allocations.
    pub block_evictions: u64,
    /// Checkpoints held now.
    pub checkpoints: usize,
    /// KV blocks in the index now (held or evictable).
    pub cached_blocks: usize,
}

/// The model's identity, hashed: configuration (dtype included) and where it runs.
pub fn model_seed(identity: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    "nextn-prefix-cache-v1".hash(&mut h);
    identity.hash(&mut h);
    h.finish()
}

/// The GDN state checkpoint index and the prefix policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixCache {
    cfg: PrefixCacheConfig,
    seed: u64,
    block_size: usize,
    /// Tokens past a block's end its key covers (1 with MTP, else 0).
    lookahead: usize,
    by_key: HashMap<BlockHash, CheckpointId>,
    key_of: Vec<Option<BlockHash>>,
    last_use: Vec<u64>,
    /// Occupied checkpoints by last use (oldest first).
    lru: BTreeMap<u64, CheckpointId>,
    free: Vec<CheckpointId>,
    tick: u64,
    pub stats: PrefixCacheStats,
}

impl PrefixCache {
    pub fn new(cfg: PrefixCacheConfig, seed: u64, block_size: usize, lookahead: usize, num_checkpoints: usize) -> Self {
        PrefixCache {
            cfg,
            seed,
            block_size,
            lookahead,
            by_key: HashMap::new(),
            key_of: vec![None; num_checkpoints],
            last_use: vec![0; num_checkpoints],
            lru: BTreeMap::new(),
            free: (0..num_checkpoints as u32).rev().map(CheckpointId).collect(),
            tick: 0,
            stats: PrefixCacheStats::default(),
        }
    }

    /// How many checkpoints `cfg`'s budget holds at `state_bytes` per checkpoint (capped at [`MAX_CHECKPOINTS`]).
    pub fn capacity_for(cfg: &PrefixCacheConfig, state_bytes: usize) -> usize {
        (cfg.state_budget_bytes / state_bytes.max(1)).min(MAX_CHECKPOINTS)
    }

    pub fn num_checkpoints(&self) -> usize {
        self.key_of.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Chain keys of the blocks of `prompt` that can be cached: block `i` when `(i + 1) · bs + lookahead ≤ len`.
    pub fn block_keys(&self, prompt: &[u32]) -> Vec<BlockHash> {
        let bs = self.block_size;
        let mut keys = Vec::new();
        let mut parent = self.seed;
        let mut i = 0;
        while (i + 1) * bs + self.lookahead <= prompt.len() {
            let mut h = std::hash::DefaultHasher::new();
            parent.hash(&mut h);
            prompt[i * bs..(i + 1) * bs + self.lookahead].hash(&mut h);
            parent = h.finish();
            keys.push(BlockHash(parent));
            i += 1;
        }
        keys
    }

    /// Positions past `after` where a prompt of `len` tokens saves a checkpoint: every
    /// `checkpoint_every_blocks` blocks and at the end of its last cacheable block (ascending).
    pub fn checkpoint_positions(&self, len: usize, after: usize) -> Vec<usize> {
        let bs = self.block_size;
        let last = len.saturating_sub(self.lookahead) / bs;
        let every = self.cfg.checkpoint_every_blocks.max(1);
        (1..=last).filter(|b| b % every == 0 || *b == last).map(|b| b * bs).filter(|&p| p > after).collect()
    }

    pub fn contains(&self, key: BlockHash) -> bool {
        self.by_key.contains_key(&key)
    }

    /// The checkpoint saved for `key`, marked as just used.
    pub fn lookup(&mut self, key: BlockHash) -> Option<CheckpointId> {
        let id = *self.by_key.get(&key)?;
        self.touch(id);
        Some(id)
    }

    /// A checkpoint to save `key`'s state into (evicting the least recently used one when all are taken);
    /// `None` when `key` is already saved (it is marked as used) or there are no checkpoints at all.
    pub fn insert(&mut self, key: BlockHash) -> Option<CheckpointId> {
        if let Some(&id) = self.by_key.get(&key) {
            self.touch(id);
            return None;
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.lru.pop_first()?;
                let old = self.key_of[id.index()].take().expect("an occupied checkpoint has a key");
                self.by_key.remove(&old);
                self.stats.checkpoint_evictions += 1;
                id
            }
        };
        self.key_of[id.index()] = Some(key);
        self.by_key.insert(key, id);
        self.tick += 1;
        self.last_use[id.index()] = self.tick;
        self.lru.insert(self.tick, id);
        self.stats.checkpoints_saved += 1;
        self.stats.checkpoints = self.by_key.len();
        Some(id)
    }

    fn touch(&mut self, id: CheckpointId) {
        self.lru.remove(&self.last_use[id.index()]);
        self.tick += 1;
        self.last_use[id.index()] = self.tick;
        self.lru.insert(self.tick, id);
    }

    /// Every checkpoint is free (no key, on the free list once) or holds one key, indexed and in the LRU.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.key_of.len();
        let mut free = vec![false; n];
        for &c in &self.free {
            let f = free.get_mut(c.index()).ok_or(format!("free checkpoint {} out of range", c.0))?;
            if std::mem::replace(f, true) {
                return Err(format!("checkpoint {} is free twice", c.0));
            }
        }
        for (i, key) in self.key_of.iter().enumerate() {
            match key {
                None if !free[i] => return Err(format!("checkpoint {i} has no key but is not free")),
                Some(_) if free[i] => return Err(format!("checkpoint {i} has a key and is free")),
                Some(k) if self.by_key.get(k) != Some(&CheckpointId(i as u32)) => {
                    return Err(format!("checkpoint {i}'s key is not indexed to it"));
                }
                Some(_) if self.lru.get(&self.last_use[i]) != Some(&CheckpointId(i as u32)) => {
                    return Err(format!("checkpoint {i} is not in the LRU"));
                }
                _ => {}
            }
        }
        if self.by_key.len() + self.free.len() != n || self.lru.len() != self.by_key.len() {
            return Err(format!(
                "{} indexed + {} free checkpoints, {} in the LRU, of {n}",
                self.by_key.len(),
                self.free.len(),
                self.lru.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pc(bs: usize, lookahead: usize, every: usize, n: usize) -> PrefixCache {
        let cfg = PrefixCacheConfig { checkpoint_every_blocks: every, state_budget_bytes: 0 };
        PrefixCache::new(cfg, model_seed("test"), bs, lookahead, n)
    }

    #[test]
    fn block_keys_chain_over_the_whole_prefix() {
        let c = pc(4, 0, 2, 2);
        let a: Vec<u32> = (0..13).collect();
        let mut b = a.clone();
        b[5] = 99; // block 1 differs: keys 1.. differ, key 0 agrees
        let (ka, kb) = (c.block_keys(&a), c.block_keys(&b));
        assert_eq!(ka.len(), 3);
        assert_eq!(ka[0], kb[0]);
        assert!(ka[1..].iter().zip(&kb[1..]).all(|(x, y)| x != y));
        // With MTP the key covers the next token too: 12 tokens make only 2 keys, and the token after a
        // block changes its key.
        let m = pc(4, 1, 2, 2);
        assert_eq!(m.block_keys(&a[..12]).len(), 2);
        let mut d = a.clone();
        d[4] = 77;
        assert_ne!(m.block_keys(&a)[0], m.block_keys(&d)[0]);
        assert_ne!(m.block_keys(&a)[0], ka[0], "MTP and plain keys never mix");
    }

    #[test]
    fn checkpoints_every_n_blocks_and_at_the_last_full_block() {
        let c = pc(4, 0, 2, 1);
        assert_eq!(c.checkpoint_positions(23, 0), vec![8, 16, 20]);
        assert_eq!(c.checkpoint_positions(24, 0), vec![8, 16, 24]);
        assert_eq!(c.checkpoint_positions(24, 8), vec![16, 24]);
        assert_eq!(c.checkpoint_positions(3, 0), Vec::<usize>::new());
        let m = pc(4, 1, 2, 1);
        assert_eq!(m.checkpoint_positions(24, 0), vec![8, 16, 20], "with MTP a block needs the token after it");
    }

    #[test]
    fn checkpoints_are_evicted_least_recently_used_first() {
        let mut c = pc(4, 0, 1, 2);
        let (k1, k2, k3) = (BlockHash(1), BlockHash(2), BlockHash(3));
        let a = c.insert(k1).unwrap();
        let b = c.insert(k2).unwrap();
        assert_eq!(c.insert(k1), None, "already saved");
        assert_eq!(c.lookup(k1), Some(a));
        // k2 is now the oldest.
        assert_eq!(c.insert(k3), Some(b));
        assert!(c.contains(k1) && !c.contains(k2) && c.contains(k3));
        assert_eq!((c.stats.checkpoints_saved, c.stats.checkpoint_evictions, c.stats.checkpoints), (3, 1, 2));
        c.check_invariants().unwrap();
        let mut none = pc(4, 0, 1, 0);
        assert_eq!(none.insert(k1), None);
        none.check_invariants().unwrap();
    }
}
