// The row-interleaved layout of int4 and int8 weights (quant_weights.FMT_ROWS4), read by quant.cpp and
// quant_dot.cpp. int8's row_bytes is K (one 32-byte chunk is one block of 32 values; int4's holds two).
//
// Plain layout: row n's row_bytes bytes at n * row_bytes. Interleaved: every group of four rows
// (0-3, 4-7, ...) stores its rows' bytes 32 at a time in turn: chunk c of rows 4i..4i+3 (bytes
// 32c..32c+31 of each: two activation blocks of int4 codes, one of int8 values) lies at
// 4i * row_bytes + 128c + 32j for row 4i + j. A tile of four output rows then reads one stream instead
// of four: the hardware prefetcher follows one stream from its start, while four short streams (at
// K = 2048: 1 KB each for int4, 2 KB for int8) are each well under way before it catches up. Rows
// past the last full group of four stay plain, as does every weight whose rows are not whole chunks
// (row_bytes % 32 != 0): those never interleave, whatever the format value says. The codes, their
// order within a chunk and the arithmetic are those of the plain layout, so results are the same bits.

#pragma once

#include <cstdint>

namespace kvq_int4 {

constexpr int64_t kRowsBit = 512;  // or'ed into the format value: interleaved (FMT_ROWS4)
constexpr int64_t kRows = 4;       // rows per interleaved group
constexpr int64_t kChunk = 32;     // bytes of one row per turn
// How far ahead in an interleaved stream the kernels prefetch (bytes): one tile of four 1 KB rows
// ahead. The next tile's rows prefetched where the plain layout's would be (four streams a row apart)
// measured slower than this single stream ahead, and than no software prefetch at all.
constexpr int64_t kPrefetchAhead = 4096;
// The integer-dot tiles (and the exact int4 tiles) prefetch their weight streams, scale rows and planes
// into L2 (prefetcht2: locality 1), not L1: an L1 prefetch holds one of the core's few L1 miss buffers
// until its line arrives, and a 4- or 8-bit stream is consumed fast enough that they run out, so the
// tile's own loads wait behind the prefetches; L2 prefetches leave the tile's loads L2 hits.
constexpr int kPrefetchLocality = 1;

// How many leading rows are interleaved: N rounded down to a group of four, when the format asks for
// it and the rows are whole chunks; else 0.
inline int64_t interleaved_rows(bool asked, int64_t N, int64_t row_bytes) {
  return asked && row_bytes % kChunk == 0 ? N / kRows * kRows : 0;
}

// Where row n's first chunk lies (bytes from the start of the weight).
inline int64_t row_start(int64_t interleaved, int64_t row_bytes, int64_t n) {
  return n < interleaved ? (n / kRows) * kRows * row_bytes + (n % kRows) * kChunk : n * row_bytes;
}

// Bytes from one chunk of row n to its next.
inline int64_t chunk_step(int64_t interleaved, int64_t n) { return n < interleaved ? kRows * kChunk : kChunk; }

// Where byte o of row n lies.
inline int64_t byte_at(int64_t interleaved, int64_t row_bytes, int64_t n, int64_t o) {
  return row_start(interleaved, row_bytes, n) + (o / kChunk) * chunk_step(interleaved, n) + o % kChunk;
}

}  // namespace kvq_int4
