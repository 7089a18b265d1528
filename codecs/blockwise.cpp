// Blockwise int8 and sign encode and decode on the CPU: per-thread ranges of whole blocks (a
// block is a multiple of 32 elements, so a range starts on a word of either codec).
#include "blockwise.hpp"

#include <cstring>

#include "cpu_table.hpp"
#include "parallel.hpp"

namespace gradzip::detail {
namespace {

template <class C>
void encode_blockwise(const CpuEncode& job) {
  const uint32_t block = job.param;
  const size_t scale_bytes = C::scale_bytes(job.n, block);
  std::memset(job.payload + scale_bytes, 0, job.layout.section1 - scale_bytes);
  auto* scales = reinterpret_cast<float*>(job.payload + job.layout.section0);
  auto* words = reinterpret_cast<typename C::Word*>(job.payload + job.layout.section1);
  parallel_ranges(job.n, block, [&](size_t b, size_t e) {
    job.loops.of(C{}).encode(job.a.at(b), e - b, block, scales + b / block,
                             words + b / C::kElementsPerWord);
  });
}

template <class C>
void decode_blockwise(const CpuDecode& job) {
  const uint32_t block = job.header.param;
  const auto* scales = reinterpret_cast<const float*>(job.payload + job.layout.section0);
  const auto* words = reinterpret_cast<const typename C::Word*>(job.payload + job.layout.section1);
  parallel_ranges(job.n, block, [&](size_t b, size_t e) {
    job.loops.of(C{}).decode(scales + b / block, words + b / C::kElementsPerWord, e - b, block,
                             job.out + b, job.add);
  });
}

}  // namespace

void encode_cpu(Int8Codec, const CpuEncode& job) { encode_blockwise<Int8Codec>(job); }
void encode_cpu(SignCodec, const CpuEncode& job) { encode_blockwise<SignCodec>(job); }
void decode_cpu(Int8Codec, const CpuDecode& job) { decode_blockwise<Int8Codec>(job); }
void decode_cpu(SignCodec, const CpuDecode& job) { decode_blockwise<SignCodec>(job); }

}  // namespace gradzip::detail
