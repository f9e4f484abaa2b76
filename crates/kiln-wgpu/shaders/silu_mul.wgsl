// SiLU-and-multiply: out[i] = g[i] / (1 + e^-g[i]) * u[i], one thread per element.

struct Params {
    len: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> g: array<f32>;
@group(0) @binding(2) var<storage, read_write> u: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let e = group_index(wid, nwg) * 64u + t;
    if e >= p.len {
        return;
    }
    let v = g[e];
    out[e] = v / (1.0 + exp(-v)) * u[e];
}
