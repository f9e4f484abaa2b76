// kiln-cuda: host execution of the kernel source. Included by common.cuh when the host
// C++ compiler (not NVRTC) compiles a .cu file, for the tests: it defines the CUDA
// built-ins the kernels use so the same source runs on the CPU.
//
// A launch runs its blocks one after another; a block's threads are fibers on the
// calling OS thread (on x86-64 a minimal switch of the callee-saved registers, written
// below; elsewhere ucontext, whose every switch is a system call), switched only at
// synchronisation points, so the run is deterministic. __syncthreads() parks a fiber until every live thread of the block has
// arrived; a warp shuffle writes the lane's value to its warp's exchange slots, parks
// until the warp's 32 lanes have written, reads its partner's slot and parks again until
// all have read. A barrier that can never be released (threads of one warp split between
// a warp operation and __syncthreads, or a shuffle in a partial warp) aborts with a
// message rather than hanging. __shared__ variables are function statics, one copy per
// OS thread, so blocks that run one after another on it reuse them as a GPU would.
#pragma once

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct dim3 {
  unsigned x, y, z;
};

namespace kiln_host {

template <class... P>
constexpr size_t kernel_arity(void (*)(P...)) {
  return sizeof...(P);
}

enum class State { Run, BlockBarrier, WarpBarrier, Done };

#if defined(__x86_64__)
// kiln_switch(&from, to): saves the callee-saved registers, MXCSR and the x87 control
// word on the current stack, stores the stack pointer in *from and resumes the stack
// `to` saved the same way. kiln_fiber_start is where a new fiber's first switch lands.
extern "C" void kiln_switch(void** from, void* to);
asm(R"(
  .text
  .globl kiln_switch
  .type kiln_switch, @function
kiln_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kiln_switch, .-kiln_switch
  .globl kiln_fiber_start
  .type kiln_fiber_start, @function
kiln_fiber_start:
  andq $-16, %rsp
  call kiln_fiber_main
  ud2
  .size kiln_fiber_start, .-kiln_fiber_start
)");
extern "C" void kiln_fiber_start();
extern "C" void kiln_fiber_main();
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

struct Fiber {
  Context ctx;
  dim3 tid;
  State state;
};

// One block in flight on this OS thread.
struct Block {
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  Context scheduler;
  unsigned current = 0;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  // Per warp, 32 exchange slots of 8 bytes for the shuffles.
  std::vector<uint64_t> exchange;
  // Per thread, the 10 fragment words of a warp matrix multiply-add.
  std::vector<uint32_t> mma;
};

inline thread_local Block* block = nullptr;
inline thread_local dim3 block_idx{0, 0, 0};
inline thread_local dim3 block_dim{1, 1, 1};
inline thread_local dim3 grid_dim{1, 1, 1};

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "kiln host execution: %s\n", what);
  std::abort();
}

inline Fiber& me() { return block->fibers[block->current]; }

inline unsigned linear_tid() {
  const dim3& t = me().tid;
  return t.x + block_dim.x * (t.y + block_dim.y * t.z);
}

// Saves the running context in `from` and resumes `to`.
inline void switch_to(Context& from, Context& to) {
#if defined(__x86_64__)
  kiln_switch(&from.sp, to.sp);
#else
  if (swapcontext(&from.uc, &to.uc) != 0) fail("swapcontext failed");
#endif
}

inline void park(State s) {
  Fiber& f = me();
  f.state = s;
  switch_to(f.ctx, block->scheduler);
}

inline void fiber_entry() {
  block->body(block->arg);
  park(State::Done);
  fail("a finished fiber was resumed");
}

}  // namespace kiln_host

#if defined(__x86_64__)
extern "C" void kiln_fiber_main() { ::kiln_host::fiber_entry(); }
#endif

namespace kiln_host {

// Kernels keep their arrays in registers, so a fiber needs little stack; left
// uninitialised, so a launch does not spend its time zeroing stacks.
constexpr size_t STACK_BYTES = 64 * 1024;

#if defined(__x86_64__)
// A new fiber's stack: a zeroed register save area under kiln_fiber_start's address,
// with the default MXCSR (0x1f80) and x87 control word (0x037f).
inline void init_fiber(Fiber& f, char* stack) {
  uintptr_t top = ((uintptr_t)(stack + STACK_BYTES)) & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)top;
  *--sp = 0;
  *--sp = (uint64_t)(uintptr_t)&kiln_fiber_start;
  for (int i = 0; i < 6; ++i) *--sp = 0;
  *--sp = 0x1f80ull | (0x037full << 32);
  f.ctx.sp = sp;
  f.state = State::Run;
}
#else
// Kept out of line: getcontext returns like setjmp, so the caller's loop variables
// must not live in the same frame.
[[gnu::noinline]] inline void init_fiber(Fiber& f, char* stack) {
  if (getcontext(&f.ctx.uc) != 0) fail("getcontext failed");
  f.ctx.uc.uc_stack.ss_sp = stack;
  f.ctx.uc.uc_stack.ss_size = STACK_BYTES;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, fiber_entry, 0);
  f.state = State::Run;
}
#endif

