//! Safetensors checkpoints: memory-mapped, single file or sharded, tensors kept in their stored dtype.
//!
//! A [`Tensor`] is a typed view into a mapped file (or an owned buffer, for dummy weights): nothing is
//! converted at load. Compute reads rows and widens them to f32 on the fly (see [`crate::backend::cpu::math`]).
//! [`WeightLoader`] hands tensors to the model constructors by checkpoint name, checks shapes and dtypes,
//! and reports every missing, mis-shaped, mistyped or unexpected tensor in one error.

pub mod dummy;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{LoadError, TensorProblem};

/// Storage dtypes the compute path reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        }
    }
}

/// Anonymous zeroed memory of `len` bytes advised for transparent huge pages. Batch-1 decode streams
/// every active weight once per token; in 4 KiB pages that is a page walk every 4 KiB (110 K per token for
/// 0.45 GB), in 2 MiB pages one per 2 MiB: decode on the comparison checkpoint went from 45 to 54 tok/s
/// (2-core Xeon). The advice is best effort: a kernel without THP gives ordinary pages.
pub fn huge_page_alloc(len: usize) -> std::io::Result<memmap2::MmapMut> {
    let m = memmap2::MmapMut::map_anon(len.max(1))?;
    #[cfg(target_os = "linux")]
    let _ = m.advise(memmap2::Advice::HugePage);
    Ok(m)
}

/// Whether host weights are copied into huge-page memory (`NEXTN_HUGEPAGES=0`: used in place, the
/// checkpoint's file mapping or the allocator's pages).
pub fn huge_pages_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("NEXTN_HUGEPAGES").map_or(true, |v| v != "0"))
}

/// `bytes` copied into read-only huge-page memory ([`huge_page_alloc`]).
fn huge_copy(bytes: &[u8]) -> std::io::Result<Mmap> {
    let mut m = huge_page_alloc(bytes.len())?;
    m[..bytes.len()].copy_from_slice(bytes);
    m.make_read_only()
}

/// Bytes that back tensors: a mapped file or an owned buffer.
pub enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A typed, shaped view of contiguous row-major bytes.
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    offset: usize,
    dtype: DType,
    shape: Vec<usize>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({:?}, {:?})", self.dtype, self.shape)
    }
}

