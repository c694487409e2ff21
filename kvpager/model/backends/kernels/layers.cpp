// kvpager CPU kernels: the per-layer glue of a decode step and the fused layer stack (see common.h).
#include "common.h"

namespace {

using kvp::dot;
using kvp::bf16_t;
using kvp::fast_exp;
using kvp::kv_load;
using kvp::kv_store_row;
using kvp::worth_threads;
#if defined(__AVX512F__)
using kvp::fast_exp16;
using kvp::load16;
using kvp::reduce16;
#endif

// acc[m][r] = x[m] . w[r] for MS input rows and 4 weight rows (each of K floats): 4 * MS independent
// accumulators, each weight vector loaded once for all inputs.
template <int MS>
inline void dot_tile(const float* __restrict x, int64_t K, const float* __restrict w, float acc[4][4]) {
#if defined(__AVX512F__)
  __m512 a[MS][4];
  for (int m = 0; m < MS; ++m)
    for (int r = 0; r < 4; ++r) a[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    // NOTE: prefetch the next tile's weight rows: measured 20 -> 26 GB/s at batch 1 (prefetches never fault).
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * K + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 5 * K + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 6 * K + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 7 * K + k), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + K + k);
    const __m512 w2 = _mm512_loadu_ps(w + 2 * K + k), w3 = _mm512_loadu_ps(w + 3 * K + k);
    for (int m = 0; m < MS; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      a[m][0] = _mm512_fmadd_ps(w0, xv, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(w1, xv, a[m][1]);
      a[m][2] = _mm512_fmadd_ps(w2, xv, a[m][2]);
      a[m][3] = _mm512_fmadd_ps(w3, xv, a[m][3]);
    }
  }
  if constexpr (MS == 4) {
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce16(&a[0][0]));  // lane m * 4 + r = x[m] . w[r]
    for (int m = 0; m < 4; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = sums[m * 4 + r];
  } else {
    for (int m = 0; m < MS; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_reduce_add_ps(a[m][r]);
  }
  for (int m = 0; m < MS; ++m)
    for (int r = 0; r < 4; ++r)
      for (int64_t kk = k; kk < K; ++kk) acc[m][r] += x[m * K + kk] * w[r * K + kk];
#else
  for (int m = 0; m < MS; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = dot(x + m * K, w + r * K, K);
#endif
}

// kvq_linear (quant.cpp, the packed-weight library): y [M, N] = x [M, K] @ w.T (+ bias) for a packed
// weight of format fmt, through the best code path up to max_level.
using PackedLinear = void (*)(int64_t fmt, const float* x, int64_t M, int64_t K, const void* w, const float* scales,
                              const float* offsets, int64_t N, int64_t group, const float* bias, float* y,
                              int64_t num_threads, int64_t max_level);

// kvq_dot_linear (quant_dot.cpp, the same library): y [M, N] = quantize_per_block(x [M, K]) . w (+ bias)
// for an int8 / int4 weight with int8 activations (w8a8_int8 / w4a8_int8); returns 0, or -1 when it
// refuses the format or group (the caller checked both when it built the table).
using DotLinear = int64_t (*)(int64_t fmt, const float* x, int64_t M, int64_t K, const void* w, const void* scales,
                              const float* offsets, int64_t N, int64_t group, const float* bias, float* y,
                              int64_t num_threads, int64_t max_level);

// 1 / sqrt(mean(x^2) + eps) over `dim` floats.
inline float inv_rms(const float* __restrict x, int64_t dim, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
}

inline void rms_norm_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t dim,
                         float eps) {
  const float inv = inv_rms(x, dim, eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inv * w[i];
}

inline void rms_norm_inplace(float* __restrict x, const float* __restrict w, int64_t dim, float eps) {
  const float inv = inv_rms(x, dim, eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) x[i] = x[i] * inv * w[i];
}

inline void rope_head(float* __restrict x, const float* __restrict cos, const float* __restrict sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// o[i] = silu(g[i]) * u[i] for n elements, g and u float32 or bfloat16 (widened exactly): the same float32
// arithmetic for both.
template <typename T>
inline void silu_mul_span(const T* __restrict g, const T* __restrict u, float* __restrict o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = load16(g + i);
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), load16(u + i)));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) {
    const float gj = kv_load(g[j]);
    o[j] = gj / (1.f + fast_exp(-gj)) * kv_load(u[j]);
  }
}

// One token of kvp_rope_and_cache on its float32 qkv row, in place: q/k norms, RoPE, K and V stored.
void rope_token(float* row, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const float* c, const float* s,
                const float* q_norm, const float* k_norm, float eps, void* k_cache, void* v_cache, int64_t slot,
                int64_t kv_format) {
  const int64_t half = head_dim / 2, kv_size = num_kv_heads * head_dim;
  for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
    float* x = row + h * head_dim;
    const float* w = h < num_heads ? q_norm : k_norm;
    if (w != nullptr) rms_norm_inplace(x, w, head_dim, eps);
    rope_head(x, c, s, half);
  }
  const float* k = row + num_heads * head_dim;
  kvp::with_kv(kv_format, k_cache, [&](auto typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    kvp::kv_store_row(static_cast<T*>(k_cache) + slot * kv_size, k, kv_size);
    kvp::kv_store_row(static_cast<T*>(v_cache) + slot * kv_size, k + kv_size, kv_size);
  });
}

}  // namespace

extern "C" {

// OpenMP's thread count is per calling thread: the engine may step on a thread other than the one
// that called torch.set_num_threads, so the caller sets it (per step) to torch's.
void kvp_set_num_threads(int64_t n) { omp_set_num_threads(static_cast<int>(n)); }
int64_t kvp_max_threads() { return omp_get_max_threads(); }

// How many of values[0..n) lie outside [lo, hi): the binding checks index arguments (slots, block
// ids, token rows) with it before a kernel uses them as offsets.
int64_t kvp_check_range(const int64_t* values, int64_t n, int64_t lo, int64_t hi) {
  int64_t bad = 0;
#pragma omp simd reduction(+ : bad)
  for (int64_t i = 0; i < n; ++i) bad += (values[i] < lo) | (values[i] >= hi);
  return bad;
}

// Which of up to four index arrays hold a value outside their range, in one call: limits is
// {count, then (n, lo, hi) for each of the count <= 4 arrays v0..v3}; bit i of the result is set
// when values v_i[0..n_i) leave [lo_i, hi_i). A null array (an absent optional tensor) is skipped.
// The binding checks all of a kernel's index tensors with it before each cached call.
int64_t kvp_check_ranges(const int64_t* limits, const int64_t* v0, const int64_t* v1, const int64_t* v2,
                         const int64_t* v3) {
  const int64_t* values[4] = {v0, v1, v2, v3};
  const int64_t count = limits[0] < 4 ? limits[0] : 4;
  int64_t failed = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* lim = limits + 1 + 3 * i;
    if (values[i] != nullptr && kvp_check_range(values[i], lim[0], lim[1], lim[2]) != 0) failed |= int64_t{1} << i;
  }
  return failed;
}

// The instruction set the library was compiled for: 2 AVX-512, 1 AVX2 with FMA, 0 neither (the
// portable branches, vectorised by the compiler for whatever the target has).
int64_t kvp_isa() {
#if defined(__AVX512F__)
  return 2;
#elif defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

// out[m, n] = x[m] . w[n] (+ bias[n]) for a few rows x [M, K] and weights w [N, K] (torch's Linear
// layout). Batch-1 decode is a matrix-vector product bound by reading the weights: each weight row is
// read once for all M inputs, threads split the rows.
void kvp_linear_small(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* out) {
  const int64_t tiles = (N + 3) / 4;
// NOTE: guided, not static: a thread that loses its core for a while (a busy event loop, another
// tenant's vCPU) no longer holds back the other's half of the rows. Engine, one process, alternating:
// 32 sequences 1.19 -> 1.12 s, with a competing process 1.39 -> 1.21 s; batch 1 and 4-8 unchanged.
#pragma omp parallel for schedule(guided) if (worth_threads(N * K))
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t n0 = tile * 4, rows = std::min<int64_t>(4, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t ms = std::min<int64_t>(4, M - m0);
      float acc[4][4];
      if (rows == 4 && ms == 4) {
        dot_tile<4>(x + m0 * K, K, w + n0 * K, acc);
      } else if (rows == 4 && ms == 1) {
        dot_tile<1>(x + m0 * K, K, w + n0 * K, acc);
      } else if (rows == 4 && ms == 2) {
        dot_tile<2>(x + m0 * K, K, w + n0 * K, acc);
      } else if (rows == 4 && ms == 3) {
        dot_tile<3>(x + m0 * K, K, w + n0 * K, acc);
      } else {
        for (int64_t m = 0; m < ms; ++m)
          for (int64_t r = 0; r < rows; ++r) acc[m][r] = dot(x + (m0 + m) * K, w + (n0 + r) * K, K);
      }
      for (int64_t m = 0; m < ms; ++m)
        for (int64_t r = 0; r < rows; ++r)
          out[(m0 + m) * N + n0 + r] = acc[m][r] + (bias != nullptr ? bias[n0 + r] : 0.f);
    }
  }
}

