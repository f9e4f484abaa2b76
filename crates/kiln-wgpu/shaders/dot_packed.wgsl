// The products' 4 x 8-bit dot products as WGSL's packed_4x8_integer_dot_product built-ins
// (SPIR-V's OpSDot/OpUDot where the Vulkan device has integer dot products; Metal's dot
// of char4/uchar4 vectors).

fn dot4s(a: u32, b: u32) -> i32 {
    return dot4I8Packed(a, b);
}

fn dot4u(a: u32, b: u32) -> i32 {
    return i32(dot4U8Packed(a, b));
}
