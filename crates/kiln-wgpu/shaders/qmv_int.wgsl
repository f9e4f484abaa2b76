// qmv_int: y[i, r] = sum_j w[r, j] x[i, j] under an integer activation scheme (`int8`,
// `int16`), for any number of rows: kiln-core's `reference::qmv_int` to the bit, so
// `qmv`, `qmv_wide` and `qmm` rows are all the CPU's bits. The activations were quantized
// by `act_quant.wgsl` (codes, and per row and group sx, xsum, qsum and the high bytes'
// sum). A workgroup of 64 threads takes 64 output features and up to 8 rows; a thread
// runs its feature's rows one after another.
//
// Per weight group g the exact integer tot = sum_j q_j xq_j comes from 4 x 8-bit dot
// products (`dot4s`, `dot4u`: `dot_packed.wgsl` or `dot_plain.wgsl`):
// - 4-bit weights: a word's low nibbles (q in 0..15, as signed or unsigned bytes the same)
//   against the even elements' codes, its high nibbles against the odd ones';
// - 16-bit codes: tot = 256 sum q hi + sum q lo, hi signed and lo unsigned bytes;
//   8-bit weights are signed as q - 128 against hi (sum q hi = that + 128 sum hi) and
//   unsigned against lo.
// The float half is kiln-core's `Lanes`: group g into lane g % 8,
// lane = fma(f32(tot - c qsum), s sx, lane), lane = fma(fma(s, c, b), xsum, lane), the
// lanes summed ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
// With `sums` set the kernel writes each tot (as i32 bits) instead of y, for the tests.

struct Params {
    n: u32,
    k: u32,
    m: u32,
    bits: u32,
    group: u32,
    sdt: u32,
    y_off: u32,
    wide: u32,
    info_off: u32,
    sums: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> packed: array<u32>;
@group(0) @binding(2) var<storage, read_write> scales: array<u32>;
@group(0) @binding(3) var<storage, read_write> biases: array<u32>;
@group(0) @binding(4) var<storage, read_write> act: array<u32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

// sum_j q_j xq_j over group g of feature r and row i.
fn group_dot(r: u32, i: u32, g: u32, info: u32) -> i32 {
    let wpg = p.group * p.bits / 32u;
    let wbase = r * (p.k * p.bits / 32u) + g * wpg;
    let cpr = p.k / 4u;
    let planes = select(1u, 2u, p.wide == 1u);
    let cbase = i * planes * cpr + g * p.group / 4u;
    if p.bits == 4u {
        var th = 0;
        var tl = 0;
        for (var w = 0u; w < wpg; w++) {
            let word = packed[wbase + w];
            let even = word & 0x0f0f0f0fu;
            let odd = (word >> 4u) & 0x0f0f0f0fu;
            let at = cbase + 2u * w;
            th = th + dot4s(even, act[at]) + dot4s(odd, act[at + 1u]);
            if p.wide == 1u {
                tl = tl + dot4u(even, act[at + cpr]) + dot4u(odd, act[at + cpr + 1u]);
            }
        }
        if p.wide == 1u {
            return 256 * th + tl;
        }
        return th;
    }
    var th = 0;
    var tl = 0;
    for (var w = 0u; w < wpg; w++) {
        let word = packed[wbase + w];
        th = th + dot4s(word ^ 0x80808080u, act[cbase + w]);
        tl = tl + dot4u(word, act[cbase + cpr + w]);
    }
    let hsum = bitcast<i32>(act[info + 3u]);
    return 256 * (th + 128 * hsum) + tl;
}

// Group g of feature r and row i added into its lane's value `lane`.
fn add_group(r: u32, i: u32, g: u32, lane: f32) -> f32 {
    let gpr = p.k / p.group;
    let info = p.info_off + (i * gpr + g) * 4u;
    let tot = group_dot(r, i, g, info);
    if p.sums == 1u {
        y[(i * p.n + r) * gpr + g] = bitcast<f32>(tot);
        return lane;
    }
    let c = i32(1u << (p.bits - 1u));
    let s = scale_at(r * gpr + g);
    let b = bias_at(r * gpr + g);
    let sx = bitcast<f32>(act[info]);
    let xsum = bitcast<f32>(act[info + 1u]);
    let qsum = bitcast<i32>(act[info + 2u]);
    let bc = fma(s, f32(c), b);
    let l = fma(f32(tot - c * qsum), s * sx, lane);
    return fma(bc, xsum, l);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let r = wid.x * 64u + t;
    if r >= p.n {
        return;
    }
    let row0 = wid.y * 8u;
    let rows = min(8u, p.m - row0);
    let gpr = p.k / p.group;
    for (var ii = 0u; ii < rows; ii++) {
        let i = row0 + ii;
        var l0 = 0.0;
        var l1 = 0.0;
        var l2 = 0.0;
        var l3 = 0.0;
        var l4 = 0.0;
        var l5 = 0.0;
        var l6 = 0.0;
        var l7 = 0.0;
        for (var g = 0u; g < gpr; g += 8u) {
            l0 = add_group(r, i, g, l0);
            if g + 1u < gpr {
                l1 = add_group(r, i, g + 1u, l1);
            }
            if g + 2u < gpr {
                l2 = add_group(r, i, g + 2u, l2);
            }
            if g + 3u < gpr {
                l3 = add_group(r, i, g + 3u, l3);
            }
            if g + 4u < gpr {
                l4 = add_group(r, i, g + 4u, l4);
            }
            if g + 5u < gpr {
                l5 = add_group(r, i, g + 5u, l5);
            }
            if g + 6u < gpr {
                l6 = add_group(r, i, g + 6u, l6);
            }
            if g + 7u < gpr {
                l7 = add_group(r, i, g + 7u, l7);
            }
        }
        if p.sums == 0u {
            y[p.y_off + i * p.n + r] = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7));
        }
    }
}