// out[r] = x[r] / rms(x[r]) * w, rows of `dim` (row strides in elements).
void kvp_rms_norm(const float* x, int64_t x_stride, const float* w, float* out, int64_t out_stride, int64_t rows,
                  int64_t dim, float eps) {
#pragma omp parallel for if (worth_threads(rows * dim))
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_stride, w, out + r * out_stride, dim, eps);
}

// residual[r] += x[r]; out[r] = rms_norm(residual[r]) * w. All contiguous [rows, dim].
void kvp_add_rms_norm(float* residual, const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                      float eps) {
#pragma omp parallel for if (worth_threads(rows * dim))
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict res = residual + r * dim;
    const float* __restrict xr = x + r * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) res[i] += xr[i];
    rms_norm_row(res, w, out + r * dim, dim, eps);
  }
}

// kvp_add_rms_norm with x and out in bfloat16: x (a bfloat16 GEMM's output) widened exactly, the same
// float32 arithmetic, out rounded to bfloat16 as torch rounds (kv_store): bit for bit kvp_add_rms_norm on
// x widened, then out.to(bfloat16). Between two bfloat16 GEMMs of a prompt step: only the residual
// stream stays in float32.
void kvp_add_rms_norm_bf16(float* residual, const bf16_t* x, const float* w, bf16_t* out, int64_t rows, int64_t dim,
                           float eps) {
#pragma omp parallel if (worth_threads(rows * dim))
  {
    std::vector<float> normed(dim);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      float* __restrict res = residual + r * dim;
      const bf16_t* __restrict xr = x + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) res[i] += kv_load(xr[i]);
      rms_norm_row(res, w, normed.data(), dim, eps);
      kv_store_row(out + r * dim, normed.data(), dim);
    }
  }
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]; gate_up [rows, 2 * inter], out [rows, inter].
void kvp_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (worth_threads(rows * inter))
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    silu_mul_span(g, g + inter, out + r * inter, inter);
  }
}

// kvp_silu_mul over bfloat16: gate_up widened exactly, the same float32 arithmetic, each result rounded to
// bfloat16 as torch rounds (kv_store): bit for bit kvp_silu_mul on the widened rows, then .to(bfloat16).
// The step between a bfloat16 GEMM's output and the next one's input, with no float32 rows in memory.
void kvp_silu_mul_bf16(const bf16_t* gate_up, bf16_t* out, int64_t rows, int64_t inter) {
  constexpr int64_t kChunk = 512;  // float32 results per chunk, in a stack buffer
#pragma omp parallel for if (worth_threads(rows * inter))
  for (int64_t r = 0; r < rows; ++r) {
    const bf16_t* g = gate_up + r * 2 * inter;
    alignas(64) float buf[kChunk];
    for (int64_t c = 0; c < inter; c += kChunk) {
      const int64_t n = inter - c < kChunk ? inter - c : kChunk;
      silu_mul_span(g + c, g + inter + c, buf, n);
      kv_store_row(out + r * inter + c, buf, n);
    }
  }
}

// In place on qkv [num_tokens, row_stride]: optional per-head RMSNorm of q and k (Qwen3; weights of
// head_dim, null when absent), RoPE of every q and k head, then K and V of token t stored at cache
// slot slots[t] (slot = block * block_size + offset; the caches are viewed as [slots, kv_heads, hd]).
void kvp_rope_and_cache(float* qkv, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const float* cos, const float* sin, const float* q_norm,
                        const float* k_norm, float eps, void* k_cache, void* v_cache, const int64_t* slots,
                        int64_t kv_format) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for if (worth_threads(num_tokens * (num_heads + 2 * num_kv_heads) * head_dim))
  for (int64_t t = 0; t < num_tokens; ++t)
    rope_token(qkv + t * row_stride, num_heads, num_kv_heads, head_dim, cos + t * half, sin + t * half, q_norm, k_norm,
               eps, k_cache, v_cache, slots[t], kv_format);
}

