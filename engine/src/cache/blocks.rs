//! Paged KV-cache bookkeeping for the full-attention layers (and the MTP layer).
//!
//! The KV buffer the runner owns is `[num_blocks * block_size, ...]`; a sequence's tokens live in the
//! blocks of its block table, token `pos` at slot `table[pos / bs] * bs + pos % bs`. Blocks are
//! reference counted: only full blocks are ever shared (the prefix cache's), so a write never lands in a
//! shared block and no copy-on-write exists.
//!
//! Prefix caching: a full block can be [`BlockManager::register`]ed under its hash-chain key
//! ([`crate::cache::prefix`]); [`BlockManager::lookup`] finds it and [`BlockManager::attach`] shares it with a
//! new sequence. A cached block whose last holder is freed is not returned to the free list but kept,
//! evictable, in an LRU; it is reclaimed (and leaves the index) only when the free list runs dry, so
//! [`BlockManager::num_free_blocks`] counts free and evictable blocks alike.
//!
//! Plain CPU code, no tensors: every call either succeeds or returns a [`CacheError`] and changes nothing.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::cache::prefix::BlockHash;

/// Tokens per block unless the caller says otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Identifies one sequence (request) across the block manager and the state-slot pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq {}", self.0)
    }
}

/// Index of one KV block, `0..num_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

impl BlockId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {}", self.0)
    }
}

/// Bookkeeping errors. Each names the sequence or the limit it hit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error(
        "KV cache exhausted: need {needed} more block(s), {free} of {total} free; wait for a sequence to finish or preempt one"
    )]
    OutOfBlocks { needed: usize, free: usize, total: usize },

    #[error("{0} is not in the block manager (never added, or already freed)")]
    UnknownSequence(SeqId),

    #[error("{0} is already in the block manager")]
    SequenceExists(SeqId),

    #[error("cannot truncate {seq} to {new_len} tokens: it holds only {len}")]
    TruncateBeyondLength { seq: SeqId, len: usize, new_len: usize },

    #[error("positions {start}..{end} of {seq} are out of range (length {len})")]
    PositionOutOfRange { seq: SeqId, start: usize, end: usize, len: usize },

    #[error(
        "invalid KV cache geometry: {num_blocks} block(s) of {block_size} token(s) (need ≥ 1 of each, at most {} blocks, and a slot count that fits in usize)",
        u32::MAX
    )]
    InvalidGeometry { num_blocks: usize, block_size: usize },

    #[error(
        "KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens × {bytes_per_token} bytes/token; raise the budget or lower the block size"
    )]
    BudgetTooSmall { budget_bytes: usize, bytes_per_token: usize, block_size: usize },
}

/// KV bytes per token for a model: `attn_layers × 2 (K and V) × kv_heads × head_dim × dtype_bytes`.
/// For Qwen3.5 `attn_layers` counts the full-attention layers (+1 for the MTP layer when it is used).
pub fn kv_bytes_per_token(attn_layers: usize, num_kv_heads: usize, head_dim: usize, dtype_bytes: usize) -> usize {
    attn_layers * 2 * num_kv_heads * head_dim * dtype_bytes
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct SeqBlocks {
    table: Vec<BlockId>,
    len: usize,
}

/// Owns the KV blocks: a free list, one reference count per block and one block table per sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockManager {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Free blocks, used as a stack (the most recently freed block is reused first).
    free: Vec<BlockId>,
    seqs: BTreeMap<SeqId, SeqBlocks>,
    /// Prefix cache: the key of each registered block, and the index back.
    hashes: Vec<Option<BlockHash>>,
    index: HashMap<BlockHash, BlockId>,
    /// Registered blocks nobody holds, by release time (oldest first): reclaimed when `free` is empty.
    evictable: BTreeMap<u64, BlockId>,
    released_at: Vec<u64>,
    tick: u64,
    evictions: u64,
}

