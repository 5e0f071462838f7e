//! Ranks on NVIDIA GPUs through NCCL (built with `cuda`; `trainer.collective_backend`): cudarc's
//! bindings, with `libnccl` loaded when the first communicator is made, so a build runs where
//! NCCL is absent until a run asks for it.
//!
//! One communicator per device: the devices of one process get theirs together
//! (`ncclCommInitAll`); ranks in several processes (the `mpi` feature) make theirs from a unique id
//! that process 0 draws and MPI hands to the others. Device tensors (gradients, parameters:
//! [`Collective::all_reduce_on_device`]) are summed where they are, NCCL reading CubeCL's memory
//! (ordered with CubeCL's queue through the host:
//! [`burn_rlhf_models::kernels::cuda_memory`]); host buffers (metrics, gathered rows) are copied
//! to the device, summed on the communicator's own stream and copied back. While it waits, the
//! rank watches the group's abort flag, so a failed peer in this process stops it instead of a
//! hang.
//!
//! Where the library is: [`super::nccl_library`].

use std::ffi::{c_char, CStr};
use std::sync::{Arc, Mutex};

use burn_rlhf_models::kernels::cuda_memory::{self, CudaTensor};
use cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError, SyncOnDrop,
};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::safe::{Comm, Id, ReduceOp};

use super::nccl_library::NCCL_LIBRARY_VARIABLE;
use super::{chunk, AbortFlag, Collective, DeviceTensor, DistributedError};

/// Whether the dynamic loader finds NCCL under one of the names cudarc asks for; the error
/// says where to point [`NCCL_LIBRARY_VARIABLE`]. Checked before cudarc loads it, since cudarc
/// panics when it cannot.
pub fn check_library() -> Result<(), String> {
    let names = cudarc::get_lib_name_candidates("nccl");
    for name in &names {
        // SAFETY: NCCL's initialisers only register the library; cudarc opens the same file.
        if unsafe { libloading::Library::new(name) }.is_ok() {
            return Ok(());
        }
    }
    Err(format!(
        "NCCL is not found (the loader tried {}); set {NCCL_LIBRARY_VARIABLE} to libnccl.so.2 \
         or its folder (pip's wheel: python3 -c \"import nvidia.nccl, os; \
         print(os.path.dirname(nvidia.nccl.__file__) + '/lib')\"), or \
         trainer.collective_backend=host",
        names[..2].join(", ")
    ))
}

/// NCCL's version as it reports it (`22703` for 2.27.3).
pub fn version() -> Result<i32, String> {
    check_library()?;
    let mut v = 0i32;
    // SAFETY: the library is loadable (checked above); the pointer is a live i32.
    unsafe { cudarc::nccl::sys::ncclGetVersion(&mut v) }
        .result()
        .map_err(|e| describe(e, None))?;
    Ok(v)
}

/// A communicator with its stream, moved to the rank's thread. NCCL lets any one thread at a
/// time use a communicator; the mutex in [`NcclRank`] sees to that.
struct OwnedComm(Comm);

// SAFETY: an NCCL communicator and a CUDA stream may be used from any thread, one at a time.
unsafe impl Send for OwnedComm {}

/// One rank's NCCL communicator.
pub struct NcclRank {
    comm: Mutex<OwnedComm>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    abort: Arc<AbortFlag>,
}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRank")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// NCCL's name and message for `error`.
fn describe(error: NcclError, comm: Option<&str>) -> String {
    // SAFETY: NCCL returns a static string for every result code.
    let text = unsafe { CStr::from_ptr(cudarc::nccl::sys::ncclGetErrorString(error.0)) };
    match comm {
        Some(detail) if !detail.is_empty() => {
            format!("{:?} ({}): {detail}", error.0, text.to_string_lossy())
        }
        _ => format!("{:?} ({})", error.0, text.to_string_lossy()),
    }
}

fn transport(rank: usize, message: String) -> DistributedError {
    DistributedError::Transport { rank, message }
}

fn driver(rank: usize, what: &str, e: DriverError) -> DistributedError {
    transport(rank, format!("CUDA {what}: {e:?}"))
}

/// A unique id for a new communicator (drawn by one process, given to every rank).
pub fn new_id() -> Result<[c_char; 128], String> {
    check_library()?;
    Id::new()
        .map(|id| *id.internal())
        .map_err(|e| format!("ncclGetUniqueId: {}", describe(e, None)))
}

