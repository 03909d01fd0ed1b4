// Whether the AVX2+FMA inner loops may run: the CPU reports both, and
// MLXQ_ATTN_ISA=generic does not ask for the baseline loops (tests run those on
// AVX2 machines too). Each op compiles its AVX2 loop only where it can (x86-64)
// and asks this once, when the library loads.
#pragma once

#include <cstdlib>
#include <string>

namespace mlxq {

inline bool use_avx2_fma() {
  const char* want = std::getenv("MLXQ_ATTN_ISA");
  if (want != nullptr && std::string(want) == "generic")
    return false;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

} // namespace mlxq
