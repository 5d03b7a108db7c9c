// AMX (Intel's Advanced Matrix Extensions, Sapphire Rapids and later): eight tile registers of up to
// 16 rows x 64 bytes, and `tdpbf16ps`, a 16 x 16 float32 tile += 16 x 32 bfloat16 times 32 x 16
// bfloat16 in one instruction, about eight times AVX-512's multiply-adds per cycle. It pays where a
// product is compute-bound (prefill, wide decode steps); at one row a product streams its weights.
//
// Linux grants a process the tile state only on request (arch_prctl, once), and each thread must
// load a tile configuration before its first tile instruction: oneDNN, on the same OpenMP threads,
// loads its own, so a kernel loads ours at the start of every parallel chunk and releases it after.
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGELLM_AMX 1
#endif

namespace pagellm {

#if defined(PAGELLM_AMX)
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles at 16 rows of 64 bytes: a C tile is 16 x 16 float32, an A tile 16 rows of 32
// bfloat16, a B tile 16 (k, k + 1) pairs of 16 columns.
inline const TileConfig& full_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int i = 0; i < 8; ++i) {
      c.colsb[i] = 64;
      c.rows[i] = 16;
    }
    return c;
  }();
  return config;
}

// Loads the configuration on this thread for a scope, and hands the tile state back after it.
struct TileScope {
  TileScope() { _tile_loadconfig(&full_tiles()); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};
#endif

// Built with AMX, the CPU has it and the kernel granted this process the tile state.
inline bool amx_permitted() {
#if defined(PAGELLM_AMX)
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

// On by default where permitted; ops.set_amx turns it off for A/B runs and tests.
inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool amx_enabled() { return amx_switch().load(std::memory_order_relaxed) && amx_permitted(); }

}  // namespace pagellm
