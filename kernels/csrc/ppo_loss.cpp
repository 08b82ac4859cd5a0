// Native CPU backend of prorl.kernels.ppo_loss (the math is in kernels/ppo_loss.py's docstring).
//
// One fused pass over the tokens, parallelised with OpenMP: per valid token the ratio, the clip-higher and
// dual clips, the KL estimator with its clamp, the importance weight and the aggregation weight give the
// token's loss contributions, its closed-form gradient dloss/dlogp and its share of every statistic. Sums are
// accumulated in double (OpenMP reductions); the per-token math is float for fp32/bf16/fp16 inputs (bf16 and
// fp16 are widened to fp32 before the kernel) and double for fp64 ones. Masked tokens are never read into the
// arithmetic (a select, not a multiply: they may hold NaN) and get exactly 0.
//
// Also registers the two softmax tile kernels (softmax_tiles.h) that the native backend of
// prorl.kernels.linear_ppo_loss drives from Python.
//
// Registered as torch.ops.prorl.ppo_forward, prorl.tile_update_stats, prorl.tile_grad (TORCH_LIBRARY_FRAGMENT:
// linear_logprob_entropy.cpp owns TORCH_LIBRARY(prorl)).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "softmax_tiles.h"

namespace prorl {
namespace {

// Must match STATS in kernels/_ppo_common.py; the option codes are positions in its KL_ESTIMATORS, KL_CLAMPS
// and IS_MODES.
enum Slot : int {
  kPg, kKl, kN, kClipLow, kClipHigh, kClip, kDual, kOldMinusNew, kRatio, kRatioMax, kKlSum, kIsSum, kIsMax,
  kIsModified, kNumStats
};
enum KlEstimator : int64_t { kK1 = 0, kK2 = 1, kK3 = 2 };
enum KlClamp : int64_t { kClampLogRatio = 0, kClampOutput = 1, kClampNone = 2 };
enum IsMode : int64_t { kIsAsGiven = 0, kIsTis = 1, kIsIcepop = 2 };
constexpr double kRatioLogClamp = 20.0;  // RATIO_LOG_CLAMP in kernels/_ppo_common.py

inline float exp_t(float x) { return fast_exp(x); }
inline double exp_t(double x) { return std::exp(std::min(x, 700.0)); }  // finite, like fast_exp

template <typename T>
struct Params {
  T lo, hi, dual_c, kl_coef, kl_v, is_lo, is_hi, inv_d;
  bool dual;
  int64_t kl_estimator, kl_clamp, is_mode;
};

constexpr int64_t kChunk = 256;  // tokens per inner loop: its per-token buffers (20 x 1 KiB) stay in L1
enum Input : int { kInLogp, kInOld, kInAdv, kInRef, kInIsw, kInWeight, kInputs };

// The per-token loop, in chunks of kChunk tokens. Phase 1 maps each token of the chunk to its loss terms,
// gradient and statistic contributions, written to small per-chunk arrays: a loop with no reductions and
// only selects, which GCC vectorises (a single loop with 14 mixed float/double OpenMP reductions stayed
// scalar and branchy: 33 ns/token at N = 64K). Phase 2 adds each array into double accumulators. Every
// thread keeps its own accumulators, merged in thread order afterwards: the result does not depend on
// timing. HasRef / HasIs / HasWeight / NeedGrad select the optional inputs and outputs at compile time.
// All 16 fp32 instantiations vectorise (checked with -fopt-info-vec); fp64 (a test dtype) stays scalar.
template <typename T, bool HasRef, bool HasIs, bool HasWeight, bool NeedGrad>
void token_loop(int64_t n, const T* logp, const T* old, const T* adv, const bool* valid, const T* ref,
                const T* isw, const T* weight, const Params<T>& p, T* grad, double* out) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int threads = omp_get_max_threads();
  std::vector<double> partial(static_cast<size_t>(threads) * kNumStats, 0.0);
#pragma omp parallel num_threads(threads)
  {
    double* acc = partial.data() + static_cast<size_t>(omp_get_thread_num()) * kNumStats;
    acc[kIsMax] = -std::numeric_limits<double>::infinity();
    alignas(64) T buf[kNumStats][kChunk];  // per token: the contribution to each slot
    alignas(64) T in[kInputs][kChunk];     // per token: the inputs, 0 on masked tokens
    const T zero = T(0), one = T(1);
    // the options as locals: GCC does not vectorise loads from the struct inside the loop
    const T lo = p.lo, hi = p.hi, dual_c = p.dual_c, kl_coef = p.kl_coef, kl_v = p.kl_v;
    const T is_lo = p.is_lo, is_hi = p.is_hi, inv_d = p.inv_d;
    const bool dual_on = p.dual;
    // The mode options as bounds and 0/1 weights, so that the loop has no select on them (GCC 12 does not
    // vectorise those). Exact: an inactive bound is infinite, and the estimators not chosen are finite
    // (exp_t never overflows) and weighted by 0.
    const T inf = std::numeric_limits<T>::infinity();
    const T log_v = p.kl_clamp == kClampLogRatio ? kl_v : inf;  // |d| bound before the estimator
    const T out_v = p.kl_clamp == kClampOutput ? kl_v : inf;    // |kl| bound after it
    const T k1 = p.kl_estimator == kK1 ? one : zero, k2 = p.kl_estimator == kK2 ? one : zero;
    const T k3 = p.kl_estimator == kK3 ? one : zero;
    const T tis_hi = p.is_mode == kIsTis ? is_hi : inf;  // w = min(w, tis_hi)
    const T ice_lo = p.is_mode == kIsIcepop ? is_lo : -inf, ice_hi = p.is_mode == kIsIcepop ? is_hi : inf;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t i0 = c * kChunk;
      const int64_t len = std::min(kChunk, n - i0);
      // Phase 0: the mask as 0/1 (also the count slot) and the inputs with masked tokens replaced by 0 (a
      // select: they may hold NaN). In a loop of their own: inside the main loop GCC 12 turns "a < 0" of a
      // selected `a` into a select of byte-sized booleans, which it then cannot vectorise. The mask is read
      // as uint8 because a bool -> float conversion does not vectorise either.
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = i0 + j;
        const T vf = static_cast<T>(reinterpret_cast<const uint8_t*>(valid)[i]);
        buf[kN][j] = vf;
        const bool v = vf != zero;
        const T lp_in = logp[i], od_in = old[i], a_in = adv[i];  // unconditional loads, then selects
        in[kInLogp][j] = v ? lp_in : zero;
        in[kInOld][j] = v ? od_in : zero;
        in[kInAdv][j] = v ? a_in : zero;
        if constexpr (HasRef) {
          const T x = ref[i];
          in[kInRef][j] = v ? x : zero;
        }
        if constexpr (HasIs) {
          const T x = isw[i];
          in[kInIsw][j] = v ? x : zero;
        }
        if constexpr (HasWeight) {
          const T x = weight[i];
          in[kInWeight][j] = v ? x : zero;
        } else {
          in[kInWeight][j] = vf;
        }
      }
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = i0 + j;
        const T vf = buf[kN][j];
        const T lp = in[kInLogp][j], od = in[kInOld][j], a = in[kInAdv][j];
        const T s = in[kInWeight][j] * inv_d;  // aggregation weight s_t (0 on masked tokens)

