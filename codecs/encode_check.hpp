// The argument checks that every encode entry point shares (Codec::encode*, gradzip::cuda::encode*),
// so that a caller's mistake reads the same on the host and on the GPU.
#pragma once

#include <cstddef>

#include "gradzip/gradzip.hpp"

namespace gradzip::detail {

// Throws Error(invalid_argument) unless the input (when n > 0) and the output are non-null, the
// output holds codec.encoded_bytes(n) (which also range-checks n) and, when ws_need > 0, the
// workspace is non-null and holds ws_need bytes. `api` begins each message ("gradzip",
// "gradzip::cuda"); ws_need is the entry point's own workspace need.
void check_encode_args(const char* api, const Codec& codec, const float* in, size_t n,
                       const void* out, size_t out_bytes, const void* workspace,
                       size_t workspace_bytes, size_t ws_need);

}  // namespace gradzip::detail
