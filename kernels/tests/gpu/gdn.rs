//! gdn.cu against the CPU backend's math (`nextn_engine::backend::cpu::math::gdn`, docs/qwen3_5_moe.md §2.6; f32 on
//! bf16-rounded inputs): the causal conv with its state, the conv-state commit, the gated delta rule in place and
//! with verify snapshot lanes, and the lane commit; production dims, small dims and awkward ones (vector and
//! scalar paths).
#![cfg(feature = "cuda")]

use cudarc::driver::CudaSlice;
use nextn_engine::backend::cpu::math::gdn::{GdnRows, causal_conv, conv_state_commit, gated_delta_rule};
use nextn_engine::models::ops::GdnShape;
use nextn_kernels::gdn::{self, GdnDims, GdnSeqs, Lanes, RecurrentInputs};
use nextn_kernels::{Gpu, bf16, normalised_error, round_bf16, test_gpu, test_values};

const TOL_BF16: f32 = 1e-2; // bf16 outputs
const TOL_STATE: f32 = 1e-3; // f32 state: only the order of f32 sums and fast exp/rsqrt differ
const K: usize = gdn::CONV_KERNEL;

fn dims(h: usize, hv: usize, dk: usize, dv: usize) -> GdnDims {
    GdnDims {
        num_k_heads: h,
        num_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
    }
}

/// Production (16/32 x 128), small vector-path dims, and awkward ones (scalar paths, partial warps/slices).
fn all_dims() -> Vec<GdnDims> {
    vec![
        dims(16, 32, 128, 128), // production: conv_dim 8192
        dims(2, 4, 32, 32),     // 2 rows per lane, vector path
        dims(1, 2, 128, 128),   // one production head pair
        dims(1, 1, 48, 24),     // 4 rows per lane; d_v < one CTA slice
        dims(2, 4, 72, 40),     // rows masked inside the lane, second d_v slice one warp wide
        dims(1, 3, 20, 12),     // scalar paths everywhere (conv_dim 76)
        dims(3, 6, 100, 50),    // scalar recurrence, 8 rows per lane, conv_dim 900
    ]
}

/// A batch: rows per sequence (in order) and each sequence's state slot.
struct Batch {
    rows_per_seq: Vec<usize>,
    slots: Vec<i32>,
    num_slots: usize,
}

impl Batch {
    fn new(rows_per_seq: &[usize], slots: &[i32], num_slots: usize) -> Batch {
        Batch {
            rows_per_seq: rows_per_seq.to_vec(),
            slots: slots.to_vec(),
            num_slots,
        }
    }
    fn rows(&self) -> usize {
        self.rows_per_seq.iter().sum()
    }
    fn starts(&self) -> Vec<i32> {
        let mut s = vec![0i32];
        for &r in &self.rows_per_seq {
            s.push(s.last().unwrap() + r as i32);
        }
        s
    }
}

fn batches() -> Vec<Batch> {
    vec![
        Batch::new(&[1], &[1], 3),                         // decode, batch 1
        Batch::new(&[6], &[0], 1),                         // a short prefill
        Batch::new(&[3, 1, 4, 0, 2], &[4, 0, 2, 1, 3], 6), // mixed, an empty sequence, slot 5 untouched
    ]
}

/// Device copies of a batch's metadata (kept alive while a `GdnSeqs` borrows them).
struct DevBatch {
    starts: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    rows: usize,
    num_seqs: usize,
}

impl DevBatch {
    fn new(gpu: &Gpu, b: &Batch) -> DevBatch {
        DevBatch {
            starts: gpu.upload(&b.starts()).unwrap(),
            slots: gpu.upload(&b.slots).unwrap(),
            rows: b.rows(),
            num_seqs: b.slots.len(),
        }
    }
    fn seqs(&self) -> GdnSeqs<'_> {
        GdnSeqs {
            rows: self.rows,
            num_seqs: self.num_seqs,
            seq_row_start: &self.starts,
            seq_slot: &self.slots,
        }
    }
}

// ---- the CPU math over a batch (layout glue only) -------------------------------------------------------------

fn shape(d: &GdnDims) -> GdnShape {
    GdnShape {
        key_heads: d.num_k_heads,
        value_heads: d.num_v_heads,
        key_head_dim: d.head_k_dim,
        value_head_dim: d.head_v_dim,
        conv_kernel: K,
    }
}

/// One slot's conv state from the kernel's layout `[C, K-1]` into the CPU's `[K-1, C]`.
fn state_rows(conv_state: &[f32], slot: usize, cd: usize) -> Vec<f32> {
    let st = &conv_state[slot * cd * (K - 1)..][..cd * (K - 1)];
    (0..(K - 1) * cd).map(|i| st[(i % cd) * (K - 1) + i / cd]).collect()
}

/// The inverse of [`state_rows`].
fn set_state_rows(conv_state: &mut [f32], slot: usize, cd: usize, rows: &[f32]) {
    let st = &mut conv_state[slot * cd * (K - 1)..][..cd * (K - 1)];
    for (i, &v) in rows.iter().enumerate() {
        st[(i % cd) * (K - 1) + i / cd] = v;
    }
}

/// Step 2 for every sequence of the batch, from its slot's conv state.
fn cpu_conv(x: &[f32], w: &[f32], conv_state: &[f32], b: &Batch, cd: usize) -> Vec<f32> {
    let starts = b.starts();
    let mut out = vec![0f32; b.rows() * cd];
    for (s, &slot) in b.slots.iter().enumerate() {
        let r = starts[s] as usize * cd..starts[s + 1] as usize * cd;
        causal_conv(&x[r.clone()], w, &state_rows(conv_state, slot as usize, cd), cd, &mut out[r]);
    }
    out
}

/// Each sequence's conv state advanced by its first `accepted[s]` rows (clamped to its rows).
fn cpu_conv_commit(x: &[f32], conv_state: &mut [f32], b: &Batch, accepted: &[i32], cd: usize) {
    let starts = b.starts();
    for (s, &slot) in b.slots.iter().enumerate() {
        let n = (accepted[s].max(0) as usize).min(b.rows_per_seq[s]);
        let mut rows = state_rows(conv_state, slot as usize, cd);
        conv_state_commit(&mut rows, &x[starts[s] as usize * cd..][..n * cd]);
        set_state_rows(conv_state, slot as usize, cd, &rows);
    }
}

struct GdnInputs {
    c: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
}

