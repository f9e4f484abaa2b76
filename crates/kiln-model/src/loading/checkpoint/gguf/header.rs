//! The GGUF container (versions 2 and 3): magic, metadata key/value pairs and tensor
//! descriptors, parsed strictly. Every read is bounds-checked against the file, every
//! tensor's data range is checked to lie inside the data section, and an unknown value
//! type or tensor type is an error naming the key or tensor.

use std::collections::BTreeMap;

use super::tensors::GgmlType;

/// File magic, `GGUF` as little-endian bytes.
const MAGIC: &[u8; 4] = b"GGUF";
/// Data section alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have.
const MAX_DIMS: u32 = 4;
/// Bound on element counts of metadata arrays and string lengths, so a corrupt length
/// cannot ask for more memory than the file could hold.
const MAX_ARRAY: u64 = 1 << 28;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values of one type.
    Array(Vec<Value>),
}

impl Value {
    /// The value's type, for messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Value::U64(_) => "unsigned integer",
            Value::I64(_) => "signed integer",
            Value::F64(_) => "float",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// `value` as a list of strings, if it is one.
pub(crate) fn as_strings(value: &Value) -> Option<Vec<String>> {
    match value {
        Value::Array(a) => a
            .iter()
            .map(|v| match v {
                Value::Str(s) => Some(s.clone()),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// One tensor's descriptor.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TensorInfo {
    /// Its name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost first (`[K, N]` for a matrix of N rows of K elements).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    /// End of the byte range (exclusive).
    pub end: usize,
}

/// A parsed GGUF header.
#[derive(Debug)]
pub(crate) struct Header {
    /// Metadata, by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
}

/// Why a GGUF file could not be parsed. The message names the key or tensor involved.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ParseError(pub String);

type Parsed<T> = Result<T, ParseError>;

/// A cursor over the file's bytes that refuses to read past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Parsed<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            ParseError(format!(
                "truncated file: {} needs {n} bytes at offset {}, the file has {}",
                what(),
                self.pos,
                self.bytes.len()
            ))
        })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Parsed<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Parsed<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Parsed<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count: u64 in v2 and v3.
    fn count(&mut self, what: &dyn Fn() -> String) -> Parsed<u64> {
        let n = self.u64(what)?;
        if n > MAX_ARRAY {
            return Err(ParseError(format!(
                "{}: length {n} is beyond any real file (at most {MAX_ARRAY})",
                what()
            )));
        }
        Ok(n)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Parsed<String> {
        let n = self.count(what)? as usize;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| ParseError(format!("{}: string is not valid UTF-8", what())))
    }

    fn value(&mut self, ty: u32, what: &dyn Fn() -> String) -> Parsed<Value> {
        Ok(match ty {
            0 => Value::U64(u64::from(self.array::<1>(what)?[0])),
            1 => Value::I64(i64::from(self.array::<1>(what)?[0] as i8)),
            2 => Value::U64(u64::from(u16::from_le_bytes(self.array(what)?))),
            3 => Value::I64(i64::from(i16::from_le_bytes(self.array(what)?))),
            4 => Value::U64(u64::from(self.u32(what)?)),
            5 => Value::I64(i64::from(i32::from_le_bytes(self.array(what)?))),
            6 => Value::F64(f64::from(f32::from_le_bytes(self.array(what)?))),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(ParseError(format!("{}: bool byte {b}, expected 0 or 1", what()))),
            },
            8 => Value::Str(self.string(what)?),
            9 => {
                let elem = self.u32(what)?;
                if elem == 9 {
                    return Err(ParseError(format!("{}: nested arrays are not supported", what())));
                }
                let n = self.count(what)?;
                let mut v = Vec::with_capacity((n as usize).min(1 << 16));
                for _ in 0..n {
                    v.push(self.value(elem, what)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            other => {
                return Err(ParseError(format!(
                    "{}: unknown metadata value type {other}: accepted types are 0 to 12",
                    what()
                )));
            }
        })
    }
}

/// Parses the header of a GGUF file held in `bytes` (the whole file).
pub(crate) fn parse(bytes: &[u8]) -> Parsed<Header> {
    let mut r = Reader { bytes, pos: 0 };
    let magic = r.array::<4>(&|| "the magic".into())?;
    if &magic != MAGIC {
        return Err(ParseError(format!("not a GGUF file: the magic is {magic:?}, expected \"GGUF\"")));
    }
    let version = r.u32(&|| "the version".into())?;
    if !(2..=3).contains(&version) {
        return Err(ParseError(format!("unsupported GGUF version {version}: accepted versions are 2 and 3")));
    }
    let n_tensors = r.count(&|| "the tensor count".into())?;
    let n_kv = r.count(&|| "the metadata count".into())?;
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = r.string(&|| format!("metadata key {i}"))?;
        let what = || format!("metadata {key}");
        let ty = r.u32(&what)?;
        let value = r.value(ty, &what)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(ParseError(format!("metadata {key}: the key occurs twice")));
        }
    }
    let mut infos = Vec::with_capacity((n_tensors as usize).min(1 << 16));
    for i in 0..n_tensors {
        let name = r.string(&|| format!("tensor {i}'s name"))?;
        let what = || format!("tensor {name}");
        let n_dims = r.u32(&what)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(ParseError(format!("tensor {name}: {n_dims} dimensions, expected 1 to {MAX_DIMS}")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = r.u64(&what)?;
            if d == 0 || d > 1 << 40 {
                return Err(ParseError(format!("tensor {name}: dimension {d} out of range (1 to 2^40)")));
            }
            dims.push(d);
        }
        let ty_code = r.u32(&what)?;
        let ty = GgmlType::from_code(ty_code).ok_or_else(|| {
            ParseError(format!(
                "tensor {name}: unknown tensor type {ty_code}: kiln knows the ggml types {}",
                GgmlType::KNOWN_NAMES
            ))
        })?;
        let offset = r.u64(&what)?;
        infos.push((name, dims, ty, offset));
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U64(a)) if *a > 0 && a.is_power_of_two() && *a <= 1 << 20 => *a,
        Some(v) => {
            return Err(ParseError(format!(
                "metadata general.alignment: {v:?} is not a power of two up to 2^20"
            )));
        }
    };
    let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
    let file_len = bytes.len() as u64;
    let mut tensors = Vec::with_capacity(infos.len());
    let mut names = std::collections::BTreeSet::new();
    for (name, dims, ty, offset) in infos {
        if !names.insert(name.clone()) {
            return Err(ParseError(format!("tensor {name}: the name occurs twice")));
        }
        if offset % alignment != 0 {
            return Err(ParseError(format!(
                "tensor {name}: data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let elements: u64 = dims.iter().product();
        let len = ty.byte_len(dims[0], elements).map_err(|m| ParseError(format!("tensor {name}: {m}")))?;
        let start = data_start.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_len => {
                tensors.push(TensorInfo { name, dims, ty, start: s as usize, end: e as usize })
            }
            _ => {
                return Err(ParseError(format!(
                    "tensor {name}: data at offset {offset} ({len} bytes from byte {data_start}) runs past \
                     the end of the file ({file_len} bytes): the file is truncated or the offset is bad"
                )));
            }
        }
    }
    Ok(Header { metadata, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    /// A v3 file with one u32 key, one string array and one F32 tensor of 4 elements.
    fn file() -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        string(&mut b, "a.count");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&7u32.to_le_bytes());
        string(&mut b, "a.list");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        string(&mut b, "x");
        string(&mut b, "yz");
        string(&mut b, "t");
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        for v in [1.0f32, 2.0, 3.0, 4.0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let bytes = file();
        let h = parse(&bytes).unwrap();
        assert_eq!(h.metadata["a.count"], Value::U64(7));
        assert_eq!(h.metadata["a.list"], Value::Array(vec![Value::Str("x".into()), Value::Str("yz".into())]));
        let t = &h.tensors[0];
        assert_eq!((t.name.as_str(), t.dims.as_slice(), t.ty), ("t", &[4u64][..], GgmlType::F32));
        assert_eq!(t.end - t.start, 16);
        assert_eq!(t.end, bytes.len());
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = file();
        for cut in 0..bytes.len() {
            let e = parse(&bytes[..cut]).unwrap_err();
            assert!(e.0.contains("truncated") || e.0.contains("runs past"), "cut at {cut}: {}", e.0);
        }
    }

    #[test]
    fn bad_magic_version_type_and_offset_are_named() {
        let mut b = file();
        b[0] = b'X';
        assert!(parse(&b).unwrap_err().0.contains("not a GGUF file"));
        let mut b = file();
        b[4] = 9;
        assert!(parse(&b).unwrap_err().0.contains("unsupported GGUF version 9"));
        let mut b = file();
        let pos = find_tensor_type(&b);
        b[pos] = 200;
        let e = parse(&b).unwrap_err().0;
        assert!(e.contains("tensor t") && e.contains("unknown tensor type 200"), "{e}");
        let mut b = file();
        b[pos + 4] = 32;
        let e = parse(&b).unwrap_err().0;
        assert!(e.contains("tensor t") && e.contains("runs past the end"), "{e}");
        let mut b = file();
        b[pos + 4] = 3;
        let e = parse(&b).unwrap_err().0;
        assert!(e.contains("tensor t") && e.contains("alignment"), "{e}");
    }

    /// Offset of tensor `t`'s type code in [`file`]'s bytes.
    fn find_tensor_type(b: &[u8]) -> usize {
        let name_at = b.windows(9).position(|w| w == [1, 0, 0, 0, 0, 0, 0, 0, b't']).unwrap();
        name_at + 9 + 4 + 8
    }
}
