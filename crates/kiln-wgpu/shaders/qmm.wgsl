// qmm: y[i, r] = sum_j w[r, j] x[i, j] for many activation rows. A workgroup of 64 threads
// takes 64 output features and 8 activation rows; each thread dequantizes its feature's
// weights (w = s q + b, as the format does) and accumulates them against the 8 rows in
// order of j. The activations are read where they are (every thread of the workgroup reads
// the same ones, from cache): no workgroup memory, no barriers. An output's
// operations do not depend on M or on which tile holds its row, so a row has the same bits
// at any M (not qmv's bits: the order of the sum differs).

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

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let r = wid.x * 64u + t;
    let row0 = wid.y * 8u;
    let rows = min(8u, p.m - row0);
    let live = r < p.n;
    let rr = min(r, p.n - 1u);
    let wpr = p.k * p.bits / 32u;
    let gpr = p.k / p.group;
    let per_word = 32u / p.bits;
    let mask = (1u << p.bits) - 1u;
    var acc: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        acc[i] = 0.0;
    }
    var xrow: array<u32, 8>;
    for (var i = 0u; i < 8u; i++) {
        xrow[i] = p.x_off + min(row0 + i, p.m - 1u) * p.k;
    }
    for (var c = 0u; c < p.k / 32u; c++) {
        let gi = c * 32u / p.group;
        let s = scale_at(rr * gpr + gi);
        let b = bias_at(rr * gpr + gi);
        let base = rr * wpr + c * p.bits;
        for (var w = 0u; w < p.bits; w++) {
            let word = packed[base + w];
            for (var u = 0u; u < per_word; u++) {
                let q = f32((word >> (u * p.bits)) & mask);
                let wv = s * q + b;
                let j = c * 32u + w * per_word + u;
                for (var i = 0u; i < 8u; i++) {
                    acc[i] = fma(wv, x[xrow[i] + j], acc[i]);
                }
            }
        }
    }
    if live {
        for (var i = 0u; i < rows; i++) {
            y[p.y_off + (row0 + i) * p.n + r] = acc[i];
        }
    }
}
