// Decode attention, first pass: for one row, one query head and one span of up to 256
// keys, the span's softmax state: its largest score m, l = sum_t e^(s_t - m) and
// acc_d = sum_t e^(s_t - m) v_td (f32, `[m, l, acc...]` in the scratch). Scores are
// q . k_t (f32 accumulation over the f16 cache) times 1 / sqrt(head_dim). Row r sits at
// position start + r and sees keys 0..=start + r. One workgroup of 64 threads per
// (span, head, row); spans past a row's keys do nothing.

struct Params {
    rows: u32,
    start: u32,
    heads: u32,
    group: u32,
    head_dim: u32,
    capacity: u32,
    spans: u32,
    scale: f32,
    q_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> keys: array<u32>;
@group(0) @binding(3) var<storage, read_write> values: array<u32>;
@group(0) @binding(4) var<storage, read_write> scratch: array<f32>;

var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, 256>;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let s = wid.x;
    let h = wid.y;
    let r = wid.z;
    let len = p.start + r + 1u;
    if s * 256u >= len {
        return;
    }
    let k0 = s * 256u;
    let n = min(256u, len - k0);
    let hd = p.head_dim;
    let pairs = hd / 2u;
    let kvh = h / p.group;
    let qb = ((p.q_off + r) * p.heads + h) * hd;
    for (var d = t; d < hd; d += 64u) {
        qs[d] = q[qb + d];
    }
    workgroupBarrier();
    for (var j = t; j < n; j += 64u) {
        let kb = (kvh * p.capacity + k0 + j) * pairs;
        var dot = 0.0;
        for (var d2 = 0u; d2 < pairs; d2++) {
            let w = keys[kb + d2];
            dot = fma(qs[2u * d2], f16_to_f32(w & 0xffffu), dot);
            dot = fma(qs[2u * d2 + 1u], f16_to_f32(w >> 16u), dot);
        }
        sc[j] = dot * p.scale;
    }
    workgroupBarrier();
    var mx = -3.4028234663852886e38;
    for (var j = t; j < n; j += 64u) {
        mx = max(mx, sc[j]);
    }
    red[t] = mx;
    workgroupBarrier();
    for (var width = 32u; width > 0u; width = width >> 1u) {
        if t < width {
            red[t] = max(red[t], red[t + width]);
        }
        workgroupBarrier();
    }
    let m = red[0];
    workgroupBarrier();
    var l = 0.0;
    for (var j = t; j < n; j += 64u) {
        let e = exp(sc[j] - m);
        sc[j] = e;
        l = l + e;
    }
    red[t] = l;
    workgroupBarrier();
    for (var width = 32u; width > 0u; width = width >> 1u) {
        if t < width {
            red[t] = red[t] + red[t + width];
        }
        workgroupBarrier();
    }
    let base = ((r * p.heads + h) * p.spans + s) * (hd + 2u);
    for (var d = t; d < hd; d += 64u) {
        var acc = 0.0;
        let vb = (kvh * p.capacity + k0) * pairs + d / 2u;
        let sh = (d & 1u) * 16u;
        for (var j = 0u; j < n; j++) {
            let v = f16_to_f32((values[vb + j * pairs] >> sh) & 0xffffu);
            acc = fma(sc[j], v, acc);
        }
        scratch[base + 2u + d] = acc;
    }
    if t == 0u {
        scratch[base] = m;
        scratch[base + 1u] = red[0];
    }
}
