// Row-wise softmax statistics and gradients over tiles of logits, shared by the native fused ops.
//
// These are the tile kernels of the chunked plan in kernels/linear_logprob_entropy.py (see its docstring for
// the math): tile_stats merges one fp32 tile of raw logits into running per-row (m, s, b, z_y) and only reads
// the tile; tile_grad overwrites a tile with dL/dx. Used by linear_logprob_entropy.cpp and ppo_loss.cpp.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace prorl {

// e^x for x <= ~88, branch-free so that it vectorises: x = k ln2 + r with |r| <= ln2/2, e^r by the
// Cephes degree-6 polynomial (about 1 ulp), 2^k built in the exponent bits. Inputs below -87.3 are
// clamped there (e^-87.3 = 1.2e-38), inputs above 88.3 to e^88.3 (finite). fast_exp(0) == 1 exactly.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float fx = x * 1.44269504088896341f;
  const float kf = (fx + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23 trick
  float r = x - kf * 0.693359375f;                     // ln2 split in a high and a low part
  r = r - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(kf) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Merge one tile x[rows, cols] (raw logits of columns c0..c0+cols) into the running statistics; x is read only.
inline void tile_stats(const float* x, int64_t rows, int64_t cols, int64_t c0, const int64_t* labels,
                       float inv_t, float* m, float* s, float* b, float* zy) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < cols; ++j) mx = std::max(mx, xr[j]);
    const float m_new = std::max(m[r], mx * inv_t);  // inv_t > 0: max commutes with the scaling
    float se = 0.f, sb = 0.f;
#pragma omp simd reduction(+ : se, sb)
    for (int64_t j = 0; j < cols; ++j) {
      const float d = xr[j] * inv_t - m_new;  // <= 0
      const float e = fast_exp(d);
      se += e;
      sb += d * e;
    }
    // b is sum (z - m) e^(z - m): re-centre the old sum on the new max before adding the tile's.
    const float alpha = expf(m[r] - m_new);
    b[r] = alpha * (b[r] + (m[r] - m_new) * s[r]) + sb;
    s[r] = alpha * s[r] + se;
    m[r] = m_new;
    const int64_t local = labels[r] - c0;
    if (local >= 0 && local < cols) zy[r] = xr[local] * inv_t;
  }
}

// In place: raw logits -> dL/dx = -(g_lp + g_ent (z - E_p[z])) p + g_lp 1[j = y]. g_lp and g_ent arrive
// multiplied by 1/T; rows where both are 0 become exact zeros without an exponential.
inline void tile_grad(float* x, int64_t rows, int64_t cols, int64_t c0, const int64_t* labels, float inv_t,
                      const float* lse, const float* ez, const float* g_lp, const float* g_ent) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * cols;
    const float l = lse[r], e = ez[r], gl = g_lp[r], ge = g_ent[r];
    if (gl == 0.f && ge == 0.f) {
      std::fill(xr, xr + cols, 0.f);
      continue;
    }
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      const float z = xr[j] * inv_t;
      const float p = fast_exp(z - l);
      xr[j] = -(gl + ge * (z - e)) * p;
    }
    const int64_t local = labels[r] - c0;
    if (local >= 0 && local < cols) xr[local] += gl;
  }
}

}  // namespace prorl
