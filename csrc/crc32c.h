// CRC-32C (Castagnoli), the checksum used for every byte range the engine writes or reads.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ds {

// Continues `crc` (0 to start) over [data, data + len). Uses SSE4.2 when the CPU has it.
uint32_t crc32c(uint32_t crc, const void* data, size_t len);

// Portable slicing-by-8 implementation; exposed so tests can check the hardware path against it.
uint32_t crc32c_sw(uint32_t crc, const void* data, size_t len);

// crc32c(A + B) from crc32c(A), crc32c(B) and len(B): lets workers checksum pieces of a segment in parallel.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// True when crc32c() runs on the SSE4.2 instruction.
bool crc32c_hw_available();

}  // namespace ds
