// The CPU emulator's execution model: thread blocks, warps and the warp-level
// instructions the block kernels use (runtime.h maps the CUDA names onto it).
//
// Each thread block runs as one cooperative fiber per CUDA thread
// on the calling OS thread. A fiber runs until it reaches a synchronisation
// point (__syncthreads, __syncwarp, a shuffle, a vote, an mma), so the code
// between two such points runs atomically; the order in which fibers and
// blocks run is drawn from a seed (odd seeds let one warp run as far ahead as
// it can), so a missing barrier or a write shared by two blocks shows up as
// results that change with the seed. Strictness:
//   * a warp collective needs all 32 lanes, with a full mask, at the same
//     kind of collective; otherwise (or if no fiber can go on) the launch
//     fails with the state of every waiting thread;
//   * dynamic shared memory is a fresh buffer of exactly the launch's size,
//     filled with 0xff bytes (NaN in every float type) and followed by a
//     guard zone that must be intact when the block ends;
//   * launch limits of the real device: 48 KiB of dynamic shared memory
//     unless raised for the kernel, the opt-in limit, grid.y/z <= 65535.
// mma.sync.m16n8k16 is computed from its operand fragments as the PTX ISA
// lays them out (products exact, sums in double, rounded to fp32), and
// ldmatrix gathers its tiles from the rows the lanes name, which must lie in
// the block's shared memory, 16-byte aligned. cp.async copies are deferred to
// the wait that covers them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>  // __half2, __nv_bfloat162 and their host conversions
#include <cuda_fp16.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace cuda_emulator {

// Settings of the emulated device and of the scheduler.
struct Config {
  uint64_t seed = 0;            // 0: index order; odd: warps run ahead; even: shuffled
  int compute_capability = 90;  // sm_90
  int smem_optin = 227 * 1024;  // cudaDevAttrMaxSharedMemoryPerBlockOptin (H100)
};
inline Config& config() {
  static Config c;
  return c;
}

// What the emulator ran since the last reset (tests and the instruction
// counts of tests/kernel_counts.py read it): collectives counts lane
// arrivals; warp_ops whole-warp instructions by Kind (sync, shuffle, vote,
// mma, ldmatrix); barriers the block barriers completed.
struct Stats {
  int64_t launches = 0, blocks = 0, collectives = 0;
  int64_t warp_ops[5] = {};
  int64_t barriers = 0;
};
inline Stats& stats() {
  static Stats s;
  return s;
}

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 256;

enum class Wait { none, block, warp };
enum class Kind : int { sync, shfl, vote, mma, ldmatrix };
inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::sync:
      return "__syncwarp";
    case Kind::shfl:
      return "shuffle";
    case Kind::vote:
      return "vote";
    case Kind::ldmatrix:
      return "ldmatrix";
    default:
      return "mma";
  }
}

// One lane's contribution to a warp collective.
struct Slot {
  Kind kind;
  unsigned mask;
  uint64_t v[10];
};

// ------------------------------------------------------------------ fibers
#if defined(__x86_64__)
// Stack switch for the SysV x86-64 ABI: push the callee-saved registers, store
// the stack pointer in *from, continue on the stack `to` (ucontext would make
// a signal-mask system call per switch). Weak: every file of the emulator
// that includes this header defines it.
extern "C" void cuda_emulator_switch(void** from, void* to);
asm(R"(
  .pushsection .text
  .weak cuda_emulator_switch
  .hidden cuda_emulator_switch
  .type cuda_emulator_switch, @function
cuda_emulator_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emulator_switch, .-cuda_emulator_switch
  .popsection
)");

struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context& from, Context& to) { cuda_emulator_switch(&from.sp, to.sp); }
// A context that starts entry() on the given stack.
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                   // entry() sees rsp = 8 mod 16, as after a call
  *--sp = reinterpret_cast<uintptr_t>(entry);  // popped by ret
  for (int i = 0; i < 6; ++i) *--sp = 0;       // rbp rbx r12 r13 r14 r15
  c.sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// ------------------------------------------------------------- block state