fn gdn_inputs(d: &GdnDims, rows: usize, seed: u64) -> GdnInputs {
    let hv = d.num_v_heads;
    GdnInputs {
        c: round_bf16(&test_values(rows * d.conv_dim(), seed, 1.0)),
        b: round_bf16(&test_values(rows * hv, seed + 1, 3.0)),
        a: round_bf16(&test_values(rows * hv, seed + 2, 2.0)),
        a_log: test_values(hv, seed + 3, 1.0),
        dt_bias: test_values(hv, seed + 4, 1.0),
    }
}

/// Steps 3-5 for every sequence's rows in order, from `state[slot]` (updated in place).
/// Returns o [rows, HV*d_v] and, per sequence, the slot's state after each of its rows.
fn cpu_gdn(d: &GdnDims, inp: &GdnInputs, state: &mut [f32], b: &Batch) -> (Vec<f32>, Vec<Vec<Vec<f32>>>) {
    let (cd, hv, vd, sl) = (d.conv_dim(), d.num_v_heads, d.value_dim(), d.state_len());
    let starts = b.starts();
    let mut o = vec![0f32; b.rows() * vd];
    let mut snaps = Vec::new();
    for (s, &slot) in b.slots.iter().enumerate() {
        let (r0, r1) = (starts[s] as usize, starts[s + 1] as usize);
        let rows = GdnRows { c: &inp.c[r0 * cd..r1 * cd], b: &inp.b[r0 * hv..r1 * hv], a: &inp.a[r0 * hv..r1 * hv] };
        let st = &mut state[slot as usize * sl..][..sl];
        let (out, lanes) = gated_delta_rule(&shape(d), rows, &inp.a_log, &inp.dt_bias, st, true, false);
        o[r0 * vd..r1 * vd].copy_from_slice(&out);
        snaps.push(lanes.expect("asked for snapshots").chunks(sl).map(<[f32]>::to_vec).collect());
    }
    (o, snaps)
}

struct DevInputs {
    c: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    a: CudaSlice<bf16>,
    a_log: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
}

impl DevInputs {
    fn new(gpu: &Gpu, inp: &GdnInputs) -> DevInputs {
        DevInputs {
            c: gpu.upload_f32_as_bf16(&inp.c).unwrap(),
            b: gpu.upload_f32_as_bf16(&inp.b).unwrap(),
            a: gpu.upload_f32_as_bf16(&inp.a).unwrap(),
            a_log: gpu.upload(&inp.a_log).unwrap(),
            dt_bias: gpu.upload(&inp.dt_bias).unwrap(),
        }
    }
    fn get(&self) -> RecurrentInputs<'_> {
        RecurrentInputs {
            c: &self.c,
            b: &self.b,
            a: &self.a,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
        }
    }
}

fn initial_state(d: &GdnDims, num_slots: usize, seed: u64) -> Vec<f32> {
    test_values(num_slots * d.state_len(), seed, 0.5)
}

// ---- conv ------------------------------------------------------------------------------------------------

#[test]
fn conv_matches_cpu_with_state() {
    let Some(gpu) = test_gpu() else { return };
    for d in all_dims() {
        let cd = d.conv_dim();
        for (bi, b) in batches().iter().enumerate() {
            let x = round_bf16(&test_values(b.rows() * cd, 10 + bi as u64, 2.0));
            let w = round_bf16(&test_values(cd * K, 11, 0.7));
            let cs = round_bf16(&test_values(b.num_slots * d.conv_state_len(), 12, 2.0));
            let db = DevBatch::new(&gpu, b);
            let (dx, dw, dcs) = (
                gpu.upload_f32_as_bf16(&x).unwrap(),
                gpu.upload_f32_as_bf16(&w).unwrap(),
                gpu.upload_f32_as_bf16(&cs).unwrap(),
            );
            let mut dout = gpu.alloc_zeros::<bf16>(b.rows() * cd).unwrap();
            gdn::conv(&gpu, &d, &db.seqs(), &dx, &dw, &dcs, &mut dout).unwrap();
            let e = normalised_error(
                &gpu.download_bf16_as_f32(&dout).unwrap(),
                &cpu_conv(&x, &w, &cs, b, cd),
            );
            assert!(e < TOL_BF16, "conv {d:?} batch {bi}: err {e}");
            // The state is only read.
            assert_eq!(
                gpu.download_bf16_as_f32(&dcs).unwrap(),
                cs,
                "conv {d:?} batch {bi} wrote the state"
            );
        }
    }
}

#[test]
fn conv_commit_shifts_accepted_rows_into_state() {
    let Some(gpu) = test_gpu() else { return };
    let cases: Vec<(Batch, Vec<i32>)> = vec![
        (Batch::new(&[1], &[1], 3), vec![1]),
        (Batch::new(&[1], &[2], 3), vec![0]),
        (Batch::new(&[6], &[0], 1), vec![6]),
        (Batch::new(&[6], &[0], 1), vec![2]),
        (Batch::new(&[4], &[0], 1), vec![3]),
        (
            Batch::new(&[3, 1, 4, 0, 2], &[4, 0, 2, 1, 3], 6),
            vec![2, 1, 4, 0, 9],
        ), // 9 clamps to 2
    ];
    for d in all_dims() {
        let cd = d.conv_dim();
        for (ci, (b, accepted)) in cases.iter().enumerate() {
            let x = round_bf16(&test_values(b.rows() * cd, 20 + ci as u64, 2.0));
            let mut cs = round_bf16(&test_values(b.num_slots * d.conv_state_len(), 21, 2.0));
            let db = DevBatch::new(&gpu, b);
            let (dx, dacc) = (
                gpu.upload_f32_as_bf16(&x).unwrap(),
                gpu.upload(accepted).unwrap(),
            );
            let mut dcs = gpu.upload_f32_as_bf16(&cs).unwrap();
            gdn::conv_commit(&gpu, &d, &db.seqs(), &dx, &dacc, &mut dcs).unwrap();
            cpu_conv_commit(&x, &mut cs, b, accepted, cd);
            assert_eq!(
                gpu.download_bf16_as_f32(&dcs).unwrap(),
                cs,
                "conv commit {d:?} case {ci}"
            );
        }
    }
}

