// AMX bfloat16 linear: out[M, N] = bf16(x)[M, K] @ w[N, K]^T with float32 accumulation, reading the plain
// row-major bfloat16 weight (a model's own tensor) with tile loads: no packed copy of the weight.
//
// The product is computed transposed, out^T = w @ x^T, so the weight is the tile multiply's first operand
// (16 output rows x 32 inputs, one 64-byte line of each of 16 weight rows: a strided tile load of the
// plain layout) and the activations the second, which AMX wants pair-interleaved: x is rounded to bfloat16
// (round to nearest even, as torch's .to(torch.bfloat16)) and packed per block of 16 rows as
// [K / 2][16 rows][2]. Each thread takes a contiguous run of 32-row output blocks and streams its weight
// rows once per block of 32 activation rows (two blocks of 16 with four accumulator tiles), so a batch of
// up to 32 rows reads the weight once, at the memory's speed, where oneDNN's GEMM on the plain weight
// reorders it first. Larger batches (prefill) stay on oneDNN (quant_weights.AMX_MAX_ROWS).
//
// kvq_amx_dequant_linear runs the same tiles on a packed weight of quant.cpp (int8 / int4 codes with their
// scales): each thread dequantizes the 32 rows of its next output block into a scratch of its own just
// before multiplying them (quant_weights.AMX_DEQUANT_MAX_ROWS), so a prompt never writes the bfloat16
// weight out whole as dequantize-then-GEMM does.
//
// A row's result does not depend on the other rows (each is its own column of the tile product, summed
// over K in the same order). AMX computes with denormal bfloat16 inputs read as zero.
//
// kvq_amx_bf16_ready() says whether the CPU has AMX-TILE + AMX-BF16, the kernel enabled their state
// (XCR0) and granted this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+). Built
// only for x86-64 Linux with a compiler that has the AMX intrinsics (GCC 11+, clang 12+); elsewhere
// the library has the two entry points and reports "not ready".
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "amx.h"

#if defined(KVP_AMX)
#include <immintrin.h>
#include <omp.h>
#endif

extern "C" void kvq_dequant_bf16(int64_t fmt, const void* w, const void* scales, const float* offsets, int64_t N,
                                 int64_t K, int64_t group, int64_t n0, int64_t n1, uint16_t* out,
                                 int64_t num_threads, int64_t max_level);  // quant.cpp
extern "C" int64_t kvq_amx_bf16_ready();  // below

namespace {

constexpr int64_t kRowBlock = 16;  // activation rows per tile (the tile's columns)
constexpr int64_t kOutBlock = 32;  // output rows per thread step: two weight tiles
constexpr int64_t kTileK = 32;     // bfloat16 inputs per tile row (64 bytes)

// Whether the kernels take this shape (AMX usable here, whole tiles along K and N, at least one row).
bool amx_shape_fits(int64_t M, int64_t N, int64_t K) {
  return kvq_amx_bf16_ready() != 0 && M >= 1 && K >= kTileK && K % kTileK == 0 && N >= kOutBlock &&
         N % kOutBlock == 0;
}

// Bytes of x's packed bfloat16 pairs: whole blocks of 16 rows.
size_t packed_bytes(int64_t M, int64_t K) {
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  return static_cast<size_t>(blocks * (K / 2) * kRowBlock) * sizeof(uint32_t);
}

// 64-byte aligned memory for `bytes` (rounded up to whole lines), or null.
void* aligned_bytes(size_t bytes) { return std::aligned_alloc(64, (bytes + 63) / 64 * 64); }

}  // namespace

#if defined(KVP_AMX)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")

namespace {

// Row m of x (K floats) rounded to bfloat16 and written as pairs into its block: xp[(j * 16 + m)] is the
// pair (x[2j], x[2j + 1]) as one 32-bit word.
void pack_row(const float* x, int64_t K, uint32_t* block, int64_t m) {
  const __m512i lsb = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), qnan = _mm512_set1_epi32(0x7fc0);
  const __m256i lanes = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  for (int64_t k = 0; k < K; k += 16) {
    __m512 v = _mm512_loadu_ps(x + k);
    __m512i bits = _mm512_castps_si512(v);
    __m512i round = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), lsb), bias);
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, round), 16);
    h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);  // NaN stays NaN
    __m256i pairs = _mm512_cvtepi32_epi16(h);  // 16 bfloat16 = 8 pairs, j = k / 2 ...
    __m256i index = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>((k / 2) * kRowBlock + m)));
    _mm256_i32scatter_epi32(block, index, pairs, 4);
  }
}

// 32 output rows x 16 activation rows, transposed into out, from two accumulator tiles' buffer
// c[half][16 n][16 m] (half 0: output rows n0..n0+15, half 1: the next 16).
void store_block(const float (*c)[kRowBlock][kRowBlock], float* out, int64_t N, int64_t n0, int64_t r0,
                 int64_t M) {
  for (int64_t m = 0; m < kRowBlock && r0 + m < M; ++m) {
    float* o = out + (r0 + m) * N + n0;
    for (int h = 0; h < 2; ++h)
      for (int64_t i = 0; i < kRowBlock; ++i) o[h * kRowBlock + i] = c[h][i][m];
  }
}

