//! The CUDA context: driver check, device, one stream, the embedded kernel modules.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
    PinnedHostSlice, ValidAsZeroBits, sys,
};
use cudarc::nvrtc::Ptx;

use crate::GpuError;
use crate::timing::KernelLog;

include!(concat!(env!("OUT_DIR"), "/modules.rs"));

/// The `-Xptxas -v` report of every kernel (registers, shared memory, spills), as built.
pub const PTXAS_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/ptxas_report.txt"));

pub use half::bf16;

/// One GPU: context, the stream every launcher uses, and the kernel modules (loaded once, lazily).
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub name: String,
    pub sm_count: u32,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    /// The dynamic shared memory each kernel has been allowed so far ([`Gpu::function_with_smem`]).
    smem_allowed: Mutex<HashMap<(&'static str, &'static str), u32>>,
    /// Per-launch device timing, off unless [`Gpu::time_kernels`] turns it on (crate::timing).
    pub(crate) kernel_log: KernelLog,
    /// Programmatic dependent launch (sm_90+, on unless `NEXTN_PDL=0`): every kernel is launched allowed to
    /// start while the previous one drains. Each kernel waits for its predecessor (`pdl_wait()` in
    /// common.cuh) before it touches anything that kernel wrote, and before it writes anything at all;
    /// the GEMVs first start streaming their weights, which no kernel writes.
    pub pdl: bool,
    /// Page-locked landing area of [`Gpu::download_ids`] (grows to a power of two; cached, not write-combined: the
    /// host reads it).
    ids_landing: Mutex<Option<PinnedHostSlice<i32>>>,
    /// Split-K for the fused GEMVs with fewer tiles than resident blocks (`crate::linear::KSplit`): off unless
    /// `NEXTN_GEMV_SPLITK=1`, until a device run has checked and timed it.
    pub gemv_split_k: bool,
    /// The split-K GEMVs' part sums and per-tile counters (grown to a power of two; the counters are zero
    /// between launches).
    pub(crate) gemv_split_scratch: Mutex<Option<(CudaSlice<f32>, CudaSlice<i32>)>>,
}

/// A kernel's arguments in order, as [`Gpu::launch`]'s `push` gives them: by-value arguments ([`Self::arg`]:
/// a scalar or a `#[repr(C)]` params struct) and buffers ([`Self::buf`]: their device address), each
/// borrowed until the launch has copied it.
pub struct KernelArgs<'a> {
    ptrs: Vec<*mut c_void>,
    addrs: Vec<Box<u64>>,
    stream: &'a CudaStream,
    _borrows: PhantomData<&'a ()>,
}

impl<'a> KernelArgs<'a> {
    /// A by-value argument.
    pub fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.ptrs.push(v as *const T as *mut c_void);
        self
    }
    /// A buffer argument (a `T*` of the kernel).
    pub fn buf<T, S: DevicePtr<T>>(&mut self, s: &'a S) -> &mut Self {
        let addr = Box::new(dptr(s, self.stream));
        self.ptrs.push(&*addr as *const u64 as *mut c_void);
        self.addrs.push(addr); // the box's heap slot does not move with the Vec
        self
    }
}

pub(crate) fn driver_err(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    let what = what.into();
    move |e| GpuError::Driver { what, msg: format!("{e:?}") }
}

/// Keep freed device memory in the device's default pool (release threshold: never) instead of handing it
/// back to the driver at each synchronisation, so buffers freed and made again (a grown workspace, scratch)
/// come from the pool without a driver allocation.
fn keep_pool_memory(ordinal: usize) -> Result<(), GpuError> {
    let dev = cudarc::driver::result::device::get(ordinal as i32).map_err(driver_err("cuDeviceGet"))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer for the call; `dev` came from the driver.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev) }
        .result()
        .map_err(driver_err("cuDeviceGetDefaultMemPool"))?;
    let mut threshold = u64::MAX;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: the release threshold attribute takes a pointer to a cuuint64_t, which `threshold` is.
    unsafe { sys::cuMemPoolSetAttribute(pool, attr, &mut threshold as *mut u64 as *mut c_void) }
        .result()
        .map_err(driver_err("cuMemPoolSetAttribute(release threshold)"))
}

