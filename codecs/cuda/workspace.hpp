// Device workspace the CUDA encoders need. Codec::workspace_bytes(n) returns the larger of this
// and the CPU path's need (it is one number for both backends).
#pragma once

#include <cstddef>

#include "gradzip/gradzip.hpp"

namespace gradzip::detail {

// Bytes of device workspace gradzip::cuda::encode / encode_with_feedback need for n elements
// (top-k: selection state, 3 histograms, two 8-byte words per 4096-element tile and a 4-byte
// candidate slot per element: 24,640 + 16 * ceil(n / 4096) + 4n bytes; other codecs: 0).
size_t cuda_workspace_bytes(const CodecSpec& spec, size_t n);

}  // namespace gradzip::detail