// kvp_rope_and_cache on a bfloat16 qkv (a bfloat16 GEMM's output), left as it is: each row widened
// exactly into a float32 row of its own, the same arithmetic, q written to q_out [num_tokens,
// num_heads * head_dim]. The values of widening qkv first and running kvp_rope_and_cache, bit for bit.
void kvp_rope_and_cache_bf16(const bf16_t* qkv, int64_t row_stride, int64_t num_tokens, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, const float* cos, const float* sin,
                             const float* q_norm, const float* k_norm, float eps, void* k_cache, void* v_cache,
                             const int64_t* slots, int64_t kv_format, float* q_out) {
  const int64_t half = head_dim / 2, width = (num_heads + 2 * num_kv_heads) * head_dim, q_size = num_heads * head_dim;
#pragma omp parallel if (worth_threads(num_tokens * width))
  {
    std::vector<float> row(width);
#pragma omp for
    for (int64_t t = 0; t < num_tokens; ++t) {
      kvp::kv_widen(qkv + t * row_stride, row.data(), width);
      rope_token(row.data(), num_heads, num_kv_heads, head_dim, cos + t * half, sin + t * half, q_norm, k_norm, eps,
                 k_cache, v_cache, slots[t], kv_format);
      std::memcpy(q_out + t * q_size, row.data(), q_size * sizeof(float));
    }
  }
}