// `panel(s, thread)` gives output step s's 32 weight rows (bfloat16, row-major, K apart): the plain
// weight's own rows, or rows dequantized into that thread's scratch.
template <class Panel>
void amx_linear(const float* x, int64_t M, int64_t N, int64_t K, float* out, uint32_t* xp, int threads,
                const Panel& panel) {
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t block_words = (K / 2) * kRowBlock;
  const int64_t steps = N / kOutBlock;
  const int64_t stride = K * 2;  // bytes between weight rows
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < blocks * kRowBlock; ++r) {
      uint32_t* block = xp + (r / kRowBlock) * block_words;
      if (r < M) {
        pack_row(x + r * K, K, block, r % kRowBlock);
      } else {
        for (int64_t j = 0; j < K / 2; ++j) block[j * kRowBlock + r % kRowBlock] = 0;
      }
    }  // implicit barrier: every block packed before any thread multiplies

    const kvp_amx::TileConfig cfg = kvp_amx::full_tiles();
    _tile_loadconfig(&cfg);
    alignas(64) float c[4][kRowBlock][kRowBlock];
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t s0 = steps * id / nt, s1 = steps * (id + 1) / nt;
    for (int64_t s = s0; s < s1; ++s) {
      const uint16_t* w0 = panel(s, id);
      const uint16_t* w1 = w0 + kRowBlock * K;
      for (int64_t b = 0; b < blocks; b += 2) {
        const uint32_t* x0 = xp + b * block_words;
        if (b + 1 < blocks) {
          const uint32_t* x1 = x0 + block_words;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t k = 0; k < K; k += kTileK) {
            _tile_loadd(4, w0 + k, stride);
            _tile_loadd(5, w1 + k, stride);
            _tile_loadd(6, x0 + (k / 2) * kRowBlock, 64);
            _tile_loadd(7, x1 + (k / 2) * kRowBlock, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          store_block(c, out, N, s * kOutBlock, b * kRowBlock, M);
          store_block(c + 2, out, N, s * kOutBlock, (b + 1) * kRowBlock, M);
        } else {
          _tile_zero(0);
          _tile_zero(1);
          for (int64_t k = 0; k < K; k += kTileK) {
            _tile_loadd(4, w0 + k, stride);
            _tile_loadd(5, w1 + k, stride);
            _tile_loadd(6, x0 + (k / 2) * kRowBlock, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
          }
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          store_block(c, out, N, s * kOutBlock, b * kRowBlock, M);
        }
      }
    }
    _tile_release();
  }
}

}  // namespace

#pragma GCC pop_options
#endif  // KVP_AMX

extern "C" {

// 1 where the AMX kernel can run in this process (asked once), else 0.
int64_t kvq_amx_bf16_ready() {
#if defined(KVP_AMX)
  static const bool ready = kvp_amx::usable();
  return ready ? 1 : 0;
#else
  return 0;
#endif
}

// out[M, N] (float32, row-major) = x[M, K] (float32, row-major, rounded to bfloat16) @ w[N, K]^T (bfloat16
// bits, row-major). Returns 0, or -1 without writing where the kernel cannot take it: no AMX here, K or N
// not a multiple of 32, M < 1, or no memory for the packed activations.
int64_t kvq_amx_bf16_linear(const float* x, int64_t M, const uint16_t* w, int64_t N, int64_t K, float* out,
                            int64_t threads) {
  if (!amx_shape_fits(M, N, K)) return -1;
#if defined(KVP_AMX)
  void* xp = aligned_bytes(packed_bytes(M, K));
  if (xp == nullptr) return -1;
  amx_linear(x, M, N, K, out, static_cast<uint32_t*>(xp), threads > 0 ? static_cast<int>(threads) : 1,
             [w, K](int64_t s, int) { return w + s * kOutBlock * K; });
  std::free(xp);
  return 0;
#else
  (void)x, (void)w, (void)out, (void)threads;
  return -1;
#endif
}

// out[M, N] = x @ W^T as kvq_amx_bf16_linear computes it, W a packed weight of quant.cpp (fmt, w, scales,
// offsets, group, max_level as kvq_dequant_bf16 takes them): each thread dequantizes the 32 weight rows of
// its next output step into a scratch of its own (kvq_dequant_bf16's values: rounded to bfloat16) and
// multiplies them there, so the bfloat16 weight is never written out whole (the per-call round trip
// through memory of a dequantize-then-GEMM). The same result, bit for bit, as kvq_amx_bf16_linear on
// kvq_dequant_bf16's rows. Returns 0, or -1 without writing where it cannot take it (as kvq_amx_bf16_linear).
int64_t kvq_amx_dequant_linear(int64_t fmt, const void* w, const void* scales, const float* offsets, int64_t N,
                               int64_t K, int64_t group, int64_t max_level, const float* x, int64_t M, float* out,
                               int64_t threads) {
  if (!amx_shape_fits(M, N, K)) return -1;
#if defined(KVP_AMX)
  const int nt = threads > 0 ? static_cast<int>(threads) : 1;
  const int64_t panel_words = kOutBlock * K;  // one step's weight rows, bfloat16
  void* xp = aligned_bytes(packed_bytes(M, K));
  void* scratch = aligned_bytes(static_cast<size_t>(nt * panel_words) * sizeof(uint16_t));
  if (xp == nullptr || scratch == nullptr) {
    std::free(xp);
    std::free(scratch);
    return -1;
  }
  uint16_t* rows = static_cast<uint16_t*>(scratch);
  amx_linear(x, M, N, K, out, static_cast<uint32_t*>(xp), nt, [=](int64_t s, int id) {
    uint16_t* panel = rows + id * panel_words;
    kvq_dequant_bf16(fmt, w, scales, offsets, N, K, group, s * kOutBlock, (s + 1) * kOutBlock, panel, 1, max_level);
    return static_cast<const uint16_t*>(panel);
  });
  std::free(xp);
  std::free(scratch);
  return 0;
#else
  (void)fmt, (void)w, (void)scales, (void)offsets, (void)group, (void)max_level, (void)x, (void)out, (void)threads;
  return -1;
#endif
}

}  // extern "C"
