//! meta.cu: a step's metadata in one page-locked upload scattered into its buffers, against the host values; and
//! `Gpu::download_ids`, the step's ids back through page-locked memory.
#![cfg(feature = "cuda")]

use nextn_kernels::cudarc::driver::CudaSlice;
use nextn_kernels::meta::{MAX_SECTIONS, MetaUpload, UploadMode};
use nextn_kernels::{Gpu, test_gpu};

/// One step's sections: i32 tokens, i64 KV slots (negative and past 2^32), an empty section, and a long block
/// table (more words than the 64 × 256 threads of the launch: the grid strides).
struct Step {
    tokens: Vec<i32>,
    slots: Vec<i64>,
    table: Vec<i32>,
}

fn step(seed: i32, table_len: usize) -> Step {
    Step {
        tokens: (0..3).map(|i| seed * 1000 + i).collect(),
        slots: vec![seed as i64, -1, (1i64 << 40) + seed as i64, i64::MIN + seed as i64, 17],
        table: (0..table_len as i32).map(|i| i * 3 + seed).collect(),
    }
}

struct Bufs {
    tokens: CudaSlice<i32>,
    slots: CudaSlice<i64>,
    empty: CudaSlice<i32>,
    table: CudaSlice<i32>,
}

const SENTINEL: i32 = -7;

fn send(gpu: &Gpu, up: &mut MetaUpload, b: &Bufs, s: &Step) {
    up.clear();
    up.section(gpu, &b.tokens, &s.tokens).unwrap();
    up.section(gpu, &b.slots, &s.slots).unwrap();
    up.section(gpu, &b.empty, &[]).unwrap();
    up.section(gpu, &b.table, &s.table).unwrap();
    assert_eq!(up.sections(), 4);
    up.send(gpu).unwrap();
}

/// A buffer's first `n` values then the sentinel the test filled it with (the scatter writes nothing past a section).
fn expect<T: Copy>(values: &[T], len: usize, fill: T) -> Vec<T> {
    let mut v = values.to_vec();
    v.resize(len, fill);
    v
}

/// Three steps sent back to back without a host sync (the second needs a larger page-locked array than the first):
/// each step's sections, copied on the device right after its scatter, hold that step's values, so no step's
/// packing overwrote the page-locked array while an earlier copy out of it was still queued. The same with a copy
/// per section (`NEXTN_META_UPLOAD=copies`).
#[test]
fn one_upload_fills_every_section() {
    let Some(gpu) = test_gpu() else { return };
    for mode in [UploadMode::Packed, UploadMode::Copies] {
        fills_every_section(&gpu, mode);
    }
}

fn fills_every_section(gpu: &Gpu, mode: UploadMode) {
    let b = Bufs {
        tokens: gpu.upload(&[SENTINEL; 8]).unwrap(),
        slots: gpu.upload(&[SENTINEL as i64; 8]).unwrap(),
        empty: gpu.upload(&[SENTINEL; 2]).unwrap(),
        table: gpu.upload(&vec![SENTINEL; 50_000]).unwrap(),
    };
    let mut up = MetaUpload::with_mode(gpu, mode).unwrap();
    let steps = [step(1, 300), step(2, 40_000), step(3, 12)];
    let mut snaps = Vec::new();
    for s in &steps {
        send(&gpu, &mut up, &b, s);
        // Snapshots in stream order, before the next step's copy and scatter.
        let t = gpu.stream.clone_dtod(&b.tokens).unwrap();
        let sl = gpu.stream.clone_dtod(&b.slots).unwrap();
        let tb = gpu.stream.clone_dtod(&b.table).unwrap();
        snaps.push((t, sl, tb));
    }
    let mut longest = 0;
    for (s, (t, sl, tb)) in steps.iter().zip(&snaps) {
        assert_eq!(gpu.download(t).unwrap(), expect(&s.tokens, 8, SENTINEL), "{mode:?} tokens");
        assert_eq!(gpu.download(sl).unwrap(), expect(&s.slots, 8, SENTINEL as i64), "{mode:?} slots");
        // A shorter table leaves the longer earlier one's tail in place.
        longest = longest.max(s.table.len());
        let got = gpu.download(tb).unwrap();
        assert_eq!(got[..s.table.len()], s.table[..], "{mode:?} table of {} values", s.table.len());
        assert!(got[longest..].iter().all(|&v| v == SENTINEL), "{mode:?}: past every section written so far");
    }
    assert_eq!(gpu.download(&b.empty).unwrap(), vec![SENTINEL; 2], "{mode:?}: an empty section writes nothing");
}

#[test]
fn bad_sections_are_typed_errors() {
    let Some(gpu) = test_gpu() else { return };
    let mut up = MetaUpload::new(&gpu).unwrap();
    let small = gpu.alloc_zeros::<i32>(2).unwrap();
    let e = up.section(&gpu, &small, &[1, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("scatter_words") && e.contains("3 values for a buffer of 2"), "{e}");
    up.clear();
    for _ in 0..MAX_SECTIONS {
        up.section(&gpu, &small, &[1]).unwrap();
    }
    let e = up.section(&gpu, &small, &[1]).unwrap_err().to_string();
    assert!(e.contains("scatter_words") && e.contains(&format!("more than {MAX_SECTIONS} sections")), "{e}");
    // Nothing packed: nothing sent, no error.
    up.clear();
    up.send(&gpu).unwrap();
}

/// Ids back through the page-locked landing area: whole buffers and views at an offset, a length that makes it grow,
/// a shorter one after it (only its own values come back), and nothing for an empty view.
#[test]
fn ids_come_back_through_page_locked_memory() {
    let Some(gpu) = test_gpu() else { return };
    let host: Vec<i32> = (0..5000).map(|i| i * 7 - 11_000).collect();
    let dev = gpu.upload(&host).unwrap();
    for (from, to) in [(0, 1), (3, 10), (0, 64), (100, 5000), (17, 20), (4999, 5000), (5, 5)] {
        assert_eq!(gpu.download_ids(&dev.slice(from..to)).unwrap(), host[from..to], "{from}..{to}");
    }
}
