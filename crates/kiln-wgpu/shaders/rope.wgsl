// RoPE in the half-split layout: element i of a head pairs with i + half. The cosines and
// sines of each row's position come from the host (kiln-model's `Rope::angles`: f32 angle,
// f64 cosine and sine rounded to f32), so every frequency scaling kiln-model supports runs
// here and the angles are the CPU's bits; the kernel rotates. One thread per pair.

struct Params {
    rows: u32,
    heads: u32,
    half: u32,
    x_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
// [rows, half] cosines, then [rows, half] sines.
@group(0) @binding(2) var<storage, read_write> cs: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let e = group_index(wid, nwg) * 64u + t;
    if e >= p.rows * p.heads * p.half {
        return;
    }
    let i = e % p.half;
    let h = (e / p.half) % p.heads;
    let r = e / (p.half * p.heads);
    let base = p.x_off + (r * p.heads + h) * 2u * p.half;
    let c = cs[r * p.half + i];
    let s = cs[(p.rows + r) * p.half + i];
    let x1 = x[base + i];
    let x2 = x[base + i + p.half];
    x[base + i] = x1 * c - x2 * s;
    x[base + i + p.half] = x2 * c + x1 * s;
}
