// Decode attention, second pass: merges a row's span states (attn_split.wgsl) into the
// output, out_d = sum_s e^(m_s - M) acc_sd / sum_s e^(m_s - M) l_s with M the largest m_s.
// One workgroup of 64 threads per (head, row).

struct Params {
    rows: u32,
    start: u32,
    heads: u32,
    head_dim: u32,
    spans: u32,
    out_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> scratch: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wid.x;
    let r = wid.y;
    let hd = p.head_dim;
    let n = (p.start + r + 1u + 255u) / 256u;
    let base = (r * p.heads + h) * p.spans * (hd + 2u);
    var mx = -3.4028234663852886e38;
    for (var s = 0u; s < n; s++) {
        mx = max(mx, scratch[base + s * (hd + 2u)]);
    }
    var l = 0.0;
    for (var s = 0u; s < n; s++) {
        let b = base + s * (hd + 2u);
        l = fma(exp(scratch[b] - mx), scratch[b + 1u], l);
    }
    let ob = ((p.out_off + r) * p.heads + h) * hd;
    for (var d = t; d < hd; d += 64u) {
        var acc = 0.0;
        for (var s = 0u; s < n; s++) {
            let b = base + s * (hd + 2u);
            acc = fma(exp(scratch[b] - mx), scratch[b + 2u + d], acc);
        }
        out[ob + d] = acc / l;
    }
}
