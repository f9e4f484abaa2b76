// Helpers every kiln-wgpu kernel is compiled with (prepended to each kernel's source).

// The workgroup's index in a dispatch of up to 65535 x 65535 groups, row-major.
fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// A scale or bias stored as f16 (dtype 0), bf16 (1) or f32 (2), element `i` of a buffer of
// u32 words: widened exactly to f32.
fn widen(word: u32, i: u32, dtype: u32) -> f32 {
    if dtype == 2u {
        return bitcast<f32>(word);
    }
    let h = (word >> ((i & 1u) * 16u)) & 0xffffu;
    if dtype == 1u {
        return bitcast<f32>(h << 16u);
    }
    return f16_to_f32(h);
}

// An f16 value's bits widened exactly to f32, subnormals included (integer arithmetic, so
// no driver's flush-to-zero can change it).
fn f16_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if e == 0x1fu {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    if e != 0u {
        return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
    }
    if m == 0u {
        return bitcast<f32>(sign);
    }
    // A subnormal: m * 2^-24, exact in f32.
    let v = f32(m) * 5.9604644775390625e-8;
    return bitcast<f32>(sign | bitcast<u32>(v));
}

// An f32 value rounded to the nearest f16 (ties to even), as its 16 bits: overflow to
// infinity, NaN kept NaN, subnormals rounded. Integer arithmetic, so the bits are the
// host's `half::f16::from_f32` on every driver.
fn f32_to_f16(f: f32) -> u32 {
    let x = bitcast<u32>(f);
    let sign = (x >> 16u) & 0x8000u;
    let ax = x & 0x7fffffffu;
    if ax >= 0x7f800000u {
        // Infinity, or NaN with a quiet bit set.
        if ax > 0x7f800000u {
            return sign | 0x7e00u | ((ax >> 13u) & 0x3ffu);
        }
        return sign | 0x7c00u;
    }
    if ax >= 0x477ff000u {
        // At or above 65520: rounds to infinity.
        return sign | 0x7c00u;
    }
    if ax >= 0x38800000u {
        // A normal f16: rebias the exponent, round the 13 dropped bits to nearest even.
        let r = ax - 0x38000000u;
        let keep = r >> 13u;
        let rest = r & 0x1fffu;
        var out = keep;
        if rest > 0x1000u || (rest == 0x1000u && (keep & 1u) == 1u) {
            out = out + 1u;
        }
        return sign | out;
    }
    if ax < 0x33000000u {
        // Below half the smallest subnormal (2^-25): zero.
        return sign;
    }
    // A subnormal f16: the mantissa with its hidden bit, shifted and rounded.
    let e = ax >> 23u;
    let m = (ax & 0x7fffffu) | 0x800000u;
    let shift = 126u - e; // 14 + (112 - e) + ... : m >> shift is the f16 subnormal's code
    let keep = m >> shift;
    let rest = m & ((1u << shift) - 1u);
    let half = 1u << (shift - 1u);
    var out = keep;
    if rest > half || (rest == half && (keep & 1u) == 1u) {
        out = out + 1u;
    }
    return sign | out;
}

// The NaN the kernels write where an input is out of range.
fn nan() -> f32 {
    return bitcast<f32>(0x7fc00000u);
}
