//! The tensors behind the caches: paged K/V for every full-attention layer and the Gated DeltaNet
//! state (conv window + fp32 recurrent state) per state slot. Slots past the running sequences' hold the
//! prefix cache's GDN state checkpoints ([`CacheStore::copy_slot`] saves and restores them). Bookkeeping
//! (which block / slot belongs to whom) lives in [`crate::cache::blocks`], [`crate::cache::slots`] and
//! [`crate::cache::prefix`]; this is only storage.

use crate::config::{LayerType, ModelConfig};

/// Which cache each layer uses: full-attention layers (then `extra` layers such as the MTP's, addressed as
/// layers `num_hidden_layers + i`) number the KV caches, GDN layers number the GDN states. Every backend's
/// storage is indexed this way.
pub struct LayerSlots {
    /// Layer index → index into the KV caches or into the GDN states.
    pub slot: Vec<usize>,
    /// KV caches.
    pub attn: usize,
    /// GDN state arrays.
    pub gdn: usize,
}

impl LayerSlots {
    pub fn of(cfg: &ModelConfig, extra_attn_layers: usize) -> Self {
        let mut slots = LayerSlots { slot: Vec::new(), attn: 0, gdn: 0 };
        for lt in &cfg.layer_types {
            let n = match lt {
                LayerType::FullAttention => &mut slots.attn,
                LayerType::LinearAttention => &mut slots.gdn,
            };
            slots.slot.push(*n);
            *n += 1;
        }
        for _ in 0..extra_attn_layers {
            slots.slot.push(slots.attn);
            slots.attn += 1;
        }
        slots
    }
}

pub struct CacheStore {
    pub block_size: usize,
    pub num_blocks: usize,
    pub num_slots: usize,
    kv_row: usize,
    /// Per full-attention layer: K and V, `[num_blocks · block_size, kv_heads · head_dim]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Layer index → index into `k`/`v` or into the GDN state arrays.
    layer_slot: Vec<usize>,
    conv_len: usize,
    rec_len: usize,
    n_gdn: usize,
    /// `[slot, gdn layer, (K-1) · conv_dim]`.
    conv: Vec<f32>,
    /// `[slot, gdn layer, Hv · Dk · Dv]`.
    recurrent: Vec<f32>,
    /// Speculative verify: the state after each verify row, `[slot, gdn layer, lane, …]` (conv, recurrent).
    lanes: usize,
    conv_lanes: Vec<f32>,
    rec_lanes: Vec<f32>,
}

impl CacheStore {
    /// `lanes`: snapshot lanes per slot (draft steps + 1; 0 without speculation). `extra_attn_layers`: KV
    /// layers beyond the decoder's (1 for the MTP layer), addressed as layer `num_hidden_layers + i`.
    pub fn new(
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
        lanes: usize,
        extra_attn_layers: usize,
    ) -> Self {
        let kv_row = cfg.num_key_value_heads * cfg.head_dim;
        let LayerSlots { slot: layer_slot, attn: n_attn, gdn: n_gdn } = LayerSlots::of(cfg, extra_attn_layers);
        let (conv_len, rec_len) = match &cfg.linear_attention {
            Some(la) => (
                (la.conv_kernel_dim - 1) * la.conv_dim(),
                la.num_value_heads * la.key_head_dim * la.value_head_dim,
            ),
            None => (0, 0),
        };
        let kv_len = num_blocks * block_size * kv_row;
        CacheStore {
            block_size,
            num_blocks,
            num_slots,
            kv_row,
            k: (0..n_attn).map(|_| vec![0.0; kv_len]).collect(),
            v: (0..n_attn).map(|_| vec![0.0; kv_len]).collect(),
            layer_slot,
            conv_len,
            rec_len,
            n_gdn,
            conv: vec![0.0; num_slots * n_gdn * conv_len],
            recurrent: vec![0.0; num_slots * n_gdn * rec_len],
            lanes,
            conv_lanes: vec![0.0; num_slots * n_gdn * lanes * conv_len],
            rec_lanes: vec![0.0; num_slots * n_gdn * lanes * rec_len],
        }
    }

    /// Bytes of KV per token (all full-attention layers, K and V, f32) — for sizing from a memory budget.
    pub fn kv_bytes_per_token(cfg: &ModelConfig) -> usize {
        let n_attn = cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();
        n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    }