// Runs one block to completion.
inline void run_block(Block& b) {
  const unsigned n = (unsigned)b.fibers.size();
  for (unsigned i = 0; i < n; ++i) init_fiber(b.fibers[i], b.stacks[i].get());
  const unsigned warps = n / 32;
  for (;;) {
    for (unsigned i = 0; i < n; ++i) {
      if (b.fibers[i].state != State::Run) continue;
      b.current = i;
      switch_to(b.scheduler, b.fibers[i].ctx);
    }
    // Nothing can run: release what is complete.
    bool all_done = true, released = false;
    for (unsigned w = 0; w < warps; ++w) {
      bool any = false, all = true;
      for (unsigned l = 0; l < 32; ++l) {
        State s = b.fibers[w * 32 + l].state;
        if (s == State::WarpBarrier) any = true;
        if (s != State::WarpBarrier) all = false;
        if (s != State::Done) all_done = false;
      }
      // No fiber is runnable here, so a lane that is not at the warp's barrier (it exited
      // or waits at __syncthreads) never will be.
      if (any && !all) fail("a warp operation was reached by only part of the warp");
      if (any && all) {
        for (unsigned l = 0; l < 32; ++l) b.fibers[w * 32 + l].state = State::Run;
        released = true;
      }
    }
    if (all_done) return;
    if (released) continue;
    bool all_block = true;
    for (unsigned i = 0; i < n; ++i) {
      State s = b.fibers[i].state;
      if (s != State::BlockBarrier && s != State::Done) all_block = false;
    }
    if (!all_block) fail("deadlock: threads wait at different barriers");
    for (unsigned i = 0; i < n; ++i)
      if (b.fibers[i].state == State::BlockBarrier) b.fibers[i].state = State::Run;
  }
}

// Runs `body(arg)` as every thread of every block of the grid.
inline void launch(dim3 grid, dim3 blk, void (*body)(void*), void* arg) {
  const unsigned n = blk.x * blk.y * blk.z;
  if (n == 0 || n > 1024 || n % 32 != 0) fail("a block must have 32..=1024 threads, a multiple of 32");
  Block b;
  b.fibers.resize(n);
  b.stacks.resize(n);
  for (auto& s : b.stacks) s.reset(new char[STACK_BYTES]);
  b.exchange.assign(n, 0);
  b.mma.assign((size_t)n * 10, 0);
  b.body = body;
  b.arg = arg;
  for (unsigned i = 0; i < n; ++i) {
    b.fibers[i].tid = dim3{i % blk.x, (i / blk.x) % blk.y, i / (blk.x * blk.y)};
  }
  Block* saved = block;
  block = &b;
  block_dim = blk;
  grid_dim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        block_idx = dim3{x, y, z};
        run_block(b);
      }
  block = saved;
}

template <class T>
inline T shfl(unsigned mask, T v, unsigned src_of_lane_xor, bool is_xor) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  if (mask != 0xffffffffu) fail("only full-warp shuffles are emulated");
  const unsigned t = linear_tid(), lane = t % 32, base = t - lane;
  uint64_t slot = 0;
  std::memcpy(&slot, &v, sizeof(T));
  block->exchange[t] = slot;
  park(State::WarpBarrier);
  const unsigned src = is_xor ? (lane ^ src_of_lane_xor) : (src_of_lane_xor % 32);
  T r;
  uint64_t got = block->exchange[base + src];
  std::memcpy(&r, &got, sizeof(T));
  park(State::WarpBarrier);
  return r;
}

