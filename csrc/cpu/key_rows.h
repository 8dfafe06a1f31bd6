// How the CPU kernels address K/V rows: a run of active keys (u0, u0 + r,
// ...) of one K/V head lies a fixed stride apart in k and v, or, with a row
// map (params.h), wherever the map puts it: read in place where the map
// spaces the run's rows evenly, else gathered row by row.
#pragma once

#include <cstdint>

#include "../params.h"
#include "tile_math.h"

namespace ring_attention::cpu {

// Where the rows of a run of n keys of K/V head kvh (batch b) lie: row i at
// base + offset + i * stride, or (stride < 0) at base + p.k_index(b, u0 + i * r, kvh).
struct KeyRows {
  const BlockParams* p = nullptr;
  int64_t b = 0, kvh = 0, u0 = 0, r = 1, offset = 0, stride = 0;

  KeyRows() = default;
  KeyRows(const BlockParams& p_, int64_t b_, int64_t kvh_, int64_t u0_, int64_t r_, int64_t n)
      : p(&p_),
        b(b_),
        kvh(kvh_),
        u0(u0_),
        r(r_),
        offset(p_.k_index(b_, u0_, kvh_)),
        stride(p_.k_run_stride(u0_, kvh_, r_, n)) {}

  bool even() const { return stride >= 0; }
  int64_t at(int64_t i) const {
    return even() ? offset + i * stride : p->k_index(b, u0 + i * r, kvh);
  }

  // The n rows of k (or v) as a tile_t tile: in place when evenly spaced and
  // of the tile's type, else in buf.
  template <typename tile_t, typename scalar_t>
  TileRef<tile_t> tile(const scalar_t* k, int64_t n, TileBuffer<tile_t>& buf) const {
    if (even()) return tile_rows<tile_t>(k + offset, stride, n, p->head_dim, buf);
    return gather_rows<tile_t>(n, p->head_dim, buf, [&](int64_t i) { return k + at(i); });
  }

  // dst's n rows += src's (rows of d values, row stride ld).
  template <typename acc_t>
  void add(const acc_t* src, int64_t ld, int64_t n, acc_t* dst) const {
    const int64_t d = p->head_dim;
    for (int64_t i = 0; i < n; ++i) {
      acc_t* row = dst + at(i);
      const acc_t* add = src + i * ld;
      for (int64_t c = 0; c < d; ++c) row[c] += add[c];
    }
  }
};

}  // namespace ring_attention::cpu
