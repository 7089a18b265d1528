// Guard for the host entry points: a CUDA device pointer passed to the CPU path is a caller bug
// that would otherwise segfault; with CUDA compiled in it becomes a clear Error instead.
#pragma once

namespace gradzip::detail {

// Throws Error(invalid_argument, "<what> is CUDA device memory: use gradzip::cuda::...") when p
// points to device memory (only when built with CUDA; otherwise does nothing). Null is allowed.
void require_host_pointer(const void* p, const char* what);

}  // namespace gradzip::detail
