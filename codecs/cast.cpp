// fp32 / fp16 / bf16 encode and decode on the CPU: the values split into per-thread ranges, each
// a whole number of 64-byte lines of the payload.
#include "cast.hpp"

#include "cpu_table.hpp"
#include "parallel.hpp"

namespace gradzip::detail {
namespace {

template <class C>
constexpr size_t kValuesPerLine = 64 / sizeof(typename C::Wire);

template <class C>
void encode_cast(const CpuEncode& job) {
  auto* out = reinterpret_cast<typename C::Wire*>(job.payload);
  parallel_ranges(job.n, kValuesPerLine<C>, [&](size_t b, size_t e) {
    job.loops.of(C{}).encode(job.a.at(b), e - b, out + b);
  });
}

template <class C>
void decode_cast(const CpuDecode& job) {
  const auto* in = reinterpret_cast<const typename C::Wire*>(job.payload);
  parallel_ranges(job.n, kValuesPerLine<C>, [&](size_t b, size_t e) {
    job.loops.of(C{}).decode(in + b, e - b, job.out + b, job.add);
  });
}

}  // namespace

void encode_cpu(Fp32Codec, const CpuEncode& job) { encode_cast<Fp32Codec>(job); }
void encode_cpu(Fp16Codec, const CpuEncode& job) { encode_cast<Fp16Codec>(job); }
void encode_cpu(Bf16Codec, const CpuEncode& job) { encode_cast<Bf16Codec>(job); }
void decode_cpu(Fp32Codec, const CpuDecode& job) { decode_cast<Fp32Codec>(job); }
void decode_cpu(Fp16Codec, const CpuDecode& job) { decode_cast<Fp16Codec>(job); }
void decode_cpu(Bf16Codec, const CpuDecode& job) { decode_cast<Bf16Codec>(job); }

}  // namespace gradzip::detail