impl NcclRank {
    /// One communicator per device of this process, ranks `0..ordinals.len()` in that order
    /// (`ncclCommInitAll`). NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
    pub(crate) fn for_devices(
        ordinals: &[usize],
        abort: Arc<AbortFlag>,
    ) -> Result<Vec<Self>, DistributedError> {
        check_library().map_err(|m| transport(0, m))?;
        let streams = ordinals
            .iter()
            .map(|&o| {
                let context = CudaContext::new(o).map_err(|e| driver(0, "context", e))?;
                context.new_stream().map_err(|e| driver(0, "stream", e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let comms = Comm::from_devices(streams.clone()).map_err(|e| {
            transport(
                0,
                format!(
                    "ncclCommInitAll on devices {ordinals:?}: {}",
                    describe(e, None)
                ),
            )
        })?;
        let world = ordinals.len();
        Ok(comms
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (comm, stream))| Self {
                comm: Mutex::new(OwnedComm(comm)),
                stream,
                rank,
                world,
                abort: abort.clone(),
            })
            .collect())
    }

    /// `rank` of `world` on device `ordinal`, from the id every rank was given
    /// (`ncclCommInitRank`; blocks until every rank has called it).
    #[cfg(feature = "mpi")]
    pub(crate) fn join(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: [c_char; 128],
        abort: Arc<AbortFlag>,
    ) -> Result<Self, DistributedError> {
        check_library().map_err(|m| transport(rank, m))?;
        let context = CudaContext::new(ordinal).map_err(|e| driver(rank, "context", e))?;
        let stream = context
            .new_stream()
            .map_err(|e| driver(rank, "stream", e))?;
        let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(id)).map_err(|e| {
            transport(
                rank,
                format!(
                    "ncclCommInitRank (rank {rank} of {world}, device {ordinal}): {}",
                    describe(e, None)
                ),
            )
        })?;
        Ok(Self {
            comm: Mutex::new(OwnedComm(comm)),
            stream,
            rank,
            world,
            abort,
        })
    }

    /// Runs `op` on the communicator with `buffer` on the device, waits for it (watching the
    /// abort flag) and returns the device result copied back.
    fn run<T>(
        &self,
        what: &str,
        input: &[T],
        output_len: usize,
        op: impl FnOnce(
            &Comm,
            &cudarc::driver::CudaSlice<T>,
            &mut cudarc::driver::CudaSlice<T>,
        ) -> Result<cudarc::nccl::result::NcclStatus, NcclError>,
    ) -> Result<Vec<T>, DistributedError>
    where
        T: cudarc::driver::DeviceRepr
            + cudarc::driver::ValidAsZeroBits
            + cudarc::nccl::safe::NcclType
            + Clone,
    {
        if let Some(reason) = self.abort.reason() {
            return Err(self.failed(reason));
        }
        let rank = self.rank;
        let guard = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let stream = &self.stream;
        let send = stream
            .clone_htod(input)
            .map_err(|e| driver(rank, "copy to the device", e))?;
        let mut recv = stream
            .alloc_zeros::<T>(output_len.max(1))
            .map_err(|e| driver(rank, "allocation", e))?;
        op(&guard.0, &send, &mut recv)
            .map_err(|e| transport(rank, format!("{what}: {}", describe(e, None))))?;
        self.wait()?;
        let mut out = stream
            .clone_dtoh(&recv)
            .map_err(|e| driver(rank, "copy to the host", e))?;
        out.truncate(output_len);
        Ok(out)
    }

    /// Waits for the work queued on the communicator's stream. Polled rather than waited on: a
    /// peer of this process that failed never joins the operation, and the flag it raised is the
    /// way out.
    fn wait(&self) -> Result<(), DistributedError> {
        let rank = self.rank;
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| driver(rank, "event", e))?;
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(driver(rank, "waiting", e)),
            }
            if let Some(reason) = self.abort.reason() {
                return Err(self.failed(reason));
            }
            std::thread::yield_now();
        }
    }

    /// The sum over the ranks of a CUDA tensor of f32, NCCL reading and writing CubeCL's memory
    /// on this communicator's stream. Shapes: `[n]` → `[n]`.
    fn all_reduce_cuda(&self, tensor: CudaTensor) -> Result<CudaTensor, DistributedError> {
        let rank = self.rank;
        if let Some(reason) = self.abort.reason() {
            return Err(self.failed(reason));
        }
        if tensor.dtype != burn::tensor::DType::F32 {
            return Err(transport(
                rank,
                format!(
                    "NCCL's device sums take f32 tensors, not {:?}",
                    tensor.dtype
                ),
            ));
        }
        let mut failure = None;
        let summed = cuda_memory::with_output(tensor, |at| {
            let guard = self.comm.lock().unwrap_or_else(|e| e.into_inner());
            if guard.0.ordinal() != at.ordinal {
                failure = Some(transport(
                    rank,
                    format!(
                        "a tensor on device {} for the communicator of device {}",
                        at.ordinal,
                        guard.0.ordinal()
                    ),
                ));
                return Err(String::new());
            }
            if let Err(e) = self.stream.context().bind_to_thread() {
                failure = Some(driver(rank, "binding the context", e));
                return Err(String::new());
            }
            let send = CubeMemory {
                address: at.input,
                elements: at.elements,
                stream: &self.stream,
            };
            let mut recv = CubeMemory {
                address: at.output,
                elements: at.elements,
                stream: &self.stream,
            };
            let queued = guard.0.all_reduce(&send, &mut recv, &ReduceOp::Sum);
            if let Err(e) = queued {
                failure = Some(transport(
                    rank,
                    format!("ncclAllReduce: {}", describe(e, None)),
                ));
                return Err(String::new());
            }
            // NCCL's writes are done before the output goes back to CubeCL.
            self.wait().map_err(|e| {
                failure = Some(e);
                String::new()
            })
        });
        summed.map_err(|message| failure.take().unwrap_or_else(|| transport(rank, message)))
    }

    fn failed(&self, reason: String) -> DistributedError {
        DistributedError::PeerFailed {
            rank: self.rank,
            reason,
        }
    }
}

