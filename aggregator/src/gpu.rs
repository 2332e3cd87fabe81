//! The CUDA path: a batched, double-buffered weighted-sum reduction on one GPU, and NCCL
//! all-reduce of partial sums across the GPUs of an aggregator group.
//!
//! Everything is loaded at run time (cudarc's dynamic loading): the crate builds and the CPU
//! path runs on machines without CUDA. [`probe`] answers "is there a usable GPU?" with a
//! specific [`GpuError`] instead of the panic cudarc gives when its libraries are missing.
//! The kernel ships as hand-written PTX (`fold_batch.ptx`), which the driver compiles for the
//! GPU it finds.
#![allow(unsafe_code)] // Kernel launches and pinned host memory are FFI; each use says why it holds.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nccl::{Comm, Id, ReduceOp};

pub use crate::error::GpuError;
use crate::error::ReduceError;
use crate::reduce::{Reducer, Sums};

const KERNEL_PTX: &str = include_str!("fold_batch.ptx");

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// GPUs the driver reports.
    pub devices: usize,
    /// Name of GPU 0.
    pub name: String,
    /// Compute capability of GPU 0.
    pub compute_capability: (i32, i32),
    /// Its memory, bytes.
    pub memory_bytes: usize,
}

/// Whether a CUDA driver and at least one GPU are present; never panics.
pub fn probe() -> Result<GpuInfo, GpuError> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::NoDriver);
    }
    let devices = CudaContext::device_count().map_err(|_| GpuError::NoDevice)?;
    if devices < 1 {
        return Err(GpuError::NoDevice);
    }
    let ctx = CudaContext::new(0)?;
    Ok(GpuInfo {
        devices: devices as usize,
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        memory_bytes: ctx.total_mem()?,
    })
}

/// Whether the NCCL library can be loaded; never panics.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// One staging set: a batch of updates in pinned host memory, their device copy, weights.
struct Staging {
    host: PinnedHostSlice<f32>,
    device: CudaSlice<f32>,
    weights: CudaSlice<f64>,
    filled: usize,
    host_weights: PinnedHostSlice<f64>,
}

/// The CUDA engine: sums live on the GPU; updates are staged in pinned memory in batches,
/// copied on a copy stream while the previous batch is reduced on the compute stream.
pub struct CudaReducer {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    kernel: CudaFunction,
    hi: CudaSlice<f64>,
    lo: CudaSlice<f64>,
    staging: [Staging; 2],
    current: usize,
    n: usize,
    batch: usize,
    grid: u32,
}

// SAFETY: the context, streams and buffers are only used from the thread that owns the
// reducer at a time (the reducer is moved between threads, never shared); cudarc binds the
// context to the calling thread on every call.
unsafe impl Send for CudaReducer {}

