// What the batched entry points of both backends share (gradzip::encode_batch, decode_batch and
// their gradzip::cuda twins), so that a batch's mistakes read the same on the host and the GPU.
#pragma once

#include <cstddef>
#include <string>

#include "gradzip/gradzip.hpp"

namespace gradzip::detail {

// Throws Error(invalid_argument) when a non-empty batch has no item array.
inline void require_items(const char* api, const void* items, size_t count) {
  if (count > 0 && items == nullptr)
    throw Error(Status::invalid_argument, std::string(api) + ": items is null");
}

// The codec of an encode item, which must name one.
inline const Codec& item_codec(const char* api, const EncodeItem& item) {
  if (item.codec == nullptr)
    throw Error(Status::invalid_argument, std::string(api) + ": codec is null");
  return *item.codec;
}

// Runs f(), naming item i of the batch in the Error it throws.
template <class F>
void for_item(size_t i, size_t count, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    throw Error(e.status(), std::string(e.what()) + " (message " + std::to_string(i) + " of " +
                                std::to_string(count) + ")");
  }
}

}  // namespace gradzip::detail
