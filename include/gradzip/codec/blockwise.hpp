// The wire rules int8 and sign share: a block size in the header, one f32 scale per block, zero
// padding to 16 bytes, then the codec's second section of words (int8's q bytes, sign's u32
// words), each word holding ElementsPerWord elements.
#pragma once

#include "gradzip/wire_types.hpp"

namespace gradzip {

template <class WordType, uint32_t ElementsPerWord>
struct BlockwiseWire {
  using Word = WordType;
  static constexpr uint32_t kElementsPerWord = ElementsPerWord;

  // Facts (see visit.hpp): one scale per block, so a block must not straddle two tensors.
  static constexpr bool block_scaled = true;
  static constexpr bool summable = false;
  static constexpr bool sparse = false;
  static constexpr bool all_gathered = false;

  // log2 of a power-of-two block.
  static GZ_HD int block_shift(uint32_t block) {
#if defined(__CUDA_ARCH__)
    return __ffs(block) - 1;
#else
    return __builtin_ctz(block);
#endif
  }
  // Bytes of the scales, before the padding.
  static GZ_HD constexpr uint64_t scale_bytes(uint64_t n, uint32_t block) {
    return 4 * ceil_div(n, block);
  }
  // Offset of the second section: the scales padded to 16 bytes.
  static GZ_HD constexpr uint64_t section1(uint64_t n, uint32_t block) {
    return align16(scale_bytes(n, block));
  }
  // Payload: the scales, their padding, then ceil(n / kElementsPerWord) words.
  static GZ_HD constexpr PayloadLayout layout(uint64_t n, uint32_t block, uint32_t /*flags*/) {
    PayloadLayout l{};
    l.section1 = section1(n, block);
    l.bytes = l.section1 + sizeof(Word) * ceil_div(n, kElementsPerWord);
    return l;
  }
  static GZ_HD constexpr WireCheck check_params(const WireHeader& h) {
    if (!valid_block(h.param)) return {WireStatus::bad_param, h.param};
    if (h.flags != 0) return {WireStatus::bad_flags, h.flags};
    return {WireStatus::ok, 0};
  }
  // The block of element i: a shift when the block is a power of two, else one division (32-bit
  // when i fits).
  static GZ_HD uint64_t block_of(uint64_t i, uint32_t block) {
    if ((block & (block - 1)) == 0) return i >> block_shift(block);
    return i <= 0xFFFFFFFFu ? static_cast<uint32_t>(i) / block : i / block;
  }
  static GZ_HD const float* scales(const uint8_t* payload) {
    return reinterpret_cast<const float*>(payload);
  }
  // The words of a payload of n elements.
  static GZ_HD const Word* words(const uint8_t* payload, uint64_t n, uint32_t block) {
    return reinterpret_cast<const Word*>(payload + section1(n, block));
  }
  // The padding after the scales is zero.
  static GZ_HD WireCheck check_scale_padding(const WireHeader& h, const uint8_t* payload) {
    const uint64_t end = section1(h.count, h.param);
    for (uint64_t i = scale_bytes(h.count, h.param); i < end; ++i)
      if (payload[i] != 0) return {WireStatus::bad_padding, i};
    return {WireStatus::ok, 0};
  }
};

}  // namespace gradzip
