// kiln-cuda: the host execution of every kernel file, as one translation unit (so the
// kernels' registrations are linked with the entry point that reads them). Built by
// build.rs with the host C++ compiler when the `host-exec` feature is on.
#include "qmv.cu"
#include "elementwise.cu"
#include "attn.cu"
#include "qmm.cu"

#include <cstring>

// Wrong on purpose: a shuffle that only half a warp reaches (on a GPU, undefined). The
// host execution must refuse it with a message instead of hanging; a test checks that.
// Host-only, so it is in no module.
extern "C" __global__ void kiln_test_partial_warp(float* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = kiln_warp_sum(1.0f);
}
KILN_REGISTER(kiln_test_partial_warp)

// Runs kernel `name` over grid (gx, gy, gz) of blocks of (bx, by, bz) threads, `args`
// holding one pointer per kernel parameter, as cuLaunchKernel takes them. Returns 0, or
// 1 when no kernel has that name.
extern "C" int kiln_host_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                unsigned by, unsigned bz, void** args) {
  for (const auto& e : ::kiln_host::registry()) {
    if (std::strcmp(e.name, name) != 0) continue;
    struct Call {
      ::kiln_host::Trampoline t;
      void** args;
    } call{e.call, args};
    ::kiln_host::launch(dim3{gx, gy, gz}, dim3{bx, by, bz},
                        [](void* p) {
                          Call* c = static_cast<Call*>(p);
                          c->t(c->args);
                        },
                        &call);
    return 0;
  }
  return 1;
}

// The number of registered kernels, and the name of kernel i: the tests check the table
// against the names the Rust side builds launches for.
extern "C" unsigned kiln_host_kernel_count() { return (unsigned)::kiln_host::registry().size(); }
extern "C" const char* kiln_host_kernel_name(unsigned i) {
  const auto& r = ::kiln_host::registry();
  return i < r.size() ? r[i].name : nullptr;
}
