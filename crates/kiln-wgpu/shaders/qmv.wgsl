// qmv and qmv_wide: y[i, r] = sum_j w[r, j] x[i, j] for M <= 8 activation rows over an
// MLX-affine 4- or 8-bit matrix, one output feature r per workgroup of 32 lanes.
//
// Lane l takes the row's 32-element chunks l, l + 32, ... . Per chunk c (inside one group:
// scale s, bias b, centre c0 = 2^(bits-1)) and activation row i it forms
// dq = sum_j (q_j - c0) x_j and xs = sum_j x_j, then acc_i = fma(s, dq, acc_i) and
// acc_i = fma(bc, xs, acc_i) with bc = fma(s, c0, b); the 32 lanes' accumulators are summed
// in a fixed tree. Every activation row goes through the same operations whatever M is, so
// a row's output has the same bits at any M (qmv_wide equals qmv).

struct Params {
    n: u32,
    k: u32,
    m: u32,
    bits: u32,
    group: u32,
    sdt: u32,
    x_off: u32,
    y_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> packed: array<u32>;
@group(0) @binding(2) var<storage, read_write> scales: array<u32>;
@group(0) @binding(3) var<storage, read_write> biases: array<u32>;
@group(0) @binding(4) var<storage, read_write> x: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

var<workgroup> part: array<array<f32, 32>, 8>;

fn scale_at(i: u32) -> f32 {
    if p.sdt == 2u {
        return bitcast<f32>(scales[i]);
    }
    return widen(scales[i >> 1u], i, p.sdt);
}

fn bias_at(i: u32) -> f32 {
    if p.sdt == 2u {
        return bitcast<f32>(biases[i]);
    }
    return widen(biases[i >> 1u], i, p.sdt);
}

@compute @workgroup_size(32)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {
    let r = group_index(wid, nwg);
    if r >= p.n {
        return;
    }
    let wpr = p.k * p.bits / 32u;
    let gpr = p.k / p.group;
    let chunks = p.k / 32u;
    let words = p.bits; // words per 32-element chunk: 4 for 4-bit, 8 for 8-bit
    let per_word = 32u / p.bits;
    let mask = (1u << p.bits) - 1u;
    let c0 = f32(1u << (p.bits - 1u));
    let ic0 = i32(1u << (p.bits - 1u));
    var acc: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        acc[i] = 0.0;
    }
    for (var c = lane; c < chunks; c += 32u) {
        let gi = c * 32u / p.group;
        let s = scale_at(r * gpr + gi);
        let b = bias_at(r * gpr + gi);
        let bc = fma(s, c0, b);
        let base = r * wpr + c * words;
        for (var i = 0u; i < p.m; i++) {
            let xb = p.x_off + i * p.k + c * 32u;
            var dq = 0.0;
            var xs = 0.0;
            for (var w = 0u; w < words; w++) {
                let word = packed[base + w];
                for (var t = 0u; t < per_word; t++) {
                    let q = i32((word >> (t * p.bits)) & mask) - ic0;
                    let xv = x[xb + w * per_word + t];
                    dq = fma(f32(q), xv, dq);
                    xs = xs + xv;
                }
            }
            acc[i] = fma(s, dq, acc[i]);
            acc[i] = fma(bc, xs, acc[i]);
        }
    }
    for (var i = 0u; i < 8u; i++) {
        part[i][lane] = acc[i];
    }
    workgroupBarrier();
    for (var width = 16u; width > 0u; width = width >> 1u) {
        if lane < width {
            for (var i = 0u; i < 8u; i++) {
                part[i][lane] = part[i][lane] + part[i][lane + width];
            }
        }
        workgroupBarrier();
    }
    if lane < p.m {
        y[p.y_off + lane * p.n + r] = part[lane][0];
    }
}