/// Decode-style: conv + commit(1) one row at a time equals one conv over all rows, then commit(all).
#[test]
fn conv_step_by_step_equals_batched() {
    let Some(gpu) = test_gpu() else { return };
    for d in [dims(2, 4, 32, 32), dims(1, 3, 20, 12)] {
        let (cd, rows) = (d.conv_dim(), 5);
        let x = round_bf16(&test_values(rows * cd, 30, 2.0));
        let w = gpu
            .upload_f32_as_bf16(&test_values(cd * K, 31, 0.7))
            .unwrap();
        let cs0 = test_values(d.conv_state_len(), 32, 2.0);

        let all = DevBatch::new(&gpu, &Batch::new(&[rows], &[0], 1));
        let dx = gpu.upload_f32_as_bf16(&x).unwrap();
        let mut dcs = gpu.upload_f32_as_bf16(&cs0).unwrap();
        let mut dout = gpu.alloc_zeros::<bf16>(rows * cd).unwrap();
        gdn::conv(&gpu, &d, &all.seqs(), &dx, &w, &dcs, &mut dout).unwrap();
        gdn::conv_commit(
            &gpu,
            &d,
            &all.seqs(),
            &dx,
            &gpu.upload(&[rows as i32]).unwrap(),
            &mut dcs,
        )
        .unwrap();
        let batched = gpu.download_bf16_as_f32(&dout).unwrap();

        let one = DevBatch::new(&gpu, &Batch::new(&[1], &[0], 1));
        let acc1 = gpu.upload(&[1i32]).unwrap();
        let mut scs = gpu.upload_f32_as_bf16(&cs0).unwrap();
        let mut sout = gpu.alloc_zeros::<bf16>(cd).unwrap();
        for t in 0..rows {
            let dxt = gpu.upload_f32_as_bf16(&x[t * cd..(t + 1) * cd]).unwrap();
            gdn::conv(&gpu, &d, &one.seqs(), &dxt, &w, &scs, &mut sout).unwrap();
            gdn::conv_commit(&gpu, &d, &one.seqs(), &dxt, &acc1, &mut scs).unwrap();
            assert_eq!(
                gpu.download_bf16_as_f32(&sout).unwrap(),
                batched[t * cd..(t + 1) * cd],
                "{d:?} row {t}"
            );
        }
        assert_eq!(
            gpu.download_bf16_as_f32(&scs).unwrap(),
            gpu.download_bf16_as_f32(&dcs).unwrap(),
            "{d:?} state"
        );
    }
}

// ---- recurrence ------------------------------------------------------------------------------------------

#[test]
fn recurrent_in_place_matches_cpu() {
    let Some(gpu) = test_gpu() else { return };
    for d in all_dims() {
        for (bi, b) in batches().iter().enumerate() {
            let inp = gdn_inputs(&d, b.rows(), 40 + bi as u64);
            let mut state = initial_state(&d, b.num_slots, 41);
            let db = DevBatch::new(&gpu, b);
            let di = DevInputs::new(&gpu, &inp);
            let mut dstate = gpu.upload(&state).unwrap();
            let mut d_o = gpu.alloc_zeros::<bf16>(b.rows() * d.value_dim()).unwrap();
            gdn::recurrent(&gpu, &d, &db.seqs(), &di.get(), &mut dstate, &mut d_o).unwrap();
            let (o, _) = cpu_gdn(&d, &inp, &mut state, b);
            let e_o = normalised_error(&gpu.download_bf16_as_f32(&d_o).unwrap(), &o);
            let e_s = normalised_error(&gpu.download(&dstate).unwrap(), &state);
            assert!(
                e_o < TOL_BF16 && e_s < TOL_STATE,
                "recurrent {d:?} batch {bi}: o err {e_o}, state err {e_s}"
            );
        }
    }
}

/// Decode: one row per call, repeated, equals all rows in one call (same state, same outputs).
#[test]
fn recurrent_step_by_step_equals_batched() {
    let Some(gpu) = test_gpu() else { return };
    for d in [
        dims(2, 4, 32, 32),
        dims(1, 2, 128, 128),
        dims(3, 6, 100, 50),
    ] {
        let rows = 5;
        let inp = gdn_inputs(&d, rows, 50);
        let s0 = initial_state(&d, 1, 51);
        let (cd, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());

        let all = DevBatch::new(&gpu, &Batch::new(&[rows], &[0], 1));
        let di = DevInputs::new(&gpu, &inp);
        let mut dstate = gpu.upload(&s0).unwrap();
        let mut d_o = gpu.alloc_zeros::<bf16>(rows * vd).unwrap();
        gdn::recurrent(&gpu, &d, &all.seqs(), &di.get(), &mut dstate, &mut d_o).unwrap();
        let batched = gpu.download_bf16_as_f32(&d_o).unwrap();

        let one = DevBatch::new(&gpu, &Batch::new(&[1], &[0], 1));
        let mut sstate = gpu.upload(&s0).unwrap();
        let mut s_o = gpu.alloc_zeros::<bf16>(vd).unwrap();
        for t in 0..rows {
            let row = GdnInputs {
                c: inp.c[t * cd..(t + 1) * cd].to_vec(),
                b: inp.b[t * hv..(t + 1) * hv].to_vec(),
                a: inp.a[t * hv..(t + 1) * hv].to_vec(),
                a_log: inp.a_log.clone(),
                dt_bias: inp.dt_bias.clone(),
            };
            let dr = DevInputs::new(&gpu, &row);
            gdn::recurrent(&gpu, &d, &one.seqs(), &dr.get(), &mut sstate, &mut s_o).unwrap();
            let e = normalised_error(
                &gpu.download_bf16_as_f32(&s_o).unwrap(),
                &batched[t * vd..(t + 1) * vd],
            );
            assert!(
                e < 1e-6,
                "{d:?} row {t}: o differs from the batched call by {e}"
            );
        }
        let e = normalised_error(
            &gpu.download(&sstate).unwrap(),
            &gpu.download(&dstate).unwrap(),
        );
        assert!(
            e < 1e-6,
            "{d:?}: state differs from the batched call by {e}"
        );
    }
}

