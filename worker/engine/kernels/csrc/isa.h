// Which inner loops may run: the CPU reports the instructions, and MLXQ_ATTN_ISA does
// not ask for less ("generic": the baseline loops, which tests run on AVX2 machines too;
// "avx2": no AVX-512). Each op compiles its vector loops only where it can (x86-64) and
// asks this once, when the library loads.
#pragma once

#include <cstdlib>
#include <string>

namespace mlxq {

inline std::string isa_request() {
  const char* want = std::getenv("MLXQ_ATTN_ISA");
  return want != nullptr ? std::string(want) : std::string();
}

inline bool use_avx2_fma() {
  if (isa_request() == "generic")
    return false;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// AVX2 + FMA with F16C (8 fp16 widened in one instruction): what int8_dot's x86 loops are built for
// (every AVX2 CPU has it; the bit is asked all the same).
inline bool use_avx2_f16c() {
  if (!use_avx2_fma())
    return false;
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// AVX-512F and VL on top of AVX2 + FMA (their 32 vector registers for 8-lane loops).
inline bool use_avx512vl() {
  if (!use_avx2_fma() || isa_request() == "avx2")
    return false;
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

} // namespace mlxq
