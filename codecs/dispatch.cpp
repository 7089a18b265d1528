// Run-time choice of the CPU loop table: the widest instruction set this CPU supports, or the one
// named by GRADZIP_CPU_ISA (portable, avx2, avx512) when that is supported.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cpu_table.hpp"
#include "gradzip/gradzip.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace gradzip::detail {
namespace {

bool supported(const char* name) {
  if (std::strcmp(name, "portable") == 0) return true;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // F16C: CPUID leaf 1, ECX bit 29 (clang 14's __builtin_cpu_supports does not know "f16c").
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c &&
                    __builtin_cpu_supports("bmi2");
  if (std::strcmp(name, "avx2") == 0) return avx2;
  if (std::strcmp(name, "avx512") == 0)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  return false;
}

const CpuLoops* table_for(const char* name) {
  if (!supported(name)) return nullptr;
#if defined(__x86_64__)
  if (std::strcmp(name, "avx512") == 0) return &cpu_loops_avx512();
  if (std::strcmp(name, "avx2") == 0) return &cpu_loops_avx2();
#endif
  if (std::strcmp(name, "portable") == 0) return &cpu_loops_portable();
  return nullptr;
}

const CpuLoops* pick() {
  if (const char* env = std::getenv("GRADZIP_CPU_ISA"))
    if (const CpuLoops* k = table_for(env)) return k;
  for (const char* name : {"avx512", "avx2", "portable"})
    if (const CpuLoops* k = table_for(name)) return k;
  return &cpu_loops_portable();
}

std::atomic<const CpuLoops*> g_table{nullptr};

}  // namespace

const CpuLoops& cpu_loops() {
  const CpuLoops* k = g_table.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = pick();
    g_table.store(k, std::memory_order_release);
  }
  return *k;
}

bool force_isa(const char* name) {
  const CpuLoops* k = table_for(name);
  if (k == nullptr) return false;
  g_table.store(k, std::memory_order_release);
  return true;
}

}  // namespace gradzip::detail

const char* gradzip::cpu_isa() { return detail::cpu_loops().isa; }
