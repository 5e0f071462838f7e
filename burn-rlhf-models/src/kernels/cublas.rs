//! The decoder's matrix products on NVIDIA's cuBLASLt (CUDA builds, when
//! [`super::set_cuda_matmul`] chose it): `x · weight` (with a bias in cuBLASLt's epilogue, added
//! before the one rounding) and its two gradients. Nothing is compiled per shape, and bf16 or f16
//! inputs multiply on tensor cores with f32 accumulation.
//!
//! CubeCL 0.10 does not hand out its CUDA streams, so a product is ordered with CubeCL's work
//! through the host: the client's queued work is waited for, the product runs on this module's
//! stream on the same device (CubeCL's primary context) and is waited for in turn before its
//! output goes back to CubeCL. Every operand stays alive (its handle held) until then.
//!
//! Operands are read at their strides: a row-major `[rows, cols]` view is cuBLASLt's column-major
//! `[cols, rows]`, and a transposed view (a weight read as `weightᵀ` in the backward, a tied LM
//! head) is the same matrix with the transpose flag; anything else is made contiguous first.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::result as driver;
use cudarc::driver::sys as cu;

use super::CudaMatmul;

/// The variable naming cuBLASLt's library file (pip's `nvidia-cublas` wheel ships it as
/// `site-packages/nvidia/cublas/lib/libcublasLt.so.13`), for a loader path without it.
pub const CUBLASLT_LIBRARY_VARIABLE: &str = "BURN_RLHF_CUBLASLT_LIB";

/// Bytes of scratch memory cuBLASLt may use per product (its heuristics' usual ceiling).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Whether cuBLASLt loads under a name cudarc asks for, after loading the file
/// [`CUBLASLT_LIBRARY_VARIABLE`] names (kept loaded, so the loader finds it again by its soname).
/// Checked before cudarc loads it, since cudarc panics when it cannot.
pub fn check_library() -> Result<(), String> {
    if let Some(path) = std::env::var_os(CUBLASLT_LIBRARY_VARIABLE) {
        // SAFETY: loading cuBLASLt runs only its initialisers.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| {
            format!(
                "{CUBLASLT_LIBRARY_VARIABLE}={}: {e}",
                std::path::Path::new(&path).display()
            )
        })?;
        std::mem::forget(lib);
    }
    let names = cudarc::get_lib_name_candidates("cublasLt");
    // SAFETY: as above.
    if names
        .iter()
        .any(|name| unsafe { libloading::Library::new(name) }.is_ok())
    {
        return Ok(());
    }
    Err(format!(
        "cuBLASLt is not found (the loader tried {} ...); put its folder on LD_LIBRARY_PATH or \
         name the file in {CUBLASLT_LIBRARY_VARIABLE} (pip's nvidia-cublas wheel: \
         site-packages/nvidia/cublas/lib/libcublasLt.so.N), or set \
         actor_rollout_ref.model.cuda_matmul=cubecl",
        names[..3].join(", ")
    ))
}

/// `a · b` (+ `bias` over the columns) on cuBLASLt when the engine is cuBLAS and `R` is CUDA's
/// runtime; `None` otherwise, or for dtypes it does not take (the caller runs CubeCL's).
/// Shapes: a `[m, k]`, b `[k, n]`, bias `[n]` → `[m, n]` in a's dtype, contiguous.
pub fn product<R: CubeRuntime>(
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
    bias: Option<&CubeTensor<R>>,
) -> Option<CubeTensor<R>> {
    let tf32 = match super::cuda_matmul() {
        CudaMatmul::CubeCl => return None,
        CudaMatmul::Cublas => false,
        CudaMatmul::CublasTf32 => true,
    };
    if TypeId::of::<R>() != TypeId::of::<CudaRuntime>() {
        return None;
    }
    let (a, b) = (as_cuda(a)?, as_cuda(b)?);
    let bias = match bias {
        Some(t) => Some(as_cuda(t)?),
        None => None,
    };
    let dtypes_ok = data_type(a.dtype).is_some()
        && b.dtype == a.dtype
        && bias.is_none_or(|t| t.dtype == a.dtype);
    if !dtypes_ok || a.qparams.is_some() || b.qparams.is_some() {
        return None;
    }
    let out = gemm(a, b, bias, tf32).unwrap_or_else(|e| panic!("cuBLASLt product: {e}"));
    let out: Box<dyn Any> = Box::new(out);
    Some(*out.downcast::<CubeTensor<R>>().expect("R is CudaRuntime"))
}