        // Conditions are 0/1 values of type T, combined by arithmetic or used as select conditions: GCC 12
        // does not vectorise selects whose result is a bool (e.g. "capped ? false : ratio_ok").
        const T log_ratio = lp - od;
        const T ratio_ok = std::abs(log_ratio) <= T(kRatioLogClamp) ? one : zero;
        const T ratio = exp_t(std::min(std::max(log_ratio, T(-kRatioLogClamp)), T(kRatioLogClamp)));
        const T unclipped = -a * ratio;
        const T clipped = -a * std::min(std::max(ratio, lo), hi);
        const T pg_clip = std::max(unclipped, clipped);
        const T cap = -dual_c * a;
        // a = 0 on masked tokens, so every "a < 0" / "a > 0" condition below is already false there
        const T capped = (dual_on && a < zero && pg_clip > cap) ? one : zero;
        const T pg = capped != zero ? cap : pg_clip;
        const T live = (unclipped >= clipped ? one : zero) * ratio_ok * (one - capped);  // grad via -A r
        const T c_low = (a < zero && ratio < lo) ? one : zero;
        const T c_high = (a > zero && ratio > hi) ? one : zero;

        T w = one, w_raw = zero, modified = zero;
        if constexpr (HasIs) {
          w_raw = in[kInIsw][j];
          w = (w_raw >= ice_lo && w_raw <= ice_hi) ? std::min(w_raw, tis_hi) : zero;
          modified = w != w_raw ? one : zero;  // w_raw = 0 on masked tokens, and then w = 0 too
        }

