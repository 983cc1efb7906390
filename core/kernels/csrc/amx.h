// Intel AMX (Sapphire Rapids and later Xeons): eight tile registers of 16 rows x 64 bytes and a bf16 tile product,
// C[16 x 16 fp32] += A[16 x 32 bf16] . B[16 pairs x 16 x 2 bf16] (products exact, sums in fp32), in 16 cycles a
// tile. Compiled where -march=native gives AMX-TILE and AMX-BF16; used only once Linux has granted the process the
// tile state (it hands it out on request, arch_prctl).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define MOEPLEX_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace moeplex_cpu {

// GCC's tile loads and stores are asm statements that do not tell the compiler they touch memory: without a barrier
// on each side it may move a write of the buffer a tile loads past the load (or a read of what a tile stored before
// the store). Every tile load and store goes through these.
#define MOEPLEX_MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")
#define MOEPLEX_TILE_LOAD(tile, base, stride) \
  do { MOEPLEX_MEMORY_BARRIER(); _tile_loadd(tile, base, stride); MOEPLEX_MEMORY_BARRIER(); } while (0)
#define MOEPLEX_TILE_STORE(tile, base, stride) \
  do { MOEPLEX_MEMORY_BARRIER(); _tile_stored(tile, base, stride); MOEPLEX_MEMORY_BARRIER(); } while (0)

// Whether this process may use the tile registers (asked once; false where the kernel refuses).
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// The calling thread's tiles, each 16 rows of 64 bytes (palette 1), for the span of one parallel chunk.
struct Tiles {
  Tiles() {
    struct {
      uint8_t palette = 1, start_row = 0;
      uint8_t reserved[14] = {};
      uint16_t bytes_per_row[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int i = 0; i < 8; ++i) {
      config.bytes_per_row[i] = 64;
      config.rows[i] = 16;
    }
    MOEPLEX_MEMORY_BARRIER();
    _tile_loadconfig(&config);
    MOEPLEX_MEMORY_BARRIER();
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

}  // namespace moeplex_cpu

#else
namespace moeplex_cpu {
inline bool amx_granted() { return false; }
}  // namespace moeplex_cpu
#endif
