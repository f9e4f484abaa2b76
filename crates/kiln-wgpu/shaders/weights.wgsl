// Helpers of the kernels that read quantized weights (qmv, qmm, the integer products, the
// embedding), prepended to each after common.wgsl: a row's scale and bias, element `i`,
// widened from the stored dtype (`p.sdt`: f16 0, bf16 1, f32 2). Each of those kernels
// declares `p`, `scales` and `biases`.

fn scale_at(i: u32) -> f32 {
    if p.sdt == 2u {
        return bitcast<f32>(scales[i]);
    }
    return widen(scales[i >> 1u], i, p.sdt);
}

fn bias_at(i: u32) -> f32 {
    if p.sdt == 2u {
        return bitcast<f32>(biases[i]);
    }
    return widen(biases[i >> 1u], i, p.sdt);
}
