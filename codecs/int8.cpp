// Blockwise int8 encode and decode on the CPU: per-thread ranges of whole blocks.
#include "int8.hpp"

#include <cstring>

#include "cpu_table.hpp"
#include "parallel.hpp"

namespace gradzip::detail {

void encode_cpu(Int8Codec, const CpuEncode& job) {
  const uint32_t block = job.param;
  const size_t scale_bytes = Int8Codec::scale_bytes(job.n, block);
  std::memset(job.payload + scale_bytes, 0, job.layout.section1 - scale_bytes);
  auto* scales = reinterpret_cast<float*>(job.payload + job.layout.section0);
  auto* q = reinterpret_cast<int8_t*>(job.payload + job.layout.section1);
  parallel_ranges(job.n, block, [&](size_t b, size_t e) {
    job.loops.int8.encode(job.a.at(b), e - b, block, scales + b / block, q + b);
  });
}

void decode_cpu(Int8Codec, const CpuDecode& job) {
  const uint32_t block = job.header.param;
  const auto* scales = reinterpret_cast<const float*>(job.payload + job.layout.section0);
  const auto* q = reinterpret_cast<const int8_t*>(job.payload + job.layout.section1);
  parallel_ranges(job.n, block, [&](size_t b, size_t e) {
    job.loops.int8.decode(scales + b / block, q + b, e - b, block, job.out + b, job.add);
  });
}

}  // namespace gradzip::detail
