// AMX (Advanced Matrix Extensions) support shared by the kernels that use bfloat16 tiles: whether this
// build has the intrinsics (KVP_AMX: x86-64 Linux, GCC 11+ or clang 12+), the tile configuration
// record and the run-time check that the CPU, the OS and this process can use the tiles.
#pragma once

#if (defined(__x86_64__) && defined(__linux__)) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define KVP_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace kvp_amx {

struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Palette 1 with tiles 0..7 all 16 rows x 64 bytes (the shape every kernel here uses).
inline TileConfig full_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// The CPU has AMX-TILE + AMX-BF16, the OS enabled their state (XCR0) and granted this process the
// tile data (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+). Asks the kernel; callers cache the answer.
inline bool usable() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv allowed
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG + XTILEDATA enabled by the OS
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace kvp_amx
#endif