// Every decoder layer of a decode-only step (M <= a few dozen rows) in one call: the same kernels
// the per-op path calls from Python, in the same order, without ~9 Python/ctypes round trips per
// layer. `layers` holds, per layer, 12 addresses (0 = absent): input norm, qkv weight, qkv bias,
// o weight, o bias, post-attention norm, gate_up weight, gate_up bias, down weight, down bias,
// q norm, k norm; then, per qkv, o, gate_up and down weight, how it is stored: its block stride when
// in column blocks (kvp_linear_b), 0 when torch's row-major float32 [N, K] (kvp_linear_small), and
// -(fmt + 1) for a packed 16-bit weight of the packed-weight library's format fmt (bfloat16 / float16
// [N, K], quant.cpp): that multiply runs `packed_linear`, the library's kvq_linear, capped at
// `packed_level`, the very kernel the per-op path calls for the weight, so both compute the same values;
// kvp::kPartsLayout for a quantized weight: each of its row parts in `weight_parts` [num_layers, 4
// weights, kMaxParts, kPartWidth] (common.h) is multiplied by the call its own matmul makes:
// `dot_linear` (the library's kvq_dot_linear, capped at `dot_level`) for an int8 / int4 weight with int8
// activations, `packed_linear` (kvq_linear, capped at `packed_level`) for an exact int8 / int4 one, with
// the part's codes, scales, offsets (0: none), format value and group, into its columns of the output,
// as gguf_packed.RowStack.matmul does for a weight of several parts.
// On entry x [M, H] is the embedding output; on return x is the last layer's MLP
// output and residual [M, H] the residual stream before it (the caller adds them in the final norm).
// The KV cache is [L, 2, NB, block_size, kv_heads, head_dim]; scratch holds
// M * (q_size + 2 kv_size + q_size + 2 inter + inter + H + max(q_size + 2 kv_size, 2 inter, H)) floats
// (the last region: a row part's output when M > 1, before it moves to its columns).
void kvp_decode_layers(float* x, float* residual, int64_t M, int64_t H, int64_t num_layers, const int64_t* layers,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, float eps,
                       void* kv_cache, int64_t num_blocks, int64_t block_size, const float* cos, const float* sin,
                       const int64_t* slots, const int64_t* block_tables, int64_t max_blocks, const int64_t* seq_lens,
                       int64_t window, float scale, int64_t partition, float* scratch, int64_t kv_format,
                       int64_t packed_linear, int64_t packed_level, int64_t dot_linear, int64_t dot_level,
                       const int64_t* weight_parts) {
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
  // K -> V of one layer, in bytes
  const int64_t half_stride = num_blocks * block_size * kv_size * kvp::kv_bytes(kv_format);
  float* qkv = scratch;
  float* attn = qkv + M * qkv_size;
  float* gate_up = attn + M * q_size;
  float* act = gate_up + M * 2 * inter;
  float* h = act + M * inter;
  float* part_out = h + M * H;
  auto f = [](int64_t address) { return reinterpret_cast<float*>(address); };
  const auto packed = reinterpret_cast<PackedLinear>(packed_linear);
  const auto dot = reinterpret_cast<DotLinear>(dot_linear);
  // one row part of a quantized weight: rows [row0, row0 + rows) of the output's N columns
  // (part: kind, codes, scales, offsets, format value, group, rows)
  auto linear_part = [&](const float* in, int64_t K, const int64_t* part, int64_t N, int64_t row0, int64_t bias,
                         float* out) {
    const int64_t rows = part[6];
    const float* b = bias != 0 ? f(bias) + row0 : nullptr;
    // one input row: the part's columns are contiguous in the output, so it writes them in place
    float* dst = rows == N || M == 1 ? out + row0 : part_out;
    const auto* w = reinterpret_cast<const void*>(part[1]);
    if (part[0] == kvp::kPartDot) {
      dot(part[4], in, M, K, w, reinterpret_cast<const void*>(part[2]), f(part[3]), rows, part[5], b, dst,
          omp_get_max_threads(), dot_level);
    } else {
      packed(part[4], in, M, K, w, f(part[2]), f(part[3]), rows, part[5], b, dst, omp_get_max_threads(), packed_level);
    }
    if (dst == part_out)
      for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * N + row0, part_out + m * rows, rows * sizeof(float));
  };
  // parts: the weight's weight_parts entries (see above)
  auto linear = [&](const float* in, int64_t K, int64_t w, int64_t bs, int64_t N, int64_t bias, float* out,
                    const int64_t* parts) {
    if (bs == kvp::kPartsLayout) {
      for (int64_t i = 0, row0 = 0; i < kvp::kMaxParts && parts[i * kvp::kPartWidth] != 0; ++i) {
        linear_part(in, K, parts + i * kvp::kPartWidth, N, row0, bias, out);
        row0 += parts[i * kvp::kPartWidth + 6];
      }
    } else if (bs < 0) {
      packed(-bs - 1, in, M, K, reinterpret_cast<const void*>(w), nullptr, nullptr, N, K, f(bias), out,
             omp_get_max_threads(), packed_level);
    } else if (bs > 0) {
      kvp_linear_b(in, M, K, f(w), bs, N, f(bias), out);
    } else {
      kvp_linear_small(in, M, K, f(w), N, f(bias), out);
    }
  };
  std::memcpy(residual, x, M * H * sizeof(float));
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layers + l * kvp::kLayerTableWidth;
    const int64_t* d = weight_parts + l * 4 * kvp::kMaxParts * kvp::kPartWidth;  // four weights' parts
    constexpr int64_t kWeight = kvp::kMaxParts * kvp::kPartWidth;
    char* k_cache = static_cast<char*>(kv_cache) + l * 2 * half_stride;
    if (l == 0) {
      kvp_rms_norm(residual, H, f(p[0]), h, H, M, H, eps);
    } else {
      kvp_add_rms_norm(residual, x, f(p[0]), h, M, H, eps);
    }
    linear(h, H, p[1], p[12], qkv_size, p[2], qkv, d);
    kvp_rope_and_cache(qkv, qkv_size, M, num_heads, num_kv_heads, head_dim, cos, sin, f(p[10]), f(p[11]), eps, k_cache,
                       k_cache + half_stride, slots, kv_format);
    kvp_paged_decode(qkv, qkv_size, attn, q_size, nullptr, M, num_heads, num_kv_heads, head_dim, k_cache,
                     k_cache + half_stride, block_size, block_tables, max_blocks, seq_lens, window, scale, partition,
                     kv_format);
    linear(attn, q_size, p[3], p[13], H, p[4], x, d + kWeight);
    kvp_add_rms_norm(residual, x, f(p[5]), h, M, H, eps);
    linear(h, H, p[6], p[14], 2 * inter, p[7], gate_up, d + 2 * kWeight);
    kvp_silu_mul(gate_up, act, M, inter);
    linear(act, inter, p[8], p[15], H, p[9], x, d + 3 * kWeight);
  }
}

}  // extern "C"
