// mlagen/mla_verify_launch.cuh — host-side launch of partial + combine for one config.
// Graph safe: no allocation, no host sync; grid = (row blocks, num_splits, batch) fixed by the
// variant and the batch size; lengths are read on the device.
#pragma once
#include <cuda_runtime.h>

#include "mlagen/mla_verify_combine.cuh"
#include "mlagen/mla_verify_partial.cuh"

namespace mlagen {

template <class Cfg>
cudaError_t mla_verify_prepare() {
  return cudaFuncSetAttribute(mla_verify_partial_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              Cfg::kSmemBytes);
}

template <class Cfg>
cudaError_t mla_verify_launch(const MlaVerifyParams& p, cudaStream_t stream) {
  if (p.batch_size == 0) return cudaSuccess;
  if (p.num_splits < 1 || p.num_splits > kMaxSplits) return cudaErrorInvalidValue;
  const dim3 grid_partial(Cfg::kRowBlocks, p.num_splits, p.batch_size);
  mla_verify_partial_kernel<Cfg><<<grid_partial, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid_combine(Cfg::kRowsMax, p.batch_size);
  mla_verify_combine_kernel<Cfg::kHeads, Cfg::kRowsMax, Cfg::kDimV><<<grid_combine, Cfg::kDimV / 4, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlagen
