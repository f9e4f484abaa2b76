// The bias add y[i] += b[i % n] over rows of n, one f32 addition per element.

struct Params {
    len: u32,
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let e = group_index(wid, nwg) * 64u + t;
    if e >= p.len {
        return;
    }
    y[e] = y[e] + b[e % p.n];
}
