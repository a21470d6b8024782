// mlagen/mla_verify_launch.cuh — host-side launch of partial + combine for one config (dimsplit_t: one kernel when
// its grid is co-resident and the caller passes merge counters, mla_verify_merge.cuh).
// Graph safe: no allocation, no host sync; grid = (row blocks, num_splits, batch) fixed by the
// variant and the batch size; lengths are read on the device.
#pragma once
#include <cstdlib>
#include <cstring>

#include <cuda_runtime.h>

#include "mlagen/mla_verify_combine.cuh"
#include "mlagen/mla_verify_dimsplit.cuh"
#include "mlagen/mla_verify_dimsplit_t.cuh"
#include "mlagen/mla_verify_partial.cuh"

namespace mlagen {

// The partial kernel of a config's schedule: rowblock (MlaVerifyConfig), dimsplit (MlaDimSplitConfig) or
// dimsplit_t (MlaDimSplitTConfig, the only config with kTransposed set).
template <class Cfg>
constexpr auto partial_kernel() {
  if constexpr (Cfg::kTransposed) {
    return &mla_verify_dimsplit_t_kernel<Cfg>;
  } else if constexpr (Cfg::kDimSplit) {
    return &mla_verify_dimsplit_kernel<Cfg>;
  } else {
    return &mla_verify_partial_kernel<Cfg>;
  }
}

// Launch `kernel` with cudaLaunchAttributeProgrammaticStreamSerialization: it may start while the kernel before it in
// the stream still runs (once that kernel's CTAs have all run griddepcontrol.launch_dependents or exited), so it must
// run ptx::griddep_wait() before touching anything that kernel writes. CUDA-graph capture keeps the programmatic edge.
// A driver that refuses the attribute gets its error returned (and cleared from the runtime's last error), with no
// silent fall-back, which could not work inside a stream capture anyway.
template <class Kernel>
cudaError_t launch_programmatic_dependent(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                                          const MlaVerifyParams& p) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, p);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

template <class Cfg>
cudaError_t mla_verify_prepare() {
  return cudaFuncSetAttribute(partial_kernel<Cfg>(), cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
}

// Preferred shared-memory carveout of the partial kernel, in percent of the SM's shared capacity
// (cudaFuncAttributePreferredSharedMemoryCarveout; -1 = the driver's default). Used to time an H200 at
// the CTAs per SM that sm_120's ~100 KB allows.
template <class Cfg>
cudaError_t mla_verify_set_carveout(int percent) {
  return cudaFuncSetAttribute(partial_kernel<Cfg>(), cudaFuncAttributePreferredSharedMemoryCarveout, percent);
}

// Whether the combine is launched as a programmatic dependent launch of the partial kernel: off unless the
// environment variable MLAGEN_PDL=1 is set (read once per process). On an H200 it was 0.9 µs faster at 4k bs 1
// and 0.5-0.9 µs slower from 16k up (docs/perf-notes.md v14), so the plain launch is the default.
inline bool combine_pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("MLAGEN_PDL");
    return e != nullptr && std::strcmp(e, "1") == 0;
  }();
  return on;
}

// The combine of a config with kChunks dim chunks per row (mla_verify_combine.cuh). With PDL its CTAs may be
// scheduled while the partial kernel's last CTAs still run (they wait in ptx::griddep_wait) instead of after the
// partial kernel has drained (launch_programmatic_dependent). PDL is opt-in. Without PDL, griddep_wait returns at
// once (stream order already holds).
template <class Cfg, int kChunks>
cudaError_t mla_verify_combine_launch(const MlaVerifyParams& p, cudaStream_t stream) {
  // o_part's element type: every config says (fp32, or bf16 for dimsplit_t: mla_verify_partial_store.cuh)
  auto* kernel = &mla_verify_combine_kernel<Cfg::kHeads, Cfg::kRowsMax, Cfg::kDimV, Cfg::kBlockN, kChunks,
                                            typename Cfg::PartialT, (Cfg::kPdl > 0)>;
  const dim3 grid(Cfg::kRowsMax * kChunks, p.batch_size);
  if (combine_pdl_enabled()) return launch_programmatic_dependent(kernel, grid, dim3(kCombineThreads), 0, stream, p);
  kernel<<<grid, kCombineThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Clusters of the partial kernel that can be resident on the current device at once (cudaOccupancyMaxActiveClusters),
// cached per device; refresh = true queries again (after the shared-memory carveout changed). 0 for configs without
// clusters (rowblock) or when the query fails. The host's split count takes at most this many clusters per wave
// (mlagen/ops.py VerifyKernel.cta_slots); the launch path queries it only for the fused merge's co-residency check.
template <class Cfg>
int mla_verify_max_active_clusters(bool refresh = false) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  static bool known[kMaxDevices] = {};
  if (Cfg::kClusterCtas < 2) return 0;  // every config says (dimsplit, dimsplit_t: 2)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    (void)cudaGetLastError();
    return 0;
  }
  if (refresh || !known[dev]) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(Cfg::kClusterCtas, 1, 1);
    cfg.blockDim = dim3(Cfg::kThreads);
    cfg.dynamicSmemBytes = Cfg::kSmemBytes;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, partial_kernel<Cfg>(), &cfg) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 0;
    }
    cached[dev] = n;
    known[dev] = true;
  }
  return cached[dev];
}