        T kl = zero, g_kl = zero;
        if constexpr (HasRef) {
          const T d_raw = lp - in[kInRef][j];
          const T d = std::min(std::max(d_raw, -log_v), log_v);
          const T e = exp_t(-d);  // k3's
          const T est = k1 * d + k2 * (T(0.5) * d * d) + k3 * (e - one + d);
          const T g_est = k1 + k2 * d + k3 * (one - e);
          // no clamp active; "&", not "&&", which GCC turns into a select of booleans
          const bool inside = (std::abs(d_raw) <= log_v) & (std::abs(est) <= out_v);
          kl = std::min(std::max(est, -out_v), out_v) * vf;
          g_kl = inside ? g_est : zero;
        }

        if constexpr (NeedGrad) {
          T g = live != zero ? -a * ratio : zero;
          if constexpr (HasIs) g = w * g;
          if constexpr (HasRef) g = g + kl_coef * g_kl;  // g_kl is finite: + 0 when kl_coef = 0
          // a NaN log-prob, old log-prob or advantage at a valid token reaches the gradient (as in
          // autograd); masked tokens read 0
          const T probe = lp - od + a;
          grad[i] = probe != probe ? probe : s * g;  // s = 0 on masked tokens
        }
        buf[kPg][j] = s * (w * pg);
        buf[kKl][j] = s * kl;
        buf[kClipLow][j] = c_low;
        buf[kClipHigh][j] = c_high;
        buf[kClip][j] = c_low + c_high;  // exclusive (A < 0 vs A > 0)
        buf[kDual][j] = capped;
        buf[kOldMinusNew][j] = (od - lp) * vf;
        buf[kRatio][j] = ratio * vf;  // also the max slot's input
        buf[kKlSum][j] = kl;
        buf[kIsSum][j] = w_raw;  // also the max slot's input
        buf[kIsModified][j] = modified;
      }
      for (int k = 0; k < kNumStats; ++k) {
        if (k == kRatioMax || k == kIsMax) continue;
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; ++j) sum += static_cast<double>(buf[k][j]);
        acc[k] += sum;
      }
      T rmax = zero, imax = -std::numeric_limits<T>::infinity();  // ratio >= 0; masked tokens count as 0
#pragma omp simd reduction(max : rmax, imax)
      for (int64_t j = 0; j < len; ++j) {
        rmax = std::max(rmax, buf[kRatio][j]);
        imax = std::max(imax, buf[kIsSum][j]);
      }
      acc[kRatioMax] = std::max(acc[kRatioMax], static_cast<double>(rmax));
      acc[kIsMax] = std::max(acc[kIsMax], static_cast<double>(imax));
    }
  }
  std::fill(out, out + kNumStats, 0.0);
  out[kIsMax] = -std::numeric_limits<double>::infinity();
  for (int t = 0; t < threads; ++t) {  // in thread order: deterministic
    const double* acc = partial.data() + static_cast<size_t>(t) * kNumStats;
    for (int k = 0; k < kNumStats; ++k) {
      out[k] = (k == kRatioMax || k == kIsMax) ? std::max(out[k], acc[k]) : out[k] + acc[k];
    }
  }
  if (!HasIs || n == 0) out[kIsMax] = 0.0;
}

