#include "pointer_check.hpp"

#include <string>

#include "gradzip/gradzip.hpp"

#ifdef GRADZIP_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gradzip::detail {

void require_host_pointer(const void* p, const char* what) {
#ifdef GRADZIP_HAS_CUDA
  if (p == nullptr) return;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // a plain host pointer may report an error on old drivers: clear it
    return;
  }
  if (attr.type == cudaMemoryTypeDevice)
    throw Error(Status::invalid_argument,
                std::string("gradzip: ") + what + " is CUDA device memory: use gradzip::cuda::...");
#else
  (void)p;
  (void)what;
#endif
}

}  // namespace gradzip::detail
