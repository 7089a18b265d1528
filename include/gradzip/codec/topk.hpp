// Top-k by magnitude: the k largest |x| as their indices and values. The header's param is k. An
// index travels as a u16 offset inside its chunk of kTopkIndexChunk elements; the chunk is implied
// by a u32 per chunk, the number of kept elements in it and the chunks before it (its end): 2 bytes
// per kept element plus 4 per 65536 elements, instead of a u32 per kept element. The values travel
// as f32, fp16 (flag kTopkFlagFp16Values) or int8 with one f32 scale per index chunk (flag
// kTopkFlagInt8Values: 1 byte per kept element plus 4 per 65536 elements; the kept values of a
// chunk are the largest of their chunk, so its scale is set by the value that matters most).
#pragma once

#include "gradzip/codec/cast.hpp"
#include "gradzip/codec/int8.hpp"
#include "gradzip/element.hpp"
#include "gradzip/wire_types.hpp"

namespace gradzip {

// How a header's flags say the values travel (check_params rejects both bits set), and back.
GZ_HD constexpr TopkValues topk_values(uint32_t flags) {
  return (flags & kTopkFlagInt8Values) != 0   ? TopkValues::int8
         : (flags & kTopkFlagFp16Values) != 0 ? TopkValues::fp16
                                              : TopkValues::f32;
}
GZ_HD constexpr uint32_t topk_flags(TopkValues v) {
  return v == TopkValues::int8 ? kTopkFlagInt8Values
         : v == TopkValues::fp16 ? kTopkFlagFp16Values : 0u;
}
GZ_HD constexpr uint64_t topk_value_bytes(TopkValues v) {
  return v == TopkValues::f32 ? 4 : v == TopkValues::fp16 ? 2 : 1;
}

namespace element {

// ---- top-k by magnitude -----------------------------------------------------------------------
// Key = abs_bits(x): orders like |x|, NaN above Inf, so non-finite values are always picked first.
// Selection is exact: the k largest keys; ties at the threshold key go to the lowest indices, so
// indices come out strictly increasing and every implementation picks the same set.
// Radix select digits over the 31-bit key, most significant first: 11, 11, then 10 bits.
GZ_HD uint32_t topk_key(float x) { return abs_bits(x); }
constexpr int kTopkDigitShift[3] = {21, 10, 0};
constexpr uint32_t kTopkDigitMask[3] = {0x7FFu, 0x7FFu, 0x3FFu};
constexpr int kTopkRadix = 2048;  // histogram size of the widest digit
// int8 values given their chunk's absmax as bits (the integer max of its kept keys): the level of
// c and what it decodes to, as Int8Codec's blocks.
GZ_HD float topk_int8_level(float c, uint32_t amax) { return int8_level(c, int8_inv_scale(amax)); }
GZ_HD float topk_int8_decoded(float level, uint32_t amax) {
  return int8_level_value(level, int8_scale(amax));
}

// Values on the wire: the kept c as f32, or (fp16) as Fp16Codec rounds it. topk_put_value writes
// slot j and returns what it decodes to; error feedback keeps c minus that. int8 values need their
// chunk's scale, known only once every kept value of the chunk is: here nothing is written and
// NaN returned, so that ef_residual leaves the residual as it was (c - NaN is not finite) and
// topk_quantize_chunk can compute the same c again from it.
GZ_HD float topk_put_value(void* values, uint64_t j, float c, TopkValues v) {
  if (v == TopkValues::fp16) {
    const Fp16Codec::Wire h = Fp16Codec::encode(c);
    static_cast<Fp16Codec::Wire*>(values)[j] = h;
    return Fp16Codec::decode(h);
  }
  if (v == TopkValues::int8) return bits_float(kCanonicalNaN);
  static_cast<float*>(values)[j] = c;
  return c;
}
// What a kept c decodes to; int8: `amax` is its chunk's (topk_int8_level).
GZ_HD float topk_value_decoded(float c, TopkValues v, uint32_t amax) {
  if (v == TopkValues::int8) return topk_int8_decoded(topk_int8_level(c, amax), amax);
  return v == TopkValues::fp16 ? Fp16Codec::decode(Fp16Codec::encode(c)) : c;
}
// Value j, in index chunk `chunk` (whose scale int8 values use).
GZ_HD float topk_get_value(const uint8_t* payload, const PayloadLayout& l, TopkValues v,
                           uint64_t j, uint64_t chunk) {
  const uint8_t* values = payload + l.section2;
  if (v == TopkValues::int8)
    return int8_dequantize(static_cast<const int8_t*>(static_cast<const void*>(values))[j],
                           bits_float(load_u32(payload + l.section3 + 4 * chunk)));
  return v == TopkValues::fp16 ? Fp16Codec::decode(load_u16(values + 2 * j))
                               : bits_float(load_u32(values + 4 * j));
}

// int8 values, once the selection is done: the kept values of one index chunk (c(j) gives value
// j of them, as the selection saw it) with the chunk's scale from the integer max of their keys,
// as Int8Codec's blocks. put(j, c, q, decoded) stores each; returns the scale.
template <class Value, class Put>
GZ_HD float topk_quantize_chunk(uint64_t count, Value&& c, Put&& put) {
  uint32_t amax = 0;
  for (uint64_t j = 0; j < count; ++j) {
    const uint32_t key = topk_key(c(j));
    amax = key > amax ? key : amax;
  }
  const float scale = int8_scale(amax), inv = int8_inv_scale(amax);
  for (uint64_t j = 0; j < count; ++j) {
    const float cj = c(j);
    const float level = int8_level(cj, inv);
    put(j, cj, static_cast<int8_t>(level), int8_level_value(level, scale));
  }
  return scale;
}

}  // namespace element

// The chunk ends a top-k payload of n elements holds: one per kTopkIndexChunk elements.
GZ_HD constexpr uint64_t topk_index_chunks(uint64_t n) { return ceil_div(n, kTopkIndexChunk); }

struct TopkCodec {
  static constexpr CodecKind kind = CodecKind::topk;
  static constexpr const char* spec_name = "topk";
  // Facts (see visit.hpp): index/value pairs. Summed at a shard's owner and re-encoded, W ranks'
  // selections would be selected again (and the union lost), so an all-reduce all-gathers every
  // rank's message of the whole bucket instead.
  static constexpr bool block_scaled = false;
  static constexpr bool summable = false;
  static constexpr bool sparse = true;
  static constexpr bool all_gathered = true;
  // Payload: ceil(n / kTopkIndexChunk) u32 chunk ends, pad to 16; k u16 in-chunk offsets, pad
  // to 16; k values; with int8 values, pad to 16 and one f32 scale per chunk.
  static GZ_HD constexpr PayloadLayout layout(uint64_t n, uint32_t k, uint32_t flags) {
    PayloadLayout l{};
    l.section1 = align16(4 * topk_index_chunks(n));
    l.section2 = l.section1 + align16(2ull * k);
    const TopkValues v = topk_values(flags);
    l.bytes = l.section2 + topk_value_bytes(v) * k;
    if (v == TopkValues::int8) {
      l.section3 = l.section2 + align16(k);
      l.bytes = l.section3 + 4 * topk_index_chunks(n);
    }
    return l;
  }
  static GZ_HD constexpr WireCheck check_params(const WireHeader& h) {
    if (h.count > kTopkMaxCount) return {WireStatus::bad_count, h.count};
    if (h.count == 0 ? h.param != 0 : (h.param == 0 || h.param > h.count))
      return {WireStatus::bad_k, h.param};
    if (h.flags != 0 && h.flags != kTopkFlagFp16Values && h.flags != kTopkFlagInt8Values)
      return {WireStatus::bad_flags, h.flags};
    return {WireStatus::ok, 0};
  }
  // The zero padding after the chunk ends, the offsets and int8 values, then the chunk ends:
  // never decreasing, a chunk holding at most its length, the last one k. The offsets are checked
  // one by one (check_index). Any scale is valid (int8's blocks: a non-finite one decodes its
  // chunk to NaN).
  static GZ_HD WireCheck check_padding(const WireHeader& h, const uint8_t* payload) {
    const uint64_t chunks = topk_index_chunks(h.count);
    const PayloadLayout l = layout(h.count, h.param, h.flags);
    for (uint64_t b = 4 * chunks; b < l.section1; ++b)
      if (payload[b] != 0) return {WireStatus::bad_padding, b};
    for (uint64_t b = l.section1 + 2ull * h.param; b < l.section2; ++b)
      if (payload[b] != 0) return {WireStatus::bad_padding, b};
    for (uint64_t b = l.section2 + h.param; b < l.section3; ++b)
      if (payload[b] != 0) return {WireStatus::bad_padding, b};
    uint64_t start = 0;
    for (uint64_t c = 0; c < chunks; ++c) {
      const uint64_t end = load_u32(payload + 4 * c);
      const uint64_t len = c + 1 < chunks ? kTopkIndexChunk : h.count - c * kTopkIndexChunk;
      if (end < start || end - start > len || (c + 1 == chunks && end != h.param))
        return {WireStatus::bad_chunk_ends, c};
      start = end;
    }
    return {WireStatus::ok, 0};
  }

