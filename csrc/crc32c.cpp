#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace ds {
namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // Castagnoli polynomial, bit-reflected

// --- Portable path: slicing-by-8 tables, built at compile time. ---

struct SliceTables {
  uint32_t t[8][256];
};

constexpr SliceTables make_slice_tables() {
  SliceTables s{};
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = n;
    for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    s.t[0][n] = c;
  }
  for (uint32_t n = 0; n < 256; n++)
    for (int k = 1; k < 8; k++) s.t[k][n] = (s.t[k - 1][n] >> 8) ^ s.t[0][s.t[k - 1][n] & 0xff];
  return s;
}

constexpr SliceTables kSlice = make_slice_tables();

inline uint32_t load32le(const unsigned char* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// --- GF(2) arithmetic modulo the polynomial (as in zlib's crc32_combine). ---

// a * b mod P, both bit-reflected. `a` must be non-zero (it is always a power of x here).
constexpr uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

struct PowerTable {
  uint32_t t[32];  // t[k] = x^(2^k) mod P
};

constexpr PowerTable make_power_table() {
  PowerTable x{};
  uint32_t p = 1u << 30;  // x^1
  x.t[0] = p;
  for (int k = 1; k < 32; k++) x.t[k] = p = multmodp(p, p);
  return x;
}

constexpr PowerTable kPowers = make_power_table();

// x^(8 * nbytes) mod P: the operator that appends nbytes zero bytes to a crc register.
constexpr uint32_t zero_bytes_op(uint64_t nbytes) {
  uint32_t p = 1u << 31;  // x^0
  unsigned k = 3;
  for (; nbytes; nbytes >>= 1, k++)
    if (nbytes & 1) p = multmodp(kPowers.t[k & 31], p);
  return p;
}

#if defined(__x86_64__)

// --- Hardware path: three independent crc32 instruction streams over adjacent blocks (the instruction has
// a 3-cycle latency but a 1-cycle throughput), merged by shifting the earlier register over the later
// blocks with a table lookup (Mark Adler's scheme). ---

constexpr size_t kLongBlock = 8192;
constexpr size_t kShortBlock = 256;

struct ShiftTable {
  uint32_t t[4][256];  // byte-wise decomposition of "multiply by zero_bytes_op(block)"
};

constexpr ShiftTable make_shift_table(uint64_t block) {
  ShiftTable s{};
  const uint32_t op = zero_bytes_op(block);
  for (uint32_t n = 0; n < 256; n++)
    for (int k = 0; k < 4; k++) s.t[k][n] = multmodp(op, n << (8 * k));
  return s;
}

constexpr ShiftTable kShiftLong = make_shift_table(kLongBlock);
constexpr ShiftTable kShiftShort = make_shift_table(kShortBlock);

inline uint64_t shift(const ShiftTable& s, uint64_t crc) {
  return s.t[0][crc & 0xff] ^ s.t[1][(crc >> 8) & 0xff] ^ s.t[2][(crc >> 16) & 0xff] ^
         s.t[3][(crc >> 24) & 0xff];
}

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

template <size_t Block>
__attribute__((target("sse4.2"))) inline uint64_t crc_blocks(uint64_t c0, const unsigned char*& p,
                                                              size_t& len, const ShiftTable& table) {
  while (len >= 3 * Block) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char* end = p + Block;
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + Block));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * Block));
      p += 8;
    } while (p < end);
    c0 = shift(table, c0) ^ c1;
    c0 = shift(table, c0) ^ c2;
    p += 2 * Block;
    len -= 3 * Block;
  }
  return c0;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t crc, const unsigned char* p, size_t len) {
  uint64_t c = ~crc;
  for (; len && (reinterpret_cast<uintptr_t>(p) & 7); len--) c = _mm_crc32_u8(uint32_t(c), *p++);
  c = crc_blocks<kLongBlock>(c, p, len, kShiftLong);
  c = crc_blocks<kShortBlock>(c, p, len, kShiftShort);
  for (; len >= 8; len -= 8, p += 8) c = _mm_crc32_u64(c, load64(p));
  for (; len; len--) c = _mm_crc32_u8(uint32_t(c), *p++);
  return ~uint32_t(c);
}

bool detect_hw() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

#else

bool detect_hw() { return false; }

#endif

const bool kHaveHw = detect_hw();

}  // namespace

uint32_t crc32c_sw(uint32_t crc, const void* data, size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto& t = kSlice.t;
  uint32_t c = ~crc;
  for (; len >= 8; len -= 8, p += 8) {
    const uint32_t lo = c ^ load32le(p), hi = load32le(p + 4);
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
  }
  for (; len; len--) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t crc32c(uint32_t crc, const void* data, size_t len) {
#if defined(__x86_64__)
  if (kHaveHw) return crc32c_hw(crc, static_cast<const unsigned char*>(data), len);
#endif
  return crc32c_sw(crc, data, len);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return multmodp(zero_bytes_op(len_b), crc_a) ^ crc_b;
}

bool crc32c_hw_available() { return kHaveHw; }

}  // namespace ds