/// Verify: lane r of sequence s is the state after r + 1 rows, the committed state is untouched, and the
/// outputs equal the in-place run's.
#[test]
fn recurrent_lanes_snapshot_every_row() {
    let Some(gpu) = test_gpu() else { return };
    for d in all_dims() {
        for (bi, b) in batches().iter().enumerate() {
            let max_lanes = *b.rows_per_seq.iter().max().unwrap() + 1; // one lane to spare
            let (sl, ns) = (d.state_len(), b.slots.len());
            let inp = gdn_inputs(&d, b.rows(), 60 + bi as u64);
            let s0 = initial_state(&d, b.num_slots, 61);
            let db = DevBatch::new(&gpu, b);
            let di = DevInputs::new(&gpu, &inp);
            let dstate = gpu.upload(&s0).unwrap();
            let mut dlanes = gpu.alloc_zeros::<f32>(ns * max_lanes * sl).unwrap();
            let mut d_o = gpu.alloc_zeros::<bf16>(b.rows() * d.value_dim()).unwrap();
            let lanes = Lanes { buf: &mut dlanes, max_lanes };
            gdn::recurrent_lanes(&gpu, &d, &db.seqs(), &di.get(), &dstate, lanes, &mut d_o).unwrap();

            let mut state = s0.clone();
            let (o, snaps) = cpu_gdn(&d, &inp, &mut state, b);
            let e_o = normalised_error(&gpu.download_bf16_as_f32(&d_o).unwrap(), &o);
            assert!(e_o < TOL_BF16, "lanes {d:?} batch {bi}: o err {e_o}");
            assert_eq!(
                gpu.download(&dstate).unwrap(),
                s0,
                "lanes {d:?} batch {bi}: the committed state changed"
            );
            let lanes = gpu.download(&dlanes).unwrap();
            for (s, seq_snaps) in snaps.iter().enumerate() {
                for (r, snap) in seq_snaps.iter().enumerate() {
                    let slot = b.slots[s] as usize;
                    let lane = &lanes[(s * max_lanes + r) * sl..(s * max_lanes + r + 1) * sl];
                    let e = normalised_error(lane, &snap[..]);
                    assert!(
                        e < TOL_STATE,
                        "lanes {d:?} batch {bi} seq {s} (slot {slot}) lane {r}: err {e}"
                    );
                }
                // Lanes past the sequence's rows are not written.
                let spare = &lanes[(s * max_lanes + seq_snaps.len()) * sl
                    ..(s * max_lanes + seq_snaps.len() + 1) * sl];
                assert!(
                    spare.iter().all(|&v| v == 0.0),
                    "lanes {d:?} batch {bi} seq {s}: spare lane written"
                );
            }
        }
    }
}

