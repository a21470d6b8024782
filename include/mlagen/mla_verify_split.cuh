// mlagen/mla_verify_split.cuh — how a request's KV tiles are spread over the split-KV CTAs.
// Shared by the partial kernel (which tiles a CTA reads) and the combine (which splits hold data),
// so both derive the same partition from kv_len on the device (CUDA-graph safe: the grid is fixed).
#pragma once

namespace mlagen {

// Tiles per non-empty split: ceil(tiles / num_splits), at least min_tiles.
__host__ __device__ __forceinline__ int tiles_per_split(int kv_len, int block_n, int num_splits, int min_tiles) {
  const int num_tiles = (kv_len + block_n - 1) / block_n;
  const int per_split = (num_tiles + num_splits - 1) / num_splits;
  return per_split < min_tiles ? min_tiles : per_split;
}

// Tiles [tile_begin, tile_end) of a request handled by split `split`; past the end it is empty.
__host__ __device__ __forceinline__ void split_tile_range(int kv_len, int block_n, int num_splits, int min_tiles,
                                                          int split, int& tile_begin, int& tile_end) {
  const int num_tiles = (kv_len + block_n - 1) / block_n;
  const int per_split = tiles_per_split(kv_len, block_n, num_splits, min_tiles);
  tile_begin = split * per_split;
  tile_end = tile_begin + per_split < num_tiles ? tile_begin + per_split : num_tiles;
}

// Number of leading splits that hold data (0 for kv_len 0); the rest are empty.
__host__ __device__ __forceinline__ int live_splits(int kv_len, int block_n, int num_splits, int min_tiles) {
  if (kv_len <= 0) return 0;
  const int num_tiles = (kv_len + block_n - 1) / block_n;
  const int per_split = tiles_per_split(kv_len, block_n, num_splits, min_tiles);
  const int live = (num_tiles + per_split - 1) / per_split;
  return live < num_splits ? live : num_splits;
}

}  // namespace mlagen
