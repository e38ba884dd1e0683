"""Paged decode attention for fp32 on CPU, a C++ kernel built on first use (torch cpp_extension).

Why: with plain torch ops a decode step gathers every sequence's K/V out of the page-major pool
into a padded copy (index_select) and then reads that copy again in SDPA; both are memory-bound
and padded to the longest sequence. The kernel reads each sequence's pages in place, once, and
stops at the sequence's own length. It also stores the step's new K/V (one token per sequence)
in the pool first, as `KVPool.set_kv` would.

A task is one sequence with all its KV heads (K/V rows read whole, in address order), or one
(sequence, KV head) when there are fewer than two sequences per thread; the query heads sharing
a KV head are computed together, so each K/V row is loaded once for all of them. All fp32:
scores, a max-subtracted softmax (exp by a ~1 ulp polynomial), the weighted sum of V. Results
equal the torch reference to fp32 rounding, not bit for bit (tests compare the two).

`load()` returns None (and callers keep the torch path) when the build fails, e.g. on a host
without a C++ compiler; the failure is logged once. Building and caching: engine/cpu_extension.py.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdserve.engine.cpu_extension import BackgroundBuild, build_or_load

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDS_AVX2 1
#endif

namespace {

// exp(x) for x <= 0 (Cephes expf: Cody-Waite reduction, degree-5 polynomial; ~1 ulp), written
// without branches or calls so the compiler vectorises the loop around it.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

#ifdef PDS_AVX2
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

// s[g * ld + o] = scale * (q_g . k_o) for G query rows (stride D) and n key rows (stride ks).
void qk_block(const float* q, int64_t G, const float* k, int64_t ks, int64_t n, int64_t D,
              float scale, float* s, int64_t ld) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    int64_t o = 0;
#ifdef PDS_AVX2
    // Four keys at once: four independent FMA chains instead of one serial one.
    for (; o + 4 <= n && D % 8 == 0; o += 4) {
      const float* k0 = k + o * ks;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + ks + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * ks + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * ks + d), a3);
      }
      s[g * ld + o] = hsum(a0) * scale;
      s[g * ld + o + 1] = hsum(a1) * scale;
      s[g * ld + o + 2] = hsum(a2) * scale;
      s[g * ld + o + 3] = hsum(a3) * scale;
    }
#endif
    for (; o < n; ++o) {
      const float* kr = k + o * ks;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
      s[g * ld + o] = dot * scale;
    }
  }
}

// acc[g * D + d] += sum_o w[g * ld + o] * v_o[d] for n value rows (stride vs).
void pv_block(const float* w, int64_t ld, int64_t G, const float* v, int64_t vs, int64_t n,
              int64_t D, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    const float* wg = w + g * ld;
    float* ag = acc + g * D;
    int64_t d = 0;
#ifdef PDS_AVX2
    // 32 outputs stay in registers across the rows.
    for (; d + 32 <= D; d += 32) {
      __m256 a0 = _mm256_loadu_ps(ag + d), a1 = _mm256_loadu_ps(ag + d + 8);
      __m256 a2 = _mm256_loadu_ps(ag + d + 16), a3 = _mm256_loadu_ps(ag + d + 24);
      for (int64_t o = 0; o < n; ++o) {
        const __m256 wv = _mm256_broadcast_ss(wg + o);
        const float* vr = v + o * vs + d;
        a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr), a0);
        a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr + 8), a1);
        a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr + 16), a2);
        a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr + 24), a3);
      }
      _mm256_storeu_ps(ag + d, a0);
      _mm256_storeu_ps(ag + d + 8, a1);
      _mm256_storeu_ps(ag + d + 16, a2);
      _mm256_storeu_ps(ag + d + 24, a3);
    }
#endif
    for (; d < D; ++d) {
      float a = ag[d];
      for (int64_t o = 0; o < n; ++o) a += wg[o] * v[o * vs + d];
      ag[d] = a;
    }
  }
}

// Hint the cache to fetch `rows` rows of `bytes` bytes each (stride in floats).
inline void prefetch_rows(const float* p, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < bytes; c += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p + r * stride) + c);
}

}  // namespace

// q [B, H, D]; k_new, v_new [B, KVH, D]; pool [P, L, 2, PS, KVH, D] (all fp32, contiguous);
// page_table [B, max_pages] and seq_lens [B], out_slots [B] int64.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                        at::Tensor pool, int64_t layer, const at::Tensor& page_table,
                        const at::Tensor& seq_lens, const at::Tensor& out_slots, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat &&
              k_new.scalar_type() == at::kFloat && v_new.scalar_type() == at::kFloat,
              "fp32 only");
  TORCH_CHECK(q.is_contiguous() && k_new.is_contiguous() && v_new.is_contiguous() &&
              pool.is_contiguous() && page_table.is_contiguous(), "contiguous inputs only");
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 6, "shape mismatch");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = pool.size(0), L = pool.size(1), PS = pool.size(3), KVH = pool.size(4);
  TORCH_CHECK(pool.size(5) == D && H % KVH == 0, "shape mismatch");
  TORCH_CHECK(k_new.size(0) == B && k_new.size(1) == KVH && k_new.size(2) == D &&
              v_new.sizes() == k_new.sizes() && page_table.size(0) == B &&
              seq_lens.size(0) == B && out_slots.size(0) == B, "shape mismatch");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              out_slots.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
              out_slots.is_contiguous() && layer >= 0 && layer < L, "bad index args");
  const int64_t G = H / KVH, max_pages = page_table.size(1);
  const int64_t tok_stride = KVH * D, kv_stride = PS * tok_stride;
  const int64_t page_stride = L * 2 * kv_stride, layer_off = layer * 2 * kv_stride;
  const float* qp = q.data_ptr<float>();
  const float* kn = k_new.data_ptr<float>();
  const float* vn = v_new.data_ptr<float>();
  float* pp = pool.data_ptr<float>();
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* os = out_slots.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) {  // bounds, so a bad index is an error, not a stray write
    TORCH_CHECK(sl[b] >= 1 && sl[b] <= max_pages * PS, "seq_len out of range");
    TORCH_CHECK(os[b] >= 0 && os[b] < P * PS, "out slot out of range");
    for (int64_t j = 0; j < (sl[b] + PS - 1) / PS; ++j)
      TORCH_CHECK(pt[b * max_pages + j] >= 0 && pt[b * max_pages + j] < P, "page out of range");
    max_len = std::max(max_len, sl[b]);
  }
  at::Tensor out = at::empty_like(q);
  float* op = out.data_ptr<float>();
  // A task is one sequence with all its KV heads (K/V rows are read whole, in address order),
  // or one (sequence, KV head) when there are too few sequences to keep every thread busy.
  const int64_t heads_per_task = B >= 2 * at::get_num_threads() ? KVH : 1;
  const int64_t tasks_per_seq = KVH / heads_per_task;

  at::parallel_for(0, B * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(H * max_len), acc(H * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq, len = sl[b];
      const int64_t h0 = task % tasks_per_seq * heads_per_task, nh = heads_per_task;
      const int64_t slot = os[b];
      float* dst = pp + slot / PS * page_stride + layer_off + slot % PS * tok_stride + h0 * D;
      std::memcpy(dst, kn + (b * KVH + h0) * D, nh * D * sizeof(float));
      std::memcpy(dst + kv_stride, vn + (b * KVH + h0) * D, nh * D * sizeof(float));
      const int64_t* pages = pt + b * max_pages;
      const float* qb = qp + (b * H + h0 * G) * D;
      float* sb = s.data() + h0 * G * len;  // scores of (head h, group g) at row (h - h0) * G + g
      const int64_t row_bytes = nh * D * sizeof(float);
      for (int64_t t0 = 0; t0 < len; t0 += PS) {
        const float* kp = pp + pages[t0 / PS] * page_stride + layer_off + h0 * D;
        if (t0 + PS < len)
          prefetch_rows(pp + pages[t0 / PS + 1] * page_stride + layer_off + h0 * D, PS,
                        tok_stride, row_bytes);
        const int64_t n = std::min(PS, len - t0);
        for (int64_t h = 0; h < nh; ++h)
          qk_block(qb + h * G * D, G, kp + h * D, tok_stride, n, D, sc, sb + h * G * len + t0,
                   len);
      }
      for (int64_t r = 0; r < nh * G; ++r) {
        float* sr = sb + r * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sr[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          const float e = exp_nonpos(sr[t] - m);
          sr[t] = e;
          sum += e;
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sr[t] *= inv;
      }
      float* ab = acc.data();
      std::fill(ab, ab + nh * G * D, 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += PS) {
        const float* vp = pp + pages[t0 / PS] * page_stride + layer_off + kv_stride + h0 * D;
        if (t0 + PS < len)
          prefetch_rows(pp + pages[t0 / PS + 1] * page_stride + layer_off + kv_stride + h0 * D,
                        PS, tok_stride, row_bytes);
        const int64_t n = std::min(PS, len - t0);
        for (int64_t h = 0; h < nh; ++h)
          pv_block(sb + h * G * len + t0, len, G, vp + h * D, tok_stride, n, D,
                   ab + h * G * D);
      }
      std::memcpy(op + (b * H + h0 * G) * D, ab, nh * G * D * sizeof(float));
    }
  });
  return out;
}
"""

# Process-wide on purpose: the compiled module is immutable and shared, like an import.
_KERNEL = BackgroundBuild(
    "CPU decode attention kernel",
    lambda: build_or_load("pdserve_cpu_decode", _SOURCE, ["paged_decode"]))


def load(block: bool = True) -> ModuleType | None:
    """The kernel module, built on first use into the pdserve cache (later processes only
    import it). With block=False it returns None while the build runs."""
    return _KERNEL.get(block)


def paged_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 buffer: torch.Tensor, layer: int, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, out_slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Stores k_new/v_new [B, kvh, d] at `out_slots`, then attends q [B, h, d] over each
    sequence's first seq_lens[b] tokens, token t of sequence b being at page
    `page_table[b, t // page_size]`, offset t % page_size. Returns [B, h, d]."""
    ext = load(block=True)
    if ext is None:
        raise RuntimeError(f"CPU decode kernel unavailable: {_KERNEL.error}")
    return ext.paged_decode(q, k_new, v_new, buffer, layer, page_table, seq_lens, out_slots,
                            scale)
