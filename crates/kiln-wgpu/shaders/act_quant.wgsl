// act_quant: activations quantized per weight group for the integer-scheme products
// (`qmv_int.wgsl`): kiln-core's `quantize_group` (crates/kiln-core/src/kernels/act.rs) on
// the device, the same codes, scales and code sums bit for bit. One thread takes one
// group of one activation row:
// - amax = max |x_j|; a non-finite value makes the scale NaN (the product is then NaN, as
//   the CPU's is) and every code 0;
// - sx = amax / qmax and inv = qmax / amax, each rounded once to nearest (`div_rn`, integer
//   arithmetic: a driver's division may be 2.5 ulp off); a subnormal amax whose inv
//   overflows divides each value by sx instead, as the CPU does;
// - code_j = round_half_even(clamp(x_j inv, -qmax, qmax)) (a product and a rounding, both
//   exact in Vulkan and Metal), summed exactly into qsum;
// - xsum: the group's sum, accumulated exactly in 64-bit fixed point below amax and
//   rounded once to f32 (`exact_sum`). The CPU sums in f64 and rounds once: the same value
//   whenever its f64 lanes are exact, that is unless the group's values span more than
//   about 2^22 in magnitude.
//
// The codes are stored as bytes packed four to a word, in the order the product reads the
// weights: for 4-bit weights (`split4`), per 8 elements one word of the even elements and
// one of the odd (a weight word's low and high nibbles); for 8-bit weights element order.
// 16-bit codes (`wide`) are two such planes per row, the signed high bytes (code >> 8)
// then the unsigned low bytes (code & 255): code = 256 hi + lo. After the codes of all
// rows, per row and group four words: sx, xsum, qsum and the sum of the high bytes.

