//! `qmv`, and `qmv_wide`'s eight-row tiles, on an x86 path this CPU may lack, prepared for
//! an x86 emulator to run.
//!
//! The AVX-512 paths differ from AVX2 only in integer dots: `qmv`'s row loop and the
//! eight-row tiles of 4-bit weights (see `x86::avx512`). An
//! [`EmulatedQmv`] quantizes the activation row natively (AVX2) and leaves the row loop
//! for one entry, [`EmulatedQmv::entry`], a C-ABI function of one pointer that computes
//! every output row without allocating, locking or calling the system: an emulator given
//! a copy of this process's memory can call it on a CPU model with AVX-512 and hand the
//! outputs back (`crates/kiln-core/tests/avx512_emulated.rs` does, under Bochs). On a
//! CPU with the path, [`EmulatedQmv::run_native`] runs the same entry directly.
//! [`EmulatedTile`] does the same for one tile of 1 to 8 activation rows against every
//! weight row, the loops `qmv_wide` and `qmm` run for such tiles, and
//! [`EmulatedLaneRows`] for the lane-row kernel of `qmv_wide` and `qmm` on AVX-512 (a
//! weight row per 32-bit lane).

use std::marker::PhantomData;

use super::tile::XTile;
use super::{Isa, check_shapes, integer_codes, x86};
use crate::act_precision::ActScheme;
use crate::matrix::QuantizedMatrix;

/// The accessors every prepared call shares: the entry's address and argument, the
/// outputs' bytes, the outputs as left here, and a native run of the entry.
macro_rules! call_accessors {
    ($ty:ident, $call:ty, $entry:ident, $out_bytes_doc:literal, $out_doc:literal) => {
        impl<'a> $ty<'a> {
            #[doc = concat!("The address of the entry: `extern \"C\" fn(arg)`, see [`", stringify!($ty), "::arg`].")]
            pub fn entry() -> usize {
                $entry as *const () as usize
            }

            /// The entry's one argument.
            pub fn arg(&self) -> usize {
                &*self.call as *const $call as usize
            }

            #[doc = $out_bytes_doc]
            pub fn out_bytes(&self) -> (usize, usize) {
                (self.out.as_ptr() as usize, 4 * self.out.len())
            }

            #[doc = $out_doc]
            pub fn out(&self) -> &[f32] {
                &self.out
            }

            /// Runs the entry on this CPU, leaving the outputs in `self.out`.
            fn run_entry(&mut self) {
                let isa = self.isa;
                assert!(
                    isa.is_available(),
                    concat!(stringify!($ty), "::run_native: this CPU lacks {}"),
                    isa.as_str()
                );
                // SAFETY: the call's pointers are this struct's own, alive; the path's
                // features were confirmed above.
                unsafe { $entry(&*self.call) };
            }
        }
    };
}

/// What the entry reads: plain pointers, laid out for C.
#[repr(C)]
struct Call {
    dots: x86::Dots,
    w: *const QuantizedMatrix,
    xt: *const XTile,
    out: *mut f32,
    n: usize,
}

/// One `qmv` (`y = W x`) prepared for its row loop to run on `isa`.
pub struct EmulatedQmv<'a> {
    isa: Isa,
    call: Box<Call>,
    _xt: Box<XTile>,
    out: Vec<f32>,
    _w: PhantomData<&'a QuantizedMatrix>,
}

impl<'a> EmulatedQmv<'a> {
    /// Quantizes `x` for `w` under `scheme` (natively, with AVX2) and allocates the output.
    ///
    /// # Panics
    /// When this CPU lacks AVX2, `isa` is not an x86 path, `w`'s width has no integer
    /// codes under `scheme`, or the shapes do not match.
    pub fn new(isa: Isa, scheme: ActScheme, x: &[f32], w: &'a QuantizedMatrix) -> EmulatedQmv<'a> {
        let mut out = vec![0.0f32; w.n()];
        check_shapes("EmulatedQmv", x, 1, w, &out);
        check_prepare("EmulatedQmv", isa);
        let dots = x86::Dots::of(isa);
        let codes = integer_codes(w, scheme).unwrap_or_else(|| {
            panic!("EmulatedQmv: {}-bit weights have no integer codes under {scheme:?}", w.spec().bits())
        });
        // SAFETY: AVX2, FMA and F16C were confirmed above.
        let xt = Box::new(unsafe { x86::qmv_vector(dots, x, w.spec().group_size(), codes) });
        let call = Box::new(Call { dots, w, xt: &*xt, out: out.as_mut_ptr(), n: w.n() });
        EmulatedQmv { isa, call, _xt: xt, out, _w: PhantomData }
    }

    /// Runs the entry on this CPU.
    ///
    /// # Panics
    /// When this CPU lacks the path it was prepared for.
    pub fn run_native(&mut self) -> &[f32] {
        self.run_entry();
        &self.out
    }
}

call_accessors!(
    EmulatedQmv,
    Call,
    qmv_rows_entry,
    "Where the outputs lie, and how many bytes they are.",
    "The outputs as the entry left them here (zero until [`EmulatedQmv::run_native`])."
);

/// Every output row of `call`, on its dots' path.
///
/// # Safety
/// `call` and its pointers must be those of a live [`EmulatedQmv`], and the CPU (or the
/// emulated one) must have the features of the call's path.
unsafe extern "C" fn qmv_rows_entry(call: *const Call) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let c = &*call;
        let out = std::slice::from_raw_parts_mut(c.out, c.n);
        x86::qmv_rows_with(c.dots, &*c.w, &*c.xt, 0..c.n, out);
    }
}