impl BlockManager {
    /// `num_blocks` blocks of `block_size` tokens each.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, CacheError> {
        let fits = num_blocks >= 1
            && block_size >= 1
            && num_blocks <= u32::MAX as usize
            && num_blocks.checked_mul(block_size).is_some();
        if !fits {
            return Err(CacheError::InvalidGeometry { num_blocks, block_size });
        }
        Ok(Self {
            block_size,
            ref_counts: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
            seqs: BTreeMap::new(),
            hashes: vec![None; num_blocks],
            index: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            tick: 0,
            evictions: 0,
        })
    }

    /// As many blocks as `budget_bytes` holds at `bytes_per_token` (see [`kv_bytes_per_token`]).
    pub fn from_budget(budget_bytes: usize, bytes_per_token: usize, block_size: usize) -> Result<Self, CacheError> {
        let too_small = CacheError::BudgetTooSmall { budget_bytes, bytes_per_token, block_size };
        let bytes_per_block = bytes_per_token.checked_mul(block_size).filter(|&b| b > 0).ok_or(too_small.clone())?;
        let num_blocks = (budget_bytes / bytes_per_block).min(u32::MAX as usize);
        if num_blocks == 0 {
            return Err(too_small);
        }
        Self::new(num_blocks, block_size)
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks an allocation can take: free ones and cached ones nobody holds (evictable).
    pub fn num_free_blocks(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Cached blocks nobody holds (counted in [`Self::num_free_blocks`]).
    pub fn num_evictable_blocks(&self) -> usize {
        self.evictable.len()
    }

    /// Blocks in the prefix index (held or evictable).
    pub fn num_cached_blocks(&self) -> usize {
        self.index.len()
    }

    /// Cached blocks reclaimed for new allocations so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// The cached block registered under `key`, if it is still cached.
    pub fn lookup(&self, key: BlockHash) -> Option<BlockId> {
        self.index.get(&key).copied()
    }

    /// Whether `block` is free now and not cached (attaching it would not take it off the evictable list).
    pub fn is_evictable(&self, block: BlockId) -> bool {
        self.ref_counts.get(block.index()) == Some(&0) && self.hashes[block.index()].is_some()
    }

    /// Enter `seq`'s full block `i` into the prefix index under `key`. Returns false (and changes nothing)
    /// when `key` is already cached in another block or the block is already registered.
    pub fn register(&mut self, seq: SeqId, i: usize, key: BlockHash) -> Result<bool, CacheError> {
        let s = self.entry(seq)?;
        if (i + 1) * self.block_size > s.len {
            return Err(CacheError::PositionOutOfRange { seq, start: i * self.block_size, end: (i + 1) * self.block_size, len: s.len });
        }
        let block = s.table[i];
        if self.index.contains_key(&key) || self.hashes[block.index()].is_some() {
            return Ok(false);
        }
        self.hashes[block.index()] = Some(key);
        self.index.insert(key, block);
        Ok(true)
    }

    /// Start the empty sequence `seq` with the cached full `blocks` (its first `blocks.len()` blocks, shared:
    /// reference count +1 each, taken off the evictable list).
    pub fn attach(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<(), CacheError> {
        let s = self.entry(seq)?;
        if s.len != 0 {
            return Err(CacheError::SequenceExists(seq));
        }
        for &b in blocks {
            if self.ref_counts[b.index()] == 0 {
                self.evictable.remove(&self.released_at[b.index()]);
            }
            self.ref_counts[b.index()] += 1;
        }
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.table = blocks.to_vec();
        s.len = blocks.len() * self.block_size;
        Ok(())
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// How many sequences hold `block` (0 = free); `None` if the id is out of range.
    pub fn ref_count(&self, block: BlockId) -> Option<u32> {
        self.ref_counts.get(block.index()).copied()
    }

    /// Registers an empty sequence (length 0, no blocks).
    pub fn add_sequence(&mut self, seq: SeqId) -> Result<(), CacheError> {
        if self.seqs.contains_key(&seq) {
            return Err(CacheError::SequenceExists(seq));
        }
        self.seqs.insert(seq, SeqBlocks::default());
        Ok(())
    }

    pub fn len(&self, seq: SeqId) -> Result<usize, CacheError> {
        Ok(self.entry(seq)?.len)
    }

    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], CacheError> {
        Ok(&self.entry(seq)?.table)
    }

    /// Free blocks that appending `n` tokens to `seq` would take.
    pub fn blocks_needed(&self, seq: SeqId, n: usize) -> Result<usize, CacheError> {
        let s = self.entry(seq)?;
        if n == 0 {
            return Ok(0);
        }
        let Some(new_len) = s.len.checked_add(n) else {
            return Ok(usize::MAX);
        };
        let grow = new_len.div_ceil(self.block_size) - s.table.len();
        Ok(grow)
    }

    /// Whether `append(seq, n)` would succeed now (false for an unknown sequence).
    pub fn can_append(&self, seq: SeqId, n: usize) -> bool {
        self.blocks_needed(seq, n).is_ok_and(|needed| needed <= self.num_free_blocks())
    }

    /// Grows `seq` by `n` tokens, allocating blocks on demand. All or nothing: on error nothing changes.
    pub fn append(&mut self, seq: SeqId, n: usize) -> Result<(), CacheError> {
        let needed = self.blocks_needed(seq, n)?;
        if needed > self.num_free_blocks() {
            return Err(CacheError::OutOfBlocks { needed, free: self.num_free_blocks(), total: self.num_blocks() });
        }
        if n == 0 {
            return Ok(());
        }
        let fresh: Vec<BlockId> = (0..needed).map(|_| self.pop_free()).collect();
        let s = self.seqs.get_mut(&seq).expect("checked by blocks_needed");
        s.table.extend(fresh);
        s.len += n;
        Ok(())
    }

    /// Shrinks `seq` to `new_len` tokens (speculative rollback), releasing blocks wholly past `new_len`.
    pub fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<(), CacheError> {
        let bs = self.block_size;
        let s = self.seqs.get_mut(&seq).ok_or(CacheError::UnknownSequence(seq))?;
        if new_len > s.len {
            return Err(CacheError::TruncateBeyondLength { seq, len: s.len, new_len });
        }
        let released = s.table.split_off(new_len.div_ceil(bs));
        s.len = new_len;
        for block in released {
            self.release(block);
        }
        Ok(())
    }

    /// Removes `seq`, returning the blocks nobody else holds to the free list.
    pub fn free(&mut self, seq: SeqId) -> Result<(), CacheError> {
        let s = self.seqs.remove(&seq).ok_or(CacheError::UnknownSequence(seq))?;
        for block in s.table.into_iter().rev() {
            self.release(block);
        }
        Ok(())
    }

    /// Flat slot of token `pos` of `seq` in a `[num_blocks * block_size, ...]` KV buffer; `pos < len`.
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<usize, CacheError> {
        let s = self.entry(seq)?;
        if pos >= s.len {
            return Err(CacheError::PositionOutOfRange { seq, start: pos, end: pos.saturating_add(1), len: s.len });
        }
        Ok(self.slot_unchecked(s, pos))
    }

    /// Slots of positions `start..start + n` of `seq` (all must be `< len`).
    pub fn slot_mapping(&self, seq: SeqId, start: usize, n: usize) -> Result<Vec<usize>, CacheError> {
        let s = self.entry(seq)?;
        let end = start.saturating_add(n);
        if end > s.len {
            return Err(CacheError::PositionOutOfRange { seq, start, end, len: s.len });
        }
        Ok((start..end).map(|pos| self.slot_unchecked(s, pos)).collect())
    }

    /// Checks the accounting: every block is free (count 0, uncached, on the free list once), evictable
    /// (count 0, cached, on the evictable list once) or held by exactly `ref_count` table entries; each table
    /// holds `ceil(len / block_size)` blocks; the prefix index and the blocks' keys agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.num_blocks();
        let mut on_free_list = vec![false; n];
        for &b in self.free.iter().chain(self.evictable.values()) {
            let slot = on_free_list.get_mut(b.index()).ok_or(format!("free list holds out-of-range {b}"))?;
            if std::mem::replace(slot, true) {
                return Err(format!("{b} is on the free / evictable lists twice"));
            }
        }
        for &b in &self.free {
            if self.hashes[b.index()].is_some() {
                return Err(format!("{b} is on the free list but still cached"));
            }
        }
        for (&t, &b) in &self.evictable {
            if self.hashes[b.index()].is_none() || self.released_at[b.index()] != t {
                return Err(format!("{b} is evictable but not cached (or listed at the wrong time)"));
            }
        }
        for (i, h) in self.hashes.iter().enumerate() {
            if let Some(h) = h
                && self.index.get(h) != Some(&BlockId(i as u32))
            {
                return Err(format!("block {i}'s key is not indexed to it"));
            }
        }
        if self.index.len() != self.hashes.iter().filter(|h| h.is_some()).count() {
            return Err("the prefix index holds keys of no block".into());
        }
        let mut held = vec![0u32; n];
        for (seq, s) in &self.seqs {
            let want = s.len.div_ceil(self.block_size);
            if s.table.len() != want {
                return Err(format!("{seq}: {} block(s) for {} token(s), expected {want}", s.table.len(), s.len));
            }
            for &b in &s.table {
                *held.get_mut(b.index()).ok_or(format!("{seq} holds out-of-range {b}"))? += 1;
            }
        }
        for i in 0..n {
            let (rc, h, free) = (self.ref_counts[i], held[i], on_free_list[i]);
            if rc != h {
                return Err(format!("block {i}: ref count {rc} but held by {h} table entries"));
            }
            if free != (rc == 0) {
                return Err(format!("block {i}: ref count {rc} but on free list = {free}"));
            }
        }
        Ok(())
    }

    fn entry(&self, seq: SeqId) -> Result<&SeqBlocks, CacheError> {
        self.seqs.get(&seq).ok_or(CacheError::UnknownSequence(seq))
    }

    fn slot_unchecked(&self, s: &SeqBlocks, pos: usize) -> usize {
        s.table[pos / self.block_size].index() * self.block_size + pos % self.block_size
    }

    /// A free block, else the least recently released cached one (leaving the index).
    fn pop_free(&mut self) -> BlockId {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first().expect("caller checked the free count");
                let key = self.hashes[b.index()].take().expect("evictable blocks are cached");
                self.index.remove(&key);
                self.evictions += 1;
                b
            }
        };
        self.ref_counts[b.index()] = 1;
        b
    }

    fn release(&mut self, b: BlockId) {
        let rc = &mut self.ref_counts[b.index()];
        *rc -= 1;
        if *rc == 0 {
            if self.hashes[b.index()].is_some() {
                self.tick += 1;
                self.released_at[b.index()] = self.tick;
                self.evictable.insert(self.tick, b);
            } else {
                self.free.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: SeqId = SeqId(1);
    const B: SeqId = SeqId(2);

    fn bm(num_blocks: usize, block_size: usize) -> BlockManager {
        BlockManager::new(num_blocks, block_size).unwrap()
    }

    #[test]
    fn slot_maps_position_through_block_table() {
        let mut m = bm(4, 4);
        m.add_sequence(A).unwrap();
        m.add_sequence(B).unwrap();
        m.append(A, 2).unwrap();
        m.append(B, 1).unwrap();
        m.append(A, 5).unwrap(); // A: 7 tokens, 2 blocks
        let t = m.block_table(A).unwrap().to_vec();
        assert_eq!(t.len(), 2);
        assert_eq!(m.slot(A, 5).unwrap(), t[1].index() * 4 + 1);
        let mapping = m.slot_mapping(A, 0, 7).unwrap();
        let expected: Vec<usize> = (0..7).map(|p| t[p / 4].index() * 4 + p % 4).collect();
        assert_eq!(mapping, expected);
        assert!(matches!(m.slot(A, 7), Err(CacheError::PositionOutOfRange { .. })));
        assert!(matches!(m.slot_mapping(A, 5, 3), Err(CacheError::PositionOutOfRange { .. })));
        m.check_invariants().unwrap();
    }

    #[test]
    fn released_cached_blocks_are_shared_by_key_then_evicted_lru() {
        let mut m = bm(3, 2);
        m.add_sequence(A).unwrap();
        m.append(A, 4).unwrap();
        let t = m.block_table(A).unwrap().to_vec();
        assert!(m.register(A, 0, BlockHash(10)).unwrap());
        assert!(m.register(A, 1, BlockHash(11)).unwrap());
        assert!(!m.register(A, 1, BlockHash(12)).unwrap(), "a block is registered once");
        assert!(matches!(m.register(A, 2, BlockHash(13)), Err(CacheError::PositionOutOfRange { .. })));
        m.free(A).unwrap();
        assert_eq!((m.num_free_blocks(), m.num_evictable_blocks(), m.num_cached_blocks()), (3, 2, 2));
        m.check_invariants().unwrap();
        m.add_sequence(B).unwrap();
        let hit = m.lookup(BlockHash(10)).unwrap();
        assert!(m.is_evictable(hit));
        m.attach(B, &[hit]).unwrap();
        assert_eq!(m.block_table(B).unwrap(), &t[..1]);
        assert_eq!((m.len(B).unwrap(), m.num_free_blocks(), m.ref_count(hit)), (2, 2, Some(1)));
        m.check_invariants().unwrap();
        // Two more blocks: the free one, then the least recently released cached one (key 11) is evicted.
        m.append(B, 4).unwrap();
        assert_eq!(m.evictions(), 1);
        assert_eq!((m.lookup(BlockHash(11)), m.lookup(BlockHash(10))), (None, Some(hit)));
        m.check_invariants().unwrap();
        m.free(B).unwrap();
        assert_eq!(m.num_free_blocks(), 3);
        m.check_invariants().unwrap();
    }

    #[test]
    fn append_allocates_only_on_block_boundaries() {
        let mut m = bm(3, 4);
        m.add_sequence(A).unwrap();
        for (n, blocks) in [(1, 1), (3, 1), (1, 2), (3, 2), (4, 3)] {
            m.append(A, n).unwrap();
            assert_eq!(m.block_table(A).unwrap().len(), blocks);
        }
        assert_eq!(m.num_free_blocks(), 0);
        assert_eq!(m.blocks_needed(A, 0).unwrap(), 0);
        assert_eq!(m.blocks_needed(A, 1).unwrap(), 1);
        assert!(m.can_append(A, 0));
        assert!(!m.can_append(A, 1));
    }

    #[test]
    fn out_of_blocks_error_names_the_limit() {
        let mut m = bm(2, 4);
        m.add_sequence(A).unwrap();
        let err = m.append(A, 9).unwrap_err();
        assert_eq!(err, CacheError::OutOfBlocks { needed: 3, free: 2, total: 2 });
        assert!(err.to_string().contains("3 more block(s), 2 of 2 free"), "{err}");
        assert_eq!(m.len(A).unwrap(), 0);
        assert_eq!(m.num_free_blocks(), 2);
        assert!(m.append(A, usize::MAX).is_err());
    }

    #[test]
    fn truncate_frees_blocks_wholly_past_new_len() {
        let mut m = bm(4, 4);
        m.add_sequence(A).unwrap();
        m.append(A, 10).unwrap(); // 3 blocks
        m.truncate(A, 5).unwrap();
        assert_eq!((m.len(A).unwrap(), m.block_table(A).unwrap().len(), m.num_free_blocks()), (5, 2, 2));
        m.truncate(A, 4).unwrap();
        assert_eq!(m.block_table(A).unwrap().len(), 1);
        m.truncate(A, 0).unwrap();
        assert_eq!(m.num_free_blocks(), 4);
        assert_eq!(m.truncate(A, 1), Err(CacheError::TruncateBeyondLength { seq: A, len: 0, new_len: 1 }));
        m.check_invariants().unwrap();
    }

    #[test]
    fn bad_calls_are_typed_errors_not_panics() {
        let mut m = bm(2, 4);
        let ghost = SeqId(99);
        assert_eq!(m.append(ghost, 1), Err(CacheError::UnknownSequence(ghost)));
        assert_eq!(m.truncate(ghost, 0), Err(CacheError::UnknownSequence(ghost)));
        assert_eq!(m.free(ghost), Err(CacheError::UnknownSequence(ghost)));
        assert!(m.block_table(ghost).is_err() && m.len(ghost).is_err() && m.slot(ghost, 0).is_err());
        assert!(!m.can_append(ghost, 0));
        m.add_sequence(A).unwrap();
        assert_eq!(m.add_sequence(A), Err(CacheError::SequenceExists(A)));
        assert!(matches!(BlockManager::new(0, 16), Err(CacheError::InvalidGeometry { .. })));
        assert!(matches!(BlockManager::new(4, 0), Err(CacheError::InvalidGeometry { .. })));
        m.check_invariants().unwrap();
    }

    #[test]
    fn from_budget_counts_whole_blocks() {
        // Qwen3.5-35B-A3B-like: 10 full-attention layers + MTP, 2 KV heads × 256, bf16 → 22 KiB/token.
        let per_token = kv_bytes_per_token(11, 2, 256, 2);
        assert_eq!(per_token, 22 * 1024);
        let m = BlockManager::from_budget(per_token * 16 * 7 + 123, per_token, 16).unwrap();
        assert_eq!((m.num_blocks(), m.block_size()), (7, 16));
        let err = BlockManager::from_budget(per_token * 15, per_token, 16).unwrap_err();
        assert!(matches!(err, CacheError::BudgetTooSmall { .. }), "{err}");
        assert!(BlockManager::from_budget(1 << 30, 0, 16).is_err());
        assert!(BlockManager::from_budget(1 << 30, usize::MAX, 16).is_err());
    }

    // ---- property test: random admit / append / truncate / free ----

    #[derive(Debug, Clone)]
    enum Op {
        Add(u64),
        Append(u64, usize),
        Truncate(u64, usize),
        Free(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let seq = 0u64..8;
        prop_oneof![
            2 => seq.clone().prop_map(Op::Add),
            4 => (seq.clone(), 0usize..12).prop_map(|(s, n)| Op::Append(s, n)),
            2 => (seq.clone(), 0usize..30).prop_map(|(s, l)| Op::Truncate(s, l)),
            1 => seq.prop_map(Op::Free),
        ]
    }

    /// A model of what the runner would see: a flat KV buffer and, per sequence, the token values it
    /// wrote. If any two sequences ever owned one slot for writing, a read-back would disagree.
    struct Shadow {
        kv: Vec<Option<u64>>,
        tokens: BTreeMap<SeqId, Vec<u64>>,
        next_value: u64,
    }

    fn apply(m: &mut BlockManager, sh: &mut Shadow, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Add(s) => {
                let r = m.add_sequence(SeqId(s));
                prop_assert_eq!(r.is_ok(), !sh.tokens.contains_key(&SeqId(s)));
                sh.tokens.entry(SeqId(s)).or_default();
            }
            Op::Append(s, n) => {
                let seq = SeqId(s);
                let before = m.clone();
                let predicted = m.can_append(seq, n);
                match m.append(seq, n) {
                    Ok(()) => {
                        prop_assert!(predicted);
                        let toks = sh.tokens.get_mut(&seq).unwrap();
                        for pos in toks.len()..toks.len() + n {
                            sh.kv[m.slot(seq, pos).unwrap()] = Some(sh.next_value);
                            toks.push(sh.next_value);
                            sh.next_value += 1;
                        }
                    }
                    Err(e) => {
                        prop_assert!(!predicted);
                        prop_assert_eq!(&before, &*m, "failed append changed state: {}", e);
                        let expected_kind = if sh.tokens.contains_key(&seq) {
                            matches!(e, CacheError::OutOfBlocks { .. })
                        } else {
                            e == CacheError::UnknownSequence(seq)
                        };
                        prop_assert!(expected_kind, "unexpected error {}", e);
                    }
                }
            }
            Op::Truncate(s, l) => {
                let seq = SeqId(s);
                let r = m.truncate(seq, l);
                match sh.tokens.get_mut(&seq) {
                    Some(t) if l <= t.len() => {
                        prop_assert!(r.is_ok());
                        t.truncate(l);
                    }
                    _ => prop_assert!(r.is_err()),
                }
            }
            Op::Free(s) => {
                let r = m.free(SeqId(s));
                prop_assert_eq!(r.is_ok(), sh.tokens.remove(&SeqId(s)).is_some());
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn block_table_never_double_owns(
            num_blocks in 2usize..=8,
            block_size in 1usize..=5,
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let mut m = bm(num_blocks, block_size);
            let mut sh = Shadow { kv: vec![None; num_blocks * block_size], tokens: BTreeMap::new(), next_value: 0 };
            for op in &ops {
                apply(&mut m, &mut sh, op)?;
                m.check_invariants().map_err(TestCaseError::fail)?;
                for (&seq, toks) in &sh.tokens {
                    prop_assert_eq!(m.len(seq).unwrap(), toks.len());
                    for (pos, &v) in toks.iter().enumerate() {
                        prop_assert_eq!(sh.kv[m.slot(seq, pos).unwrap()], Some(v), "{} pos {} after {:?}", seq, pos, op);
                    }
                }
            }
            // No leak: once everything is freed, every block is free again.
            for seq in sh.tokens.keys() {
                m.free(*seq).unwrap();
            }
            m.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(m.num_free_blocks(), num_blocks);
            prop_assert_eq!(m.num_sequences(), 0);
        }

        #[test]
        fn failed_append_changes_nothing(
            num_blocks in 2usize..=8,
            block_size in 1usize..=5,
            fill in 0usize..40,
            extra in 0usize..40,
        ) {
            let mut m = bm(num_blocks, block_size);
            m.add_sequence(A).unwrap();
            let _ = m.append(A, fill);
            let before = m.clone();
            let target = A;
            let needed = m.blocks_needed(target, extra).unwrap();
            match m.append(target, extra) {
                Ok(_) => prop_assert!(needed <= before.num_free_blocks()),
                Err(e) => {
                    prop_assert_eq!(e, CacheError::OutOfBlocks { needed, free: before.num_free_blocks(), total: num_blocks });
                    prop_assert_eq!(&before, &m);
                }
            }
            m.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}
