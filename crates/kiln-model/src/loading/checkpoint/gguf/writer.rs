//! Writes the GGUF container (version 3): metadata key/value pairs with the value types
//! llama.cpp's loader checks, tensor descriptors, and the data section with every tensor
//! aligned to `general.alignment` (32). The tensors' bytes are produced one tensor at a
//! time by the caller, so a model is never held twice in memory.

use std::io::{self, Write};

use super::tensors::GgmlType;

/// Data section alignment (GGUF's default; not written as a key).
pub(crate) const ALIGNMENT: u64 = 32;

/// A metadata value, in the GGUF type llama.cpp expects for its key.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum MetaValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

/// GGUF value type codes.
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;

/// One tensor's descriptor: its name, dimensions innermost first, type and byte length.
#[derive(Clone, Debug)]
pub(crate) struct TensorDesc {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub bytes: u64,
}

fn ggml_code(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 8,
        other => unreachable!("the exporter never writes {other:?}"),
    }
}

fn string(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn value(w: &mut impl Write, v: &MetaValue) -> io::Result<()> {
    let array_head = |w: &mut dyn Write, ty: u32, n: usize| -> io::Result<()> {
        w.write_all(&T_ARRAY.to_le_bytes())?;
        w.write_all(&ty.to_le_bytes())?;
        w.write_all(&(n as u64).to_le_bytes())
    };
    match v {
        MetaValue::U32(x) => {
            w.write_all(&T_U32.to_le_bytes())?;
            w.write_all(&x.to_le_bytes())
        }
        MetaValue::F32(x) => {
            w.write_all(&T_F32.to_le_bytes())?;
            w.write_all(&x.to_le_bytes())
        }
        MetaValue::Bool(b) => {
            w.write_all(&T_BOOL.to_le_bytes())?;
            w.write_all(&[u8::from(*b)])
        }
        MetaValue::Str(s) => {
            w.write_all(&T_STRING.to_le_bytes())?;
            string(w, s)
        }
        MetaValue::Strs(items) => {
            array_head(w, T_STRING, items.len())?;
            items.iter().try_for_each(|s| string(w, s))
        }
        MetaValue::F32s(items) => {
            array_head(w, T_F32, items.len())?;
            items.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
        MetaValue::I32s(items) => {
            array_head(w, T_I32, items.len())?;
            items.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
    }
}

fn padding(at: u64) -> u64 {
    (ALIGNMENT - at % ALIGNMENT) % ALIGNMENT
}

/// Writes the header (metadata and descriptors) and pads to the data section; returns
/// the number of bytes written. Tensor offsets follow from the byte lengths, each
/// tensor aligned.
pub(crate) fn write_header(
    w: &mut impl Write,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorDesc],
) -> io::Result<u64> {
    let mut head = Vec::new();
    head.extend_from_slice(b"GGUF");
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, v) in metadata {
        string(&mut head, key)?;
        value(&mut head, v)?;
    }
    let mut offset = 0u64;
    for t in tensors {
        string(&mut head, &t.name)?;
        head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            head.extend_from_slice(&d.to_le_bytes());
        }
        head.extend_from_slice(&ggml_code(t.ty).to_le_bytes());
        head.extend_from_slice(&offset.to_le_bytes());
        offset += t.bytes + padding(t.bytes);
    }
    let pad = padding(head.len() as u64) as usize;
    head.resize(head.len() + pad, 0);
    w.write_all(&head)?;
    Ok(head.len() as u64)
}

/// Writes one tensor's bytes and the padding that aligns the next.
pub(crate) fn write_tensor(w: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    w.write_all(bytes)?;
    w.write_all(&vec![0u8; padding(bytes.len() as u64) as usize])
}
