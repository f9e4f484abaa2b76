//! The kernels as build.rs compiled them (feature `cuda`): per source file, the PTX
//! (virtual architecture compute_80, compiled by NVRTC with `--fmad=false`) and cubins for
//! sm_80 and sm_90 (ptxas -O3), embedded so a run needs only the driver. [`pick_image`]
//! chooses what a device loads.

use crate::error::CudaError;

/// One kernel source file's compiled forms.
#[derive(Clone, Copy, Debug)]
pub struct Module {
    /// The source's name (`qmv` for `kernels/qmv.cu`).
    pub name: &'static str,
    /// PTX text, without a terminating NUL.
    pub ptx: &'static [u8],
    /// Machine code for compute capability 8.x.
    pub sm80: &'static [u8],
    /// Machine code for compute capability 9.x.
    pub sm90: &'static [u8],
}

macro_rules! module {
    ($name:literal) => {
        Module {
            name: $name,
            ptx: include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".ptx")),
            sm80: include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".sm_80.cubin")),
            sm90: include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".sm_90.cubin")),
        }
    };
}

/// Every module, in the order build.rs compiles them.
pub const MODULES: [Module; 4] = [module!("qmv"), module!("qmm"), module!("elementwise"), module!("attn")];

/// The ptxas build.rs used, for the spill check.
pub const PTXAS: &str = env!("KILN_CUDA_PTXAS");

/// Which compiled form a device loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Image {
    /// The sm_80 cubin (compute capability 8.0 to 8.9: a cubin runs on its major version
    /// from its minor version up).
    Sm80,
    /// The sm_90 cubin (9.x).
    Sm90,
    /// The PTX, compiled by the driver at load time (10.0 and newer).
    Ptx,
}

/// The image for a device of compute capability `major.minor`; below 8.0 is refused.
pub fn pick_image(major: i32, minor: i32) -> Result<Image, CudaError> {
    match major {
        8 => Ok(Image::Sm80),
        9 => Ok(Image::Sm90),
        m if m >= 10 => Ok(Image::Ptx),
        _ => Err(CudaError::Shape {
            kernel: "device",
            what: format!(
                "compute capability {major}.{minor}: kiln's kernels need 8.0 or newer (Ampere and later)"
            ),
        }),
    }
}

impl Module {
    /// The bytes to give `cuModuleLoadData` for `image` (PTX gets its terminating NUL).
    pub fn image(&self, image: Image) -> Vec<u8> {
        match image {
            Image::Sm80 => self.sm80.to_vec(),
            Image::Sm90 => self.sm90.to_vec(),
            Image::Ptx => {
                let mut v = self.ptx.to_vec();
                v.push(0);
                v
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{all_kernels, module_of};

    #[test]
    fn each_device_gets_the_image_built_for_it() {
        assert_eq!(pick_image(8, 0).unwrap(), Image::Sm80);
        assert_eq!(pick_image(8, 9).unwrap(), Image::Sm80);
        assert_eq!(pick_image(9, 0).unwrap(), Image::Sm90);
        assert_eq!(pick_image(12, 0).unwrap(), Image::Ptx);
        let e = pick_image(7, 5).unwrap_err().to_string();
        assert!(e.contains("7.5") && e.contains("8.0 or newer"), "{e}");
    }

    #[test]
    fn every_kernel_is_in_its_modules_ptx_and_the_cubins_are_elf() {
        for k in all_kernels() {
            let m = MODULES.iter().find(|m| m.name == module_of(&k)).expect("a module");
            let ptx = std::str::from_utf8(m.ptx).expect("PTX is text");
            assert!(ptx.contains(&format!(".entry {k}(")), "{k} is not an entry of {}.ptx", m.name);
        }
        for m in MODULES {
            assert_eq!(&m.sm80[..4], b"\x7fELF", "{}", m.name);
            assert_eq!(&m.sm90[..4], b"\x7fELF", "{}", m.name);
            assert_eq!(*m.image(Image::Ptx).last().unwrap(), 0);
        }
    }
}
