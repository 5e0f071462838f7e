//! bf16 tensors on the f32 kernels: the inputs widened to f32 (exact: a bf16 is the upper half
//! of an f32), the outputs rounded back to bf16 once, to nearest even (as Flex's casts round).
//! The results keep the model's dtype where the references would round, and a row's numbers
//! stay independent of the other rows of its batch in bf16 too: the batch-invariant f32 kernels
//! compute them (Flex's own bf16 product is an f32 gemm call whose blocking follows the shape).
//!
//! The paged pool keeps bf16 keys and values (half the bytes); its kernels read them through
//! [`Elem`], widening each element as they load it.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};
use half::bf16;
use rayon::prelude::*;

/// Elements per conversion task.
const CHUNK: usize = 1 << 14;

/// Where HF's half-precision arithmetic rounds an intermediate result (a product before the
/// next one, a norm's normalised value before its weight), the f32 kernels round it too, so a
/// bf16 result is HF's: [`Exact`] for f32 tensors (nothing rounded), [`ToBf16`] for tensors
/// widened from bf16.
pub(super) trait Rounding: Copy + Send + Sync + 'static {
    /// `x` as the nearest value of the dtype (nearest even on ties, as Flex's casts round).
    fn round(x: f32) -> f32;
}

/// f32 arithmetic: nothing rounded.
#[derive(Debug, Clone, Copy)]
pub(super) struct Exact;

impl Rounding for Exact {
    #[inline(always)]
    fn round(x: f32) -> f32 {
        x
    }
}

/// bf16 arithmetic.
#[derive(Debug, Clone, Copy)]
pub(super) struct ToBf16;

impl Rounding for ToBf16 {
    #[inline(always)]
    fn round(x: f32) -> f32 {
        burn_rlhf_numerics::bf16::round(x)
    }
}

/// An element the pool kernels read: f32 or bf16.
pub(super) trait Elem: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    /// The value as an f32 (exact).
    fn f32(self) -> f32;
    /// The tensor's storage as elements of this type.
    fn storage(t: &FlexTensor) -> &[Self];
    /// A uniquely owned tensor's storage, writable.
    fn storage_mut(t: &mut FlexTensor) -> Option<&mut [Self]>;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    fn storage(t: &FlexTensor) -> &[Self] {
        t.storage::<f32>()
    }
    fn storage_mut(t: &mut FlexTensor) -> Option<&mut [Self]> {
        t.try_storage_mut::<f32>()
    }
}

impl Elem for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn f32(self) -> f32 {
        burn_rlhf_numerics::bf16::widen(self)
    }
    fn storage(t: &FlexTensor) -> &[Self] {
        t.storage::<bf16>()
    }
    fn storage_mut(t: &mut FlexTensor) -> Option<&mut [Self]> {
        t.try_storage_mut::<bf16>()
    }
}

/// f32 copies of `inputs` when one of them is bf16 and the others bf16 or f32 (f32 ones pass
/// as they are), the layouts kept; `None` otherwise (all f32: the kernels take them directly;
/// another dtype: the references).
pub(super) fn widened<const N: usize>(inputs: [&FlexTensor; N]) -> Option<[FlexTensor; N]> {
    let dtypes = inputs.map(FlexTensor::dtype);
    if !dtypes.contains(&DType::BF16)
        || dtypes
            .iter()
            .any(|d| !matches!(d, DType::BF16 | DType::F32))
    {
        return None;
    }
    Some(inputs.map(|t| match t.dtype() {
        DType::BF16 => widen(t),
        _ => t.clone(),
    }))
}

/// A bf16 tensor as f32, in its own layout when its storage holds exactly its elements (a
/// transposed or permuted view converts without a copy first), else made contiguous.
fn widen(t: &FlexTensor) -> FlexTensor {
    let n = t.layout().num_elements();
    let whole = t.layout().start_offset() == 0
        && t.bytes().len() == n * 2
        && t.layout().strides().iter().all(|&s| s >= 0);
    let t = if whole { t.clone() } else { t.to_contiguous() };
    let src = t.storage::<bf16>();
    let mut out = Vec::with_capacity(src.len());
    out.par_extend(src.par_iter().with_min_len(CHUNK).map(|x| x.f32()));
    let len = out.len();
    FlexTensor::from_data(TensorData::new(out, [len])).with_layout(t.layout().clone())
}

/// `t` (f32) rounded to `dtype` when that is bf16; as it is otherwise.
pub(super) fn narrow(t: FlexTensor, dtype: DType) -> FlexTensor {
    if dtype != DType::BF16 || t.dtype() != DType::F32 {
        return t;
    }
    let t = t.to_contiguous();
    let shape = t.layout().shape().clone();
    let src = t.storage::<f32>();
    let mut out = Vec::with_capacity(src.len());
    out.par_extend(
        src.par_iter()
            .with_min_len(CHUNK)
            .map(|&x| bf16::from_f32(x)),
    );
    FlexTensor::from_data(TensorData::new(out, shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_tensor(values: &[f32], shape: [usize; 2]) -> FlexTensor {
        let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
        FlexTensor::from_data(TensorData::new(v, shape))
    }

    #[test]
    fn widening_is_exact_and_keeps_a_views_layout() {
        let values: Vec<f32> = (0..12).map(|i| (i as f32 - 5.3) * 1.37e-3).collect();
        let t = bf16_tensor(&values, [3, 4]).transpose(0, 1);
        let [w] = widened([&t]).expect("bf16 widens");
        assert_eq!(w.layout().shape().clone(), t.layout().shape().clone());
        assert_eq!(
            w.layout().strides(),
            t.layout().strides(),
            "a view converts in place"
        );
        let want: Vec<f32> = t.clone().into_data().convert::<f32>().to_vec().unwrap();
        let got: Vec<f32> = w.into_data().to_vec().unwrap();
        assert_eq!(got, want);
        let f = FlexTensor::from_data(TensorData::new(vec![1.0f32; 4], [2, 2]));
        assert!(
            widened([&f]).is_none(),
            "all f32: the kernels take it directly"
        );
    }

    #[test]
    fn narrowing_rounds_to_nearest_even_as_flexs_cast() {
        // 1 + 2^-8 lies halfway between two bf16s: to the even one (1.0); 1 + 3·2^-8 rounds up.
        let values = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -2.71875,
            65504.7,
        ];
        let t = FlexTensor::from_data(TensorData::new(values.to_vec(), [4]));
        let got: Vec<bf16> = narrow(t, DType::BF16).into_data().to_vec().unwrap();
        let want: Vec<bf16> = values.iter().map(|&x| bf16::from_f64(x as f64)).collect();
        assert_eq!(got, want);
        assert_eq!(got[0], bf16::ONE);
    }
}
