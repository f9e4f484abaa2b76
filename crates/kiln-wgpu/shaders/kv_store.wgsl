// The store of new keys and values into an f16 cache ([kv_heads, capacity, head_dim],
// two values per u32 word): rows [row_off, row_off + rows) of k and v (f32,
// [rows, kv_heads, head_dim]) go to positions start.. . Rounded to nearest even in integer
// arithmetic (common.wgsl), so no shader-f16 feature is needed and the bits are the host's.
// One thread per pair of values.

struct Params {
    rows: u32,
    kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    start: u32,
    row_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> k: array<f32>;
@group(0) @binding(2) var<storage, read_write> v: array<f32>;
@group(0) @binding(3) var<storage, read_write> keys: array<u32>;
@group(0) @binding(4) var<storage, read_write> values: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
    let pairs = p.head_dim / 2u;
    let e = group_index(wid, nwg) * 64u + t;
    if e >= p.rows * p.kv_heads * pairs {
        return;
    }
    let d2 = e % pairs;
    let h = (e / pairs) % p.kv_heads;
    let r = e / (pairs * p.kv_heads);
    let src = ((p.row_off + r) * p.kv_heads + h) * p.head_dim + 2u * d2;
    let dst = (h * p.capacity + p.start + r) * pairs + d2;
    keys[dst] = f32_to_f16(k[src]) | (f32_to_f16(k[src + 1u]) << 16u);
    values[dst] = f32_to_f16(v[src]) | (f32_to_f16(v[src + 1u]) << 16u);
}
