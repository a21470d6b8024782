// mma_probe: measures the sustained rate of the warp-level tensor-core
// instruction mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (the
// instruction a non-wgmma kernel is limited by).  A tiny pybind11 extension
// with no torch headers: the caller passes device pointers as integers and a
// cudaStream_t as an integer, and times the launch itself (CUDA events).
//
// Each thread loads its A (4 x b32 = 8 bf16) and B (2 x b32 = 4 bf16)
// fragments from global memory (so nothing is constant-folded), then runs
// `iters` rounds of NACC independent mma.sync ops into NACC register
// accumulators (independent chains hide the mma latency), and finally writes
// the sum of its accumulators to global memory (so nothing is dead code).
//
// FLOP per mma = 2*16*8*16 = 4096.  Work = blocks * (threads/32) * iters * NACC mmas.
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

constexpr int NACC = 8;  // independent accumulator chains per warp

__global__ void __launch_bounds__(512)
mma_loop_kernel(const uint32_t* __restrict__ in, uint32_t in_words_mask,
                float* __restrict__ out, int iters) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t a[4], b[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = in[(tid * 6 + i) & in_words_mask];
#pragma unroll
  for (int i = 0; i < 2; ++i) b[i] = in[(tid * 6 + 4 + i) & in_words_mask];

  float acc[NACC][4];
#pragma unroll
  for (int j = 0; j < NACC; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[j][r] = 0.f;

  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < NACC; ++j) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
          : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < NACC; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
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
// out_ptr: device pointer to blocks*threads floats; stream: cudaStream_t as int.
void launch(uintptr_t in_ptr, uint32_t in_words, uintptr_t out_ptr, int blocks,
            int threads, int iters, uintptr_t stream) {
  if (in_words == 0 || (in_words & (in_words - 1)) != 0)
    throw std::invalid_argument("in_words must be a power of two");
  if (threads % 32 != 0 || threads < 32 || threads > 512)
    throw std::invalid_argument("threads must be a multiple of 32 in [32, 512]");
  if (blocks < 1 || iters < 1) throw std::invalid_argument("blocks, iters >= 1");
  check(cudaGetLastError(), "mma_probe: pending error before launch");
  mma_loop_kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const uint32_t*>(in_ptr), in_words - 1,
      reinterpret_cast<float*>(out_ptr), iters);
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
        pybind11::arg("threads"), pybind11::arg("iters"), pybind11::arg("stream"));
  m.def("sync", &stream_sync, "synchronize stream and check errors", pybind11::arg("stream"));
}