template <typename T, bool... Flags>
void dispatch(const bool* flags, int depth, int64_t n, const T* logp, const T* old, const T* adv,
              const bool* valid, const T* ref, const T* isw, const T* weight, const Params<T>& p, T* grad,
              double* out) {
  if constexpr (sizeof...(Flags) == 4) {
    token_loop<T, Flags...>(n, logp, old, adv, valid, ref, isw, weight, p, grad, out);
  } else {
    if (flags[depth]) {
      dispatch<T, Flags..., true>(flags, depth + 1, n, logp, old, adv, valid, ref, isw, weight, p, grad, out);
    } else {
      dispatch<T, Flags..., false>(flags, depth + 1, n, logp, old, adv, valid, ref, isw, weight, p, grad, out);
    }
  }
}

at::Tensor as_compute(const at::Tensor& t, at::ScalarType dt, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "prorl native kernels take CPU tensors");
  TORCH_CHECK(t.numel() == n, name, " must have ", n, " elements, got ", t.numel());
  return t.reshape({n}).to(dt).contiguous();
}

// Returns (loss 0-d, stats [kNumStats] sums and maxima, grad [N] or empty), all in the compute dtype
// (double for fp64 logp, else float). The aggregation weight is s_t = valid_t * weight_t / D with
// weight_t = 1 when `weight` is absent and D = `denom` (a 0-d tensor; <= 0 counts as 1) if given, else
// `denom_value` if > 0, else the number of valid tokens (at least 1).
std::tuple<at::Tensor, at::Tensor, at::Tensor> ppo_forward(
    const at::Tensor& logp, const at::Tensor& old, const at::Tensor& adv, const at::Tensor& valid,
    const c10::optional<at::Tensor>& ref, const c10::optional<at::Tensor>& isw,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& denom, double denom_value,
    double eps_low, double eps_high, double dual_clip, double kl_coef, int64_t kl_estimator, int64_t kl_clamp,
    double kl_clamp_value, int64_t is_mode, double is_lo, double is_hi, bool need_grad) {
  const int64_t n = logp.numel();
  const at::ScalarType dt = logp.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.numel() == n, "valid must be a bool tensor of ", n);
  const at::Tensor lp = as_compute(logp, dt, n, "logp"), od = as_compute(old, dt, n, "old_logp");
  const at::Tensor ad = as_compute(adv, dt, n, "advantages");
  const at::Tensor vd = valid.reshape({n}).contiguous();
  const at::Tensor rf = ref ? as_compute(*ref, dt, n, "ref_logp") : at::Tensor();
  const at::Tensor iw = isw ? as_compute(*isw, dt, n, "is_weights") : at::Tensor();
  const at::Tensor wt = weight ? as_compute(*weight, dt, n, "weight") : at::Tensor();

  double d;
  if (denom) {
    d = denom->item<double>();  // a CPU scalar: no device sync involved
    d = d > 0 ? d : 1.0;
  } else if (denom_value > 0) {
    d = denom_value;
  } else {
    const bool* pv = vd.data_ptr<bool>();
    int64_t count = 0;
#pragma omp parallel for schedule(static) reduction(+ : count)
    for (int64_t i = 0; i < n; ++i) count += pv[i];
    d = count > 0 ? static_cast<double>(count) : 1.0;
  }

  at::Tensor grad = at::empty({need_grad ? n : 0}, logp.options().dtype(dt));
  double out[kNumStats];
  const bool flags[4] = {ref.has_value(), isw.has_value(), weight.has_value(), need_grad};
  AT_DISPATCH_FLOATING_TYPES(dt, "ppo_forward", [&] {
    Params<scalar_t> p;
    p.lo = static_cast<scalar_t>(1.0 - eps_low);
    p.hi = static_cast<scalar_t>(1.0 + eps_high);
    p.dual = dual_clip > 0;
    p.dual_c = static_cast<scalar_t>(dual_clip);
    p.kl_coef = static_cast<scalar_t>(kl_coef);
    p.kl_v = static_cast<scalar_t>(kl_clamp_value);
    p.kl_estimator = kl_estimator;
    p.kl_clamp = kl_clamp;
    p.is_mode = is_mode;
    p.is_lo = static_cast<scalar_t>(is_lo);
    p.is_hi = static_cast<scalar_t>(is_hi);
    p.inv_d = static_cast<scalar_t>(1.0 / d);
    auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<scalar_t>() : nullptr; };
    dispatch<scalar_t>(flags, 0, n, ptr(lp), ptr(od), ptr(ad), vd.data_ptr<bool>(), ptr(rf), ptr(iw), ptr(wt),
                       p, need_grad ? grad.data_ptr<scalar_t>() : nullptr, out);
  });
  const double loss = ref ? out[kPg] + kl_coef * out[kKl] : out[kPg];
  at::Tensor stats = at::empty({kNumStats}, at::kDouble);
  std::copy(out, out + kNumStats, stats.data_ptr<double>());
  return {at::scalar_tensor(loss, logp.options().dtype(dt)), stats.to(dt), grad};
}

