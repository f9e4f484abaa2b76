// qmv and qmv_wide: y[i, r] = sum_j w[r, j] x[i, j] for M <= 8 activation rows over an
// MLX-affine 4- or 8-bit matrix. A workgroup of 64 threads takes 64 / L output features,
// L lanes each; L (a power of two, 1 to 32) depends on K alone (`kernels::qmv_lanes`),
// so a wide row gets many lanes and a narrow one few lanes with several chunks each.
//
// Lane l takes the row's 32-element chunks l, l + L, ... . Per chunk c (inside one group:
// scale s, bias b, centre c0 = 2^(bits-1)) and activation row i it forms
// dq = sum_j (q_j - c0) x_j and xs = sum_j x_j, then acc_i = fma(s, dq, acc_i) and
// acc_i = fma(bc, xs, acc_i) with bc = fma(s, c0, b); the L lanes' accumulators are summed
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
    lanes: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> packed: array<u32>;
@group(0) @binding(2) var<storage, read_write> scales: array<u32>;
@group(0) @binding(3) var<storage, read_write> biases: array<u32>;
@group(0) @binding(4) var<storage, read_write> x: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

var<workgroup> part: array<array<f32, 64>, 8>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let lanes = p.lanes;
    let lane = t % lanes;
    let r = group_index(wid, nwg) * (64u / lanes) + t / lanes;
    let live = r < p.n;
    let wpr = p.k * p.bits / 32u;
    let gpr = p.k / p.group;
    let chunks = p.k / 32u;
    let words = p.bits; // words per 32-element chunk: 4 for 4-bit, 8 for 8-bit
    let per_word = 32u / p.bits;
    let mask = (1u << p.bits) - 1u;
    let c0 = f32(1u << (p.bits - 1u));
    let ic0 = i32(1u << (p.bits - 1u));
    // One activation row after another, each with a scalar accumulator (a private array
    // indexed by the row would live in memory on a CPU driver); the weights are read again
    // per row, from cache.
    for (var i = 0u; i < 8u; i++) {
        var acc = 0.0;
        if live && i < p.m {
            let xrow = p.x_off + i * p.k;
            for (var c = lane; c < chunks; c += lanes) {
                let gi = c * 32u / p.group;
                let s = scale_at(r * gpr + gi);
                let b = bias_at(r * gpr + gi);
                let bc = fma(s, c0, b);
                let base = r * wpr + c * words;
                let xb = xrow + c * 32u;
                var dq = 0.0;
                var xs = 0.0;
                for (var w = 0u; w < words; w++) {
                    let word = packed[base + w];
                    for (var u = 0u; u < per_word; u++) {
                        let q = i32((word >> (u * p.bits)) & mask) - ic0;
                        let xv = x[xb + w * per_word + u];
                        dq = fma(f32(q), xv, dq);
                        xs = xs + xv;
                    }
                }
                acc = fma(s, dq, acc);
                acc = fma(bc, xs, acc);
            }
        }
        part[i][t] = acc;
    }
    workgroupBarrier();
    for (var width = lanes / 2u; width > 0u; width = width >> 1u) {
        if lane < width {
            for (var i = 0u; i < 8u; i++) {
                part[i][t] = part[i][t] + part[i][t + width];
            }
        }
        workgroupBarrier();
    }
    if live && lane == 0u {
        for (var i = 0u; i < p.m; i++) {
            y[p.y_off + i * p.n + r] = part[i][t];
        }
    }
}