impl CudaReducer {
    /// A reducer for `n_params` parameters on GPU `device`, `batch` updates per transfer.
    pub fn new(device: usize, n_params: usize, batch: usize) -> Result<Self, GpuError> {
        probe()?;
        let ctx = CudaContext::new(device)?;
        let compute = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(KERNEL_PTX))?;
        let kernel = module.load_function("fold_batch")?;
        let batch = batch.max(1);
        let staging = |_| -> Result<Staging, GpuError> {
            Ok(Staging {
                // SAFETY: pinned memory starts uninitialized; only the first `filled` updates
                // (each written whole before use) are ever copied out.
                host: unsafe { ctx.alloc_pinned::<f32>(batch * n_params.max(1))? },
                device: compute.alloc_zeros::<f32>(batch * n_params.max(1))?,
                weights: compute.alloc_zeros::<f64>(batch)?,
                filled: 0,
                // SAFETY: as above; only the first `filled` weights are read by the kernel.
                host_weights: unsafe { ctx.alloc_pinned::<f64>(batch)? },
            })
        };
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )?
            .max(1) as u32;
        let blocks_needed = n_params.div_ceil(256).max(1) as u32;
        Ok(CudaReducer {
            hi: compute.alloc_zeros::<f64>(n_params.max(1))?,
            lo: compute.alloc_zeros::<f64>(n_params.max(1))?,
            staging: [staging(0)?, staging(1)?],
            ctx,
            compute,
            copy,
            kernel,
            current: 0,
            n: n_params,
            batch,
            grid: blocks_needed.min(sms * 16),
        })
    }

    /// The GPU's name.
    pub fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_default()
    }

    /// Copies the current batch to the GPU and launches its reduction; switches batches.
    fn launch_current(&mut self) -> Result<(), GpuError> {
        let s = &mut self.staging[self.current];
        if s.filled == 0 {
            return Ok(());
        }
        // The copy stream waits for the kernel that last read this device buffer (cudarc's
        // event tracking), then the kernel waits for the copy. Both sources are pinned, so
        // the copies are asynchronous: the host goes on staging the next batch. (A partial
        // last batch copies its whole buffer; only its first `filled` updates are read.)
        self.copy.memcpy_htod(&s.host, &mut s.device)?;
        self.copy.memcpy_htod(&s.host_weights, &mut s.weights)?;
        let (k, n) = (s.filled as u32, self.n as u64);
        let cfg = LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.compute.launch_builder(&self.kernel);
        launch.arg(&mut self.hi).arg(&mut self.lo).arg(&s.device).arg(&s.weights).arg(&k).arg(&n);
        // SAFETY: the arguments match fold_batch's signature (two f64 buffers of n, an f32
        // buffer of at least k × n, an f64 buffer of at least k, k, n); the kernel stays in
        // bounds by its loop conditions.
        unsafe { launch.launch(cfg)? };
        s.filled = 0;
        self.current ^= 1;
        Ok(())
    }

    /// Copies `bytes` of little-endian f32s into slot `slot` of the current batch.
    fn stage(&mut self, weight: u64, delta_le: &[u8]) -> Result<(), GpuError> {
        let n = self.n;
        let s = &mut self.staging[self.current];
        // Waits for the last copy out of this pinned buffer to finish before writing it.
        let host = s.host.as_mut_slice()?;
        let dst = &mut host[s.filled * n..(s.filled + 1) * n];
        for (d, c) in dst.iter_mut().zip(delta_le.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        s.host_weights.as_mut_slice()?[s.filled] = weight as f64;
        s.filled += 1;
        Ok(())
    }
}

