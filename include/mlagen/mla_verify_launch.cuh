// mlagen/mla_verify_launch.cuh — host-side launch of partial + combine for one config.
// Graph safe: no allocation, no host sync; grid = (row blocks, num_splits, batch) fixed by the
// variant and the batch size; lengths are read on the device.
#pragma once
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

template <class Cfg>
cudaError_t mla_verify_launch(const MlaVerifyParams& p, cudaStream_t stream) {
  // Defence in depth (the Python wrapper checks these first): grid and workspace layout assume them.
  if (p.num_splits < 1 || p.num_splits > kMaxSplits) return cudaErrorInvalidValue;
  if (p.q_len < 1 || p.q_len > Cfg::kQLenMax || p.batch_size < 0 || p.batch_size > 65535) return cudaErrorInvalidValue;
  if (Cfg::kMask == MaskKind::kTree && p.tree_mask == nullptr) return cudaErrorInvalidValue;
  if (p.batch_size == 0) return cudaSuccess;
  // dimsplit, dimsplit_t: two CTAs (a cluster, compile-time __cluster_dims__) per row block.
  const dim3 grid_partial(Cfg::kRowBlocks * Cfg::kClusterCtas, p.num_splits, p.batch_size);
  partial_kernel<Cfg>()<<<grid_partial, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid_combine(Cfg::kRowsMax, p.batch_size);
  mla_verify_combine_kernel<Cfg::kHeads, Cfg::kRowsMax, Cfg::kDimV, Cfg::kBlockN><<<grid_combine, Cfg::kDimV / 4, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlagen
