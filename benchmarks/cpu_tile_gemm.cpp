// The tile products timed by benchmarks/cpu_tile_gemm.py (see its docstring).
#include <ATen/native/CPUBlas.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <cstdlib>
#include <ctime>
#include <vector>

#include "../csrc/cpu/packed_tiles.h"
#include "../csrc/cpu/softmax_rows.h"
#include "../csrc/cpu/split_products.h"
#include "../csrc/cpu/tile_path.h"
namespace cpu = ring_attention::cpu;
using bf = c10::BFloat16;
template <class T>
using blas = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                      const T*, const int*, const T*, const int*, const float*, float*, const int*);
// Microseconds of this thread's CPU time per call (other jobs on a shared
// machine move wall-clock times far more).
inline double thread_us() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return 1e6 * static_cast<double>(t.tv_sec) + 1e-3 * static_cast<double>(t.tv_nsec);
}
template <class F>
double us(F f, int iters) {
  for (int i = 0; i < 20; ++i) f();
  const double t0 = thread_us();
  for (int i = 0; i < iters; ++i) f();
  return (thread_us() - t0) / iters;
}
template <class T>
T* buf(int64_t n, int64_t byte_offset) {
  char* p =
      static_cast<char*>(std::aligned_alloc(4096, ((n * sizeof(T) + 4095) / 4096 + 1) * 4096));
  for (int64_t i = 0; i < n * int64_t(sizeof(T)) + byte_offset; ++i) p[i] = 0;
  return reinterpret_cast<T*>(p + byte_offset);  // (leaked: a one-shot benchmark)
}
template <class T>
void fill(T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = 0.01f * (i % 97) - 0.4f;
}

