// mma_probe: measures the sustained rate of the warp-level tensor-core
// instruction mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (the
// instruction a non-wgmma kernel is limited by).  A tiny pybind11 extension
// with no torch headers: the caller passes device pointers as integers and a
// cudaStream_t as an integer, and times the launch itself (CUDA events).
//
// Each thread loads its A (4 x b32 = 8 bf16) and B (2 x b32 = 4 bf16)
// fragments from global memory (so nothing is constant-folded), then runs
// `iters` rounds of `chains` (default NACC = 8) independent mma.sync ops into
// that many register accumulators (independent chains hide the mma latency),
// and finally writes the sum of its accumulators to global memory (so nothing
// is dead code).  With ldsm, each round's A fragments come from shared memory
// by ldmatrix.x4, one per two chains, as in a dimsplit_t score warp.  Few
// warps per SM and few chains measure what one dependent instruction stream
// per scheduler can reach (bench/ceilings.py mma_sync_stream_table).
//
// FLOP per mma = 2*16*8*16 = 4096.  Work = blocks * (threads/32) * iters * chains mmas.
//
// Build (bench/ceilings.py does this):
//   nvcc -O3 -shared -Xcompiler -fPIC -std=c++17 $(python3 -m pybind11 --includes) \
//        -gencode arch=compute_90,code=sm_90 mma_probe.cu -o mma_probe_ext$(EXT_SUFFIX)
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace {

constexpr int NACC = 8;  // independent accumulator chains per warp of the throughput launch (mma_sync_tflops)

// kChains independent accumulators per warp, each round kChains mma.sync. kLdsm: a round first takes its A
// fragments from shared memory by ldmatrix.x4 (one per two chains, as a score warp of the dimsplit_t schedule
// feeds 3 MMAs per K fragment: 2 m16 tiles x kChains / 2 n8 tiles), requested one round ahead; B stays in
// registers. Without kLdsm, A and B stay in registers (the device's issue-rate ceiling).
template <int kChains, bool kLdsm>
__global__ void __launch_bounds__(512)
mma_loop_kernel(const uint32_t* __restrict__ in, uint32_t in_words_mask,
                float* __restrict__ out, int iters) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ __align__(16) uint16_t a_smem[2][16][24];  // two m16 x k16 bf16 tiles, rows padded by 16 B
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t a[4], b[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = in[(tid * 6 + i) & in_words_mask];
#pragma unroll
  for (int i = 0; i < 2; ++i) b[i] = in[(tid * 6 + 4 + i) & in_words_mask];
  constexpr int kMt = kLdsm ? 2 : 1;
  uint32_t a_lds[2][kMt][4];  // (kLdsm) this round's and the next round's A fragments
  uint32_t lds_addr = 0;
  if constexpr (kLdsm) {
    for (int i = threadIdx.x; i < 2 * 16 * 24; i += blockDim.x)
      (&a_smem[0][0][0])[i] = static_cast<uint16_t>(in[(i * 7) & in_words_mask]);
    __syncthreads();
    const int lane = threadIdx.x % 32;
    lds_addr = static_cast<uint32_t>(__cvta_generic_to_shared(&a_smem[0][lane % 16][(lane / 16) * 8]));
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(a_lds[0][mt][0]), "=r"(a_lds[0][mt][1]), "=r"(a_lds[0][mt][2]), "=r"(a_lds[0][mt][3])
                   : "r"(lds_addr + mt * 16 * 24 * 2));
  }

  float acc[kChains][4];
#pragma unroll
  for (int j = 0; j < kChains; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[j][r] = 0.f;

  for (int it = 0; it < iters; it += 2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // two rounds per trip: the A double buffer's index is a constant
      if constexpr (kLdsm) {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(a_lds[h ^ 1][mt][0]), "=r"(a_lds[h ^ 1][mt][1]), "=r"(a_lds[h ^ 1][mt][2]),
                         "=r"(a_lds[h ^ 1][mt][3])
                       : "r"(lds_addr + mt * 16 * 24 * 2));
      }
#pragma unroll
      for (int j = 0; j < kChains; ++j) {
        const uint32_t* aj = kLdsm ? a_lds[h][j % kMt] : a;
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
            : "r"(aj[0]), "r"(aj[1]), "r"(aj[2]), "r"(aj[3]), "r"(b[0]), "r"(b[1]));
      }
    }
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kChains; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  out[tid] = s;
#endif
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + ": " +
                             cudaGetErrorString(e));
  }
}

