//! embedding.cu against a CPU gather (docs/qwen3_5_moe.md §2.1): exact copies, out-of-range ids zero-filled and counted.
#![cfg(feature = "cuda")]

use nextn_kernels::embedding::{self, GatherDims};
use nextn_kernels::{round_bf16, test_gpu, test_values};

fn cpu_gather(ids: &[i32], table: &[f32], vocab: usize, hidden: usize) -> Vec<f32> {
    ids.iter()
        .flat_map(|&id| {
            if id >= 0 && (id as usize) < vocab {
                table[id as usize * hidden..(id as usize + 1) * hidden].to_vec()
            } else {
                vec![0.0; hidden]
            }
        })
        .collect()
}

#[test]
fn gather_copies_rows_exactly() {
    let Some(gpu) = test_gpu() else { return };
    for &(tokens, vocab, hidden) in &[(1, 10, 2048), (5, 37, 64), (7, 13, 100), (64, 1000, 8), (3, 5, 17), (300, 50, 2048)] {
        let table = round_bf16(&test_values(vocab * hidden, 7, 1.0));
        let ids: Vec<i32> = (0..tokens).map(|t| ((t * 7919 + 3) % vocab) as i32).collect();
        let (dt, di) = (gpu.upload_f32_as_bf16(&table).unwrap(), gpu.upload(&ids).unwrap());
        let mut out = gpu.alloc_zeros(tokens * hidden).unwrap();
        let mut err = gpu.alloc_zeros::<i32>(1).unwrap();
        embedding::embedding_gather(&gpu, &di, &dt, &mut out, &mut err, GatherDims { tokens, vocab, hidden }).unwrap();
        assert_eq!(gpu.download_bf16_as_f32(&out).unwrap(), cpu_gather(&ids, &table, vocab, hidden), "T={tokens} V={vocab} H={hidden}");
        assert_eq!(embedding::take_errors(&gpu, &mut err).unwrap(), 0);
    }
}

#[test]
fn out_of_range_ids_zero_fill_and_are_counted() {
    let Some(gpu) = test_gpu() else { return };
    for hidden in [64, 30] {
        let vocab = 20;
        let table = round_bf16(&test_values(vocab * hidden, 8, 1.0));
        let ids = vec![3, -1, 19, 20, i32::MAX, 0, i32::MIN];
        let tokens = ids.len();
        let (dt, di) = (gpu.upload_f32_as_bf16(&table).unwrap(), gpu.upload(&ids).unwrap());
        // Start from garbage: the bad rows must be written as zeros, not left alone.
        let mut out = gpu.upload_f32_as_bf16(&vec![9.0; tokens * hidden]).unwrap();
        let mut err = gpu.alloc_zeros::<i32>(1).unwrap();
        embedding::embedding_gather(&gpu, &di, &dt, &mut out, &mut err, GatherDims { tokens, vocab, hidden }).unwrap();
        assert_eq!(gpu.download_bf16_as_f32(&out).unwrap(), cpu_gather(&ids, &table, vocab, hidden));
        // Sticky across launches until taken.
        embedding::embedding_gather(&gpu, &di, &dt, &mut out, &mut err, GatherDims { tokens, vocab, hidden }).unwrap();
        assert_eq!(embedding::take_errors(&gpu, &mut err).unwrap(), 8, "4 bad ids x 2 launches");
        assert_eq!(embedding::take_errors(&gpu, &mut err).unwrap(), 0, "take_errors re-zeroes the flag");
        // The flag-less gather: same rows, nothing counted.
        let mut out2 = gpu.upload_f32_as_bf16(&vec![9.0; tokens * hidden]).unwrap();
        embedding::gather(&gpu, &dt, &di, &mut out2, GatherDims { tokens, vocab, hidden }).unwrap();
        assert_eq!(gpu.download_bf16_as_f32(&out2).unwrap(), cpu_gather(&ids, &table, vocab, hidden));
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    let Some(gpu) = test_gpu() else { return };
    let ids = gpu.upload(&[0i32, 1]).unwrap();
    let table = gpu.alloc_zeros(16).unwrap();
    let mut out = gpu.alloc_zeros(16).unwrap();
    let mut err = gpu.alloc_zeros::<i32>(1).unwrap();
    // Table shorter than vocab*hidden.
    let e = embedding::embedding_gather(&gpu, &ids, &table, &mut out, &mut err, GatherDims { tokens: 2, vocab: 4, hidden: 8 })
        .unwrap_err();
    assert!(e.to_string().contains("embedding_gather_bf16"), "{e}");
    // More tokens than ids.
    let e = embedding::embedding_gather(&gpu, &ids, &table, &mut out, &mut err, GatherDims { tokens: 3, vocab: 2, hidden: 4 })
        .unwrap_err();
    assert!(e.to_string().contains("embedding_gather_bf16"), "{e}");
}
