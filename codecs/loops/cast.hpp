// fp32 / fp16 / bf16 CPU loops, one template over the codec (P: Fp32Codec, Fp16Codec or
// Bf16Codec of gradzip/codec/cast.hpp): one pass, c rounded and the residual updated.
#pragma once

#include "common.hpp"

namespace gradzip::detail {
namespace {

template <class P, bool EF>
void cast_encode_loop(const float* __restrict g, float* __restrict r, float p, size_t n,
                      typename P::Wire* __restrict out) {
  for (size_t i = 0; i < n; ++i) {
    const float c = cin<EF>(g, r, p, i);
    const typename P::Wire w = P::encode(c);
    out[i] = w;
    if constexpr (EF) r[i] = el::ef_residual(c, P::decode(w), r[i]);
  }
}
template <class P>
void encode_cast(EncodeArgs a, size_t n, typename P::Wire* out) {
  with_ef(a, [&](auto ef) { cast_encode_loop<P, ef.value>(a.grad, a.residual, a.prescale, n, out); });
}

template <class P, bool ADD>
void cast_decode_loop(const typename P::Wire* __restrict in, size_t n, float* __restrict out) {
  for (size_t i = 0; i < n; ++i) store<ADD>(out, i, P::decode(in[i]));
}
template <class P>
void decode_cast(const typename P::Wire* in, size_t n, float* out, bool add) {
  if (add) cast_decode_loop<P, true>(in, n, out);
  else cast_decode_loop<P, false>(in, n, out);
}

}  // namespace
}  // namespace gradzip::detail