  // Element by element, every value decodes to 0: the kept values are scattered afterwards.
  struct ElementDecoder {
    GZ_HD float operator()(uint64_t /*e*/) const { return 0.0f; }
  };
  static GZ_HD ElementDecoder element_decoder(const WireHeader&, const uint8_t*, uint64_t) {
    return {};
  }
};

// Where position j of a top-k payload lies: its chunk (the first whose end is above j, found by
// bisection over the chunk ends, which check_padding validated), the chunk's first position and
// the element index. Independent per j, so the device decoders use it in parallel.
struct TopkPosition {
  uint64_t chunk, chunk_start, index;
};
GZ_HD TopkPosition topk_position(const WireHeader& h, const uint8_t* payload, uint64_t j) {
  uint64_t lo = 0, hi = topk_index_chunks(h.count) - 1;  // j < k: some chunk ends above j
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (load_u32(payload + 4 * mid) > j) hi = mid; else lo = mid + 1;
  }
  const uint64_t start = lo == 0 ? 0 : load_u32(payload + 4 * (lo - 1));
  const PayloadLayout l = TopkCodec::layout(h.count, h.param, 0);
  return {lo, start, lo * kTopkIndexChunk + load_u16(payload + l.section1 + 2 * j)};
}

// Top-k position j of a message whose header and chunk ends are valid: its index below count and
// above the one at j - 1 (inside a chunk; the chunks themselves are in order).
GZ_HD WireCheck check_index(const WireHeader& h, const uint8_t* payload, uint64_t j) {
  const TopkPosition p = topk_position(h, payload, j);
  if (p.index >= h.count) return {WireStatus::bad_index, 2 * j};
  const uint8_t* offsets = payload + TopkCodec::layout(h.count, h.param, 0).section1;
  if (j > p.chunk_start && load_u16(offsets + 2 * j) <= load_u16(offsets + 2 * (j - 1)))
    return {WireStatus::bad_index, 2 * j + 1};
  return {WireStatus::ok, 0};
}

}  // namespace gradzip