struct WarpState {
  Slot slot[2][kWarp];
  int arrived = 0;
  uint64_t gen = 0;
};

// Everything about the thread block being run.
struct BlockState {
  int nthreads = 0, ndone = 0, current = -1;
  Context scheduler;
  std::vector<Context> ctx;
  std::vector<uint8_t> done;
  std::vector<Wait> wait;
  std::vector<uint64_t> wait_gen;
  std::vector<WarpState> warps;
  int bar_arrived = 0;
  uint64_t bar_gen = 0;
  // __syncthreads_or: the predicate gathered for the open barrier, and each
  // generation's result (by parity: a thread reads it before the barrier
  // after next can complete).
  bool bar_or = false;
  bool bar_or_result[2] = {false, false};
  std::string error;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  // cp.async per thread: the open group, then committed groups, oldest first.
  struct Copy {
    void* dst;
    const void* src;
    int bytes;
  };
  std::vector<std::vector<Copy>> open_copies;
  std::vector<std::vector<std::vector<Copy>>> committed;
};

inline thread_local BlockState* g_block = nullptr;
inline thread_local std::vector<std::unique_ptr<char[]>> g_stacks;

}  // namespace cuda_emulator

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

namespace cuda_emulator {

inline void yield() {
  BlockState& b = *g_block;
  switch_context(b.ctx[b.current], b.scheduler);
}

// Record a failure and stop this fiber for good (the launch then throws).
[[noreturn]] inline void fail(const std::string& what) {
  BlockState& b = *g_block;
  if (b.error.empty()) {
    std::ostringstream os;
    os << what << " (block " << blockIdx.x << "," << blockIdx.y << "," << blockIdx.z << ", thread "
       << b.current << ")";
    b.error = os.str();
  }
  for (;;) yield();
}

// A block barrier; returns whether any thread passed pred != 0 (as
// __syncthreads_or; plain __syncthreads passes 0).
inline bool syncthreads(bool pred = false) {
  BlockState& b = *g_block;
  const uint64_t gen = b.bar_gen;
  b.bar_or = b.bar_or || pred;
  if (++b.bar_arrived == b.nthreads - b.ndone) {
    b.bar_arrived = 0;
    ++stats().barriers;
    b.bar_or_result[gen & 1] = b.bar_or;
    b.bar_or = false;
    ++b.bar_gen;
    return b.bar_or_result[gen & 1];
  }
  b.wait[b.current] = Wait::block;
  b.wait_gen[b.current] = gen;
  yield();
  return b.bar_or_result[gen & 1];
}

// Deposit this lane's slot, wait for the 32 lanes of the warp, return them.
inline const Slot* warp_collective(const Slot& mine) {
  BlockState& b = *g_block;
  ++stats().collectives;
  const int lane = b.current % kWarp;
  WarpState& w = b.warps[b.current / kWarp];
  const uint64_t gen = w.gen;
  Slot* slots = w.slot[gen & 1];
  slots[lane] = mine;
  if (mine.mask != 0xffffffffu) fail("warp collective with a partial mask");
  if (++w.arrived == kWarp) {
    w.arrived = 0;
    ++w.gen;
    ++stats().warp_ops[static_cast<int>(mine.kind)];
  } else {
    b.wait[b.current] = Wait::warp;
    b.wait_gen[b.current] = gen;
    yield();
  }
  for (int i = 0; i < kWarp; ++i)
    if (slots[i].kind != mine.kind)
      fail(std::string("lanes of a warp met at different collectives: ") + kind_name(mine.kind) +
           " and " + kind_name(slots[i].kind));
  return slots;
}

template <typename T>
inline uint64_t to_bits(T x) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t u = 0;
  std::memcpy(&u, &x, sizeof(T));
  return u;
}
template <typename T>
inline T from_bits(uint64_t u) {
  T x;
  std::memcpy(&x, &u, sizeof(T));
  return x;
}

