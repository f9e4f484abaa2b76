// The residual add x[i] += y[i], one f32 addition per element.

struct Params {
    len: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let e = group_index(wid, nwg) * 64u + t;
    if e >= p.len {
        return;
    }
    x[e] = x[e] + y[e];
}