/// `t` as the CUDA runtime's tensor it is (`R` is `CudaRuntime`).
fn as_cuda<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<&CubeTensor<CudaRuntime>> {
    (t as &dyn Any).downcast_ref::<CubeTensor<CudaRuntime>>()
}

/// cuBLASLt's type for a dtype it multiplies.
fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        _ => None,
    }
}

/// One device's cuBLASLt handle, stream and workspace, made once in CubeCL's (primary) context.
struct DeviceState {
    context: cu::CUcontext,
    handle: sys::cublasLtHandle_t,
    stream: cu::CUstream,
    workspace: cu::CUdeviceptr,
}

// SAFETY: the handles are used under `STATES`' lock only, with the context made current first.
unsafe impl Send for DeviceState {}

static STATES: Mutex<Option<HashMap<usize, DeviceState>>> = Mutex::new(None);

impl DeviceState {
    fn new(ordinal: usize) -> Result<Self, String> {
        let e = |what: &'static str| move |err: driver::DriverError| format!("{what}: {err:?}");
        driver::init().map_err(e("cuInit"))?;
        let device = driver::device::get(ordinal as i32).map_err(e("cuDeviceGet"))?;
        // SAFETY: the primary context CubeCL's server retained for the same device.
        let context = unsafe { driver::primary_ctx::retain(device) }.map_err(e("retain"))?;
        // SAFETY: a context just retained.
        unsafe { driver::ctx::set_current(context) }.map_err(e("cuCtxSetCurrent"))?;
        let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking)
            .map_err(e("cuStreamCreate"))?;
        // SAFETY: an allocation in the current context, kept for the process.
        let workspace = unsafe { driver::malloc_sync(WORKSPACE_BYTES) }.map_err(e("cuMemAlloc"))?;
        let handle = lt::create_handle().map_err(|err| format!("cublasLtCreate: {err:?}"))?;
        Ok(Self {
            context,
            handle,
            stream,
            workspace,
        })
    }
}

/// How an operand is read: its device address, cuBLASLt's (column-major) rows, columns and
/// leading dimension, and whether the product takes its transpose.
struct Operand {
    ptr: u64,
    rows: u64,
    cols: u64,
    ld: i64,
    transpose: bool,
}

/// The column-major operand `Mᵀ` (`[cols, rows]` of the row-major `[rows, cols]` matrix `m`)
/// that computes `Cᵀ = Bᵀ·Aᵀ` for row-major `C = A·B`: a row-major `m` (unit column stride)
/// is it as stored; a transposed view (unit row stride) is the stored matrix, transposed by the
/// product. `None` for other strides.
fn operand(m: &CubeTensor<CudaRuntime>, ptr: u64) -> Option<Operand> {
    let (shape, strides) = (m.meta.shape(), m.meta.strides());
    let (rows, cols) = (shape[0] as u64, shape[1] as u64);
    let (rs, cs) = (strides[0] as i64, strides[1] as i64);
    if cs == 1 || cols == 1 {
        Some(Operand {
            ptr,
            rows: cols,
            cols: rows,
            ld: rs.max(cols as i64).max(1),
            transpose: false,
        })
    } else if rs == 1 || rows == 1 {
        Some(Operand {
            ptr,
            rows,
            cols,
            ld: cs.max(rows as i64).max(1),
            transpose: true,
        })
    } else {
        None
    }
}

