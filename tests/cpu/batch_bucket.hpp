// A bucket of messages for the batch tests of both backends (tests/cpu/test_batch.cpp,
// tests/gpu/test_gpu_batch.cpp): mixed codecs and odd sizes in 16-byte aligned slots, as the
// compressed all-reduce cuts a bucket.
#pragma once

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace gztest {

using gradzip::Codec;
using gradzip::DecodeItem;
using gradzip::EncodeItem;

// A bucket cut into messages, as the compressed all-reduce cuts one: each message its own codec
// and its own slice of one input, in 16-byte aligned slots of one wire buffer.
struct Bucket {
  std::vector<Codec> codecs;
  std::vector<size_t> sizes, offsets, slots;
  size_t n = 0, wire_bytes = 0;

  explicit Bucket(const std::vector<std::pair<const char*, size_t>>& messages) {
    for (const auto& [spec, m] : messages) {
      codecs.push_back(Codec::parse(spec));
      sizes.push_back(m);
      offsets.push_back(n);
      slots.push_back(wire_bytes);
      n += m;
      wire_bytes += gradzip::message_slot_bytes(codecs.back().encoded_bytes(m));
    }
  }
  size_t count() const { return codecs.size(); }
  size_t bytes(size_t i) const { return codecs[i].encoded_bytes(sizes[i]); }

  std::vector<EncodeItem> encode_items(const float* in, float* residual, std::byte* wire) const {
    std::vector<EncodeItem> items;
    for (size_t i = 0; i < count(); ++i)
      items.push_back({&codecs[i], in + offsets[i], residual ? residual + offsets[i] : nullptr,
                       sizes[i], wire + slots[i], bytes(i)});
    return items;
  }
  std::vector<DecodeItem> decode_items(const std::byte* wire, float* out) const {
    std::vector<DecodeItem> items;
    for (size_t i = 0; i < count(); ++i)
      items.push_back({wire + slots[i], bytes(i), out + offsets[i], sizes[i]});
    return items;
  }
};

// Every codec family, odd sizes, exact (fp32) messages between compressed ones, an empty message.
inline const Bucket& bucket() {
  static const Bucket b({{"int8", 1001},
                         {"fp32", 37},
                         {"int8:block=64", 129},
                         {"sign", 2049},
                         {"fp32", 0},
                         {"fp16", 333},
                         {"bf16", 65},
                         {"topk:0.01", 4097},
                         {"topk:0.1:values=fp16", 999},
                         {"sign:block=32", 31}});
  return b;
}

// Random values with the special ones sprinkled in: NaN, +-Inf, denormals, signed zeros.
inline std::vector<float> batch_input(size_t n, uint64_t seed) {
  std::vector<float> v = random_grad(n, seed);
  const float special[] = {std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::denorm_min(), -1e-40f, -0.0f};
  for (size_t i = 0; i < n; i += 211) v[i] = special[(i / 211) % 6];
  return v;
}

}  // namespace gztest
