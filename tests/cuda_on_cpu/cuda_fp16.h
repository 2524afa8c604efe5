// __half on the CPU emulator: IEEE binary16 storage, converted through the compiler's _Float16 (round to
// nearest even, as __float2half_rn).
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};

inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return float(f);
}

inline __half __float2half_rn(float v) {
  const _Float16 f = static_cast<_Float16>(v);
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
