// Native CPU backend of prorl.kernels.linear_logprob_entropy (see that module's docstring for the math).
//
// The plan is the chunked one shared by all backends: the [N, V] logits are visited in tiles of at most
// `chunk_bytes`; each tile is produced by MKL's sgemm (at::mm_out into one reused buffer) and consumed at
// once by an OpenMP loop over its rows that does the exponentials and reductions. Backward recomputes the
// tile, turns it into dL/dx in place, and hands it back to sgemm for dhidden and dweight. All arithmetic
// on logits and gradients is fp32; bf16/fp16 inputs are converted tile by tile.
//
// Registered as torch.ops.prorl.lle_forward / lle_backward (no Python bindings; loaded with
// torch.ops.load_library). The per-tile loops live in softmax_tiles.h; their exponential (fast_exp) is
// written so that GCC vectorises the `omp simd` loops (8 lanes with AVX2) without -ffast-math, which would
// change the process's numerics. Nothing relies on infinities: the running max starts at -FLT_MAX.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <tuple>

#include "softmax_tiles.h"  // fast_exp, tile_stats, tile_grad (shared with ppo_loss.cpp)

namespace prorl {
namespace {

constexpr int64_t kMinTileCols = 256;

// Rows and columns of one fp32 tile within chunk_bytes; mirrors tile_shape() in Python.
std::pair<int64_t, int64_t> tile_shape(int64_t n, int64_t v, int64_t chunk_bytes) {
  const int64_t min_cols = std::min(v, kMinTileCols);
  const int64_t rows = std::max<int64_t>(1, std::min(n, chunk_bytes / (4 * min_cols)));
  const int64_t cols = std::max(min_cols, std::min(v, chunk_bytes / (4 * rows)));
  return {rows, cols};
}

void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels) {
  TORCH_CHECK(hidden.device().is_cpu() && weight.device().is_cpu() && labels.device().is_cpu(),
              "prorl native kernels take CPU tensors");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "hidden [N, D] and weight [V, D] expected");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == hidden.size(0), "labels [N] expected");
  TORCH_CHECK(labels.scalar_type() == at::kLong, "labels must be int64");
}

