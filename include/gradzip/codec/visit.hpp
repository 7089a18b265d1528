// The one place that turns a CodecKind into a codec: visit(kind, f) calls f with the codec's
// traits (gradzip/codec/<codec>.hpp), so every codec-specific step is an overload or a member of
// those types and a new codec is one enum value, one case here and one file per layer.
//
// Besides its steps, every traits type states the codec's facts as static constexpr members, which
// code that holds only a kind reads through visit (visit(kind, [](auto c) { return c.sparse; })):
//   block_scaled  one scale per block of the header's param (int8, sign): a block must not mix two
//                 tensors, whose scales can differ by orders of magnitude, so the bucket reduction
//                 encodes a shard as one message per tensor piece
//   summable      the payload is the n values in a float type (wire_dtype) that a backend's
//                 all-reduce sums in place (the casts): a bucket can be summed on the wire
//   sparse        the payload is k increasing indices, then k values (top-k): validators check
//                 every index, decoders write zeros and scatter the values
//   all_gathered  an all-reduce all-gathers every rank's message of the whole bucket and each rank
//                 decode-adds them, instead of the two-phase exchange (top-k; the bucket reduction
//                 takes the two-phase exchange for it too when asked, CastSum::fp32)
#pragma once

#include "gradzip/codec/cast.hpp"
#include "gradzip/codec/int8.hpp"
#include "gradzip/codec/sign.hpp"
#include "gradzip/codec/topk.hpp"
#include "gradzip/wire_types.hpp"

namespace gradzip {

GZ_HD constexpr bool known_codec(CodecKind kind) {
  return static_cast<uint8_t>(kind) <= static_cast<uint8_t>(CodecKind::topk);
}

// kind must be known_codec (callers check it first: check_header, Codec's validation).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // f may be host-only: visit is then only called on the host
#endif
template <class F>
GZ_HD constexpr decltype(auto) visit(CodecKind kind, F&& f) {
  switch (kind) {
    case CodecKind::fp32: return f(Fp32Codec{});
    case CodecKind::fp16: return f(Fp16Codec{});
    case CodecKind::bf16: return f(Bf16Codec{});
    case CodecKind::int8: return f(Int8Codec{});
    case CodecKind::sign: return f(SignCodec{});
    case CodecKind::topk: break;
  }
  return f(TopkCodec{});
}

}  // namespace gradzip
