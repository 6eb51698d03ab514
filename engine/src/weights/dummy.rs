//! `--load-format dummy`: random weights of the shapes a config implies, so full-size shapes can be run and
//! profiled without a checkpoint. Values are uniform with a fan-in scale, so activations stay finite; 1-D
//! tensors (norms, gates' biases) get neutral values. Generation is parallel and deterministic per seed.

use rayon::prelude::*;

use crate::weights::{DType, Tensor};

pub struct DummyWeights {
    seed: u64,
    dtype: DType,
    /// Qwen3.5 decoder norms are `x̂ · (1 + w)`: neutral w = 0. Plain norms: neutral w = 1.
    zero_centred_norms: bool,
    next: u64,
    /// Bytes generated so far.
    pub bytes: usize,
}

impl DummyWeights {
    pub fn new(seed: u64, dtype: DType, zero_centred_norms: bool) -> Self {
        DummyWeights { seed, dtype, zero_centred_norms, next: 0, bytes: 0 }
    }

    pub fn tensor(&mut self, name: &str, shape: &[usize]) -> Tensor {
        let numel: usize = shape.iter().product();
        self.next += 1;
        let stream = splitmix(self.seed ^ splitmix(self.next));
        let values: Vec<f32> = if shape.len() == 1 {
            let v = if name.ends_with("linear_attn.norm.weight") || !self.zero_centred_norms { 1.0 } else { 0.0 };
            vec![v; numel] // norms neutral; A_log = 0 (A = 1), dt_bias = 0
        } else {
            let fan_in = *shape.last().unwrap() as f32;
            let scale = (3.0 / fan_in).sqrt();
            const CHUNK: usize = 1 << 16;
            let mut v = vec![0.0f32; numel];
            v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
                let mut s = splitmix(stream ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                for x in out.iter_mut() {
                    s = splitmix(s);
                    // Top 24 bits → uniform in [-1, 1).
                    *x = ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale;
                }
            });
            v
        };
        let bytes: Vec<u8> = match self.dtype {
            DType::F32 => bytemuck::cast_slice(&values).to_vec(),
            DType::BF16 => values.par_iter().flat_map_iter(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes()).collect(),
            DType::F16 => values.par_iter().flat_map_iter(|&x| half::f16::from_f32(x).to_bits().to_le_bytes()).collect(),
        };
        self.bytes += bytes.len();
        Tensor::from_bytes_huge(shape.to_vec(), self.dtype, bytes)
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