    /// Bytes of linear-attention state per slot.
    pub fn state_bytes_per_slot(cfg: &ModelConfig) -> usize {
        let n_gdn = cfg.layer_types.iter().filter(|t| **t == LayerType::LinearAttention).count();
        match &cfg.linear_attention {
            Some(la) => {
                n_gdn * 4 * ((la.conv_kernel_dim - 1) * la.conv_dim() + la.num_value_heads * la.key_head_dim * la.value_head_dim)
            }
            None => 0,
        }
    }

    pub fn kv_row(&self) -> usize {
        self.kv_row
    }

    /// K and V of full-attention layer `layer` (a decoder layer index).
    pub fn kv_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        let i = self.layer_slot[layer];
        (&mut self.k[i], &mut self.v[i])
    }

    pub fn lanes(&self) -> usize {
        self.lanes
    }

    /// GDN layer `layer`'s (a decoder layer index) state in `slot` and its snapshot lanes: `[conv, recurrent, conv lanes, recurrent
    /// lanes]`, of `conv_len`, `rec_len`, `[lanes, conv_len]` and `[lanes, rec_len]` values (a verify pass
    /// reads the state and fills the lanes).
    pub fn gdn_and_lanes_mut(&mut self, layer: usize, slot: usize) -> [&mut [f32]; 4] {
        let i = slot * self.n_gdn + self.layer_slot[layer];
        let (c, r) = (self.lanes * self.conv_len, self.lanes * self.rec_len);
        [
            &mut self.conv[i * self.conv_len..(i + 1) * self.conv_len],
            &mut self.recurrent[i * self.rec_len..(i + 1) * self.rec_len],
            &mut self.conv_lanes[i * c..(i + 1) * c],
            &mut self.rec_lanes[i * r..(i + 1) * r],
        ]
    }

    /// Commit: the slot's state becomes snapshot `lane` (the state after verify row `lane`), in every GDN layer.
    pub fn commit_lane(&mut self, slot: usize, lane: usize) {
        assert!(lane < self.lanes, "lane {lane} of {}", self.lanes);
        for g in 0..self.n_gdn {
            let i = slot * self.n_gdn + g;
            let src = (i * self.lanes + lane) * self.conv_len;
            self.conv[i * self.conv_len..(i + 1) * self.conv_len]
                .copy_from_slice(&self.conv_lanes[src..src + self.conv_len]);
            let src = (i * self.lanes + lane) * self.rec_len;
            self.recurrent[i * self.rec_len..(i + 1) * self.rec_len]
                .copy_from_slice(&self.rec_lanes[src..src + self.rec_len]);
        }
    }

    /// Zero a slot's state: a new sequence starts from an empty conv window and a zero recurrent state.
    pub fn reset_slot(&mut self, slot: usize) {
        let (c, r) = (self.n_gdn * self.conv_len, self.n_gdn * self.rec_len);
        self.conv[slot * c..(slot + 1) * c].fill(0.0);
        self.recurrent[slot * r..(slot + 1) * r].fill(0.0);
    }

    /// Copy GDN layer `layer`'s (a decoder layer index) conv window and recurrent state of slot `src` into slot
    /// `dst` (a forward saving a prefix-cache checkpoint inside a prefill chunk, layer by layer).
    pub fn copy_layer_slot(&mut self, layer: usize, src: usize, dst: usize) {
        let (s, d) = (src * self.n_gdn + self.layer_slot[layer], dst * self.n_gdn + self.layer_slot[layer]);
        self.conv.copy_within(s * self.conv_len..(s + 1) * self.conv_len, d * self.conv_len);
        self.recurrent.copy_within(s * self.rec_len..(s + 1) * self.rec_len, d * self.rec_len);
    }

    /// Copy the GDN state (conv windows + recurrent states of every layer) of slot `src` into slot `dst`
    /// (prefix cache: save a checkpoint, or restore one into a sequence's slot).
    pub fn copy_slot(&mut self, src: usize, dst: usize) {
        let (c, r) = (self.n_gdn * self.conv_len, self.n_gdn * self.rec_len);
        self.conv.copy_within(src * c..(src + 1) * c, dst * c);
        self.recurrent.copy_within(src * r..(src + 1) * r, dst * r);
    }
}
