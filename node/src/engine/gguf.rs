//! A bounds-checked reader of GGUF files (versions 2 and 3) over a memory map.
//!
//! candle's own GGUF reader trusts lengths and counts in the file (a corrupt
//! string length allocates gigabytes, a bad dtype or shape can panic later),
//! so the header, metadata and tensor directory are parsed here, every length
//! checked against the bytes that remain, and every tensor's byte range
//! checked against the file before candle sees it.
//!
//! # Invariants
//! - A [`GgufFile`] only exists if every tensor's data lies inside the file and
//!   its element count is a whole number of blocks of its type.
//! - Metadata keys are unique; tensor names are unique.
//!
//! # Failure
//! [`EngineError::Gguf`] with a message naming the offending part (magic,
//! version, key, tensor) and, for truncation, the offset.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use super::EngineError;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: usize = 4;

/// A GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub dtype: GgmlDType,
    /// Shape in candle order (outermost first): a `[out, in]` matrix.
    pub shape: Vec<usize>,
    /// Absolute byte range of the data in the file.
    pub start: usize,
    pub len: usize,
}

/// A parsed GGUF file; the tensor bytes stay in the memory map.
pub struct GgufFile {
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: HashMap<String, TensorEntry>,
    data: Arc<memmap2::Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn err(msg: impl Into<String>) -> EngineError {
    EngineError::Gguf(msg.into())
}

/// Maps `path` read-only.
pub fn map_file(path: &Path) -> Result<Arc<memmap2::Mmap>, EngineError> {
    let file = std::fs::File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the map is read-only and model files are not modified while a
    // node serves them (they are identified by digest and replaced, never
    // edited in place). Every access goes through bounds-checked slices.
    #[allow(unsafe_code, reason = "memmap2 maps are unsafe to build; see SAFETY")]
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Arc::new(map))
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], EngineError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(err(format!(
                "truncated file: {what} needs {n} bytes at offset {}, file has {}",
                self.pos,
                self.buf.len()
            ))),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], EngineError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, EngineError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, EngineError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn string(&mut self, what: &str) -> Result<String, EngineError> {
        let len = self.u64(what)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.remaining())
            .ok_or_else(|| {
                err(format!(
                    "truncated file: {what} claims {len} bytes at offset {}, {} remain",
                    self.pos,
                    self.remaining()
                ))
            })?;
        let bytes = self.take(len, what)?;
        // Some converters emit invalid UTF-8 in token strings; keep them readable.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: u32, key: &str, depth: u8) -> Result<MetaValue, EngineError> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(key)?[0]),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(key)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(key)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(err(format!("metadata {key}: invalid bool byte {b}"))),
            },
            8 => MetaValue::String(self.string(key)?),
            9 => {
                if depth > 2 {
                    return Err(err(format!("metadata {key}: arrays nested too deeply")));
                }
                let elem_ty = self.u32(key)?;
                let count = self.u64(key)?;
                // Every element takes at least one byte: a count larger than
                // the rest of the file is corruption, not a reason to allocate.
                let count = usize::try_from(count)
                    .ok()
                    .filter(|&c| c <= self.remaining())
                    .ok_or_else(|| {
                        err(format!(
                            "metadata {key}: array of {count} elements does not fit in the file"
                        ))
                    })?;
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array(key)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(err(format!("metadata {key}: unknown value type {t}"))),
        })
    }
}