/// What preparing a call for `isa` needs: AVX2 here, for the native quantization, and an
/// x86 path to prepare for.
fn check_prepare(what: &str, isa: Isa) {
    assert!(
        Isa::Avx2.is_available(),
        "{what}: the activations are quantized with AVX2, which this CPU lacks"
    );
    assert!(
        matches!(isa, Isa::Avx512Vnni | Isa::Avx512 | Isa::Avx2),
        "{what}: {} is not an x86 path",
        isa.as_str()
    );
}

/// What the tile entry reads.
#[repr(C)]
struct TileCall {
    dots: x86::Dots,
    w: *const QuantizedMatrix,
    tile: *const x86::PreparedTile,
    out: *mut f32,
    n: usize,
}

/// One tile of `qmv_wide` (`rows` activation rows against every row of `W`) prepared for
/// its loop to run on `isa`.
pub struct EmulatedTile<'a> {
    isa: Isa,
    rows: usize,
    call: Box<TileCall>,
    _tile: Box<x86::PreparedTile>,
    out: Vec<f32>,
    _w: PhantomData<&'a QuantizedMatrix>,
}

impl<'a> EmulatedTile<'a> {
    /// Quantizes the `rows` (1 to 8) rows of `x` for `w` under `scheme` and widens `w`'s
    /// scales (natively, with AVX2), and allocates the output.
    ///
    /// # Panics
    /// As [`EmulatedQmv::new`], and when `rows` is not 1 to 8.
    pub fn new(
        isa: Isa,
        scheme: ActScheme,
        x: &[f32],
        rows: usize,
        w: &'a QuantizedMatrix,
    ) -> EmulatedTile<'a> {
        let mut out = vec![0.0f32; 8 * w.n()];
        check_shapes("EmulatedTile", x, rows, w, &out[..rows * w.n()]);
        check_prepare("EmulatedTile", isa);
        // `int16-wide8` gives these rows its wide codes, as `qmv_wide` does.
        let codes = integer_codes(w, scheme.rows_scheme(rows)).unwrap_or_else(|| {
            panic!("EmulatedTile: {}-bit weights have no integer codes under {scheme:?}", w.spec().bits())
        });
        // SAFETY: AVX2, FMA and F16C were confirmed above.
        let tile = Box::new(unsafe { x86::PreparedTile::new(x, rows, w, codes) });
        let call =
            Box::new(TileCall { dots: x86::Dots::of(isa), w, tile: &*tile, out: out.as_mut_ptr(), n: w.n() });
        EmulatedTile { isa, rows, call, _tile: tile, out, _w: PhantomData }
    }

    /// Raw outputs (as [`EmulatedTile::out_bytes`] lays them out) to `y[rows, N]`, the
    /// layout `qmv_wide` writes.
    pub fn to_rows(&self, raw: &[f32]) -> Vec<f32> {
        let n = self.call.n;
        assert_eq!(raw.len(), 8 * n);
        let mut y = vec![0f32; self.rows * n];
        for (r, lanes) in raw.chunks_exact(8).enumerate() {
            for (i, &v) in lanes.iter().enumerate().take(self.rows) {
                y[i * n + r] = v;
            }
        }
        y
    }

    /// Runs the entry on this CPU and returns `y[rows, N]`.
    ///
    /// # Panics
    /// When this CPU lacks the path it was prepared for.
    pub fn run_native(&mut self) -> Vec<f32> {
        self.run_entry();
        self.to_rows(&self.out)
    }
}