// A [rows, cols] fp32 view over the front of the reused tile buffer.
at::Tensor tile_view(const at::Tensor& buf, int64_t rows, int64_t cols) {
  return buf.narrow(0, 0, rows * cols).view({rows, cols});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lle_forward(const at::Tensor& hidden,
                                                                        const at::Tensor& weight,
                                                                        const at::Tensor& labels, double inv_t,
                                                                        int64_t chunk_bytes) {
  check_inputs(hidden, weight, labels);
  const int64_t n = hidden.size(0), v = weight.size(0);
  auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor m = at::full({n}, -FLT_MAX, f32), s = at::zeros({n}, f32), b = at::zeros({n}, f32);
  at::Tensor zy = at::zeros({n}, f32);
  if (n > 0) {
    const at::Tensor h = hidden.to(at::kFloat).contiguous();
    const at::Tensor w = weight.contiguous();
    const at::Tensor y = labels.contiguous();
    auto [rows, cols] = tile_shape(n, v, chunk_bytes);
    at::Tensor buf = at::empty({rows * cols}, f32);
    for (int64_t r0 = 0; r0 < n; r0 += rows) {
      const int64_t nr = std::min(rows, n - r0);
      const at::Tensor hb = h.narrow(0, r0, nr);
      for (int64_t c0 = 0; c0 < v; c0 += cols) {
        const int64_t nc = std::min(cols, v - c0);
        at::Tensor x = tile_view(buf, nr, nc);
        at::mm_out(x, hb, w.narrow(0, c0, nc).to(at::kFloat).t());
        tile_stats(x.data_ptr<float>(), nr, nc, c0, y.data_ptr<int64_t>() + r0, static_cast<float>(inv_t),
                   m.data_ptr<float>() + r0, s.data_ptr<float>() + r0, b.data_ptr<float>() + r0,
                   zy.data_ptr<float>() + r0);
      }
    }
  }
  const at::Tensor log_s = at::log(s);
  const at::Tensor mean_shift = b / s;  // E_p[z] - m
  at::Tensor lse = m + log_s;
  return {zy - lse, log_s - mean_shift, lse, m + mean_shift};
}

std::tuple<at::Tensor, at::Tensor> lle_backward(const at::Tensor& hidden, const at::Tensor& weight,
                                                const at::Tensor& labels, const at::Tensor& lse,
                                                const at::Tensor& ez, const at::Tensor& g_lp,
                                                const at::Tensor& g_ent, double inv_t, int64_t chunk_bytes,
                                                bool need_h, bool need_w) {
  check_inputs(hidden, weight, labels);
  const int64_t n = hidden.size(0), v = weight.size(0), d = hidden.size(1);
  auto f32 = hidden.options().dtype(at::kFloat);
  const at::Tensor h = hidden.to(at::kFloat).contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor y = labels.contiguous(), l = lse.contiguous(), e = ez.contiguous();
  const at::Tensor gl = g_lp.to(at::kFloat).contiguous(), ge = g_ent.to(at::kFloat).contiguous();
  auto [rows, cols] = tile_shape(std::max<int64_t>(n, 1), v, chunk_bytes);
  // With a single row block every dW tile is written once, straight into an fp32 result.
  at::Tensor gh = need_h ? at::zeros({n, d}, f32) : at::Tensor();
  at::Tensor gw = need_w ? (rows >= n ? at::empty({v, d}, f32) : at::zeros({v, d}, f32)) : at::Tensor();
  if (need_w && n == 0) gw.zero_();
  at::Tensor buf = at::empty({rows * cols}, f32);
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t nr = std::min(rows, n - r0);
    const at::Tensor hb = h.narrow(0, r0, nr);
    for (int64_t c0 = 0; c0 < v; c0 += cols) {
      const int64_t nc = std::min(cols, v - c0);
      const at::Tensor wt = w.narrow(0, c0, nc).to(at::kFloat);  // [nc, D] fp32 (a view when fp32)
      at::Tensor x = tile_view(buf, nr, nc);
      at::mm_out(x, hb, wt.t());
      tile_grad(x.data_ptr<float>(), nr, nc, c0, y.data_ptr<int64_t>() + r0, static_cast<float>(inv_t),
                l.data_ptr<float>() + r0, e.data_ptr<float>() + r0, gl.data_ptr<float>() + r0,
                ge.data_ptr<float>() + r0);
      if (need_h) {
        at::Tensor ghb = gh.narrow(0, r0, nr);
        ghb.addmm_(x, wt);
      }
      if (need_w) {
        at::Tensor gwt = gw.narrow(0, c0, nc);
        if (rows >= n) {
          at::mm_out(gwt, x.t(), hb);
        } else {
          gwt.addmm_(x.t(), hb);
        }
      }
    }
  }
  const at::Tensor none = at::empty({0}, f32);  // placeholder for a gradient that was not asked for
  return {need_h ? gh.to(hidden.scalar_type()) : none, need_w ? gw.to(weight.scalar_type()) : none};
}

}  // namespace

TORCH_LIBRARY(prorl, lib) {
  lib.def("lle_forward(Tensor hidden, Tensor weight, Tensor labels, float inv_t, int chunk_bytes)"
          " -> (Tensor, Tensor, Tensor, Tensor)");
  lib.def("lle_backward(Tensor hidden, Tensor weight, Tensor labels, Tensor lse, Tensor ez, Tensor g_lp,"
          " Tensor g_ent, float inv_t, int chunk_bytes, bool need_h, bool need_w) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prorl, CPU, lib) {
  lib.impl("lle_forward", &lle_forward);
  lib.impl("lle_backward", &lle_backward);
}

}  // namespace prorl