// in_ptr: device pointer to in_words uint32 words (in_words a power of two);
// out_ptr: device pointer to blocks*threads floats; stream: cudaStream_t as int; iters: rounds per warp (even);
// chains: independent accumulators per warp (1, 2, 3, 4, 6, 8, 12); ldsm: A fragments by ldmatrix (even chains).
// Raises std::invalid_argument on any other value.
void launch(uintptr_t in_ptr, uint32_t in_words, uintptr_t out_ptr, int blocks,
            int threads, int iters, uintptr_t stream, int chains, bool ldsm) {
  if (in_words == 0 || (in_words & (in_words - 1)) != 0)
    throw std::invalid_argument("in_words must be a power of two");
  if (threads % 32 != 0 || threads < 32 || threads > 512)
    throw std::invalid_argument("threads must be a multiple of 32 in [32, 512]");
  if (blocks < 1 || iters < 2 || iters % 2 != 0) throw std::invalid_argument("blocks >= 1, iters even and >= 2");
  check(cudaGetLastError(), "mma_probe: pending error before launch");
  const auto* in = reinterpret_cast<const uint32_t*>(in_ptr);
  auto* out = reinterpret_cast<float*>(out_ptr);
  auto* s = reinterpret_cast<cudaStream_t>(stream);
  const uint32_t mask = in_words - 1;
#define MMA_PROBE_CASE(C)                                                                   \
  case C:                                                                                   \
    if (ldsm) {                                                                             \
      if (C % 2 != 0) throw std::invalid_argument("ldsm needs an even chain count");        \
      mma_loop_kernel<C, true><<<blocks, threads, 0, s>>>(in, mask, out, iters);            \
    } else {                                                                                \
      mma_loop_kernel<C, false><<<blocks, threads, 0, s>>>(in, mask, out, iters);           \
    }                                                                                       \
    break;
  switch (chains) {
    MMA_PROBE_CASE(1) MMA_PROBE_CASE(2) MMA_PROBE_CASE(3) MMA_PROBE_CASE(4) MMA_PROBE_CASE(6)
    MMA_PROBE_CASE(8) MMA_PROBE_CASE(12)
    default: throw std::invalid_argument("chains must be 1, 2, 3, 4, 6, 8 or 12");
  }
#undef MMA_PROBE_CASE
  check(cudaGetLastError(), "mma_probe: launch");
}

// Synchronize the stream and report any asynchronous kernel error.
void stream_sync(uintptr_t stream) {
  check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)),
        "mma_probe: kernel");
}

}  // namespace

PYBIND11_MODULE(mma_probe_ext, m) {
  m.doc() = "mma.sync m16n8k16 bf16 throughput probe (see bench/ceilings.py)";
  m.attr("NACC") = NACC;
  m.attr("FLOP_PER_MMA") = 2 * 16 * 8 * 16;
  m.def("launch", &launch, "launch the mma loop kernel", pybind11::arg("in_ptr"),
        pybind11::arg("in_words"), pybind11::arg("out_ptr"), pybind11::arg("blocks"),
        pybind11::arg("threads"), pybind11::arg("iters"), pybind11::arg("stream"),
        pybind11::arg("chains") = NACC, pybind11::arg("ldsm") = false);
  m.def("sync", &stream_sync, "synchronize stream and check errors", pybind11::arg("stream"));
}
