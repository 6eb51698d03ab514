//! What the CUDA kernels handle, checked before anything is uploaded: a model or GPU outside it fails at load with
//! every reason named, not at its first step after minutes of weight upload.

use nextn_kernels::{gdn, moe, sample};

use crate::config::ModelConfig;

/// Head dims the paged attention kernels are built for.
pub const ATTENTION_HEAD_DIMS: [usize; 4] = [32, 64, 128, 256];

/// Why `cfg` cannot run on a GPU of compute capability `(major, minor)`; empty when it can.
pub fn unsupported(cfg: &ModelConfig, (major, minor): (i32, i32)) -> Vec<String> {
    let mut why = Vec::new();
    if major < 9 {
        why.push(format!("compute capability {major}.{minor}: the kernels are built for sm_90 (Hopper) and newer"));
    }
    if !ATTENTION_HEAD_DIMS.contains(&cfg.head_dim) {
        why.push(format!("head_dim {}: the attention kernels take {ATTENTION_HEAD_DIMS:?}", cfg.head_dim));
    }
    if cfg.num_key_value_heads == 0 || cfg.num_attention_heads % cfg.num_key_value_heads != 0 {
        why.push(format!(
            "num_attention_heads {} is not a multiple of num_key_value_heads {}",
            cfg.num_attention_heads, cfg.num_key_value_heads
        ));
    }
    if let Some(la) = &cfg.linear_attention {
        if la.key_head_dim > gdn::MAX_HEAD_K_DIM {
            why.push(format!("linear_key_head_dim {}: the GDN kernels take at most {}", la.key_head_dim, gdn::MAX_HEAD_K_DIM));
        }
        if la.conv_kernel_dim != gdn::CONV_KERNEL {
            why.push(format!("linear_conv_kernel_dim {}: the GDN kernels take {}", la.conv_kernel_dim, gdn::CONV_KERNEL));
        }
    }
    if cfg.num_experts > moe::MAX_TOPK_EXPERTS || cfg.num_experts_per_tok > moe::MAX_TOP_K {
        why.push(format!(
            "{} experts, {} per token: the routing kernels take at most {} and {}",
            cfg.num_experts,
            cfg.num_experts_per_tok,
            moe::MAX_TOPK_EXPERTS,
            moe::MAX_TOP_K
        ));
    }
    if cfg.vocab_size > sample::SAMPLE_MAX_VOCAB {
        why.push(format!("vocab_size {}: the device sampler takes at most {}", cfg.vocab_size, sample::SAMPLE_MAX_VOCAB));
    }
    why
}
