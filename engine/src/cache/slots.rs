//! The pool of linear-attention (Gated DeltaNet) state slots.
//!
//! The backend preallocates, per GDN layer, `num_slots` conv windows and recurrent states; each running
//! sequence owns one slot index into them (its speculative snapshot lanes are the backend's business).
//!
//! Plain CPU code: running out of slots is [`SlotError::NoFreeSlot`] (the scheduler makes the request wait).

use std::collections::BTreeMap;
use std::fmt;

use crate::cache::blocks::SeqId;

/// Index of one state slot, `0..capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

impl SlotId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "state slot {}", self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    #[error("all {capacity} linear-attention state slots are in use; wait for a sequence to finish")]
    NoFreeSlot { capacity: usize },

    #[error("{0} holds no state slot (never allocated, or already freed)")]
    UnknownSequence(SeqId),

    #[error("{seq} already holds {slot}")]
    AlreadyHasSlot { seq: SeqId, slot: SlotId },

    #[error("invalid state-slot pool: {num_slots} slot(s) (need 1..={})", u32::MAX)]
    InvalidGeometry { num_slots: usize },
}

/// Hands out state slots to sequences, one each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateSlotPool {
    /// `owner[slot]` is the sequence holding it, `None` when free.
    owner: Vec<Option<SeqId>>,
    /// Free slots, used as a stack; the lowest index is handed out first on a fresh pool.
    free: Vec<SlotId>,
    by_seq: BTreeMap<SeqId, SlotId>,
}

impl StateSlotPool {
    /// `num_slots` slots.
    pub fn new(num_slots: usize) -> Result<Self, SlotError> {
        if !(1..=u32::MAX as usize).contains(&num_slots) {
            return Err(SlotError::InvalidGeometry { num_slots });
        }
        Ok(Self {
            owner: vec![None; num_slots],
            free: (0..num_slots as u32).rev().map(SlotId).collect(),
            by_seq: BTreeMap::new(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.owner.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Gives `seq` a slot. The runner must reset that slot's state before the sequence's first step.
    pub fn alloc(&mut self, seq: SeqId) -> Result<SlotId, SlotError> {
        if let Some(&slot) = self.by_seq.get(&seq) {
            return Err(SlotError::AlreadyHasSlot { seq, slot });
        }
        let slot = self.free.pop().ok_or(SlotError::NoFreeSlot { capacity: self.capacity() })?;
        self.owner[slot.index()] = Some(seq);
        self.by_seq.insert(seq, slot);
        Ok(slot)
    }

    /// Returns `seq`'s slot to the pool and says which one it was.
    pub fn free(&mut self, seq: SeqId) -> Result<SlotId, SlotError> {
        let slot = self.by_seq.remove(&seq).ok_or(SlotError::UnknownSequence(seq))?;
        self.owner[slot.index()] = None;
        self.free.push(slot);
        Ok(slot)
    }

    pub fn slot_of(&self, seq: SeqId) -> Option<SlotId> {
        self.by_seq.get(&seq).copied()
    }

    /// The sequence holding `slot`, if any.
    pub fn owner(&self, slot: SlotId) -> Option<SeqId> {
        self.owner.get(slot.index()).copied().flatten()
    }

    /// Every slot is either free (no owner, on the free list exactly once) or owned by exactly one
    /// sequence whose entry points back at it.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut on_free_list = vec![false; self.capacity()];
        for &s in &self.free {
            let seen = on_free_list.get_mut(s.index()).ok_or(format!("free list holds out-of-range {s}"))?;
            if std::mem::replace(seen, true) {
                return Err(format!("{s} is on the free list twice"));
            }
        }
        for (&seq, &slot) in &self.by_seq {
            if self.owner(slot) != Some(seq) {
                return Err(format!("{seq} maps to {slot}, whose owner is {:?}", self.owner(slot)));
            }
        }
        for (i, owner) in self.owner.iter().enumerate() {
            match owner {
                None if !on_free_list[i] => return Err(format!("slot {i} has no owner but is not free")),
                Some(seq) if on_free_list[i] => return Err(format!("slot {i} is owned by {seq} and free")),
                Some(seq) if self.by_seq.get(seq) != Some(&SlotId(i as u32)) => {
                    return Err(format!("slot {i} is owned by {seq}, which maps to {:?}", self.by_seq.get(seq)));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn exhausted_pool_is_a_typed_error() {
        let mut p = StateSlotPool::new(2).unwrap();
        assert_eq!(p.alloc(SeqId(1)), Ok(SlotId(0)));
        assert_eq!(p.alloc(SeqId(2)), Ok(SlotId(1)));
        let err = p.alloc(SeqId(3)).unwrap_err();
        assert_eq!(err, SlotError::NoFreeSlot { capacity: 2 });
        assert!(err.to_string().contains("all 2"), "{err}");
        assert_eq!(p.free(SeqId(1)), Ok(SlotId(0)));
        assert_eq!(p.alloc(SeqId(3)), Ok(SlotId(0)));
        p.check_invariants().unwrap();
    }

    #[test]
    fn bad_calls_are_typed_errors_not_panics() {
        let mut p = StateSlotPool::new(3).unwrap();
        let slot = p.alloc(SeqId(7)).unwrap();
        assert_eq!(p.alloc(SeqId(7)), Err(SlotError::AlreadyHasSlot { seq: SeqId(7), slot }));
        assert_eq!(p.free(SeqId(8)), Err(SlotError::UnknownSequence(SeqId(8))));
        assert_eq!(p.slot_of(SeqId(8)), None);
        assert_eq!(p.owner(SlotId(99)), None);
        assert!(matches!(StateSlotPool::new(0), Err(SlotError::InvalidGeometry { .. })));
        p.check_invariants().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(u64),
    }

    proptest! {
        #[test]
        fn state_slot_never_double_owned(
            num_slots in 1usize..=6,
            ops in proptest::collection::vec(
                prop_oneof![(0u64..10).prop_map(Op::Alloc), (0u64..10).prop_map(Op::Free)],
                1..60,
            ),
        ) {
            let mut p = StateSlotPool::new(num_slots).unwrap();
            let mut held: BTreeMap<SeqId, SlotId> = BTreeMap::new();
            for op in &ops {
                let before = p.clone();
                match *op {
                    Op::Alloc(s) => match p.alloc(SeqId(s)) {
                        Ok(slot) => {
                            prop_assert!(!held.contains_key(&SeqId(s)));
                            prop_assert!(held.values().all(|&h| h != slot), "{} handed out twice", slot);
                            held.insert(SeqId(s), slot);
                        }
                        Err(e) => {
                            prop_assert_eq!(&before, &p, "failed alloc changed state");
                            let expected = match held.get(&SeqId(s)) {
                                Some(&slot) => SlotError::AlreadyHasSlot { seq: SeqId(s), slot },
                                None => SlotError::NoFreeSlot { capacity: num_slots },
                            };
                            prop_assert_eq!(e, expected);
                        }
                    },
                    Op::Free(s) => {
                        prop_assert_eq!(p.free(SeqId(s)).ok(), held.remove(&SeqId(s)));
                    }
                }
                p.check_invariants().map_err(TestCaseError::fail)?;
                prop_assert_eq!(p.num_free(), num_slots - held.len());
                for (&seq, &slot) in &held {
                    prop_assert_eq!(p.slot_of(seq), Some(slot));
                }
            }
            for seq in held.keys() {
                p.free(*seq).unwrap();
            }
            p.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(p.num_free(), num_slots);
        }
    }
}