impl Tensor {
    /// An owned f32 tensor (tests, dummy weights).
    pub fn from_f32(shape: Vec<usize>, data: &[f32]) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "shape/data mismatch");
        let bytes: Vec<u8> = bytemuck::cast_slice(data).to_vec();
        Tensor { storage: Arc::new(Storage::Owned(bytes)), offset: 0, dtype: DType::F32, shape }
    }

    /// An owned tensor from raw little-endian bytes of `dtype`.
    pub fn from_bytes(shape: Vec<usize>, dtype: DType, bytes: Vec<u8>) -> Self {
        assert_eq!(shape.iter().product::<usize>() * dtype.size(), bytes.len(), "shape/bytes mismatch");
        Tensor { storage: Arc::new(Storage::Owned(bytes)), offset: 0, dtype, shape }
    }

    /// [`Self::from_bytes`], held in huge-page memory when it spans at least one 2 MiB page (and
    /// [`huge_pages_on`]); otherwise, or if the mapping fails, as the owned buffer.
    pub fn from_bytes_huge(shape: Vec<usize>, dtype: DType, bytes: Vec<u8>) -> Self {
        if !huge_pages_on() || bytes.len() < 2 << 20 {
            return Self::from_bytes(shape, dtype, bytes);
        }
        assert_eq!(shape.iter().product::<usize>() * dtype.size(), bytes.len(), "shape/bytes mismatch");
        match huge_copy(&bytes) {
            Ok(m) => Tensor { storage: Arc::new(Storage::Mapped(m)), offset: 0, dtype, shape },
            Err(_) => Self::from_bytes(shape, dtype, bytes),
        }
    }

    /// A zero-element placeholder, used while collecting load problems.
    pub fn placeholder() -> Self {
        Tensor { storage: Arc::new(Storage::Owned(Vec::new())), offset: 0, dtype: DType::F32, shape: vec![0] }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Elements in one row (the last dim); rows = numel / row_len.
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    pub fn rows(&self) -> usize {
        self.numel() / self.row_len().max(1)
    }
    /// Stored bytes of this view.
    pub fn bytes(&self) -> &[u8] {
        let len = self.numel() * self.dtype.size();
        &self.storage.bytes()[self.offset..self.offset + len]
    }

    /// Sub-tensor `i` along the first dim (e.g. expert `i` of a fused [E, out, in] tensor). Zero copy.
    pub fn index0(&self, i: usize) -> Tensor {
        assert!(self.shape.len() >= 2 && i < self.shape[0], "index0({i}) on {:?}", self.shape);
        let inner: usize = self.shape[1..].iter().product();
        Tensor {
            storage: self.storage.clone(),
            offset: self.offset + i * inner * self.dtype.size(),
            dtype: self.dtype,
            shape: self.shape[1..].to_vec(),
        }
    }

    /// Rows `start..end` of a 2-D tensor (e.g. the gate half of a fused gate_up). Zero copy.
    pub fn rows_range(&self, start: usize, end: usize) -> Tensor {
        assert!(self.shape.len() == 2 && start <= end && end <= self.shape[0], "rows {start}..{end} of {:?}", self.shape);
        Tensor {
            storage: self.storage.clone(),
            offset: self.offset + start * self.shape[1] * self.dtype.size(),
            dtype: self.dtype,
            shape: vec![end - start, self.shape[1]],
        }
    }

    /// A new contiguous 2-D tensor of the given rows, in order (e.g. the LM head rows of a draft vocabulary).
    pub fn gather_rows(&self, rows: &[u32]) -> Tensor {
        assert!(self.shape.len() == 2, "gather_rows on {:?}", self.shape);
        let row_bytes = self.shape[1] * self.dtype.size();
        let src = self.bytes();
        let mut bytes = Vec::with_capacity(rows.len() * row_bytes);
        for &r in rows {
            let r = r as usize;
            assert!(r < self.shape[0], "gather_rows: row {r} of {:?}", self.shape);
            bytes.extend_from_slice(&src[r * row_bytes..(r + 1) * row_bytes]);
        }
        Tensor::from_bytes(vec![rows.len(), self.shape[1]], self.dtype, bytes)
    }

    /// Row `r` widened to f32 into `out` (len = row_len).
    #[inline]
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let n = self.row_len();
        let es = self.dtype.size();
        let bytes = &self.bytes()[r * n * es..(r + 1) * n * es];
        widen(self.dtype, bytes, out);
    }

    /// The whole tensor as f32 (small tensors: norms, biases, conv weights).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.numel()];
        widen(self.dtype, self.bytes(), &mut out);
        out
    }
}