template <typename T>
inline T shuffle(unsigned mask, T x, int src) {
  Slot s{Kind::shfl, mask, {to_bits(x)}};
  const Slot* all = warp_collective(s);
  return from_bits<T>(all[src & (kWarp - 1)].v[0]);
}

// One 16-bit operand of an mma fragment register as a float.
template <typename T>
inline double operand(uint32_t reg, int half) {
  const uint16_t bits = static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffffu);
  return static_cast<double>(static_cast<float>(T(bits, T::from_bits())));
}

// PTX ISA, mma.m16n8k16 with .f16/.bf16 operands (g = lane / 4, t = lane % 4):
//   A 16x16: register i of lane (g, t) holds row g + 8 (i & 1), columns
//            2t + 8 (i >> 1) and the next one (low half first);
//   B 16x8:  register i holds rows 2t + 8 i and the next one, column g;
//   C 16x8:  c[i] is row g + 8 (i >> 1), column 2t + (i & 1).
template <typename T>
inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Slot s{Kind::mma, 0xffffffffu, {a[0], a[1], a[2], a[3], b0, b1}};
  const Slot* all = warp_collective(s);
  auto A = [&](int row, int k) {
    const Slot& src = all[(row % 8) * 4 + (k % 8) / 2];
    return operand<T>(static_cast<uint32_t>(src.v[(row >= 8) + 2 * (k >= 8)]), k % 2);
  };
  auto B = [&](int k, int n) {
    const Slot& src = all[n * 4 + (k % 8) / 2];
    return operand<T>(static_cast<uint32_t>(src.v[4 + (k >= 8)]), k % 2);
  };
  const int lane = g_block->current % kWarp, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    double sum = c[i];
    for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
    c[i] = static_cast<float>(sum);
  }
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8m..8m+7 pass the
// addresses of the 8 rows (8 x 16 bits, 16-byte aligned, in the block's
// dynamic shared memory) of tile m; every lane receives register m from tile
// m: row lane/4, columns 2(lane%4) and the next (low half first); with
// .trans, column lane/4 of rows 2(lane%4) and the next.
inline void ldmatrix(uint32_t (&r)[4], const uint16_t* rows, bool trans) {
  const BlockState& b = *g_block;
  const auto addr = reinterpret_cast<uintptr_t>(rows);
  const auto lo = reinterpret_cast<uintptr_t>(b.smem);
  if (addr % 16 != 0) fail("ldmatrix row address not 16-byte aligned");
  if (addr < lo || addr + 16 > lo + b.smem_bytes) fail("ldmatrix row outside shared memory");
  Slot s{Kind::ldmatrix, 0xffffffffu, {addr, trans ? 1u : 0u}};
  const Slot* all = warp_collective(s);
  const int lane = b.current % kWarp;
  for (int m = 0; m < 4; ++m) {
    uint16_t half[2];
    for (int e = 0; e < 2; ++e) {
      const int row = trans ? 2 * (lane % 4) + e : lane / 4;
      const int col = trans ? lane / 4 : 2 * (lane % 4) + e;
      if (all[8 * m + row].v[1] != s.v[1]) fail("ldmatrix lanes disagree on .trans");
      half[e] = reinterpret_cast<const uint16_t*>(all[8 * m + row].v[0])[col];
    }
    r[m] = static_cast<uint32_t>(half[0]) | (static_cast<uint32_t>(half[1]) << 16);
  }
}