// The tile kernels of softmax_tiles.h as ops (same contract as the triton/torch tile ops in Python).
void check_tile(const at::Tensor& x, const at::Tensor& labels, std::initializer_list<at::Tensor> rows) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tile must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.numel() == x.size(0) && labels.is_contiguous(),
              "labels must be contiguous int64 [rows]");
  for (const auto& t : rows) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == x.size(0) && t.is_contiguous(),
                "row statistics must be contiguous float32 [rows]");
  }
}

void tile_update_stats_op(const at::Tensor& x, const at::Tensor& labels, int64_t c0, double inv_t,
                          const at::Tensor& m, const at::Tensor& s, const at::Tensor& b, const at::Tensor& zy) {
  check_tile(x, labels, {m, s, b, zy});
  tile_stats(x.data_ptr<float>(), x.size(0), x.size(1), c0, labels.data_ptr<int64_t>(),
             static_cast<float>(inv_t), m.data_ptr<float>(), s.data_ptr<float>(), b.data_ptr<float>(),
             zy.data_ptr<float>());
}

void tile_grad_op(const at::Tensor& x, const at::Tensor& labels, int64_t c0, double inv_t, const at::Tensor& lse,
                  const at::Tensor& ez, const at::Tensor& g_lp, const at::Tensor& g_ent) {
  check_tile(x, labels, {lse, ez, g_lp, g_ent});
  tile_grad(x.data_ptr<float>(), x.size(0), x.size(1), c0, labels.data_ptr<int64_t>(), static_cast<float>(inv_t),
            lse.data_ptr<float>(), ez.data_ptr<float>(), g_lp.data_ptr<float>(), g_ent.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prorl, lib) {
  lib.def("ppo_forward(Tensor logp, Tensor old, Tensor adv, Tensor valid, Tensor? ref, Tensor? isw,"
          " Tensor? weight, Tensor? denom, float denom_value, float eps_low, float eps_high, float dual_clip,"
          " float kl_coef, int kl_estimator, int kl_clamp, float kl_clamp_value, int is_mode, float is_lo,"
          " float is_hi, bool need_grad) -> (Tensor, Tensor, Tensor)");
  lib.def("tile_update_stats(Tensor x, Tensor labels, int c0, float inv_t, Tensor(a!) m, Tensor(b!) s,"
          " Tensor(c!) b, Tensor(d!) zy) -> ()");
  lib.def("tile_grad(Tensor(a!) x, Tensor labels, int c0, float inv_t, Tensor lse, Tensor ez, Tensor g_lp,"
          " Tensor g_ent) -> ()");
}

TORCH_LIBRARY_IMPL(prorl, CPU, lib) {
  lib.impl("ppo_forward", &ppo_forward);
  lib.impl("tile_update_stats", &tile_update_stats_op);
  lib.impl("tile_grad", &tile_grad_op);
}

}  // namespace prorl
