//! bf16 rounding as Flex's casts round (to nearest, ties to even: `half`'s conversion).

use half::bf16;

/// `x` as the nearest bf16, read back as an f32.
#[inline(always)]
pub fn round(x: f32) -> f32 {
    widen(bf16::from_f32(x))
}

/// A bf16 as an f32 (exact: its bits are the f32's upper half, spelled out so that loops over
/// it vectorise).
#[inline(always)]
pub fn widen(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// Rounds every value of `values` to bf16 in place.
pub fn round_all(values: &mut [f32]) {
    values.iter_mut().for_each(|x| *x = round(*x));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_even_and_widening_exact() {
        // 1 + 2^-8 lies halfway between two bf16s: to the even one (1.0); 1 + 3·2^-8 rounds up.
        assert_eq!(round(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(round(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        for x in [-2.71875f32, 65504.7, 1e-30, 0.0] {
            assert_eq!(round(x), bf16::from_f32(x).to_f32());
            assert_eq!(widen(bf16::from_f32(x)), bf16::from_f32(x).to_f32());
        }
        let mut v = vec![1.0 + 3.0 * 2f32.powi(-8), -0.1];
        round_all(&mut v);
        assert_eq!(v, [round(1.0 + 3.0 * 2f32.powi(-8)), round(-0.1)]);
    }
}