/// The ggml type with id `t`, if candle supports it.
fn ggml_dtype(t: u32) -> Option<GgmlDType> {
    Some(match t {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

impl GgufFile {
    /// Opens and validates `path`.
    pub fn open(path: &Path) -> Result<GgufFile, EngineError> {
        let data = map_file(path)?;
        Self::parse(data)
    }

    /// Parses and validates a mapped file.
    pub fn parse(data: Arc<memmap2::Mmap>) -> Result<GgufFile, EngineError> {
        let (metadata, tensors) = parse_bytes(&data)?;
        Ok(GgufFile {
            metadata,
            tensors,
            data,
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The raw bytes of a tensor (validated to lie inside the file).
    pub fn tensor_bytes(&self, entry: &TensorEntry) -> &[u8] {
        &self.data[entry.start..entry.start + entry.len]
    }

    /// Loads a tensor into a candle `QTensor` (copying it out of the map).
    pub fn qtensor(&self, name: &str) -> Result<QTensor, EngineError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor {
                name: name.to_string(),
            })?;
        let bytes = self.tensor_bytes(entry);
        Ok(candle_core::quantized::ggml_file::qtensor_from_ggml(
            entry.dtype,
            bytes,
            entry.shape.clone(),
            &Device::Cpu,
        )?)
    }
}

type Parsed = (HashMap<String, MetaValue>, HashMap<String, TensorEntry>);

/// A GGUF file's header read from its first bytes: metadata and where each
/// tensor's data lies (not checked against the file's length).
#[derive(Debug, Clone)]
pub struct Header {
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: HashMap<String, TensorEntry>,
    /// Bytes the header takes (where tensor data starts).
    pub data_start: u64,
}

/// Parses the header from the first bytes of a GGUF file. `Ok(None)` when
/// `prefix` ends before the tensor directory does (read more and retry);
/// an error for anything malformed.
pub fn parse_header(prefix: &[u8]) -> Result<Option<Header>, EngineError> {
    match parse_directory(prefix) {
        Ok((metadata, raw, data_start)) => {
            let mut tensors = HashMap::new();
            for e in raw {
                let start = data_start
                    .checked_add(e.offset)
                    .and_then(|s| usize::try_from(s).ok())
                    .ok_or_else(|| {
                        err(format!("tensor {}: offset {} overflows", e.name, e.offset))
                    })?;
                let entry = TensorEntry {
                    dtype: e.dtype,
                    shape: e.shape,
                    start,
                    len: e.len,
                };
                if tensors.insert(e.name.clone(), entry).is_some() {
                    return Err(err(format!("tensor {} appears twice", e.name)));
                }
            }
            Ok(Some(Header {
                metadata,
                tensors,
                data_start,
            }))
        }
        Err(Truncated::Short(_)) => Ok(None),
        Err(Truncated::Bad(e)) => Err(e),
    }
}

/// A tensor directory entry before its range is checked.
struct RawEntry {
    name: String,
    dtype: GgmlDType,
    shape: Vec<usize>,
    offset: u64,
    len: usize,
}

/// Metadata, tensor directory, and where tensor data starts.
type Directory = (HashMap<String, MetaValue>, Vec<RawEntry>, u64);

/// Why the directory could not be read: the bytes end too soon, or are wrong.
enum Truncated {
    Short(EngineError),
    Bad(EngineError),
}

impl From<EngineError> for Truncated {
    fn from(e: EngineError) -> Self {
        match &e {
            EngineError::Gguf(m) if m.starts_with("truncated file") => Truncated::Short(e),
            _ => Truncated::Bad(e),
        }
    }
}

fn parse_bytes(buf: &[u8]) -> Result<Parsed, EngineError> {
    let (metadata, raw, data_start) = parse_directory(buf).map_err(|t| match t {
        Truncated::Short(e) | Truncated::Bad(e) => e,
    })?;
    check_ranges(buf, metadata, raw, data_start)
}

/// Header, metadata and tensor directory.
fn parse_directory(buf: &[u8]) -> Result<Directory, Truncated> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.array::<4>("magic").map_err(|_| {
        Truncated::Bad(err(format!(
            "not a gguf file: {} bytes, too short for the magic",
            buf.len()
        )))
    })?;
    if &magic != MAGIC {
        return Err(Truncated::Bad(err(format!(
            "not a gguf file: bad magic {:?} (expected \"GGUF\")",
            String::from_utf8_lossy(&magic)
        ))));
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(Truncated::Bad(err(format!(
            "unsupported gguf version {version} (supported: 2, 3)"
        ))));
    }
    let tensor_count = c.u64("tensor count")?;
    let kv_count = c.u64("metadata count")?;
    // Each entry takes well over 8 bytes; anything larger is corruption (or,
    // for a prefix of the file, too few bytes so far).
    let max_entries = (buf.len() / 8) as u64;
    if tensor_count > max_entries || kv_count > max_entries {
        return Err(err(format!(
            "truncated file or corrupt header: {tensor_count} tensors and {kv_count} metadata entries cannot fit in {} bytes",
            buf.len()
        ))
        .into());
    }
    let mut metadata = HashMap::new();
    for _ in 0..kv_count {
        let key = c.string("metadata key")?;
        let ty = c.u32(&key)?;
        let value = c.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(err(format!("metadata key {key} appears twice")).into());
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return Err(err(format!("general.alignment {v:?} is not a power of two")).into()),
        },
    };

    let mut raw = Vec::new();
    for _ in 0..tensor_count {
        let name = c.string("tensor name")?;
        let n_dims = c.u32(&name)? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(err(format!(
                "tensor {name}: {n_dims} dimensions (1 to 4 allowed)"
            ))
            .into());
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = c.u64(&name)?;
            dims.push(
                usize::try_from(d)
                    .map_err(|_| err(format!("tensor {name}: dimension {d} too large")))?,
            );
        }
        let ty = c.u32(&name)?;
        let dtype = ggml_dtype(ty)
            .ok_or_else(|| err(format!("tensor {name}: unsupported ggml type {ty}")))?;
        let offset = c.u64(&name)?;
        let elems = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| err(format!("tensor {name}: shape {dims:?} overflows")))?;
        let block = dtype.block_size();
        if elems == 0 || dims[0] % block != 0 {
            return Err(err(format!(
                "tensor {name}: shape {dims:?} is not a whole number of {dtype:?} blocks of {block}"
            ))
            .into());
        }
        let len = (elems / block)
            .checked_mul(dtype.type_size())
            .ok_or_else(|| err(format!("tensor {name}: size overflows")))?;
        // GGUF stores dimensions innermost first; candle wants outermost first.
        dims.reverse();
        raw.push(RawEntry {
            name,
            dtype,
            shape: dims,
            offset,
            len,
        });
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    // Offsets are relative to the aligned data start.
    if let Some(e) = raw.iter().find(|e| e.offset % alignment != 0) {
        return Err(err(format!(
            "tensor {}: offset {} is not aligned to {alignment}",
            e.name, e.offset
        ))
        .into());
    }
    Ok((metadata, raw, data_start))
}

/// Checks every tensor's data lies inside `buf`.
fn check_ranges(
    buf: &[u8],
    metadata: HashMap<String, MetaValue>,
    raw: Vec<RawEntry>,
    data_start: u64,
) -> Result<Parsed, EngineError> {
    let mut tensors = HashMap::new();
    for e in raw {
        let start = data_start
            .checked_add(e.offset)
            .and_then(|s| usize::try_from(s).ok());
        let end = start.and_then(|s| s.checked_add(e.len));
        let (Some(start), Some(end)) = (start, end) else {
            return Err(err(format!(
                "tensor {}: offset {} overflows",
                e.name, e.offset
            )));
        };
        if end > buf.len() {
            return Err(err(format!(
                "truncated file: tensor {} needs bytes {start}..{end}, file has {}",
                e.name,
                buf.len()
            )));
        }
        // candle reads the blocks in place as f32/f16 structs.
        if start % 4 != 0 {
            return Err(err(format!(
                "tensor {}: data at {start} is not 4-byte aligned",
                e.name
            )));
        }
        let entry = TensorEntry {
            dtype: e.dtype,
            shape: e.shape,
            start,
            len: e.len,
        };
        if tensors.insert(e.name.clone(), entry).is_some() {
            return Err(err(format!("tensor {} appears twice", e.name)));
        }
    }
    Ok((metadata, tensors))
}