/// Committing lane m of a verify pass equals running the first m + 1 rows in place (CPU twin and GPU);
/// lane -1 keeps the state.
#[test]
fn commit_lane_equals_in_place_prefix() {
    let Some(gpu) = test_gpu() else { return };
    for d in [
        dims(2, 4, 32, 32),
        dims(1, 2, 128, 128),
        dims(1, 3, 20, 12),
        dims(2, 4, 72, 40),
    ] {
        let b = Batch::new(&[4, 3, 1, 2], &[3, 0, 4, 1], 5);
        let lane = [2i32, -1, 0, 1];
        let (sl, ns, max_lanes, cd, hv) = (d.state_len(), 4, 4, d.conv_dim(), d.num_v_heads);
        let inp = gdn_inputs(&d, b.rows(), 70);
        let s0 = initial_state(&d, b.num_slots, 71);
        let db = DevBatch::new(&gpu, &b);
        let di = DevInputs::new(&gpu, &inp);
        let mut dstate = gpu.upload(&s0).unwrap();
        let mut dlanes = gpu.alloc_zeros::<f32>(ns * max_lanes * sl).unwrap();
        let mut d_o = gpu.alloc_zeros::<bf16>(b.rows() * d.value_dim()).unwrap();
        let lanes = Lanes { buf: &mut dlanes, max_lanes };
        gdn::recurrent_lanes(&gpu, &d, &db.seqs(), &di.get(), &dstate, lanes, &mut d_o).unwrap();
        let dlane = gpu.upload(&lane).unwrap();
        let lanes = Lanes { buf: &dlanes, max_lanes };
        gdn::commit_lane(&gpu, &d, &db.seqs(), &dlane, lanes, &mut dstate).unwrap();
        let committed = gpu.download(&dstate).unwrap();

        // CPU: the prefix batch (m + 1 rows of each sequence, none where lane = -1) run in place.
        let prefix = Batch::new(&lane.map(|m| (m + 1) as usize), &b.slots, b.num_slots);
        let starts = b.starts();
        let mut pin = GdnInputs {
            c: vec![],
            b: vec![],
            a: vec![],
            a_log: inp.a_log.clone(),
            dt_bias: inp.dt_bias.clone(),
        };
        for (s, &m) in lane.iter().enumerate() {
            for t in starts[s] as usize..starts[s] as usize + (m + 1) as usize {
                pin.c.extend_from_slice(&inp.c[t * cd..(t + 1) * cd]);
                pin.b.extend_from_slice(&inp.b[t * hv..(t + 1) * hv]);
                pin.a.extend_from_slice(&inp.a[t * hv..(t + 1) * hv]);
            }
        }
        let mut cpu_state = s0.clone();
        cpu_gdn(&d, &pin, &mut cpu_state, &prefix);
        let e = normalised_error(&committed, &cpu_state);
        assert!(
            e < TOL_STATE,
            "commit lane {d:?}: err {e} against the CPU prefix run"
        );
        assert_eq!(
            committed[0..sl],
            s0[0..sl],
            "{d:?}: slot 0 (lane -1) changed"
        );
        assert_eq!(
            committed[2 * sl..3 * sl],
            s0[2 * sl..3 * sl],
            "{d:?}: unused slot 2 changed"
        );

        // GPU: the same prefix batch in place.
        let dp = DevBatch::new(&gpu, &prefix);
        let dpi = DevInputs::new(&gpu, &pin);
        let mut pstate = gpu.upload(&s0).unwrap();
        let mut p_o = gpu
            .alloc_zeros::<bf16>(prefix.rows() * d.value_dim())
            .unwrap();
        gdn::recurrent(&gpu, &d, &dp.seqs(), &dpi.get(), &mut pstate, &mut p_o).unwrap();
        let e = normalised_error(&committed, &gpu.download(&pstate).unwrap());
        assert!(
            e < 1e-6,
            "commit lane {d:?}: differs from the GPU in-place prefix run by {e}"
        );
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    let Some(gpu) = test_gpu() else { return };
    let d = dims(2, 4, 32, 32);
    let db = DevBatch::new(&gpu, &Batch::new(&[2], &[0], 1));
    let inp = DevInputs::new(&gpu, &gdn_inputs(&d, 2, 80));
    let mut state = gpu.alloc_zeros::<f32>(d.state_len()).unwrap();
    let mut short_o = gpu.alloc_zeros::<bf16>(d.value_dim()).unwrap(); // one row, need two
    let e = gdn::recurrent(&gpu, &d, &db.seqs(), &inp.get(), &mut state, &mut short_o).unwrap_err();
    assert!(e.to_string().contains("gdn_recurrent_bf16"), "{e}");

    let bad = dims(3, 4, 32, 32); // HV not a multiple of H
    let x = gpu.alloc_zeros::<bf16>(2 * bad.conv_dim()).unwrap();
    let w = gpu.alloc_zeros::<bf16>(bad.conv_dim() * K).unwrap();
    let cs = gpu.alloc_zeros::<bf16>(bad.conv_state_len()).unwrap();
    let mut out = gpu.alloc_zeros::<bf16>(2 * bad.conv_dim()).unwrap();
    let e = gdn::conv(&gpu, &bad, &db.seqs(), &x, &w, &cs, &mut out).unwrap_err();
    assert!(e.to_string().contains("gdn_conv_bf16"), "{e}");

    let too_wide = dims(1, 1, 256, 32); // d_k > 128
    let e = gdn::recurrent(
        &gpu,
        &too_wide,
        &db.seqs(),
        &inp.get(),
        &mut state,
        &mut short_o,
    )
    .unwrap_err();
    assert!(e.to_string().contains("head_k_dim"), "{e}");

    let lanes = gpu.alloc_zeros::<f32>(d.state_len()).unwrap(); // one lane, asked for two
    let lane = gpu.upload(&[0i32]).unwrap();
    let e = gdn::commit_lane(&gpu, &d, &db.seqs(), &lane, Lanes { buf: &lanes, max_lanes: 2 }, &mut state).unwrap_err();
    assert!(e.to_string().contains("gdn_commit_lane_f32"), "{e}");
}

// ---- fused decode / verify launches ----------------------------------------------------------------------

/// `conv_step` (conv and commit in one launch) equals `conv` then `conv_commit` bit for bit, for batches of
/// short sequences with commits of every kind (none, some rows, all rows, a clamped count, a sequence that
/// only reads its window: commit slot -1).
#[test]
fn conv_step_equals_conv_then_commit() {
    let Some(gpu) = test_gpu() else { return };
    let cases: Vec<(Batch, Vec<i32>, Vec<i32>)> = vec![
        (Batch::new(&[1], &[1], 3), vec![1], vec![1]),
        (Batch::new(&[4], &[0], 1), vec![0], vec![0]),
        (Batch::new(&[4], &[0], 1), vec![-1], vec![4]),
        (
            Batch::new(&[3, 1, 4, 0, 2], &[4, 0, 2, 1, 3], 6),
            vec![4, 0, -1, 1, 3],
            vec![2, 1, 4, 0, 9],
        ),
        (Batch::new(&[16, 2], &[1, 0], 2), vec![1, 0], vec![16, 2]),
    ];
    for d in all_dims().into_iter().filter(|d| d.conv_dim() % 8 == 0) {
        let cd = d.conv_dim();
        for (ci, (b, commit, accepted)) in cases.iter().enumerate() {
            let x = round_bf16(&test_values(b.rows() * cd, 50 + ci as u64, 2.0));
            let w = gpu.upload_f32_as_bf16(&test_values(cd * K, 51, 0.7)).unwrap();
            let cs = round_bf16(&test_values(b.num_slots * d.conv_state_len(), 52, 2.0));
            let db = DevBatch::new(&gpu, b);
            let dx = gpu.upload_f32_as_bf16(&x).unwrap();
            let (dcommit, dacc) = (gpu.upload(commit).unwrap(), gpu.upload(accepted).unwrap());
            // Two kernels: the conv reads every window, the commit writes the committing sequences' windows
            // (slot -1 for the others, accepted as given).
            let mut two_cs = gpu.upload_f32_as_bf16(&cs).unwrap();
            let mut two_out = gpu.alloc_zeros::<bf16>(b.rows() * cd).unwrap();
            gdn::conv(&gpu, &d, &db.seqs(), &dx, &w, &two_cs, &mut two_out).unwrap();
            let commit_seqs = GdnSeqs { seq_slot: &dcommit, ..db.seqs() };
            gdn::conv_commit(&gpu, &d, &commit_seqs, &dx, &dacc, &mut two_cs).unwrap();
            let mut one_cs = gpu.upload_f32_as_bf16(&cs).unwrap();
            let mut one_out = gpu.alloc_zeros::<bf16>(b.rows() * cd).unwrap();
            let max_rows = *b.rows_per_seq.iter().max().unwrap();
            gdn::conv_step(&gpu, &d, &db.seqs(), max_rows, &dcommit, &dacc, &dx, &w, &mut one_cs, &mut one_out, None).unwrap();
            assert_eq!(
                gpu.download_bf16_as_f32(&one_out).unwrap(),
                gpu.download_bf16_as_f32(&two_out).unwrap(),
                "conv_step out {d:?} case {ci}"
            );
            assert_eq!(
                gpu.download_bf16_as_f32(&one_cs).unwrap(),
                gpu.download_bf16_as_f32(&two_cs).unwrap(),
                "conv_step state {d:?} case {ci}"
            );
        }
    }
    // Refused: more rows per sequence than the launch walks, channels not a multiple of 8.
    let d = dims(2, 4, 32, 32);
    let b = Batch::new(&[17], &[0], 1);
    let db = DevBatch::new(&gpu, &b);
    let z = gpu.alloc_zeros::<bf16>(17 * d.conv_dim()).unwrap();
    let (mut cs, mut out) = (gpu.alloc_zeros::<bf16>(d.conv_state_len()).unwrap(), gpu.alloc_zeros::<bf16>(17 * d.conv_dim()).unwrap());
    let (c, a) = (gpu.upload(&[0i32]).unwrap(), gpu.upload(&[17i32]).unwrap());
    let w = gpu.alloc_zeros::<bf16>(d.conv_dim() * K).unwrap();
    let e = gdn::conv_step(&gpu, &d, &db.seqs(), 17, &c, &a, &z, &w, &mut cs, &mut out, None).unwrap_err();
    assert!(e.to_string().contains("rows per sequence"), "{e}");
}

/// `conv_step` with `keep`: the kept sequences' raw rows land at their keep rows (bf16 bits unchanged), nothing
/// else in the keep buffer is written, and the conv output and windows are what they are without it; a keep
/// buffer too small for the kept rows is a typed error.
#[test]
fn conv_step_keeps_verify_rows() {
    let Some(gpu) = test_gpu() else { return };
    let b = Batch::new(&[3, 1, 4, 0, 2], &[4, 0, 2, 1, 3], 6);
    let (commit, accepted) = (vec![-1, 0, -1, 1, 3], vec![0, 1, 0, 0, 2]);
    // Sequences 0 and 2 verify: their rows go to keep rows 0..3 and 3..7 (row 7 stays as it was).
    let keep_row = vec![0i32, -1, 3, -1, -1];
    let (kept_rows, sentinel) = (8, -7.5f32);
    for d in all_dims().into_iter().filter(|d| d.conv_dim() % 8 == 0) {
        let cd = d.conv_dim();
        let x = round_bf16(&test_values(b.rows() * cd, 70, 2.0));
        let w = gpu.upload_f32_as_bf16(&test_values(cd * K, 71, 0.7)).unwrap();
        let cs = round_bf16(&test_values(b.num_slots * d.conv_state_len(), 72, 2.0));
        let db = DevBatch::new(&gpu, &b);
        let dx = gpu.upload_f32_as_bf16(&x).unwrap();
        let (dcommit, dacc, drow) = (gpu.upload(&commit).unwrap(), gpu.upload(&accepted).unwrap(), gpu.upload(&keep_row).unwrap());
        let run = |keep: Option<gdn::ConvKeep>| {
            let mut dcs = gpu.upload_f32_as_bf16(&cs).unwrap();
            let mut out = gpu.alloc_zeros::<bf16>(b.rows() * cd).unwrap();
            gdn::conv_step(&gpu, &d, &db.seqs(), 4, &dcommit, &dacc, &dx, &w, &mut dcs, &mut out, keep).unwrap();
            (gpu.download_bf16_as_f32(&out).unwrap(), gpu.download_bf16_as_f32(&dcs).unwrap())
        };
        let plain = run(None);
        let mut dkeep = gpu.upload_f32_as_bf16(&vec![sentinel; kept_rows * cd]).unwrap();
        let kept = run(Some(gdn::ConvKeep { row: &drow, rows: kept_rows, buf: &mut dkeep }));
        assert_eq!(kept, plain, "keep changed the conv {d:?}");
        let keep = gpu.download_bf16_as_f32(&dkeep).unwrap();
        let starts = b.starts();
        let mut want = vec![sentinel; kept_rows * cd];
        for (s, &at) in keep_row.iter().enumerate().filter(|(_, at)| **at >= 0) {
            let (r0, r1) = (starts[s] as usize, starts[s + 1] as usize);
            want[at as usize * cd..(at as usize + r1 - r0) * cd].copy_from_slice(&x[r0 * cd..r1 * cd]);
        }
        assert_eq!(keep, want, "kept rows {d:?}");
        let mut small = gpu.alloc_zeros::<bf16>(kept_rows * cd - 1).unwrap();
        let mut dcs = gpu.upload_f32_as_bf16(&cs).unwrap();
        let mut out = gpu.alloc_zeros::<bf16>(b.rows() * cd).unwrap();
        let keep = Some(gdn::ConvKeep { row: &drow, rows: kept_rows, buf: &mut small });
        let e = gdn::conv_step(&gpu, &d, &db.seqs(), 4, &dcommit, &dacc, &dx, &w, &mut dcs, &mut out, keep).unwrap_err();
        assert!(e.to_string().contains("keep"), "{e}");
    }
}

/// A verify batch in one launch (`recurrent_verify_norm`: some sequences in place, some into lanes) equals
/// the in-place launch and the lane launch, each given only its own sequences: o, y, the state slots, the
/// lanes; arrival counts back at zero.
#[test]
fn recurrent_verify_equals_in_place_and_lane_launches() {
    let Some(gpu) = test_gpu() else { return };
    let eps = 1e-6;
    let b = Batch::new(&[3, 1, 4, 0, 2], &[4, 0, 2, 1, 3], 6);
    // Sequences 0 and 2 verify (lanes), 1 and 4 advance in place, 3 has no rows.
    let in_place = vec![-1i32, 0, -1, 1, 3];
    let snap = vec![4i32, -1, 2, -1, -1];
    let max_lanes = 5;
    for d in all_dims() {
        let (rows, vd, sl, ns) = (b.rows(), d.value_dim(), d.state_len(), b.slots.len());
        let inp = gdn_inputs(&d, rows, 80);
        let z = gpu.upload_f32_as_bf16(&round_bf16(&test_values(rows * vd, 81, 2.0))).unwrap();
        let w = gpu.upload_f32_as_bf16(&round_bf16(&test_values(d.head_v_dim, 82, 1.0))).unwrap();
        let state0 = initial_state(&d, b.num_slots, 83);
        let di = DevInputs::new(&gpu, &inp);
        let starts = gpu.upload(&b.starts()).unwrap();
        let (d_in_place, d_snap) = (gpu.upload(&in_place).unwrap(), gpu.upload(&snap).unwrap());
        let seqs_in_place = GdnSeqs { rows, num_seqs: ns, seq_row_start: &starts, seq_slot: &d_in_place };
        let seqs_snap = GdnSeqs { seq_slot: &d_snap, ..seqs_in_place };
        let mut arrivals = gpu.alloc_zeros::<u32>(ns * d.num_v_heads).unwrap();
        let fresh = |gpu: &Gpu| {
            let state = gpu.upload(&state0).unwrap();
            let lanes = gpu.alloc_zeros::<f32>(ns * max_lanes * sl).unwrap();
            let o = gpu.alloc_zeros::<bf16>(rows * vd).unwrap();
            let y = gpu.alloc_zeros::<bf16>(rows * vd).unwrap();
            (state, lanes, o, y)
        };
        // Two launches.
        let (mut st2, mut lanes2, mut o2, mut y2) = fresh(&gpu);
        let norm = gdn::GatedNormOut { z: &z, w: &w, eps, y: &mut y2, arrivals: &mut arrivals };
        gdn::recurrent_norm(&gpu, &d, &seqs_in_place, &di.get(), &mut st2, &mut o2, Some(norm)).unwrap();
        let norm = gdn::GatedNormOut { z: &z, w: &w, eps, y: &mut y2, arrivals: &mut arrivals };
        let lanes = Lanes { buf: &mut lanes2, max_lanes };
        gdn::recurrent_lanes_norm(&gpu, &d, &seqs_snap, &di.get(), &st2, lanes, &mut o2, Some(norm)).unwrap();
        // One launch.
        let (mut st1, mut lanes1, mut o1, mut y1) = fresh(&gpu);
        let norm = gdn::GatedNormOut { z: &z, w: &w, eps, y: &mut y1, arrivals: &mut arrivals };
        let lanes = Lanes { buf: &mut lanes1, max_lanes };
        gdn::recurrent_verify_norm(&gpu, &d, &seqs_in_place, &d_snap, &di.get(), &mut st1, lanes, &mut o1, Some(norm)).unwrap();
        assert_eq!(gpu.download_bf16_as_f32(&o1).unwrap(), gpu.download_bf16_as_f32(&o2).unwrap(), "o {d:?}");
        assert_eq!(gpu.download_bf16_as_f32(&y1).unwrap(), gpu.download_bf16_as_f32(&y2).unwrap(), "y {d:?}");
        let (s1, s2) = (gpu.download(&st1).unwrap(), gpu.download(&st2).unwrap());
        assert_eq!(s1, s2, "state {d:?}");
        assert_ne!(s1, state0, "no sequence advanced in place {d:?}");
        for slot in [4usize, 2, 5] {
            assert_eq!(s1[slot * sl..(slot + 1) * sl], state0[slot * sl..(slot + 1) * sl], "slot {slot} written {d:?}");
        }
        let (l1, l2) = (gpu.download(&lanes1).unwrap(), gpu.download(&lanes2).unwrap());
        assert_eq!(l1, l2, "lanes {d:?}");
        assert!(l1[..3 * sl].iter().any(|&v| v != 0.0), "sequence 0 wrote no lanes {d:?}");
        assert!(l1[max_lanes * sl..2 * max_lanes * sl].iter().all(|&v| v == 0.0), "an in-place sequence wrote lanes {d:?}");
        assert!(gpu.download(&arrivals).unwrap().iter().all(|&c| c == 0), "arrivals left non-zero {d:?}");
    }
}

/// `commit_layers` (a verify's commit, every layer in one launch) equals `conv_commit` over the kept rows and
/// `commit_lane` in each layer, bit for bit; slots without an entry keep their windows and states; bad entries
/// are typed errors.
#[test]
fn commit_layers_equals_commit_per_layer() {
    let Some(gpu) = test_gpu() else { return };
    let (layers, num_slots, max_lanes, lane_seqs, keep_rows) = (3, 5, 4, 3, 10);
    // Verify batch sequences 0 and 2 (slots 3 and 1) kept rows 0..4 and 4..7, accepted lanes 2 and 0; batch
    // sequence 1 (slot 4) was not verifying.
    let entries = [
        gdn::CommitEntry { slot: 3, lane_seq: 0, lane: 2, keep_row: 0, kept: 4 },
        gdn::CommitEntry { slot: 1, lane_seq: 2, lane: 0, keep_row: 4, kept: 3 },
    ];
    for d in [dims(16, 32, 128, 128), dims(2, 4, 32, 32), dims(1, 3, 20, 12)] {
        let (cd, sl) = (d.conv_dim(), d.state_len());
        let make = |seed: u64| {
            let conv: Vec<_> = (0..layers)
                .map(|l| gpu.upload_f32_as_bf16(&round_bf16(&test_values(num_slots * d.conv_state_len(), seed + l as u64, 2.0))).unwrap())
                .collect();
            let state: Vec<_> = (0..layers).map(|l| gpu.upload(&test_values(num_slots * sl, seed + 10 + l as u64, 0.5)).unwrap()).collect();
            (conv, state)
        };
        let keep: Vec<_> = (0..layers)
            .map(|l| gpu.upload_f32_as_bf16(&round_bf16(&test_values(keep_rows * cd, 90 + l as u64, 2.0))).unwrap())
            .collect();
        let lanes: Vec<_> = (0..layers).map(|l| gpu.upload(&test_values(lane_seqs * max_lanes * sl, 95 + l as u64, 0.5)).unwrap()).collect();

        // Two launches per layer, with the metadata the per-layer kernels take.
        let (mut conv2, mut state2) = make(80);
        let keep_start = gpu.upload(&[0i32, 4, 7]).unwrap();
        let keep_slot = gpu.upload(&[3i32, 1]).unwrap();
        let accepted = gpu.upload(&[3i32, 1]).unwrap();
        let (lane_rows, lane_slot, lane) =
            (gpu.upload(&[0i32; 4]).unwrap(), gpu.upload(&[3i32, -1, 1]).unwrap(), gpu.upload(&[2i32, -1, 0]).unwrap());
        let keep_seqs = GdnSeqs { rows: 7, num_seqs: 2, seq_row_start: &keep_start, seq_slot: &keep_slot };
        let lane_seqs_meta = GdnSeqs { rows: 0, num_seqs: lane_seqs, seq_row_start: &lane_rows, seq_slot: &lane_slot };
        for l in 0..layers {
            gdn::conv_commit(&gpu, &d, &keep_seqs, &keep[l], &accepted, &mut conv2[l]).unwrap();
            let ls = Lanes { buf: &lanes[l], max_lanes };
            gdn::commit_lane(&gpu, &d, &lane_seqs_meta, &lane, ls, &mut state2[l]).unwrap();
        }
        // One launch.
        let (mut conv1, mut state1) = make(80);
        let mut scratch = gdn::CommitScratch::default();
        let (conv_p, state_p) = make(80);
        for round in 0..3 {
            if round == 1 {
                (conv1, state1) = make(80); // again, on the kept scratch (new buffers: their addresses uploaded again)
            }
            if round == 2 {
                // Fresh contents in the same buffers: the kept address table is reused as it is.
                for l in 0..layers {
                    gpu.stream.memcpy_dtod(&conv_p[l], &mut conv1[l]).unwrap();
                    gpu.stream.memcpy_dtod(&state_p[l], &mut state1[l]).unwrap();
                }
            }
            let bufs = gdn::LayerBuffers { conv_state: &mut conv1, keep: &keep, state: &mut state1, lanes: &lanes, max_lanes };
            gdn::commit_layers(&gpu, &d, bufs, &entries, &mut scratch).unwrap();
            for l in 0..layers {
                assert_eq!(gpu.download_bf16_as_f32(&conv1[l]).unwrap(), gpu.download_bf16_as_f32(&conv2[l]).unwrap(), "conv {d:?} layer {l}");
                assert_eq!(gpu.download(&state1[l]).unwrap(), gpu.download(&state2[l]).unwrap(), "state {d:?} layer {l}");
            }
        }
        let (conv0, state0) = make(80);
        for l in 0..layers {
            let (c0, c1) = (gpu.download_bf16_as_f32(&conv0[l]).unwrap(), gpu.download_bf16_as_f32(&conv1[l]).unwrap());
            let (s0, s1) = (gpu.download(&state0[l]).unwrap(), gpu.download(&state1[l]).unwrap());
            for slot in [0usize, 2, 4] {
                let w = d.conv_state_len();
                assert_eq!(c1[slot * w..(slot + 1) * w], c0[slot * w..(slot + 1) * w], "window of slot {slot} changed {d:?}");
                assert_eq!(s1[slot * sl..(slot + 1) * sl], s0[slot * sl..(slot + 1) * sl], "state of slot {slot} changed {d:?}");
            }
            assert_ne!(s1[3 * sl..4 * sl], s0[3 * sl..4 * sl], "slot 3 not committed {d:?}");
        }
        // Refused: a lane past the sequence's kept rows, kept rows past the buffer, a slot twice.
        let bad = [
            gdn::CommitEntry { lane: 4, ..entries[0] },
            gdn::CommitEntry { keep_row: 8, ..entries[0] },
            gdn::CommitEntry { lane_seq: 1, ..entries[1] },
        ];
        for (i, e) in bad.iter().enumerate() {
            let list = if i == 2 { vec![entries[1], *e] } else { vec![*e] };
            let bufs = gdn::LayerBuffers { conv_state: &mut conv1, keep: &keep, state: &mut state1, lanes: &lanes, max_lanes };
            let err = gdn::commit_layers(&gpu, &d, bufs, &list, &mut scratch).unwrap_err();
            assert!(err.to_string().contains("gdn_commit_layers"), "{err}");
        }
    }
}

/// CPU form of the layer's output norm over o [rows, HV*d_v] (bf16-rounded, as the kernels store it).
fn cpu_gated_norm(o: &[f32], z: &[f32], w: &[f32], eps: f32, dv: usize) -> Vec<f32> {
    let mut y = round_bf16(o);
    for (v, zv) in y.chunks_mut(dv).zip(z.chunks(dv)) {
        nextn_engine::backend::cpu::math::gated_rms_norm(v, zv, w, eps);
    }
    y
}

/// The recurrence with the output norm in its launch: o and the state exactly as without it, y as the CPU's
/// gated RMSNorm of o; in place and in lane mode; twice in a row (the arrival counts return to zero).
#[test]
fn recurrent_norm_matches_cpu_gated_norm() {
    let Some(gpu) = test_gpu() else { return };
    let eps = 1e-6;
    for d in all_dims() {
        let (vd, dv) = (d.value_dim(), d.head_v_dim);
        for (bi, b) in batches().iter().enumerate() {
            let rows = b.rows();
            let inp = gdn_inputs(&d, rows, 60 + bi as u64);
            let z = round_bf16(&test_values(rows * vd, 61, 2.0));
            let w = round_bf16(&test_values(dv, 62, 1.0));
            let state0 = initial_state(&d, b.num_slots, 63);
            let db = DevBatch::new(&gpu, b);
            let di = DevInputs::new(&gpu, &inp);
            let (dz, dw) = (gpu.upload_f32_as_bf16(&z).unwrap(), gpu.upload_f32_as_bf16(&w).unwrap());
            let mut arrivals = gpu.alloc_zeros::<u32>(b.slots.len() * d.num_v_heads).unwrap();

            // Unfused reference run on the device.
            let mut ref_state = gpu.upload(&state0).unwrap();
            let mut ref_o = gpu.alloc_zeros::<bf16>(rows * vd).unwrap();
            gdn::recurrent(&gpu, &d, &db.seqs(), &di.get(), &mut ref_state, &mut ref_o).unwrap();
            let ref_o = gpu.download_bf16_as_f32(&ref_o).unwrap();
            let want_y = cpu_gated_norm(&ref_o, &z, &w, eps, dv);

            for round in 0..2 {
                let mut dstate = gpu.upload(&state0).unwrap();
                let mut d_o = gpu.alloc_zeros::<bf16>(rows * vd).unwrap();
                let mut dy = gpu.alloc_zeros::<bf16>(rows * vd).unwrap();
                let norm = gdn::GatedNormOut { z: &dz, w: &dw, eps, y: &mut dy, arrivals: &mut arrivals };
                gdn::recurrent_norm(&gpu, &d, &db.seqs(), &di.get(), &mut dstate, &mut d_o, Some(norm)).unwrap();
                assert_eq!(gpu.download_bf16_as_f32(&d_o).unwrap(), ref_o, "o {d:?} batch {bi} round {round}");
                assert_eq!(gpu.download(&dstate).unwrap(), gpu.download(&ref_state).unwrap(), "state {d:?} batch {bi}");
                let e = normalised_error(&gpu.download_bf16_as_f32(&dy).unwrap(), &want_y);
                assert!(e < TOL_BF16, "y {d:?} batch {bi} round {round}: err {e}");
                assert!(gpu.download(&arrivals).unwrap().iter().all(|&c| c == 0), "arrivals left non-zero");
            }

            // Lane mode: the same y, the state only read.
            let lanes_n = 16;
            let mut lanes = gpu.alloc_zeros::<f32>(b.slots.len() * lanes_n * d.state_len()).unwrap();
            let dstate = gpu.upload(&state0).unwrap();
            let mut d_o = gpu.alloc_zeros::<bf16>(rows * vd).unwrap();
            let mut dy = gpu.alloc_zeros::<bf16>(rows * vd).unwrap();
            let norm = gdn::GatedNormOut { z: &dz, w: &dw, eps, y: &mut dy, arrivals: &mut arrivals };
            let lanes_arg = Lanes { buf: &mut lanes, max_lanes: lanes_n };
            gdn::recurrent_lanes_norm(&gpu, &d, &db.seqs(), &di.get(), &dstate, lanes_arg, &mut d_o, Some(norm)).unwrap();
            let e = normalised_error(&gpu.download_bf16_as_f32(&dy).unwrap(), &want_y);
            assert!(e < TOL_BF16, "lanes y {d:?} batch {bi}: err {e}");
            assert_eq!(gpu.download(&dstate).unwrap(), state0, "lane mode wrote the state");
            assert!(gpu.download(&arrivals).unwrap().iter().all(|&c| c == 0), "arrivals left non-zero (lanes)");
        }
    }
}