// The host twin of `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`:
// D = A B + C for a 16x16 A (row-major fragments), a 16x8 B (column-major) and 16x8 f32
// C/D, distributed over the warp as the PTX ISA lays them out (lane = 4 * group + t):
// A register i holds row group + 8 * (i % 2), columns 2t + 8 * (i / 2) + {0, 1}; B
// register j holds rows 2t + 8j + {0, 1} of column group; C/D element e is row
// group + 8 * (e / 2), column 2t + e % 2. Every lane publishes its fragments, the warp
// waits, each lane computes its four outputs (products exact in f32, summed in k order
// with fmaf), and the warp waits again. The hardware sums in its own order, so the
// tests bound the difference rather than assume bits.
inline void mma_m16n8k16(const uint32_t a[4], const uint32_t b[2], float d[4], float (*widen)(uint16_t)) {
  const unsigned t = linear_tid(), lane = t % 32, base = t - lane;
  uint32_t* mine = &block->mma[(size_t)t * 10];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  for (int i = 0; i < 2; ++i) mine[4 + i] = b[i];
  for (int i = 0; i < 4; ++i) std::memcpy(&mine[6 + i], &d[i], 4);
  park(State::WarpBarrier);
  auto elem = [&](unsigned l, int reg, int half) -> float {
    uint32_t w = block->mma[(size_t)(base + l) * 10 + reg];
    return widen((uint16_t)(half ? (w >> 16) : (w & 0xffffu)));
  };
  // A[row][k]: the lane holding it and which of its registers and halves.
  auto A = [&](unsigned row, unsigned k) -> float {
    unsigned g = row % 8, tt = (k % 8) / 2;
    int reg = (int)(row / 8) + 2 * (int)(k / 8);
    return elem(4 * g + tt, reg, (int)(k % 2));
  };
  auto B = [&](unsigned k, unsigned col) -> float {
    unsigned tt = (k % 8) / 2;
    return elem(4 * col + tt, 4 + (int)(k / 8), (int)(k % 2));
  };
  const unsigned g = lane / 4, tt = lane % 4;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    unsigned row = g + 8 * (e / 2), col = 2 * tt + e % 2;
    float acc;
    std::memcpy(&acc, &block->mma[(size_t)t * 10 + 6 + e], 4);
    for (unsigned k = 0; k < 16; ++k) acc = std::fma(A(row, k), B(k, col), acc);
    out[e] = acc;
  }
  park(State::WarpBarrier);
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

inline uint16_t float_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to infinity
  if (a < 0x38800000u) {
    // Subnormal half (or zero): the value in units of 2^-24, rounded to nearest even.
    float av;
    std::memcpy(&av, &a, 4);
    float scaled = av * 16777216.0f;  // exact: a power of two
    float r = std::nearbyint(scaled);  // default rounding mode: ties to even
    return (uint16_t)(sign | (uint32_t)r);
  }
  uint32_t mant = a & 0x7fffffu;
  uint32_t exp = (a >> 23) - 112;
  uint32_t h = (exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;
  return (uint16_t)(sign | h);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t u;
  if (e == 0) {
    float v = (float)m * (1.0f / 16777216.0f);
    std::memcpy(&u, &v, 4);
    u |= sign;
  } else if (e == 31) {
    u = sign | 0x7f800000u | (m << 13);
  } else {
    u = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Kernels by name, each with a trampoline that unpacks a cuLaunchKernel-style argument
// array (one pointer per parameter) and calls it: the same array the device path
// passes to the driver.
using Trampoline = void (*)(void** args);

struct Entry {
  const char* name;
  Trampoline call;
};

inline std::vector<Entry>& registry() {
  static std::vector<Entry> r;
  return r;
}

struct Registrar {
  Registrar(const char* name, Trampoline t) { registry().push_back(Entry{name, t}); }
};

template <class... P, size_t... I>
inline void invoke_with(void (*k)(P...), void** a, std::index_sequence<I...>) {
  k(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(a[I])...);
}

template <auto K>
inline void trampoline(void** a) {
  invoke_with(K, a, std::make_index_sequence<kernel_arity(K)>{});
}

}  // namespace kiln_host

#define KILN_REGISTER(name) \
  static ::kiln_host::Registrar kiln_registrar_##name(#name, &::kiln_host::trampoline<&name>);

#define threadIdx (::kiln_host::me().tid)
#define blockIdx (::kiln_host::block_idx)
#define blockDim (::kiln_host::block_dim)
#define gridDim (::kiln_host::grid_dim)

inline void __syncthreads() { ::kiln_host::park(::kiln_host::State::BlockBarrier); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::kiln_host::park(::kiln_host::State::WarpBarrier); }

template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  return ::kiln_host::shfl(mask, v, (unsigned)lane_mask, true);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane) {
  return ::kiln_host::shfl(mask, v, (unsigned)src_lane, false);
}

using std::fmaf;
using std::fmaxf;
using std::fminf;
