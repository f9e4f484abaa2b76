// The products' 4 x 8-bit dot products in plain i32 arithmetic, for an adapter without
// packed integer dot products: each byte extracted (signed or unsigned) and multiplied.

fn dot4s(a: u32, b: u32) -> i32 {
    let x = bitcast<i32>(a);
    let y = bitcast<i32>(b);
    return extractBits(x, 0u, 8u) * extractBits(y, 0u, 8u) + extractBits(x, 8u, 8u) * extractBits(y, 8u, 8u)
        + extractBits(x, 16u, 8u) * extractBits(y, 16u, 8u) + extractBits(x, 24u, 8u) * extractBits(y, 24u, 8u);
}

fn dot4u(a: u32, b: u32) -> i32 {
    return i32(extractBits(a, 0u, 8u) * extractBits(b, 0u, 8u) + extractBits(a, 8u, 8u) * extractBits(b, 8u, 8u)
        + extractBits(a, 16u, 8u) * extractBits(b, 16u, 8u) + extractBits(a, 24u, 8u) * extractBits(b, 24u, 8u));
}
