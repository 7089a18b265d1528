// Small RAII helpers over the CUDA runtime for the GPU tests and benchmarks (tests and
// bench/gpu/ share them): a device buffer, checked calls, host <-> device copies.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gztest {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device memory of `bytes` bytes (+ `slack` guard bytes after it, for out-of-bounds checks).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    cuda_check(cudaMalloc(&p_, bytes == 0 ? 16 : bytes), "cudaMalloc");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }

  void* get() const { return p_; }
  template <class T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

  void fill(uint8_t byte) { cuda_check(cudaMemset(p_, byte, bytes_), "cudaMemset"); }
  template <class T>
  void upload(const std::vector<T>& v, size_t offset_bytes = 0) {
    cuda_check(cudaMemcpy(static_cast<char*>(p_) + offset_bytes, v.data(), v.size() * sizeof(T),
                          cudaMemcpyHostToDevice),
               "cudaMemcpy H2D");
  }
  template <class T>
  std::vector<T> download(size_t count, size_t offset_bytes = 0) const {
    std::vector<T> v(count);
    cuda_check(cudaMemcpy(v.data(), static_cast<const char*>(p_) + offset_bytes, count * sizeof(T),
                          cudaMemcpyDeviceToHost),
               "cudaMemcpy D2H");
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Exit code CTest reads as "skipped" (SKIP_RETURN_CODE 77).
constexpr int kSkipExitCode = 77;

}  // namespace gztest