impl Reducer for CudaReducer {
    fn engine(&self) -> &'static str {
        "cuda"
    }

    fn n_params(&self) -> usize {
        self.n
    }

    fn push(&mut self, weight: u64, delta_le: Arc<Vec<u8>>) -> Result<(), ReduceError> {
        let expected = self.n * 4;
        if delta_le.len() != expected {
            return Err(ReduceError::Length { expected, got: delta_le.len() });
        }
        self.stage(weight, &delta_le)?;
        if self.staging[self.current].filled >= self.batch {
            self.launch_current()?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<Sums, ReduceError> {
        self.launch_current()?;
        let mut hi = self.compute.clone_dtoh(&self.hi).map_err(GpuError::from)?;
        let mut lo = self.compute.clone_dtoh(&self.lo).map_err(GpuError::from)?;
        self.compute.synchronize().map_err(GpuError::from)?;
        hi.truncate(self.n);
        lo.truncate(self.n);
        self.compute.memset_zeros(&mut self.hi).map_err(GpuError::from)?;
        self.compute.memset_zeros(&mut self.lo).map_err(GpuError::from)?;
        Ok((hi, lo))
    }
}

/// An NCCL communicator over the GPUs of an aggregator group (one process per GPU), on a
/// stream of its own.
pub struct NcclGroup {
    // Field order is drop order: the communicator is aborted before the buffers of a
    // collective that timed out are freed (freeing them waits for that collective otherwise).
    comm: Comm,
    stream: Arc<CudaStream>,
    stranded: Vec<CudaSlice<f64>>,
}

// SAFETY: as for CudaReducer, the communicator is used by one thread at a time.
unsafe impl Send for NcclGroup {}

impl NcclGroup {
    /// A fresh unique id (the group leader makes it and publishes it through the coordinator).
    pub fn unique_id() -> Result<Vec<u8>, GpuError> {
        if !nccl_present() {
            return Err(GpuError::NoNccl);
        }
        let id = Id::new()?;
        Ok(id.internal().iter().map(|c| *c as u8).collect())
    }

    /// Joins the group `id` as `rank` of `world_size` on GPU `device`. Blocks until every
    /// member has joined (or NCCL's bootstrap gives up), so call it off the async runtime.
    pub fn join(
        device: usize,
        rank: usize,
        world_size: usize,
        id: &[u8],
    ) -> Result<Self, GpuError> {
        if id.len() != 128 {
            return Err(GpuError::BadNcclId(id.len()));
        }
        probe()?;
        if !nccl_present() {
            return Err(GpuError::NoNccl);
        }
        let internal: [std::ffi::c_char; 128] = std::array::from_fn(|i| id[i] as std::ffi::c_char);
        let stream = CudaContext::new(device)?.new_stream()?;
        let comm = Comm::from_rank(stream.clone(), rank, world_size, Id::uninit(internal))?;
        Ok(NcclGroup { comm, stream, stranded: vec![] })
    }

    /// Sums `hi` and `lo` (a member's partial sums, on the host) across the group: one
    /// all-reduce of both, copied in and, when `want_result`, out again. Waits for the
    /// collective at most until `deadline`; after [`GpuError::CollectiveTimeout`] the group
    /// is broken: drop it (that aborts the communicator) and join a new one.
    pub fn all_reduce_sums(
        &mut self,
        hi: &[f64],
        lo: &[f64],
        want_result: bool,
        deadline: std::time::Instant,
    ) -> Result<Option<Sums>, GpuError> {
        let n = hi.len();
        if lo.len() != n {
            return Err(GpuError::Nccl(format!("high parts {n}, low parts {}", lo.len())));
        }
        let both: Vec<f64> = hi.iter().chain(lo).copied().collect();
        let mut buffer = self.stream.clone_htod(&both)?;
        drop(both);
        self.comm.all_reduce_in_place(&mut buffer, &ReduceOp::Sum)?;
        let done = self.stream.record_event(None)?;
        // Polled, not synchronized: a member that died mid-collective would block a
        // synchronize forever.
        while !done.try_is_complete()? {
            if std::time::Instant::now() >= deadline {
                self.stranded.push(buffer);
                return Err(GpuError::CollectiveTimeout);
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        if !want_result {
            return Ok(None);
        }
        let mut sums = self.stream.clone_dtoh(&buffer)?;
        self.stream.synchronize()?;
        let lo = sums.split_off(n);
        Ok(Some((sums, lo)))
    }

    /// Members of the group.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Drops the group, aborting its communicator (cudarc's drop aborts, and panics if the
    /// abort fails: that panic stops here).
    pub fn abort(self) {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(self))).is_err() {
            tracing::error!("aborting the NCCL communicator failed");
        }
    }
}

/// Figures of the GPU path alone, for the benchmark (`cargo bench -p starling-aggregator`).
#[derive(Debug, Clone, Copy)]
pub struct KernelFigures {
    /// Update bytes reduced per second by the kernel alone (updates already on the GPU).
    pub update_gbps: f64,
    /// All bytes the kernel moves per second (updates read, sums read and written).
    pub memory_gbps: f64,
    /// Pinned host-to-device copy, bytes per second.
    pub h2d_gbps: f64,
}

/// Times the kernel on `k` updates of `n` parameters already on GPU 0 (`reps` launches), and a
/// pinned host-to-device copy of the same batch.
pub fn measure_kernel(n: usize, k: usize, reps: usize) -> Result<KernelFigures, GpuError> {
    let mut r = CudaReducer::new(0, n, k)?;
    for slot in 0..k {
        let bytes: Vec<u8> = (0..n).flat_map(|i| ((i % 97) as f32 * 1e-3).to_le_bytes()).collect();
        r.stage(1 + slot as u64, &bytes)?;
    }
    let s = &mut r.staging[0];
    r.copy.memcpy_htod(&s.host, &mut s.device)?;
    r.copy.memcpy_htod(&s.host_weights, &mut s.weights)?;
    r.copy.synchronize()?;
    // Host-to-device alone.
    let started = std::time::Instant::now();
    for _ in 0..reps {
        r.copy.memcpy_htod(&s.host, &mut s.device)?;
    }
    r.copy.synchronize()?;
    let h2d_secs = started.elapsed().as_secs_f64();
    let (kk, nn) = (k as u32, n as u64);
    let cfg =
        LaunchConfig { grid_dim: (r.grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let launch = |r: &mut CudaReducer| -> Result<(), GpuError> {
        let s = &r.staging[0];
        let mut launch = r.compute.launch_builder(&r.kernel);
        launch.arg(&mut r.hi).arg(&mut r.lo).arg(&s.device).arg(&s.weights).arg(&kk).arg(&nn);
        // SAFETY: as in `launch_current`.
        unsafe { launch.launch(cfg)? };
        Ok(())
    };
    launch(&mut r)?; // warm-up (and the JIT compile)
    r.compute.synchronize()?;
    let started = std::time::Instant::now();
    for _ in 0..reps {
        launch(&mut r)?;
    }
    r.compute.synchronize()?;
    let secs = started.elapsed().as_secs_f64();
    let update_bytes = (k * n * 4 * reps) as f64;
    let moved = update_bytes + (n * 32 * reps) as f64;
    Ok(KernelFigures {
        update_gbps: update_bytes / secs / 1e9,
        memory_gbps: moved / secs / 1e9,
        h2d_gbps: (k * n * 4 * reps) as f64 / h2d_secs / 1e9,
    })
}

/// What [`measure_all_reduce`] measured.
#[derive(Debug, Clone, Copy)]
pub struct AllReduceFigures {
    /// GPUs in the communicator (every visible one).
    pub gpus: usize,
    /// Buffer bytes all-reduced per second (NCCL's "algorithm bandwidth").
    pub algorithm_gbps: f64,
    /// Algorithm bandwidth × 2(g − 1)/g: what each GPU's links carry (NCCL's "bus
    /// bandwidth", comparable across GPU counts; zero for one GPU).
    pub bus_gbps: f64,
}

/// Times an NCCL all-reduce of `n` f64 across every visible GPU (one communicator per GPU in
/// this process, launched as one NCCL group), `reps` times.
pub fn measure_all_reduce(n: usize, reps: usize) -> Result<AllReduceFigures, GpuError> {
    probe()?;
    if !nccl_present() {
        return Err(GpuError::NoNccl);
    }
    let gpus = CudaContext::device_count()?.max(1) as usize;
    let streams = (0..gpus)
        .map(|d| Ok(CudaContext::new(d)?.new_stream()?))
        .collect::<Result<Vec<_>, GpuError>>()?;
    let comms = Comm::from_devices(streams.clone())?;
    let mut buffers =
        streams.iter().map(|s| s.alloc_zeros::<f64>(n)).collect::<Result<Vec<_>, _>>()?;
    let mut all_reduce = || -> Result<(), GpuError> {
        cudarc::nccl::result::group_start()?;
        for (comm, buffer) in comms.iter().zip(buffers.iter_mut()) {
            comm.all_reduce_in_place(buffer, &ReduceOp::Sum)?;
        }
        cudarc::nccl::result::group_end()?;
        Ok(())
    };
    let sync = |streams: &[Arc<CudaStream>]| -> Result<(), GpuError> {
        streams.iter().try_for_each(|s| s.synchronize().map_err(GpuError::from))
    };
    all_reduce()?; // warm-up: NCCL sets up its channels on the first collective
    sync(&streams)?;
    let started = std::time::Instant::now();
    for _ in 0..reps {
        all_reduce()?;
    }
    sync(&streams)?;
    let algorithm_gbps = (n * 8 * reps) as f64 / started.elapsed().as_secs_f64() / 1e9;
    let g = gpus as f64;
    Ok(AllReduceFigures { gpus, algorithm_gbps, bus_gbps: algorithm_gbps * 2.0 * (g - 1.0) / g })
}