/// Little-endian `dtype` bytes → f32. Reads unaligned: mapped tensors need not be aligned.
#[inline]
pub fn widen(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
struct TensorEntry {
    file: usize,
    dtype: Result<DType, String>,
    shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    start: usize,
}

/// All safetensors files of a checkpoint directory, indexed by tensor name.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Arc<Storage>)>,
    tensors: BTreeMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Open `dir`: `model.safetensors.index.json` (sharded) if present, else `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut ckpt = Checkpoint { dir: dir.to_path_buf(), files: Vec::new(), tensors: BTreeMap::new() };
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|error| LoadError::Io { path: index_path.clone(), error })?;
            let index: serde_json::Value = serde_json::from_str(&text)
                .map_err(|error| LoadError::Json { path: index_path.clone(), error })?;
            let map = index.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| LoadError::ConfigField {
                path: index_path.clone(),
                field: "weight_map".into(),
                reason: "missing or not an object".into(),
            })?;
            let mut by_shard: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for (name, shard) in map {
                let shard = shard.as_str().ok_or_else(|| LoadError::ConfigField {
                    path: index_path.clone(),
                    field: format!("weight_map.{name}"),
                    reason: "expected a file name".into(),
                })?;
                by_shard.entry(shard.to_string()).or_default().push(name.clone());
            }
            for (shard, names) in &by_shard {
                let path = dir.join(shard);
                if !path.is_file() {
                    return Err(LoadError::Shard {
                        index: index_path.clone(),
                        shard: shard.clone(),
                        reason: format!("{} does not exist", path.display()),
                    });
                }
                let file = ckpt.add_file(&path)?;
                for name in names {
                    match ckpt.tensors.get(name) {
                        Some(e) if e.file == file => {}
                        _ => {
                            return Err(LoadError::Shard {
                                index: index_path.clone(),
                                shard: shard.clone(),
                                reason: format!("it does not contain tensor `{name}`"),
                            });
                        }
                    }
                }
            }
        } else if single.is_file() {
            ckpt.add_file(&single)?;
        } else {
            return Err(LoadError::NoWeights { dir: dir.to_path_buf() });
        }
        Ok(ckpt)
    }

    fn add_file(&mut self, path: &Path) -> Result<usize, LoadError> {
        let file = std::fs::File::open(path).map_err(|error| LoadError::Io { path: path.to_path_buf(), error })?;
        // SAFETY: the mapping is read-only; a checkpoint modified while loaded is outside our contract.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|error| LoadError::Io { path: path.to_path_buf(), error })?;
        let (header_len, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| LoadError::Safetensors {
            path: path.to_path_buf(),
            reason: describe_safetensors_error(&e),
        })?;
        let data_start = 8 + header_len;
        let idx = self.files.len();
        for (name, info) in meta.tensors() {
            if let Some(prev) = self.tensors.get(&name) {
                return Err(LoadError::DuplicateTensor {
                    name,
                    first: self.files[prev.file].0.clone(),
                    second: path.to_path_buf(),
                });
            }
            let dtype = match info.dtype {
                Dtype::F32 => Ok(DType::F32),
                Dtype::F16 => Ok(DType::F16),
                Dtype::BF16 => Ok(DType::BF16),
                other => Err(format!("{other:?}")),
            };
            let entry = TensorEntry { file: idx, dtype, shape: info.shape.clone(), start: data_start + info.data_offsets.0 };
            self.tensors.insert(name, entry);
        }
        self.files.push((path.to_path_buf(), Arc::new(Storage::Mapped(mmap))));
        Ok(idx)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }
    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> usize {
        self.files.iter().map(|(_, s)| s.bytes().len()).sum()
    }

    fn tensor(&self, name: &str) -> Option<Result<Tensor, String>> {
        let e = self.tensors.get(name)?;
        Some(e.dtype.clone().map(|dtype| Tensor {
            storage: self.files[e.file].1.clone(),
            offset: e.start,
            dtype,
            shape: e.shape.clone(),
        }))
    }
}

fn describe_safetensors_error(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::MetadataIncompleteBuffer => {
            "the file is shorter or longer than its header says (truncated or partially written?)".into()
        }
        E::HeaderTooSmall => "file too small to hold a safetensors header (truncated?)".into(),
        E::InvalidHeaderLength => "header length points past the end of the file (truncated?)".into(),
        other => other.to_string(),
    }
}

/// Where [`WeightLoader`] gets tensors from.
pub enum WeightSource<'a> {
    Checkpoint(&'a Checkpoint),
    /// Random weights of the requested shapes (`--load-format dummy`), for profiling without a checkpoint.
    Dummy(crate::weights::dummy::DummyWeights),
}

/// Hands tensors to model constructors and records every problem, so one load reports all of them.
pub struct WeightLoader<'a> {
    source: WeightSource<'a>,
    used: HashSet<String>,
    problems: Vec<TensorProblem>,
    /// Names the model recognises but does not consume (e.g. `mtp.*` before the MTP module exists).
    ignored_prefixes: Vec<String>,
}

impl<'a> WeightLoader<'a> {
    pub fn new(ckpt: &'a Checkpoint) -> Self {
        Self::from_source(WeightSource::Checkpoint(ckpt))
    }

    pub fn from_source(source: WeightSource<'a>) -> Self {
        WeightLoader { source, used: HashSet::new(), problems: Vec::new(), ignored_prefixes: Vec::new() }
    }

    /// Whether the source holds `name` (layout detection). Dummy weights use the released layout.
    pub fn contains(&self, name: &str) -> bool {
        match &self.source {
            WeightSource::Checkpoint(c) => c.contains(name),
            WeightSource::Dummy(_) => true,
        }
    }

    /// Tensors under `prefix` are known but not consumed; they are not reported as unexpected.
    pub fn ignore_prefix(&mut self, prefix: &str) {
        self.ignored_prefixes.push(prefix.to_string());
    }

    /// The tensor `name` with exactly `shape`; records a problem and returns a placeholder otherwise.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Tensor {
        self.used.insert(name.to_string());
        let ckpt = match &mut self.source {
            WeightSource::Dummy(d) => return d.tensor(name, shape),
            WeightSource::Checkpoint(c) => *c,
        };
        match ckpt.tensor(name) {
            None => {
                self.problems.push(TensorProblem::Missing { name: name.into(), expected: shape.to_vec() });
                Tensor::placeholder()
            }
            Some(Err(found)) => {
                self.problems.push(TensorProblem::Dtype { name: name.into(), found });
                Tensor::placeholder()
            }
            Some(Ok(t)) if t.shape() != shape => {
                self.problems.push(TensorProblem::Shape {
                    name: name.into(),
                    expected: shape.to_vec(),
                    found: t.shape().to_vec(),
                });
                Tensor::placeholder()
            }
            Some(Ok(t)) => t,
        }
    }

    /// Succeeds only if nothing was missing, mis-shaped, mistyped or left over.
    pub fn finish(mut self) -> Result<(), LoadError> {
        let ckpt = match &self.source {
            WeightSource::Checkpoint(c) => *c,
            WeightSource::Dummy(_) => return Ok(()),
        };
        let mut unexpected: Vec<TensorProblem> = ckpt
            .tensors
            .iter()
            .filter(|(name, _)| !self.used.contains(*name))
            .filter(|(name, _)| !self.ignored_prefixes.iter().any(|p| name.starts_with(p.as_str())))
            .map(|(name, e)| TensorProblem::Unexpected { name: name.clone(), shape: e.shape.clone() })
            .collect();
        self.problems.append(&mut unexpected);
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(LoadError::Tensors { dir: ckpt.dir.clone(), problems: self.problems })
        }
    }
}

/// Counts per dtype, for load summaries.
pub fn dtype_histogram(ckpt: &Checkpoint) -> HashMap<&'static str, usize> {
    let mut h = HashMap::new();
    for e in ckpt.tensors.values() {
        let k = match &e.dtype {
            Ok(d) => d.name(),
            Err(_) => "other",
        };
        *h.entry(k).or_insert(0) += 1;
    }
    h
}

impl Checkpoint {
    /// Bring every file into memory the CPU backend streams well: copied into anonymous huge-page memory
    /// ([`huge_page_alloc`]; the file mappings are dropped, so the page cache can be reclaimed), or with
    /// `NEXTN_HUGEPAGES=0` left mapped and paged in. Call before taking tensors. With `progress`, a progress
    /// bar on stderr.
    pub fn make_resident(&mut self, progress: bool) -> Result<(), LoadError> {
        let bar = if progress { indicatif::ProgressBar::new(self.total_bytes() as u64) } else { indicatif::ProgressBar::hidden() };
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading {msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(self.dir.display().to_string());
        const STEP: usize = 64 << 20;
        for (path, storage) in &mut self.files {
            let bytes = storage.bytes();
            if huge_pages_on() {
                let io = |error| LoadError::Io { path: path.clone(), error };
                let mut m = huge_page_alloc(bytes.len()).map_err(io)?;
                for (dst, src) in m.chunks_mut(STEP).zip(bytes.chunks(STEP)) {
                    dst[..src.len()].copy_from_slice(src);
                    bar.inc(src.len() as u64);
                }
                *storage = Arc::new(Storage::Mapped(m.make_read_only().map_err(io)?));
            } else if progress {
                let mut sink = 0u8;
                for chunk in bytes.chunks(STEP) {
                    chunk.chunks(4096).for_each(|page| sink ^= page[0]);
                    bar.inc(chunk.len() as u64);
                }
                std::hint::black_box(sink);
            }
        }
        bar.finish_and_clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Making a checkpoint resident (huge-page copy, or the paged-in mapping with `NEXTN_HUGEPAGES=0`)
    /// keeps every tensor's bytes.
    #[test]
    fn make_resident_keeps_every_tensor() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_bf16");
        let mut ckpt = Checkpoint::open(&dir).unwrap();
        let before: Vec<(String, Vec<u8>)> =
            ckpt.names().map(|n| (n.to_string(), ckpt.tensor(n).unwrap().unwrap().bytes().to_vec())).collect();
        ckpt.make_resident(false).unwrap();
        assert!(!before.is_empty());
        for (name, bytes) in &before {
            assert_eq!(ckpt.tensor(name).unwrap().unwrap().bytes(), &bytes[..], "{name}");
        }
        let big: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
        let t = Tensor::from_bytes_huge(vec![3 << 19], DType::BF16, big.clone());
        assert_eq!(t.bytes(), &big[..]);
    }
}
