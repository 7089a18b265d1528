// decode and decode_add: validate the whole message (read_header), then run the kernels per
// thread range. Top-k scatters its values after zeroing (decode) or onto the output (decode_add).
#include <cstdint>
#include <cstring>
#include <string>

#include "detail.hpp"
#include "gradzip/gradzip.hpp"
#include "parallel.hpp"
#include "pointer_check.hpp"

namespace gradzip {
namespace {

void decode_impl(const void* wire, size_t bytes, float* out, size_t n, bool add) {
  const detail::IeeeFloatMode ieee;  // the caller's thread; workers set their own
  detail::require_host_pointer(out, "out");
  // The payload is read as floats and words in place: as on the GPU, it must be 4-byte aligned
  // (a message inside a concatenated buffer: start each one at a multiple of 4 or 16).
  if (reinterpret_cast<uintptr_t>(wire) % 4 != 0)
    throw Error(Status::invalid_argument, "gradzip: wire must be 4-byte aligned");
  const WireHeader h = read_header(wire, bytes);
  if (h.count != n)
    throw Error(Status::size_mismatch, "gradzip: payload holds " + std::to_string(h.count) +
                                           " elements, the output has " + std::to_string(n));
  if (n > 0 && out == nullptr) throw Error(Status::invalid_argument, "gradzip: out is null");
  const auto kind = static_cast<CodecKind>(h.codec);
  const bool fp16_values = (h.flags & kTopkFlagFp16Values) != 0;
  const PayloadLayout l = payload_layout(h);
  const char* payload = static_cast<const char*>(wire) + kHeaderBytes;
  const detail::CpuLoops& k = detail::cpu_loops();
  switch (kind) {
    case CodecKind::fp32:
      detail::parallel_ranges(n, 16, [&](size_t b, size_t e) {
        k.decode_fp32(reinterpret_cast<const float*>(payload) + b, e - b, out + b, add);
      });
      break;
    case CodecKind::fp16:
    case CodecKind::bf16: {
      auto fn = kind == CodecKind::fp16 ? k.decode_fp16 : k.decode_bf16;
      detail::parallel_ranges(n, 32, [&](size_t b, size_t e) {
        fn(reinterpret_cast<const uint16_t*>(payload) + b, e - b, out + b, add);
      });
      break;
    }
    case CodecKind::int8:
    case CodecKind::sign: {
      const uint32_t block = h.param;
      const auto* scales = reinterpret_cast<const float*>(payload + l.section0);
      detail::parallel_ranges(n, block, [&](size_t b, size_t e) {
        if (kind == CodecKind::int8)
          k.decode_int8(scales + b / block, reinterpret_cast<const int8_t*>(payload + l.section1) + b,
                        e - b, block, out + b, add);
        else
          k.decode_sign(scales + b / block,
                        reinterpret_cast<const uint32_t*>(payload + l.section1) + b / 32, e - b,
                        block, out + b, add);
      });
      break;
    }
    case CodecKind::topk: {
      if (!add)
        detail::parallel_ranges(n, 16, [&](size_t b, size_t e) {
          std::memset(out + b, 0, (e - b) * sizeof(float));
        });
      const auto* idx = reinterpret_cast<const uint32_t*>(payload + l.section0);
      const size_t kk = h.param;
      const auto* f32 = reinterpret_cast<const float*>(payload + l.section1);
      const auto* f16 = reinterpret_cast<const uint16_t*>(payload + l.section1);
      // Indices are strictly increasing (validated), so ranges of them write disjoint outputs.
      // fp16 values are widened 256 at a time by the vectorised decoder first: converted inside
      // the scatter loop they made it four times slower.
      detail::parallel_ranges(kk, 16, [&](size_t b, size_t e) {
        alignas(64) float widened[256];
        for (size_t s = b; s < e; s += 256) {
          const size_t m = e - s < 256 ? e - s : 256;
          const float* v = f32 + s;
          if (fp16_values) {
            k.decode_fp16(f16 + s, m, widened, false);
            v = widened;
          }
          for (size_t j = 0; j < m; ++j) {
            float& o = out[idx[s + j]];
            o = add ? o + v[j] : v[j];
          }
        }
      });
      break;
    }
  }
}

}  // namespace

void decode(const void* wire, size_t bytes, float* out, size_t n) {
  decode_impl(wire, bytes, out, n, false);
}
void decode_add(const void* wire, size_t bytes, float* out, size_t n) {
  decode_impl(wire, bytes, out, n, true);
}

}  // namespace gradzip