// Whether a launch of num_clusters clusters of Cfg's partial kernel folds the combine in (mla_verify_merge.cuh): a
// config with the merge (dimsplit_t built with MLAGEN_DST_MERGE 1 only), merge counters given, and every cluster of
// the grid resident at once on this device (the merge waits for all of them). Shipped configs stop at the first test.
template <class Cfg>
bool mla_verify_fused_merge(const MlaVerifyParams& p, long long num_clusters) {
  return Cfg::kFusedMerge && p.merge_counters != nullptr && num_clusters <= mla_verify_max_active_clusters<Cfg>();
}

template <class Cfg>
cudaError_t mla_verify_launch(const MlaVerifyParams& p_in, cudaStream_t stream) {
  MlaVerifyParams p = p_in;
  // Defence in depth (the Python wrapper checks these first): grid and workspace layout assume them.
  if (p.num_splits < 1 || p.num_splits > kMaxSplits) return cudaErrorInvalidValue;
  if (p.q_len < 1 || p.q_len > Cfg::kQLenMax || p.batch_size < 0 || p.batch_size > 65535) return cudaErrorInvalidValue;
  if (p.batch_size == 0) return cudaSuccess;
  // tree rows from somewhere, unless every row of a direct batch is padding (then no row reads them)
  if (Cfg::kMask == MaskKind::kTree && p.tree_mask == nullptr && p.tree_qlen_mask == nullptr &&
      !(p.seq_lens != nullptr && p.num_real == 0))
    return cudaErrorInvalidValue;
  if (p.seq_lens != nullptr && (p.num_real < 0 || p.num_real > p.batch_size || p.block_table_rows < 1 ||
                                p.block_table_cols < 0 || p.req_idx == nullptr))
    return cudaErrorInvalidValue;
  // dimsplit, dimsplit_t: two CTAs (a cluster, compile-time __cluster_dims__) per row block.
  const dim3 grid_partial(Cfg::kRowBlocks * Cfg::kClusterCtas, p.num_splits, p.batch_size);
  const long long clusters = static_cast<long long>(Cfg::kRowBlocks) * p.num_splits * p.batch_size;
  const bool fused = mla_verify_fused_merge<Cfg>(p, clusters);
  if (!fused) p.merge_counters = nullptr;
  cudaError_t err = cudaSuccess;
  if constexpr (Cfg::kPdl > 0) {  // a programmatic dependent of the kernel before (MLAGEN_DST_PDL, MLAGEN_ROWBLOCK_PDL)
    err = launch_programmatic_dependent(partial_kernel<Cfg>(), grid_partial, dim3(Cfg::kThreads), Cfg::kSmemBytes,
                                        stream, p);
  } else {
    partial_kernel<Cfg>()<<<grid_partial, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess || fused) return err;
  switch (combine_chunks(p.num_splits)) {
    case 8:
      return mla_verify_combine_launch<Cfg, 8>(p, stream);
    case 4:
      return mla_verify_combine_launch<Cfg, 4>(p, stream);
    default:
      return mla_verify_combine_launch<Cfg, 1>(p, stream);
  }
}

}  // namespace mlagen
