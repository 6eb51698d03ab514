//! CUDA graphs for the steady-state greedy steps (decode rows, verifies, and a greedy MTP cycle's draft extend and
//! chained draft steps): a step's kernels are captured once per shape and replayed, so its ~290 launches (a draft
//! step's ~20) cost one graph launch.
//!
//! A graph replays kernels with the arguments they were captured with, so a graphed step may change only what
//! lives in device memory: its tokens, positions, KV slots, block tables, state slots (the step metadata, uploaded
//! before the replay into buffers at fixed addresses) and its LM-head row ids (uploaded into the scratch ids).
//! What the kernels take by value must be the same for every step of a shape: the rows and sequences, and the
//! attention's split plan, which follows the step's longest context. That context is bucketed
//! ([`crate::backend::buckets::ctx_bucket`]) and the block tables are cut or padded to the bucket's width, so a plan holds for a few hundred
//! tokens (rows attend to their own context length; splits past it are empty). Every buffer a graph reads was made
//! before it; a workspace, snapshot-lane or metadata buffer that grows bumps [`Graphs::generation`], which drops
//! the captured graphs.
//!
//! `NEXTN_CUDA_GRAPHS`: `1` captures and replays; `eager` runs the same bucketed steps without graphs (what the
//! replay is checked against); anything else, or unset, leaves steps as they were (the default until a device run
//! has checked the graphs: `bench/gpu/NOTES.md`).

use std::collections::HashMap;

use nextn_kernels::cudarc::driver::CudaGraph;

pub use crate::backend::buckets::ctx_bucket;

/// Whether steps run through graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphMode {
    /// Steps as before: exact context, no graphs.
    Off,
    /// Graph-stable metadata (bucketed context, fixed-width tables), run eagerly.
    Eager,
    /// Graph-stable metadata, captured once per shape and replayed.
    Capture,
}

impl GraphMode {
    /// From `NEXTN_CUDA_GRAPHS` (see the module docs).
    pub fn from_env() -> Self {
        match std::env::var("NEXTN_CUDA_GRAPHS").as_deref() {
            Ok("1") => GraphMode::Capture,
            Ok("eager") => GraphMode::Eager,
            _ => GraphMode::Off,
        }
    }
}

/// Rows a graphed step holds at most: the custom GEMV's row limit (`linear::GEMV_MAX_M`); past it a projection
/// may go to cuBLAS, which is not set up for capture.
pub const MAX_GRAPH_ROWS: usize = nextn_kernels::linear::GEMV_MAX_M;

/// What fixes a graphed step's kernels and their arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub rows: usize,
    pub num_seqs: usize,
    pub rows_per_seq: usize,
    /// Bucketed context ([`crate::backend::buckets::ctx_bucket`]) and the block tables' width.
    pub max_ctx: usize,
    pub max_blocks: usize,
    /// A verify (snapshot lanes, kept conv rows).
    pub snapshot: bool,
    /// The hiddens kept for the MTP (one more copy).
    pub keep_hidden: bool,
    /// LM-head rows, and the head's width (the vocabulary, or a draft vocabulary's size).
    pub head_rows: usize,
    pub head_width: usize,
    /// The head's tokens are keyed draws (`sample_f32`), not argmaxes.
    pub drawn: bool,
    /// 0: a target step; 1: a greedy cycle's draft extend; 1 + s: its chained draft step s.
    pub stage: usize,
    /// A cycle's draft count k (0 for a target step): a draft step's ids land in `chain_ids` at an offset of it.
    pub cycle_k: usize,
    /// The draft steps' positions in the draft head are mapped to token ids (`take_i32`): a draft vocabulary.
    pub draft_vocab: bool,
    pub generation: u64,
}

/// A captured graph the backend owns, and the workspace shapes its capture left (`(rows, cols)` of
/// `Workspace::bufs_mut`): a replay runs no host code, so the backend puts them back after it, or a later eager
/// step would read the shapes of whatever ran eagerly last (a kept hidden's row count, say).
struct Owned(CudaGraph, Vec<(usize, usize)>);

// SAFETY: a graph is launched only by the backend that captured it, through `&mut` (one thread at a time; a backend
// moves between threads but is never shared), and `CudaGraph::launch` binds the graph's context to the calling
// thread first.
unsafe impl Send for Owned {}

/// What a shape has been through.
enum Slot {
    /// Ran once eagerly: the kernels it uses are loaded (a first launch may load a module, which a capture may
    /// refuse), its buffers made.
    Warmed,
    Captured(Owned),
    /// Its capture failed: it runs eagerly.
    Failed,
}

/// What to do with a graphed step of a shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// First time: run it eagerly (the warm-up).
    Warm,
    /// Second time: capture it, then launch the graph.
    Capture,
    /// Launch its graph.
    Replay,
    /// Its capture failed: run it eagerly.
    Eager,
}

/// The captured graphs, by shape.
pub struct Graphs {
    pub mode: GraphMode,
    map: HashMap<GraphKey, Slot>,
    /// Bumped whenever a buffer a graph may read is remade.
    pub generation: u64,
    pub captured: usize,
    pub replayed: usize,
}

impl Graphs {
    pub fn new(mode: GraphMode) -> Self {
        Graphs { mode, map: HashMap::new(), generation: 0, captured: 0, replayed: 0 }
    }

    /// Buffers were remade: every captured graph reads stale addresses.
    pub fn invalidate(&mut self) {
        self.generation += 1;
        self.map.clear();
    }

    /// What a step of `key` does now; a warm-up is recorded as done.
    pub fn next(&mut self, key: &GraphKey) -> Next {
        match self.map.get(key) {
            None => {
                self.map.insert(*key, Slot::Warmed);
                Next::Warm
            }
            Some(Slot::Warmed) => Next::Capture,
            Some(Slot::Captured(_)) => {
                self.replayed += 1;
                Next::Replay
            }
            Some(Slot::Failed) => Next::Eager,
        }
    }

    /// `key`'s graph and the workspace shapes its capture left.
    pub fn get(&self, key: &GraphKey) -> Option<(&CudaGraph, &[(usize, usize)])> {
        match self.map.get(key) {
            Some(Slot::Captured(g)) => Some((&g.0, &g.1)),
            _ => None,
        }
    }

    /// The outcome of `key`'s capture: its graph and the shapes it left, or `None` (it runs eagerly from now on).
    pub fn insert(&mut self, key: GraphKey, graph: Option<(CudaGraph, Vec<(usize, usize)>)>) {
        self.captured += usize::from(graph.is_some());
        self.map.insert(key, graph.map_or(Slot::Failed, |(g, shapes)| Slot::Captured(Owned(g, shapes))));
    }
}