struct Params {
    m: u32,
    k: u32,
    group: u32,
    qmax: u32, // f32 bits
    wide: u32,
    split4: u32,
    x_off: u32,
    info_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> act: array<u32>;

// A positive finite f32's significand as a 24-bit integer and its exponent, so that
// v = sig * 2^(e - 150) (subnormals normalized).
fn unpack_pos(v: f32) -> vec2<i32> {
    let u = bitcast<u32>(v) & 0x7fffffffu;
    let e = i32(u >> 23u);
    let f = u & 0x7fffffu;
    if e != 0 {
        return vec2<i32>(i32(f | 0x800000u), e);
    }
    let sh = 23 - i32(firstLeadingBit(f));
    return vec2<i32>(i32(f << u32(sh)), 1 - sh);
}

// a / b for positive finite a and b, rounded once to nearest even: a restoring division of
// the 24-bit significands to 24 bits and a guard bit, with the remainder as sticky bit.
// Overflows to infinity; a quotient below the normal range (2^-126: a group whose
// largest value is under 2^-110) takes the driver's division.
fn div_rn(a: f32, b: f32) -> f32 {
    let ua = unpack_pos(a);
    let ub = unpack_pos(b);
    let den = u32(ub.x);
    var num = u32(ua.x);
    var e = ua.y - ub.y + 127;
    if num < den {
        num = num << 1u;
        e = e - 1;
    }
    var q = 0u;
    for (var i = 0u; i < 25u; i++) {
        q = q << 1u;
        if num >= den {
            num = num - den;
            q = q | 1u;
        }
        num = num << 1u;
    }
    var mant = q >> 1u;
    if (q & 1u) == 1u && (num != 0u || (mant & 1u) == 1u) {
        mant = mant + 1u;
    }
    if mant == 0x1000000u {
        mant = 0x800000u;
        e = e + 1;
    }
    if e >= 255 {
        return bitcast<f32>(0x7f800000u);
    }
    if e <= 0 {
        return a / b;
    }
    return bitcast<f32>((u32(e) << 23u) | (mant & 0x7fffffu));
}

// The exact sum of the group's values rounded once to nearest even, for a group whose
// largest magnitude `amax` is positive and finite. Each value is added into a two's
// complement 64-bit integer (hi, lo) in units of 2^(ea - 182) (ea: amax's exponent as in
// `unpack_pos`): a value 2^32 times below amax or more loses its bits under that unit.
// Below 2^-63 the sum is the plain f32 one.
fn exact_sum(base: u32, amax: f32) -> f32 {
    let ea = unpack_pos(amax).y;
    if ea < 64 {
        var s = 0.0;
        for (var j = 0u; j < p.group; j++) {
            s = s + x[base + j];
        }
        return s;
    }
    var hi = 0u;
    var lo = 0u;
    for (var j = 0u; j < p.group; j++) {
        let v = x[base + j];
        if v == 0.0 {
            continue;
        }
        let se = unpack_pos(v);
        let sig = u32(se.x);
        let s = 32 + se.y - ea; // left shift of the significand, at most 32
        var vh = 0u;
        var vl = 0u;
        if s >= 32 {
            vh = sig;
        } else if s > 0 {
            vh = sig >> u32(32 - s);
            vl = sig << u32(s);
        } else if s > -32 {
            vl = sig >> u32(-s);
        }
        if v > 0.0 {
            let l = lo + vl;
            hi = hi + vh + select(0u, 1u, l < lo);
            lo = l;
        } else {
            let borrow = select(0u, 1u, lo < vl);
            lo = lo - vl;
            hi = hi - vh - borrow;
        }
    }
    var sign = 0u;
    if (hi & 0x80000000u) != 0u {
        sign = 0x80000000u;
        lo = ~lo + 1u;
        hi = ~hi + select(0u, 1u, lo == 0u);
    }
    if hi == 0u && lo == 0u {
        return 0.0;
    }
    // The top bit's position, then the magnitude shifted up to bit 63.
    var top = i32(firstLeadingBit(lo));
    if hi != 0u {
        top = 32 + i32(firstLeadingBit(hi));
    }
    let n = 63 - top;
    if n >= 32 {
        hi = lo << u32(n - 32);
        lo = 0u;
    } else if n > 0 {
        hi = (hi << u32(n)) | (lo >> u32(32 - n));
        lo = lo << u32(n);
    }
    var mant = hi >> 8u;
    let r = hi & 0xffu;
    if r > 0x80u || (r == 0x80u && (lo != 0u || (mant & 1u) == 1u)) {
        mant = mant + 1u;
    }
    var e = top + ea - 55;
    if mant == 0x1000000u {
        mant = 0x800000u;
        e = e + 1;
    }
    if e >= 255 {
        return bitcast<f32>(sign | 0x7f800000u);
    }
    return bitcast<f32>(sign | (u32(e) << 23u) | (mant & 0x7fffffu));
}

fn is_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) != 0x7f800000u;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let gpr = p.k / p.group;
    let idx = group_index(wid, nwg) * 64u + t;
    if idx >= p.m * gpr {
        return;
    }
    let row = idx / gpr;
    let gi = idx % gpr;
    let qmax = bitcast<f32>(p.qmax);
    let base = p.x_off + row * p.k + gi * p.group;
    var amax = 0.0;
    var finite = true;
    for (var j = 0u; j < p.group; j++) {
        let v = x[base + j];
        finite = finite && is_finite(v);
        amax = max(amax, abs(v));
    }
    var sx = 0.0;
    var inv = 0.0;
    var xsum = 0.0;
    var ok = false; // codes to compute
    if !finite {
        sx = nan();
        xsum = nan();
    } else if amax > 0.0 {
        xsum = exact_sum(base, amax);
        if !is_finite(xsum) {
            sx = nan();
        } else {
            sx = div_rn(amax, qmax);
            inv = div_rn(qmax, amax);
            ok = true;
        }
    }
    let planes = select(1u, 2u, p.wide == 1u);
    let cpr = p.k / 4u; // words per plane of a row
    let cbase = row * planes * cpr + gi * p.group / 4u;
    var qsum = 0;
    var hsum = 0;
    for (var c = 0u; c < p.group / 8u; c++) {
        // Two words per 8 elements in each plane.
        var w0 = 0u;
        var w1 = 0u;
        var l0 = 0u;
        var l1 = 0u;
        for (var u = 0u; u < 8u; u++) {
            var code = 0;
            if ok {
                let v = x[base + c * 8u + u];
                var f = 0.0;
                if is_finite(inv) {
                    f = v * inv;
                } else if v != 0.0 {
                    f = div_rn(abs(v), sx);
                    if v < 0.0 {
                        f = -f;
                    }
                }
                code = i32(round(clamp(f, -qmax, qmax)));
            }
            qsum = qsum + code;
            var second = u >= 4u;
            var byte = u & 3u;
            if p.split4 == 1u {
                second = (u & 1u) == 1u;
                byte = u >> 1u;
            }
            var hb = u32(code) & 0xffu;
            var lb = 0u;
            if p.wide == 1u {
                hsum = hsum + (code >> 8u);
                hb = u32(code >> 8u) & 0xffu;
                lb = u32(code) & 0xffu;
            }
            if second {
                w1 = w1 | (hb << (8u * byte));
                l1 = l1 | (lb << (8u * byte));
            } else {
                w0 = w0 | (hb << (8u * byte));
                l0 = l0 | (lb << (8u * byte));
            }
        }
        let at = cbase + c * 2u;
        act[at] = w0;
        act[at + 1u] = w1;
        if p.wide == 1u {
            act[at + cpr] = l0;
            act[at + cpr + 1u] = l1;
        }
    }
    let info = p.info_off + (row * gpr + gi) * 4u;
    act[info] = bitcast<u32>(sx);
    act[info + 1u] = bitcast<u32>(xsum);
    act[info + 2u] = bitcast<u32>(qsum);
    act[info + 3u] = bitcast<u32>(hsum);
}