/// CubeCL's memory as NCCL's operand: an address, its f32 element count and the communicator's
/// stream. Nothing to order on that stream: CubeCL's queue was waited for before, and the stream
/// is waited for after ([`cuda_memory::with_output`]).
struct CubeMemory<'a> {
    address: u64,
    elements: usize,
    stream: &'a Arc<CudaStream>,
}

impl DeviceSlice<f32> for CubeMemory<'_> {
    fn len(&self) -> usize {
        self.elements
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl DevicePtr<f32> for CubeMemory<'_> {
    fn device_ptr<'a>(
        &'a self,
        _stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.address, SyncOnDrop::Sync(None))
    }
}

impl DevicePtrMut<f32> for CubeMemory<'_> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.address, SyncOnDrop::Sync(None))
    }
}

impl Collective for NcclRank {
    fn sums_on_device(&self, tensor: &DeviceTensor) -> bool {
        tensor.is::<CudaTensor>()
    }

    fn all_reduce_on_device(&self, tensor: DeviceTensor) -> Result<DeviceTensor, DistributedError> {
        let tensor = tensor
            .downcast::<CudaTensor>()
            .map_err(|_| transport(self.rank, "NCCL sums CUDA tensors".into()))?;
        Ok(DeviceTensor::from_primitive(self.all_reduce_cuda(tensor)?))
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        if data.is_empty() {
            return Ok(data);
        }
        let n = data.len();
        self.run("ncclAllReduce", &data, n, |comm, send, recv| {
            comm.all_reduce(send, recv, &ReduceOp::Sum)
        })
    }

    /// NCCL gathers equal lengths: the lengths first, then every rank's values padded to the
    /// longest.
    fn all_gather(&self, mine: Vec<f32>) -> Result<Vec<Vec<f32>>, DistributedError> {
        let world = self.world;
        let lengths = self.run("ncclAllGather", &[mine.len() as u64], world, |c, s, r| {
            c.all_gather(s, r)
        })?;
        let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
        if longest == 0 {
            return Ok(vec![Vec::new(); world]);
        }
        let mut padded = mine;
        padded.resize(longest, 0.0);
        let all = self.run("ncclAllGather", &padded, longest * world, |c, s, r| {
            c.all_gather(s, r)
        })?;
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * longest..r * longest + n as usize].to_vec())
            .collect())
    }

    /// NCCL scatters equal chunks: each rank's [`chunk`] is laid out at a stride of the
    /// largest, zero-padded, and this rank keeps its own length of the result.
    fn reduce_scatter(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        let (world, n) = (self.world, data.len());
        let stride = n.div_ceil(world).max(1);
        let mut padded = vec![0.0f32; stride * world];
        for r in 0..world {
            let range = chunk(n, world, r);
            padded[r * stride..r * stride + range.len()].copy_from_slice(&data[range]);
        }
        let mine = chunk(n, world, self.rank).len();
        let mut out = self.run("ncclReduceScatter", &padded, stride, |c, s, r| {
            c.reduce_scatter(s, r, &ReduceOp::Sum)
        })?;
        out.truncate(mine);
        Ok(out)
    }

    fn broadcast(&self, root: usize, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        if data.is_empty() {
            return Ok(data);
        }
        let n = data.len();
        self.run("ncclBroadcast", &data, n, |c, s, r| {
            c.broadcast(Some(s), r, root as i32)
        })
    }

    fn abort(&self, reason: &str) {
        self.abort
            .raise(&format!("rank {} failed: {reason}", self.rank));
    }
}