/// `a · b (+ bias)` on cuBLASLt, ordered with CubeCL's work through the host (module docs).
fn gemm(
    a: &CubeTensor<CudaRuntime>,
    b: &CubeTensor<CudaRuntime>,
    bias: Option<&CubeTensor<CudaRuntime>>,
    tf32: bool,
) -> Result<CubeTensor<CudaRuntime>, String> {
    let readable = |t: &CubeTensor<CudaRuntime>| {
        let s = t.meta.strides();
        if s[0] == 1 || s[1] == 1 {
            t.clone()
        } else {
            into_contiguous(t.clone())
        }
    };
    let (a, b) = (readable(a), readable(b));
    let bias = bias.map(|t| into_contiguous(t.clone()));
    let (m, n) = (a.meta.shape()[0], b.meta.shape()[1]);
    let dtype = a.dtype;
    let out = empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        Shape::new([m, n]),
        dtype,
    );
    if m == 0 || n == 0 {
        return Ok(out);
    }
    let client = a.client.clone();
    cubecl::future::block_on(client.sync()).map_err(|e| format!("CubeCL's queue: {e:?}"))?;
    let address = super::cuda_memory::address;
    let (pa, ra) = address(&a)?;
    let (pb, rb) = address(&b)?;
    let (pd, rd) = address(&out)?;
    let pbias = match &bias {
        Some(t) => Some(address(t)?),
        None => None,
    };
    // Cᵀ [n, m] = Bᵀ [n, k] · Aᵀ [k, m], column-major.
    let lhs = operand(&b, pb).ok_or("b's strides")?;
    let rhs = operand(&a, pa).ok_or("a's strides")?;
    let ty = data_type(dtype).ok_or("dtype")?;
    let compute = match (dtype, tf32) {
        (DType::F32, true) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    let states = states.get_or_insert_with(HashMap::new);
    let ordinal = a.device.index;
    let state = match states.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(DeviceState::new(ordinal)?),
    };
    // SAFETY: every pointer is a live device allocation of CubeCL's (its handle held until the
    // stream is synchronised below) or this module's; the layouts describe them; the context is
    // the device's.
    unsafe {
        driver::ctx::set_current(state.context).map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let lt_err = |what: &'static str| move |e: lt::CublasError| format!("{what}: {e:?}");
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
            .map_err(lt_err("cublasLtMatmulDescCreate"))?;
        let set_desc = |attr, value: *const c_void, size| {
            lt::set_matmul_desc_attribute(desc, attr, value, size)
                .map_err(lt_err("cublasLtMatmulDescSetAttribute"))
        };
        // cublasOperation_t: 0 = N, 1 = T.
        let (op_a, op_b) = (lhs.transpose as i32, rhs.transpose as i32);
        set_desc(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &op_a as *const i32 as *const c_void,
            4,
        )?;
        set_desc(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            &op_b as *const i32 as *const c_void,
            4,
        )?;
        if let Some((ptr, _)) = &pbias {
            let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
            set_desc(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &epilogue as *const _ as *const c_void,
                std::mem::size_of_val(&epilogue),
            )?;
            let ptr = *ptr as *const c_void;
            set_desc(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &ptr as *const *const c_void as *const c_void,
                std::mem::size_of::<*const c_void>(),
            )?;
        }
        let layout = |o: &Operand| {
            lt::create_matrix_layout(ty, o.rows, o.cols, o.ld)
                .map_err(lt_err("cublasLtMatrixLayoutCreate"))
        };
        let (la, lb) = (layout(&lhs)?, layout(&rhs)?);
        let lout = lt::create_matrix_layout(ty, n as u64, m as u64, n as i64)
            .map_err(lt_err("cublasLtMatrixLayoutCreate"))?;
        let pref = lt::create_matmul_pref().map_err(lt_err("cublasLtMatmulPreferenceCreate"))?;
        let bytes = WORKSPACE_BYTES as u64;
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &bytes as *const u64 as *const c_void,
            8,
        )
        .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))?;
        let heuristic = lt::get_matmul_algo_heuristic(state.handle, desc, la, lb, lout, lout, pref)
            .map_err(lt_err("cublasLtMatmulAlgoGetHeuristic"))?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let run = lt::matmul(
            state.handle,
            desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            lhs.ptr as *const c_void,
            la,
            rhs.ptr as *const c_void,
            lb,
            pd as *const c_void,
            lout,
            pd as *mut c_void,
            lout,
            &heuristic.algo,
            state.workspace as *mut c_void,
            WORKSPACE_BYTES,
            state.stream as sys::cudaStream_t,
        )
        .map_err(lt_err("cublasLtMatmul"));
        let synced = driver::stream::synchronize(state.stream)
            .map_err(|e| format!("cuStreamSynchronize: {e:?}"));
        let _ = lt::destroy_matmul_pref(pref);
        let _ = lt::destroy_matrix_layout(lout);
        let _ = lt::destroy_matrix_layout(lb);
        let _ = lt::destroy_matrix_layout(la);
        let _ = lt::destroy_matmul_desc(desc);
        run?;
        synced?;
    }
    drop((ra, rb, rd, pbias));
    Ok(out)
}
