//! The element type of the activations on the device (`x`, `B`, `C`, `z` and `out`): f32, or
//! bf16 ([`Bf16`]); everything else (`dt`, `A`, `D`, `dt_bias`, the states, the
//! intermediates) stays f32.
//!
//! With bf16 activations the products take bf16 operands on the tensor cores with f32
//! accumulation, rounded where mamba_ssm's kernels round them (the reference's
//! `MatmulPrecision::Bf16` is the model; check at `--precision bf16`). Where no bf16 kernel
//! serves the shape or the kernel variant ([`crate::Gpu::runs_bf16`]), the forward widens the
//! activations to f32 copies, runs the f32 kernels and rounds `out` to bf16: the same contract,
//! slower.

use std::borrow::Cow;

use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::kernels::Kernel;
use crate::params::ConvertParams;
use crate::runtime::Args;
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError};

/// A bfloat16 value as its bit pattern: what the bf16 device buffers hold.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// `v` rounded to bf16, to nearest with ties to even (as `MatmulPrecision::Bf16` and the
    /// kernels round).
    pub fn from_f32(v: f32) -> Self {
        Bf16(half::bf16::from_f32(v).to_bits())
    }

    /// The value, exactly.
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

// SAFETY: a plain 16-bit integer, laid out as the kernels' `bf16_t`.
unsafe impl DeviceRepr for Bf16 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::Bf16 {}
}

/// The element types the activations may have on the device: `f32` and [`Bf16`].
pub trait IoElement: DeviceRepr + Copy + Default + Send + Sync + 'static + sealed::Sealed {
    /// True for [`Bf16`].
    const BF16: bool;
    /// `v` in this type: `v` itself for f32 (no copy), rounded to nearest even for bf16.
    fn from_f32_slice(v: &[f32]) -> Cow<'_, [Self]>;
    /// The value as an f32, exactly.
    fn to_f32(self) -> f32;
}

impl IoElement for f32 {
    const BF16: bool = false;
    fn from_f32_slice(v: &[f32]) -> Cow<'_, [Self]> {
        Cow::Borrowed(v)
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl IoElement for Bf16 {
    const BF16: bool = true;
    fn from_f32_slice(v: &[f32]) -> Cow<'_, [Self]> {
        Cow::Owned(v.iter().map(|&x| Bf16::from_f32(x)).collect())
    }
    fn to_f32(self) -> f32 {
        Bf16::to_f32(self)
    }
}

impl Gpu {
    /// Enqueues one element-wise conversion of `n` elements between device addresses.
    fn convert(&self, kernel: Kernel, src: u64, dst: u64, n: usize) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let params = ConvertParams {
            src,
            dst,
            n: n as i64,
        };
        let grid = u32::try_from(n.div_ceil(256))
            .map_err(|_| crate::error::unsupported(format!("{n} elements to convert")))?;
        // SAFETY: `ConvertParams` is the struct of `ssd_widen_bf16` and `ssd_narrow_bf16`
        // (kernels/convert.cu); the callers pass buffers of at least `n` elements of the
        // kernel's source and destination types, and the grid covers `n` exactly (one thread
        // per element, the rest return).
        unsafe { self.launch(kernel, (grid, 1, 1), 0, &params) }
    }

    /// A new f32 buffer holding `src`'s values.
    fn widened<T: crate::IoElement>(&self, src: &CudaSlice<T>) -> Result<CudaSlice<f32>, GpuError> {
        // SAFETY: every element is written by the conversion below before anything reads it.
        let mut dst = unsafe { self.stream.alloc::<f32>(src.len()) }?;
        let mut args = Args::new(&self.stream);
        let (s, d) = (args.read(src), args.write(&mut dst));
        self.convert(Kernel::WidenBf16, s, d, src.len())?;
        drop(args);
        Ok(dst)
    }

    /// The bf16 forward where no bf16 kernel serves: widened copies of the activations (and
    /// copies of the other inputs) through the f32 kernels, `out` rounded to bf16 and the f32
    /// outputs copied into `outputs`.
    pub(crate) fn forward_widened<T: crate::IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
    ) -> Result<(), GpuError> {
        if !T::BF16 {
            return Err(GpuError::Internal(
                "f32 activations reached the bf16 widening".into(),
            ));
        }
        let copy = |s: &CudaSlice<f32>| self.stream.clone_dtod(s);
        let wide = DeviceInputs::<f32> {
            dims: inputs.dims,
            options: inputs.options,
            x: self.widened(&inputs.x)?,
            dt: copy(&inputs.dt)?,
            A: copy(&inputs.A)?,
            B: self.widened(&inputs.B)?,
            C: self.widened(&inputs.C)?,
            D: inputs.D.as_ref().map(copy).transpose()?,
            z: inputs.z.as_ref().map(|z| self.widened(z)).transpose()?,
            dt_bias: inputs.dt_bias.as_ref().map(copy).transpose()?,
            initial_states: inputs.initial_states.as_ref().map(copy).transpose()?,
            seq_idx: inputs
                .seq_idx
                .as_ref()
                .map(|s| self.stream.clone_dtod(s))
                .transpose()?,
        };
        let f = self.forward_device(&wide)?;
        let mut args = Args::new(&self.stream);
        let (s, d) = (args.read(&f.out), args.write(&mut outputs.out));
        self.convert(Kernel::NarrowBf16, s, d, f.out.len())?;
        drop(args);
        self.stream
            .memcpy_dtod(&f.final_states, &mut outputs.final_states)?;
        self.stream
            .memcpy_dtod(&f.dA_cumsum, &mut outputs.dA_cumsum)?;
        self.stream.memcpy_dtod(&f.dt, &mut outputs.dt)?;
        self.stream
            .memcpy_dtod(&f.chunk_states, &mut outputs.chunk_states)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ssd_reference::Real;

    #[test]
    fn bf16_uploads_round_as_the_reference_and_f32_is_not_copied() {
        // Ties (0x3f80_8000 lies halfway between two bf16), both signs, tiny and huge values.
        let v: Vec<f32> = [1.0f32, -2.5, 1e-30, 3e38, 0.1]
            .into_iter()
            .chain((0..1000u32).map(|k| f32::from_bits(0x3f80_0000 + k * 0x1_0123)))
            .chain([f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)])
            .collect();
        let b = Bf16::from_f32_slice(&v);
        for (x, h) in v.iter().zip(b.iter()) {
            assert_eq!(h.to_f32(), x.round_bf16(), "{x:e}");
        }
        assert!(matches!(f32::from_f32_slice(&v), Cow::Borrowed(_)));
    }
}
