// 1-bit sign encode and decode on the CPU: per-thread ranges of whole blocks (a block is a
// multiple of 32 elements, so a range starts on a sign word).
#include "sign.hpp"

#include <cstring>

#include "cpu_table.hpp"
#include "parallel.hpp"

namespace gradzip::detail {

void encode_cpu(SignCodec, const CpuEncode& job) {
  const uint32_t block = job.param;
  const size_t scale_bytes = SignCodec::scale_bytes(job.n, block);
  std::memset(job.payload + scale_bytes, 0, job.layout.section1 - scale_bytes);
  auto* scales = reinterpret_cast<float*>(job.payload + job.layout.section0);
  auto* words = reinterpret_cast<uint32_t*>(job.payload + job.layout.section1);
  parallel_ranges(job.n, block, [&](size_t b, size_t e) {
    job.loops.sign.encode(job.a.at(b), e - b, block, scales + b / block, words + b / 32);
  });
}

void decode_cpu(SignCodec, const CpuDecode& job) {
  const uint32_t block = job.header.param;
  const auto* scales = reinterpret_cast<const float*>(job.payload + job.layout.section0);
  const auto* words = reinterpret_cast<const uint32_t*>(job.payload + job.layout.section1);
  parallel_ranges(job.n, block, [&](size_t b, size_t e) {
    job.loops.sign.decode(scales + b / block, words + b / 32, e - b, block, job.out + b, job.add);
  });
}

}  // namespace gradzip::detail
