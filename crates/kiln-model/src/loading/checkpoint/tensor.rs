//! Typed buffers from stored tensors, every byte counted in the pool under the weights
//! tag: views into the memory map where the dtype and alignment allow, copies otherwise,
//! and f16/bf16 widened to f32 where kiln computes in f32.

use std::sync::Arc;

use half::{bf16, f16};
use kiln_core::{Buffer, BufferError, MemoryPool, ScaleData, SharedBytes, Tag};
use rayon::prelude::*;
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
    /// for F32, F16 and BF16), in parallel blocks.
    pub(crate) fn widen(&self, name: &str, t: &TensorRef, first: usize, out: &mut [f32]) -> Result<()> {
        let float = match t.dtype {
            Dtype::F32 => Float::F32,
            Dtype::F16 => Float::F16,
            Dtype::BF16 => Float::Bf16,
            other => return Err(self.error(t, name, format!("dtype {other:?}, expected F32, F16 or BF16"))),
        };
        let size = float.size();
        let bytes = &self.ck.bytes(t)[first * size..(first + out.len()) * size];
        out.par_chunks_mut(WIDEN_BLOCK)
            .zip(bytes.par_chunks(WIDEN_BLOCK * size))
            .for_each(|(o, b)| widen_block(float, b, o));
        Ok(())
    }
}

/// Elements one parallel task widens.
const WIDEN_BLOCK: usize = 1 << 16;

/// The float dtypes kiln widens.
#[derive(Clone, Copy)]
enum Float {
    F32,
    F16,
    Bf16,
}

impl Float {
    fn size(self) -> usize {
        match self {
            Float::F32 => 4,
            Float::F16 | Float::Bf16 => 2,
        }
    }
}

/// Decodes little-endian values into f32.
fn widen_block(float: Float, bytes: &[u8], out: &mut [f32]) {
    match float {
        Float::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Float::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        Float::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file whose data section starts 8-aligned, holding a U32 tensor at
    /// offset 0 (aligned), an F16 one at 8 (aligned) and an F32 one at 10 (misaligned).
    fn write_file(dir: &std::path::Path) {
        let mut header = String::from(
            r#"{"b":{"dtype":"U32","shape":[2],"data_offsets":[0,8]},"h":{"dtype":"F16","shape":[1],"data_offsets":[8,10]},"a":{"dtype":"F32","shape":[3],"data_offsets":[10,22]}}"#,
        );
        while (8 + header.len()) % 8 != 0 {
            header.push(' ');
        }
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        for v in [7u32, 0xdead_beef] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        bytes.extend_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        for v in [1.5f32, -2.0, 3.25] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    }

    #[test]
    fn aligned_tensors_are_views_and_misaligned_ones_counted_copies() {
        let tmp = tempfile::tempdir().unwrap();
        write_file(tmp.path());
        let ck = Checkpoint::open(tmp.path()).unwrap();
        let pool = MemoryPool::unlimited();
        let reader = TensorReader { ck: &ck, pool: &pool };
        let b = reader.u32s("b", ck.get("b").unwrap()).unwrap();
        assert!(b.is_shared() || cfg!(target_endian = "big"));
        assert_eq!(&*b, &[7, 0xdead_beef]);
        let ScaleData::F16(h) = reader.scales("h", ck.get("h").unwrap()).unwrap() else {
            panic!("F16 stays F16")
        };
        assert_eq!(h[0].to_f32(), 0.5);
        let a = reader.f32s("a", ck.get("a").unwrap()).unwrap();
        assert!(!a.is_shared(), "an f32 tensor at byte 10 cannot be viewed");
        assert_eq!(&*a, &[1.5, -2.0, 3.25]);
        assert_eq!(pool.stats().live_bytes, 8 + 2 + 12);
        drop((b, h, a));
        assert_eq!(pool.stats().live_bytes, 0);
    }

    #[test]
    fn a_dtype_kiln_cannot_widen_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        write_file(tmp.path());
        let ck = Checkpoint::open(tmp.path()).unwrap();
        let pool = MemoryPool::unlimited();
        let reader = TensorReader { ck: &ck, pool: &pool };
        let e = reader.f32s("b", ck.get("b").unwrap()).unwrap_err().to_string();
        assert!(e.contains("tensor b") && e.contains("U32") && e.contains("F32, F16 or BF16"), "{e}");
    }
}
