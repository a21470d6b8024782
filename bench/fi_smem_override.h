// Pre-included (nvcc -include) into a second build of FlashInfer's fa2 MLA module by
// bench/flashinfer_baselines.py: the module then sees at most MLAGEN_FI_SMEM_PER_SM bytes of shared
// memory per SM, so mla.cuh's DISPATCH_SMEM_CONFIG (which reads
// cudaDevAttrMaxSharedMemoryPerMultiprocessor at run time) picks the configuration it picks on a GPU
// with that much shared memory -- e.g. 102400 B (sm_120, RTX PRO 6000): 1 stage of 16 KV rows, no QK
// shard, instead of the H200's 2 stages of 64. Every other attribute passes through unchanged.
// FlashInfer's files on disk are not touched; the module is built under its own name.
#pragma once
#include <cuda_runtime.h>

#ifndef MLAGEN_FI_SMEM_PER_SM
#error "bench/fi_smem_override.h needs -DMLAGEN_FI_SMEM_PER_SM=<bytes>"
#endif

static inline cudaError_t mlagen_fi_device_get_attribute(int* value, cudaDeviceAttr attr, int device) {
  cudaError_t err = ::cudaDeviceGetAttribute(value, attr, device);
  if (err == cudaSuccess && attr == cudaDevAttrMaxSharedMemoryPerMultiprocessor &&
      *value > (MLAGEN_FI_SMEM_PER_SM)) {
    *value = (MLAGEN_FI_SMEM_PER_SM);
  }
  return err;
}

#define cudaDeviceGetAttribute mlagen_fi_device_get_attribute