call_accessors!(
    EmulatedTile,
    TileCall,
    tile_rows_entry,
    "Where the raw outputs lie (`8 * N` values, weight row by weight row, eight lanes each), and how many bytes they are.",
    "The raw outputs as the entry left them here (zero until [`EmulatedTile::run_native`])."
);

/// Every weight row of `call` against its tile, on its dots' path.
///
/// # Safety
/// `call` and its pointers must be those of a live [`EmulatedTile`], and the CPU (or the
/// emulated one) must have the features of the call's path.
unsafe extern "C" fn tile_rows_entry(call: *const TileCall) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let c = &*call;
        let out = std::slice::from_raw_parts_mut(c.out, 8 * c.n);
        x86::tile_rows_with(c.dots, &*c.w, &*c.tile, out);
    }
}

/// What the lane-row entry reads.
#[repr(C)]
struct RowsCall {
    vnni: bool,
    w: *const QuantizedMatrix,
    rows: *const x86::lanerows::PreparedRows,
    rows_per_task: usize,
    out: *mut f32,
    len: usize,
}

/// The lane-row kernel of `qmv_wide` and `qmm` (AVX-512, 4-bit weights, `K` a multiple of
/// 64: a weight row per 32-bit lane) for 2 to 32 activation rows against every row of `W`,
/// in tasks of a given number of weight rows as the pool runs them, prepared for it to run
/// on `isa`.
pub struct EmulatedLaneRows<'a> {
    isa: Isa,
    call: Box<RowsCall>,
    _rows: Box<x86::lanerows::PreparedRows>,
    out: Vec<f32>,
    _w: PhantomData<&'a QuantizedMatrix>,
}

impl<'a> EmulatedLaneRows<'a> {
    /// Quantizes the `rows` rows of `x` for `w` under `scheme` (natively, with AVX2) and
    /// allocates the output, for tasks of `rows_per_task` weight rows (a multiple of 16);
    /// `None` where the lane-row kernel does not take them (other widths or group sizes,
    /// `K` not a multiple of 64, one row or more than 32).
    ///
    /// # Panics
    /// As [`EmulatedQmv::new`], when `isa` is not an AVX-512 path, and when
    /// `rows_per_task` is not a positive multiple of 16.
    pub fn new(
        isa: Isa,
        scheme: ActScheme,
        x: &[f32],
        rows: usize,
        rows_per_task: usize,
        w: &'a QuantizedMatrix,
    ) -> Option<EmulatedLaneRows<'a>> {
        assert!(
            rows_per_task > 0 && rows_per_task.is_multiple_of(16),
            "EmulatedLaneRows: {rows_per_task} rows per task is not a positive multiple of 16"
        );
        let mut out = vec![0.0f32; rows * w.n()];
        check_shapes("EmulatedLaneRows", x, rows, w, &out);
        check_prepare("EmulatedLaneRows", isa);
        assert!(
            matches!(isa, Isa::Avx512 | Isa::Avx512Vnni),
            "EmulatedLaneRows: {} is not AVX-512",
            isa.as_str()
        );
        let codes = integer_codes(w, scheme.rows_scheme(rows))?;
        // SAFETY: AVX2, FMA and F16C were confirmed above.
        let prepared = Box::new(unsafe { x86::lanerows::PreparedRows::new(x, rows, w, codes) }?);
        let call = Box::new(RowsCall {
            vnni: isa == Isa::Avx512Vnni,
            w,
            rows: &*prepared,
            rows_per_task,
            out: out.as_mut_ptr(),
            len: out.len(),
        });
        Some(EmulatedLaneRows { isa, call, _rows: prepared, out, _w: PhantomData })
    }

    /// Runs the entry on this CPU.
    ///
    /// # Panics
    /// When this CPU lacks the path it was prepared for.
    pub fn run_native(&mut self) -> &[f32] {
        self.run_entry();
        &self.out
    }
}

call_accessors!(
    EmulatedLaneRows,
    RowsCall,
    lane_rows_entry,
    "Where the outputs (`y[rows, N]`) lie, and how many bytes they are.",
    "The outputs as the entry left them here (zero until [`EmulatedLaneRows::run_native`])."
);

/// Every weight row of `call` against its rows, on its path.
///
/// # Safety
/// `call` and its pointers must be those of a live [`EmulatedLaneRows`], and the CPU (or
/// the emulated one) must have the features of the call's path.
unsafe extern "C" fn lane_rows_entry(call: *const RowsCall) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let c = &*call;
        let out = std::slice::from_raw_parts_mut(c.out, c.len);
        x86::lanerows::rows_with(c.vnni, &*c.w, &*c.rows, c.rows_per_task, out);
    }
}
