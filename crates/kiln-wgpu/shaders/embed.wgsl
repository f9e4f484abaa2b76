// Embedding lookup: row i of the output is the quantized table's row tokens[i],
// dequantized as the format does (s q + b per element, any of 2..8 bits); a token outside
// the vocabulary gives a row of NaN. One thread per output element.

struct Params {
    rows: u32,
    vocab: u32,
    d: u32,
    bits: u32,
    group: u32,
    sdt: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> packed: array<u32>;
@group(0) @binding(2) var<storage, read_write> scales: array<u32>;
@group(0) @binding(3) var<storage, read_write> biases: array<u32>;
@group(0) @binding(4) var<storage, read_write> tokens: array<i32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let e = group_index(wid, nwg) * 64u + t;
    if e >= p.rows * p.d {
        return;
    }
    let i = e / p.d;
    let j = e % p.d;
    let tok = tokens[i];
    if tok < 0 || u32(tok) >= p.vocab {
        out[e] = nan();
        return;
    }
    let row = u32(tok);
    let wpr = p.d * p.bits / 32u;
    let bit = j * p.bits;
    let word = row * wpr + bit / 32u;
    let shift = bit % 32u;
    var v = packed[word] >> shift;
    if shift + p.bits > 32u {
        v = v | (packed[word + 1u] << (32u - shift));
    }
    let q = f32(v & ((1u << p.bits) - 1u));
    let gi = row * (p.d / p.group) + j / p.group;
    let s = scale_at(gi);
    let b = bias_at(gi);
    // Two roundings, as the format's dequantization: a fused multiply-add would differ.
    let sq = s * q;
    out[e] = sq + b;
}
