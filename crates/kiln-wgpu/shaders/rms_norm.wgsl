// RMSNorm: out[r, j] = x[r, j] / sqrt(mean_j x[r, j]^2 + eps) * w[j], one workgroup of 64
// threads per row (f32 in and out).

struct Params {
    rows: u32,
    d: u32,
    eps: f32,
    x_off: u32,
    out_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> part: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let r = group_index(wid, nwg);
    if r >= p.rows {
        return;
    }
    let xb = p.x_off + r * p.d;
    var ss = 0.0;
    for (var j = t; j < p.d; j += 64u) {
        let v = x[xb + j];
        ss = fma(v, v, ss);
    }
    part[t] = ss;
    workgroupBarrier();
    for (var width = 32u; width > 0u; width = width >> 1u) {
        if t < width {
            part[t] = part[t] + part[t + width];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(part[0] / f32(p.d) + p.eps);
    let ob = p.out_off + r * p.d;
    for (var j = t; j < p.d; j += 64u) {
        out[ob + j] = x[xb + j] * inv * w[j];
    }
}