// cp.async.cg 16 bytes: the destination turns to 0xff poison at once (a
// reader that should have finished before the copy was issued sees it) and
// gets its data (src, zero-filled past src_bytes) only when the thread waits
// for the group (a reader that does not wait, or skips the barrier after the
// wait, sees the poison).
inline void cp_async_16(void* dst, const void* src, int src_bytes) {
  BlockState& b = *g_block;
  const auto d = reinterpret_cast<uintptr_t>(dst), lo = reinterpret_cast<uintptr_t>(b.smem);
  if (d % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    fail("cp.async with an address that is not 16-byte aligned");
  if (d < lo || d + 16 > lo + b.smem_bytes) fail("cp.async destination outside shared memory");
  if (src_bytes < 0 || src_bytes > 16) fail("cp.async src-size outside [0, 16]");
  std::memset(dst, 0xff, 16);  // in flight: a reader that is not yet done sees poison
  b.open_copies[b.current].push_back({dst, src, src_bytes});
}

inline void cp_async_commit() {
  BlockState& b = *g_block;
  b.committed[b.current].push_back(std::move(b.open_copies[b.current]));
  b.open_copies[b.current].clear();
}

inline void cp_async_wait(int pending) {
  BlockState& b = *g_block;
  auto& groups = b.committed[b.current];
  while (static_cast<int>(groups.size()) > pending) {
    for (const BlockState::Copy& c : groups.front()) {
      std::memset(c.dst, 0, 16);
      if (c.bytes > 0) std::memcpy(c.dst, c.src, c.bytes);
    }
    groups.erase(groups.begin());
  }
}

[[noreturn]] inline void fiber_main() {
  BlockState& b = *g_block;
  b.body(b.body_arg);
  b.done[b.current] = 1;
  ++b.ndone;
  // A thread that exits counts as arrived at the block barrier.
  if (b.bar_arrived > 0 && b.bar_arrived == b.nthreads - b.ndone) {
    b.bar_arrived = 0;
    ++b.bar_gen;
  }
  switch_context(b.ctx[b.current], b.scheduler);
  __builtin_unreachable();  // a finished fiber is never resumed
}

inline bool runnable(const BlockState& b, int t) {
  if (b.done[t]) return false;
  switch (b.wait[t]) {
    case Wait::block:
      return b.bar_gen != b.wait_gen[t];
    case Wait::warp:
      return b.warps[t / kWarp].gen != b.wait_gen[t];
    default:
      return true;
  }
}

inline std::string deadlock_report(const BlockState& b) {
  std::ostringstream os;
  os << "deadlock in block " << blockIdx.x << "," << blockIdx.y << "," << blockIdx.z << ":";
  for (int t = 0; t < b.nthreads; ++t) {
    if (b.done[t]) continue;
    os << " t" << t << (b.wait[t] == Wait::block ? "@__syncthreads" : "@warp");
  }
  os << " (" << b.ndone << " threads exited)";
  return os.str();
}

// Run one thread block of `nthreads` fibers, each calling body(arg).
inline void run_block(int nthreads, void (*body)(void*), void* arg, unsigned char* smem,
                      size_t smem_bytes, std::mt19937_64* rng, bool run_ahead) {
  BlockState b;
  b.nthreads = nthreads;
  b.ctx.resize(nthreads);
  b.done.assign(nthreads, 0);
  b.wait.assign(nthreads, Wait::none);
  b.wait_gen.assign(nthreads, 0);
  b.warps.resize((nthreads + kWarp - 1) / kWarp);
  b.body = body;
  b.body_arg = arg;
  b.smem = smem;
  b.smem_bytes = smem_bytes;
  b.open_copies.resize(nthreads);
  b.committed.resize(nthreads);
  while (static_cast<int>(g_stacks.size()) < nthreads) g_stacks.emplace_back(new char[kStackBytes]);
  BlockState* outer = g_block;
  g_block = &b;
  for (int t = 0; t < nthreads; ++t) {
    make_context(b.ctx[t], g_stacks[t].get(), kStackBytes, fiber_main);
  }
  // Run the fibers of `group` (thread indices) until none of them can go on;
  // true if any ran. The order is shuffled when a generator is given.
  const auto run_group = [&](std::vector<int>& group) {
    bool any = false;
    for (bool ran = true; ran && b.error.empty();) {
      ran = false;
      if (rng != nullptr) std::shuffle(group.begin(), group.end(), *rng);
      for (const int t : group) {
        if (!runnable(b, t)) continue;
        ran = any = true;
        b.current = t;
        b.wait[t] = Wait::none;
        threadIdx = uint3{static_cast<unsigned>(t), 0, 0};
        switch_context(b.scheduler, b.ctx[t]);
        if (!b.error.empty()) break;
      }
      if (!run_ahead) break;
    }
    return any;
  };
  // Round robin: every thread in turn (one step each), so warps keep pace.
  // Run ahead: one warp as far as it can go (to a barrier), then the next in
  // a random order, so a warp that overtakes the others exposes a missing
  // barrier between its writes and their reads.
  std::vector<std::vector<int>> groups;
  for (int t = 0; t < nthreads; ++t) {
    if (run_ahead ? t % kWarp == 0 : t == 0) groups.emplace_back();
    groups.back().push_back(t);
  }
  while (b.ndone < nthreads && b.error.empty()) {
    if (rng != nullptr) std::shuffle(groups.begin(), groups.end(), *rng);
    bool ran = false;
    for (std::vector<int>& group : groups) ran = run_group(group) || ran;
    if (!ran && b.error.empty()) b.error = deadlock_report(b);
  }
  g_block = outer;
  TORCH_CHECK(b.error.empty(), "cuda_emulator: ", b.error);
}

// Kernels raised above 48 KiB of dynamic shared memory.
inline std::map<const void*, size_t>& smem_limits() {
  static std::map<const void*, size_t> m;
  return m;
}

template <typename... Args>
struct LaunchArgs {
  void (*kernel)(Args...);
  std::tuple<Args...> args;
  static void call(void* self) {
    auto* l = static_cast<LaunchArgs*>(self);
    std::apply(l->kernel, l->args);
  }
};

inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args... args) {
  const std::lock_guard<std::mutex> lock(launch_mutex());
  const int nthreads = static_cast<int>(block.x * block.y * block.z);
  TORCH_CHECK(block.y == 1 && block.z == 1 && nthreads > 0 && nthreads <= kMaxThreads,
              "cuda_emulator: bad block size");
  TORCH_CHECK(grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.y <= 65535 && grid.z <= 65535,
              "cuda_emulator: bad grid ", grid.x, "x", grid.y, "x", grid.z);
  size_t limit = 48 * 1024;
  if (auto it = smem_limits().find(reinterpret_cast<const void*>(kernel));
      it != smem_limits().end())
    limit = it->second;
  TORCH_CHECK(smem <= limit, "cuda_emulator: launch with ", smem,
              " bytes of dynamic shared memory, the kernel allows ", limit);

  Stats& st = stats();
  ++st.launches;
  LaunchArgs<Params...> call{kernel, std::tuple<Params...>(args...)};
  const uint64_t seed = config().seed;
  std::mt19937_64 rng(seed);
  std::vector<uint3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back(uint3{x, y, z});
  if (seed != 0) std::shuffle(blocks.begin(), blocks.end(), rng);
  std::vector<unsigned char> buffer(smem + kGuardBytes);
  gridDim = grid;
  blockDim = block;
  for (const uint3& id : blocks) {
    std::fill(buffer.begin(), buffer.end(), 0xff);
    blockIdx = id;
    ++st.blocks;
    run_block(nthreads, &LaunchArgs<Params...>::call, &call, buffer.data(), smem,
              seed != 0 ? &rng : nullptr, seed % 2 == 1);
    for (size_t i = smem; i < buffer.size(); ++i)
      TORCH_CHECK(buffer[i] == 0xff, "cuda_emulator: block ", id.x, ",", id.y, ",", id.z, " wrote ",
                  i - smem, " bytes past its ", smem, " bytes of shared memory");
  }
}

}  // namespace cuda_emulator