/// Whether a CUDA driver library can be loaded and reports at least one device. Never panics.
pub fn device_count() -> Result<i32, GpuError> {
    // cudarc panics when libcuda is missing: look for the library before touching the driver API.
    // SAFETY: this only tries to dlopen libcuda (running the driver's own initialisers, as the first driver
    // call would anyway) and closes it again; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::NoDriver);
    }
    cudarc::driver::result::init().map_err(driver_err("cuInit"))?;
    CudaContext::device_count().map_err(driver_err("cuDeviceGetCount"))
}

impl Gpu {
    /// Open device `ordinal`. Typed errors for no driver / no device / bad ordinal.
    pub fn new(ordinal: usize) -> Result<Arc<Gpu>, GpuError> {
        let count = device_count()?;
        if count <= 0 {
            return Err(GpuError::NoDevice(count));
        }
        if ordinal as i32 >= count {
            return Err(GpuError::BadOrdinal { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("cuCtxCreate"))?;
        // One stream, ordered launches: the per-buffer event tracking cudarc does for multi-stream use
        // costs an event record per argument per launch; we do not need it.
        // SAFETY: cudarc's contract is cross-stream synchronisation by hand. Every buffer is allocated, used
        // and freed on `stream`, the one stream of this context, whose order serialises all of it; no
        // buffer was made before this call.
        unsafe { ctx.disable_event_tracking() };
        // An own non-blocking stream, not the legacy default one: its work does not serialise with other
        // streams' (a profiler's, another library's), and CUDA graph capture needs a non-legacy stream.
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        if ctx.has_async_alloc() {
            keep_pool_memory(ordinal)?;
        }
        let name = ctx.name().map_err(driver_err("cuDeviceGetName"))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_err("cuDeviceGetAttribute"))? as u32;
        let pdl = pdl_wanted(&ctx);
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            ordinal,
            name,
            sm_count,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            smem_allowed: Mutex::new(HashMap::new()),
            kernel_log: KernelLog::default(),
            pdl,
            ids_landing: Mutex::new(None),
            gemv_split_k: std::env::var("NEXTN_GEMV_SPLITK").is_ok_and(|v| v == "1"),
            gemv_split_scratch: Mutex::new(None),
        }))
    }

    /// A kernel by module (the .cu file stem) and `extern "C"` name.
    pub fn function(&self, module: &'static str, name: &'static str) -> Result<CudaFunction, GpuError> {
        if let Some(f) = self.functions.lock().unwrap().get(&(module, name)) {
            return Ok(f.clone());
        }
        let m = self.module(module)?;
        let f = m.load_function(name).map_err(driver_err(format!("loading kernel {module}::{name}")))?;
        self.functions.lock().unwrap().insert((module, name), f.clone());
        Ok(f)
    }

    /// [`Gpu::function`], allowed `smem` bytes of dynamic shared memory per block. The opt-in attribute is set
    /// whenever `smem` exceeds what the kernel was allowed before, not only above 48 KiB: a kernel's static shared
    /// memory counts against the 48 KiB default too, so 40 KiB of dynamic memory beside 9 KiB of static fails to
    /// launch without it. Once per kernel and size, so a CUDA graph's capture sees no driver call.
    pub fn function_with_smem(&self, module: &'static str, name: &'static str, smem: u32) -> Result<CudaFunction, GpuError> {
        let f = self.function(module, name)?;
        let mut allowed = self.smem_allowed.lock().unwrap();
        let now = allowed.entry((module, name)).or_insert(0);
        if smem > *now {
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(driver_err(format!("{module}::{name}: allowing {smem} bytes of dynamic shared memory")))?;
            *now = smem;
        }
        Ok(f)
    }

    fn module(&self, module: &'static str) -> Result<Arc<CudaModule>, GpuError> {
        let mut modules = self.modules.lock().unwrap();
        if let Some(m) = modules.get(module) {
            return Ok(m.clone());
        }
        let (_, fatbin) = MODULES.iter().find(|(n, _)| *n == module).ok_or_else(|| GpuError::Driver {
            what: format!("module {module}"),
            msg: "no such kernels/cuda/*.cu in this build".into(),
        })?;
        let m = self
            .ctx
            .load_module(Ptx::from_binary(fatbin.to_vec()))
            .map_err(driver_err(format!("loading module {module}.cu")))?;
        modules.insert(module, m.clone());
        Ok(m)
    }

    /// Launch kernel `f` on the stream with shape `cfg`, `push` pushing its arguments; a failed launch is
    /// reported as `launching {kernel}`. Every launcher of this crate launches through here; its second
    /// half, [`Gpu::launch_untimed`], holds the crate's only `unsafe` kernel launch.
    ///
    /// Contract (why this is crate-private; each launcher keeps it and a reviewer checks it there):
    /// 1. `push` pushes exactly the parameters of the kernel's `extern "C"` signature in `kernels/cuda/*.cu`,
    ///    in order, each with the type the kernel reads: a buffer through [`KernelArgs::buf`] (or a `u64`
    ///    device address through [`KernelArgs::arg`]) for a `T*`, `i32`/`u64`/`i64`/`f32` for `int`/`unsigned
    ///    long long`/`long long`/`float`, and a `#[repr(C)]` params struct whose fields mirror the `.cu` struct
    ///    field for field;
    /// 2. the launcher's `check`s already proved that every buffer (and every raw address in a params struct)
    ///    covers the elements the kernel touches for the grid in `cfg`;
    /// 3. `cfg.shared_mem_bytes` is within what the kernel is allowed (launchers get such a kernel from
    ///    [`Gpu::function_with_smem`], which sets the opt-in attribute);
    /// 4. the kernel begins with `PDL_ENTRY()` (or, like the GEMVs, calls `pdl_wait()` in every block before it
    ///    reads another kernel's output or writes anything): with [`Gpu::pdl`] it may start before its
    ///    predecessor ends.
    ///
    /// While [`Gpu::time_kernels`] is on, the launch is bracketed by a pair of timing events (crate::timing).
    pub(crate) fn launch<'a>(
        &'a self,
        f: &'a CudaFunction,
        kernel: &'static str,
        cfg: LaunchConfig,
        push: impl FnOnce(&mut KernelArgs<'a>),
    ) -> Result<(), GpuError> {
        let start = self.timing_start()?;
        self.launch_untimed(f, kernel, cfg, push)?;
        match start {
            Some(start) => self.timing_finish(kernel, start),
            None => Ok(()),
        }
    }

    /// [`Gpu::launch`] without the timing (the timing's own hold kernel launches through here); same contract.
    pub(crate) fn launch_untimed<'a>(
        &'a self,
        f: &'a CudaFunction,
        kernel: &'static str,
        cfg: LaunchConfig,
        push: impl FnOnce(&mut KernelArgs<'a>),
    ) -> Result<(), GpuError> {
        let mut args = KernelArgs { ptrs: Vec::with_capacity(8), addrs: Vec::new(), stream: &self.stream, _borrows: PhantomData };
        push(&mut args);
        let mut pdl = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut pdl,
            numAttrs: u32::from(self.pdl),
        };
        self.ctx.bind_to_thread().map_err(launch_err(kernel))?;
        // SAFETY: the caller kept the contract above: the pushed arguments match the kernel's parameters in
        // number, order and type, and its checks proved every buffer covers what the kernel reads and writes
        // for this grid. `args` holds a pointer to each argument's value (borrowed for 'a, or boxed in
        // `args`), alive across this call, which copies them. The device buffers outlive the kernel because
        // cudarc frees a CudaSlice in order on its stream (this one) or after synchronising it. With `pdl`
        // the kernel may start before the previous one ends: every kernel calls pdl_wait() before touching
        // what another kernel writes (common.cuh).
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), args.ptrs.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(launch_err(kernel))?;
        Ok(())
    }

    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(driver_err("cuStreamSynchronize"))
    }

    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, GpuError> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(driver_err(format!("allocating {n} elements")))
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, GpuError> {
        if host.is_empty() {
            return Err(GpuError::Driver { what: "upload".into(), msg: "empty buffer".into() });
        }
        self.stream.clone_htod(host).map_err(driver_err(format!("uploading {} elements", host.len())))
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, GpuError> {
        self.stream.clone_dtoh(dev).map_err(driver_err("downloading"))
    }

    pub fn upload_f32_as_bf16(&self, host: &[f32]) -> Result<CudaSlice<bf16>, GpuError> {
        let v: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
        self.upload(&v)
    }

    /// The ids a step sends back (argmax ids, accepted counts, drafts): copied into page-locked memory, then the
    /// stream synchronised (the one host sync of a step). From pageable memory the driver would stage the copy
    /// through a bounce buffer and copy it again.
    pub fn download_ids(&self, src: &CudaView<'_, i32>) -> Result<Vec<i32>, GpuError> {
        let n = src.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut landing = self.ids_landing.lock().unwrap_or_else(|p| p.into_inner());
        if landing.as_ref().is_none_or(|p| p.len() < n) {
            *landing = None;
            // SAFETY: the memory is uninitialised until written: zeroed through the slice before anything reads it.
            let mut p = unsafe { self.ctx.alloc_pinned_with_flags::<i32>(n.next_power_of_two().max(64), 0) }
                .map_err(driver_err("cuMemHostAlloc (id downloads)"))?;
            p.as_mut_slice().map_err(driver_err("page-locked ids"))?.fill(0);
            *landing = Some(p);
        }
        let host = landing.as_mut().expect("made above").as_mut_slice().map_err(driver_err("page-locked ids"))?;
        self.stream.memcpy_dtoh(src, &mut host[..n]).map_err(driver_err(format!("downloading {n} ids")))?;
        self.synchronize()?;
        Ok(host[..n].to_vec())
    }

    pub fn download_bf16_as_f32(&self, dev: &CudaSlice<bf16>) -> Result<Vec<f32>, GpuError> {
        Ok(self.download(dev)?.into_iter().map(|x| x.to_f32()).collect())
    }
}

