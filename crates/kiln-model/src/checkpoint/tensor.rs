//! Typed buffers from stored tensors, every byte counted in the pool under the weights
//! tag: views into the memory map where the dtype and alignment allow, copies otherwise,
//! and f16/bf16 widened to f32 where kiln computes in f32.

use std::sync::Arc;

use half::{bf16, f16};
use kiln_core::{Buffer, BufferError, MemoryPool, ScaleData, SharedBytes, Tag};
use safetensors::Dtype;

use super::safetensors::{Checkpoint, TensorRef};
use crate::error::{ModelError, Result};

/// Reads tensors of one checkpoint into buffers counted by one pool.
pub(crate) struct TensorReader<'a> {
    /// The checkpoint.
    pub ck: &'a Checkpoint,
    /// The pool.
    pub pool: &'a MemoryPool,
}

impl TensorReader<'_> {
    fn error(&self, t: &TensorRef, name: &str, message: impl std::fmt::Display) -> ModelError {
        ModelError::Checkpoint {
            path: self.ck.path(t).to_path_buf(),
            message: format!("tensor {name}: {message}"),
        }
    }

    /// A view of `t` as `T` in the mapped file, or `None` when it is not aligned for `T`
    /// (or the host is big-endian and the bytes need swapping).
    fn view<T: bytemuck::Pod>(&self, name: &str, t: &TensorRef) -> Result<Option<Buffer<T>>> {
        if cfg!(target_endian = "big") {
            return Ok(None);
        }
        let lease = self.pool.reserve(Tag::Weights, t.byte_len() as u64)?;
        let file: Arc<dyn SharedBytes> = Arc::clone(self.ck.file(t)) as Arc<dyn SharedBytes>;
        match Buffer::from_shared(file, t.start, t.end, Some(lease)) {
            Ok(b) => Ok(Some(b)),
            Err(BufferError::Misaligned { .. }) => Ok(None),
            Err(e) => Err(self.error(t, name, e)),
        }
    }

    /// Packed codes: a view when aligned, else a counted copy.
    pub(crate) fn u32s(&self, name: &str, t: &TensorRef) -> Result<Buffer<u32>> {
        if let Some(b) = self.view::<u32>(name, t)? {
            return Ok(b);
        }
        let mut v = self.pool.alloc_zeroed::<u32>(Tag::Weights, t.elements())?;
        for (o, c) in v.iter_mut().zip(self.ck.bytes(t).chunks_exact(4)) {
            *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(Buffer::from_pool(v))
    }

    /// Per-group scales or biases in their stored dtype: a view when aligned, else a copy.
    pub(crate) fn scales(&self, name: &str, t: &TensorRef) -> Result<ScaleData> {
        Ok(match t.dtype {
            Dtype::F32 => ScaleData::F32(self.f32s(name, t)?),
            Dtype::F16 => ScaleData::F16(self.halves(name, t, |c| f16::from_bits(u16::from_le_bytes(c)))?),
            Dtype::BF16 => ScaleData::Bf16(self.halves(name, t, |c| bf16::from_bits(u16::from_le_bytes(c)))?),
            other => return Err(self.error(t, name, format!("dtype {other:?}, expected F32, F16 or BF16"))),
        })
    }

    fn halves<T: bytemuck::Pod + bytemuck::Zeroable>(
        &self,
        name: &str,
        t: &TensorRef,
        decode: impl Fn([u8; 2]) -> T,
    ) -> Result<Buffer<T>> {
        if let Some(b) = self.view::<T>(name, t)? {
            return Ok(b);
        }
        let mut v = self.pool.alloc_zeroed::<T>(Tag::Weights, t.elements())?;
        for (o, c) in v.iter_mut().zip(self.ck.bytes(t).chunks_exact(2)) {
            *o = decode([c[0], c[1]]);
        }
        Ok(Buffer::from_pool(v))
    }

    /// A float tensor as f32: a view of aligned f32 data, else a counted widened copy.
    pub(crate) fn f32s(&self, name: &str, t: &TensorRef) -> Result<Buffer<f32>> {
        if t.dtype == Dtype::F32
            && let Some(b) = self.view::<f32>(name, t)?
        {
            return Ok(b);
        }
        let mut v = self.pool.alloc_zeroed::<f32>(Tag::Weights, t.elements())?;
        self.widen(name, t, 0, &mut v)?;
        Ok(Buffer::from_pool(v))
    }

    /// Widens elements `first..first + out.len()` of float tensor `t` into `out` (exact
    /// for F32, F16 and BF16).
    pub(crate) fn widen(&self, name: &str, t: &TensorRef, first: usize, out: &mut [f32]) -> Result<()> {
        let all = self.ck.bytes(t);
        match t.dtype {
            Dtype::F32 => {
                let bytes = &all[first * 4..(first + out.len()) * 4];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Dtype::F16 => {
                let bytes = &all[first * 2..(first + out.len()) * 2];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            Dtype::BF16 => {
                let bytes = &all[first * 2..(first + out.len()) * 2];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            other => return Err(self.error(t, name, format!("dtype {other:?}, expected F32, F16 or BF16"))),
        }
        Ok(())
    }
}