std::map<std::string, double> run(int iters) {
  const int64_t M = 256, N = 512, D = 64, ldq = 512;  // 8 heads x 64: rows 512 apart
  void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
  auto bgemm = reinterpret_cast<blas<bf>>(dlsym(lib, "gemm_bf16bf16f32_"));
  auto sgemm = reinterpret_cast<blas<float>>(dlsym(lib, "sgemm_"));
  std::map<std::string, double> r;
  const float one = 1, zero = 0;
  bf *Q = buf<bf>(M * ldq, 0), *K = buf<bf>(N * ldq, 0), *V = buf<bf>(N * ldq, 0),
     *P = buf<bf>(M * 528, 0);
  fill(Q, M * ldq), fill(K, N * ldq), fill(V, N * ldq), fill(P, M * 528);
  // What this machine runs (the knobs unset): fp32 tiles through brgemm where
  // the CPU has AVX-512, the AVX2 kernels where it has AVX2; bf16 products
  // where it has bf16 dot products.
  const auto isa = cpu::machine_isa();
  const bool avx512 = isa >= ring_attention::config::CpuIsa::kAvx512;
  const bool avx2 = isa >= ring_attention::config::CpuIsa::kAvx2;
  const bool bf16 = bgemm != nullptr && isa >= ring_attention::config::CpuIsa::kAvx512Bf16;
  const bool vnni = bf16 && cpu::bf16_brgemm();
  float *S = buf<float>(M * 528, 0), *O = buf<float>(M * D, 0);
  // bf16 S = Q K^T via MKL, C aligned or not, stride 512 or 528
  for (int64_t ldc : {512, 528}) {
    if (!bf16) break;
    for (int64_t off : {0, 16}) {
      float* S = buf<float>(M * ldc, off);
      int m = N, n = M, k = D, ia = ldq, ib = ldq, ic = ldc;
      r["bf16 S mkl ldc=" + std::to_string(ldc) + " c_offset=" + std::to_string(off)] =
          us([&] { bgemm("T", "N", &m, &n, &k, &one, K, &ib, Q, &ia, &zero, S, &ic); }, iters);
    }
  }
  // bf16 packed (VNNI): K^T as d x N, V as N x d in row pairs
  bf *Kp = buf<bf>(N * D, 0), *Vp = buf<bf>(N * D, 0);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t c = 0; c < D; ++c) {
      Kp[(c / 2) * N * 2 + j * 2 + c % 2] = K[j * ldq + c];
      Vp[(j / 2) * D * 2 + c * 2 + j % 2] = V[j * ldq + c];
    }
  if (vnni) {
    r["bf16 S brgemm packed ldc=528"] = us(
        [&] { at::native::cpublas::brgemm(M, N, D, ldq, N, 528, false, Q, Kp, S, true); }, iters);
    r["bf16 PV brgemm packed"] =
        us([&] { at::native::cpublas::brgemm(M, D, N, 528, D, D, true, P, Vp, O, true); }, iters);
    at::native::cpublas::brgemm_release(true);
  }
  if (bf16) {
    int m = D, n = M, k = N, ia = 528, ib = ldq, ic = D;
    r["bf16 PV mkl"] =
        us([&] { bgemm("N", "N", &m, &n, &k, &one, V, &ib, P, &ia, &one, O, &ic); }, iters);
  }
  // fp32: sgemm in place against brgemm on K^T and V contiguous
  float *Qf = buf<float>(M * ldq, 0), *Kf = buf<float>(N * ldq, 0), *Vf = buf<float>(N * ldq, 0);
  float *Pf = buf<float>(M * 528, 0), *Kt = buf<float>(D * N, 0), *Vc = buf<float>(N * D, 0);
  fill(Qf, M * ldq), fill(Kf, N * ldq), fill(Vf, N * ldq), fill(Pf, M * 528);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t c = 0; c < D; ++c)
      Kt[c * N + j] = Kf[j * ldq + c], Vc[j * D + c] = Vf[j * ldq + c];
  {
    int m = N, n = M, k = D, ia = ldq, ib = ldq, ic = 528;
    r["fp32 S sgemm in place"] =
        us([&] { sgemm("T", "N", &m, &n, &k, &one, Kf, &ib, Qf, &ia, &zero, S, &ic); }, iters);
  }
  // The packed fp32 kernels: brgemm (AVX-512), the AVX2 ones.
  std::vector<std::pair<std::string, cpu::TileGemm>> packed;
  if (avx512) packed.emplace_back("brgemm", cpu::TileGemm::kFp32Brgemm);
  if (avx2) packed.emplace_back("avx2", cpu::TileGemm::kFp32Avx2);
  for (const auto& [name, kernel] : packed)
    r["fp32 S " + name + " K^T"] =
        us([&] { cpu::gemm_packed(kernel, M, N, D, Qf, ldq, Kt, N, S, 528, false); }, iters);
  {
    int m = D, n = M, k = N, ia = 528, ib = ldq, ic = D;
    r["fp32 PV sgemm in place"] =
        us([&] { sgemm("N", "N", &m, &n, &k, &one, Vf, &ib, Pf, &ia, &one, O, &ic); }, iters);
  }
  for (const auto& [name, kernel] : packed)
    r["fp32 PV " + name + " V copied"] =
        us([&] { cpu::gemm_packed(kernel, M, D, N, Pf, 528, Vc, D, O, D, true); }, iters);
  // fp32 S as six bf16 part products on AMX (csrc/cpu/split_products.h), and
  // the splits of a query tile and of a key tile behind it.
  if (cpu::select_path(at::kFloat, D, 0.125).split()) {
    std::vector<int64_t> bad;
    bf *Q6 = buf<bf>(M * 6 * D, 0), *K6 = buf<bf>(6 * D * N, 0);
    r["split: fp32 Q tile"] = us([&] { cpu::split_queries(Qf, ldq, M, D, Q6, bad); }, iters);
    r["split: fp32 K tile packed"] =
        us([&] { cpu::pack_keys_split(Kf, ldq, N, D, K6, bad); }, iters);
    r["fp32 S split (6 bf16 products, AMX)"] = us(
        [&] { cpu::gemm_split_scores(M, N, D, Q6, K6, N, S, 528, {Qf, ldq}, {Kf, ldq}, {}, {}); },
        iters);
    at::native::cpublas::brgemm_release(true);
  }
  // The fp32 backward's products per (query tile, key tile), 256 rows x 256
  // keys (csrc/cpu/block_backward.cpp): S and dP on K^T / V^T, dV^T += dO^T P
  // and dK^T += Q^T dS on the score tile, dQ += dS K.
  for (const auto& [name, kernel] : packed) {
    const int64_t T = 256, lds = 272;
    float *Sb = buf<float>(T * lds, 0), *Dt = buf<float>(D * T, 0), *Acc = buf<float>(D * T, 0);
    fill(Sb, T * lds), fill(Dt, D * T);
    r["bwd fp32 S " + name + " 256x256x64"] =
        us([&] { cpu::gemm_packed(kernel, T, T, D, Qf, ldq, Kt, T, Sb, lds, false); }, iters);
    r["bwd fp32 dV^T " + name + " 64x256x256"] =
        us([&] { cpu::gemm_packed(kernel, D, T, T, Dt, T, Sb, lds, Acc, T, true); }, iters);
    r["bwd fp32 dQ " + name + " 256x64x256"] =
        us([&] { cpu::gemm_packed(kernel, T, D, T, Sb, lds, Vc, D, Qf, ldq, true); }, iters);
  }
  // The forward's pass between its two products, over the S tile in place,
  // in each of the lanes this machine runs: each row's maximum, then
  // exp(scale * s - max) and its sum; and the pass after a row's first key
  // tile: one sweep, the row's shift kept (here its maximum: it never rises).
  std::vector<std::pair<std::string, cpu::Lanes>> lanes = {{"vec", cpu::Lanes::kVec}};
  if (avx2) lanes.emplace_back("avx2", cpu::Lanes::kAvx2);
  if (avx512) lanes.emplace_back("avx512", cpu::Lanes::kAvx512);
  for (const auto& [name, lane] : lanes) {
    fill(S, M * 528);
    r["pass: fp32 softmax " + name + " (row max, exp, sum)"] = us(
        [&] {
          for (int64_t i = 0; i < M; ++i)
            cpu::exp_row(S + i * 528, N, 0.125f, cpu::row_max(S + i * 528, N) * 0.125f, lane);
        },
        iters);
    std::vector<float> shift(M);
    fill(S, M * 528);
    for (int64_t i = 0; i < M; ++i) shift[i] = cpu::row_max(S + i * 528, N) * 0.125f;
    r["pass: fp32 lazy exp " + name + " (shift kept)"] = us(
        [&] {
          for (int64_t i = 0; i < M; ++i) {
            float m = shift[i];
            cpu::exp_row_lazy(S + i * 528, N, 0.125f, &m, 8.0f, lane);
          }
        },
        iters);
  }
  // The forward's S and its pass on a row's later key tiles (the shift kept):
  // the pass over the stored tile after S, or in S's epilogue (gemm_exp).
  if (avx2) {
    std::vector<float> shift(M), sums(M);
    std::vector<uint8_t> passed(M);
    cpu::gemm_packed(cpu::TileGemm::kFp32Avx2, M, N, D, Qf, ldq, Kt, N, S, 528, false);
    for (int64_t i = 0; i < M; ++i) shift[i] = cpu::row_max(S + i * 528, N) * 0.125f;
    r["fp32 S + lazy pass avx2, the pass apart"] = us(
        [&] {
          cpu::gemm_packed(cpu::TileGemm::kFp32Avx2, M, N, D, Qf, ldq, Kt, N, S, 528, false);
          for (int64_t i = 0; i < M; ++i) {
            float m = shift[i];
            cpu::exp_row_lazy(S + i * 528, N, 0.125f, &m, 8.0f, cpu::Lanes::kAvx2);
          }
        },
        iters);
    r["fp32 S + lazy pass avx2, in S's epilogue"] = us(
        [&] {
          cpu::avx2::gemm_exp(M, N, D, Qf, ldq, Kt, N, S, 528, 0.125f, shift.data(), 8.0f,
                              sums.data(), passed.data());
        },
        iters);
  }
  return r;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