impl Gpu {
    /// The device's compute capability `(major, minor)` (`(0, 0)` if the driver will not say).
    pub fn compute_capability(&self) -> (i32, i32) {
        let attr = |a| self.ctx.attribute(a).unwrap_or(0);
        (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )
    }
}

/// Whether to launch with programmatic dependent launch: compute capability 9.0 or newer (older parts ignore
/// the attribute only on some drivers) and not turned off with `NEXTN_PDL=0`.
fn pdl_wanted(ctx: &CudaContext) -> bool {
    let major = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).unwrap_or(0);
    major >= 9 && std::env::var("NEXTN_PDL").map_or(true, |v| v != "0")
}

/// The raw device address of a buffer, for `#[repr(C)]` params structs. Event tracking is off (see
/// [`Gpu::new`]), so the returned guard has nothing to record.
pub fn dptr<T, S: DevicePtr<T>>(s: &S, stream: &CudaStream) -> u64 {
    let (p, _guard) = s.device_ptr(stream);
    p
}

/// Shape check helper for launchers: `Err(Shape)` naming the kernel when `ok` is false.
pub(crate) fn check(ok: bool, kernel: &'static str, msg: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok { Ok(()) } else { Err(GpuError::Shape { kernel, msg: msg() }) }
}

fn launch_err(kernel: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver { what: format!("launching {kernel}"), msg: format!("{e:?}") }
}

/// 1-D launch shape helper.
pub fn grid_1d(n: u32, block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(block).max(1), 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// For tests: the GPU, or `None` after printing why the test is skipped (no driver / no device).
pub fn test_gpu() -> Option<Arc<Gpu>> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e @ (GpuError::NoDriver | GpuError::NoDevice(_))) => {
            eprintln!("{} ({e})", crate::SKIP_NO_DEVICE);
            None
        }
        Err(e) => panic!("CUDA present but unusable: {e}"),
    }
}

/// Normalised error of a GPU result against its CPU twin: max|a - b| / max(max|b|, 1e-6).
pub fn normalised_error(gpu: &[f32], cpu: &[f32]) -> f32 {
    assert_eq!(gpu.len(), cpu.len(), "length mismatch");
    let scale = cpu.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let err = gpu.iter().zip(cpu).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    if gpu.iter().any(|v| !v.is_finite()) { f32::INFINITY } else { err / scale }
}

/// Deterministic pseudo-random values in [-scale, scale) for kernel tests (no rand dependency).
pub fn test_values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Round through bf16 (what the GPU sees when a CPU twin uploads `x`).
pub fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}
