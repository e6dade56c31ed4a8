//===- CpuFeatures.cpp - The x86-64 features this CPU has -----------------===//
//
// cpuid leaves 1, 7 (subleaves 0 and 1) and 0x80000001, and XGETBV for the
// OS's support of the AVX and AVX-512 register state (a CPU with AVX-512
// under an OS that does not save ZMM registers cannot run AVX-512 code).
//
//===----------------------------------------------------------------------===//

#include "CpuFeatures.h"

#include "ce/runtime/BundleAbi.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace ce {

namespace {

/// Which register and bit of which cpuid leaf a feature is.
struct FeatureBit {
  const char *name;
  unsigned leaf, subleaf;
  enum Register { Ebx, Ecx, Edx, Eax } reg;
  unsigned bit;
  /// The OS state it needs: 0 none, 1 AVX (XMM+YMM), 2 AVX-512 (+ZMM, k).
  int state;
};

constexpr FeatureBit kBits[] = {
    {"sse4.1", 1, 0, FeatureBit::Ecx, 19, 0},
    {"sse4.2", 1, 0, FeatureBit::Ecx, 20, 0},
    {"popcnt", 1, 0, FeatureBit::Ecx, 23, 0},
    {"movbe", 1, 0, FeatureBit::Ecx, 22, 0},
    {"fma", 1, 0, FeatureBit::Ecx, 12, 1},
    {"avx", 1, 0, FeatureBit::Ecx, 28, 1},
    {"f16c", 1, 0, FeatureBit::Ecx, 29, 1},
    {"bmi", 7, 0, FeatureBit::Ebx, 3, 0},
    {"avx2", 7, 0, FeatureBit::Ebx, 5, 1},
    {"bmi2", 7, 0, FeatureBit::Ebx, 8, 0},
    {"avx512f", 7, 0, FeatureBit::Ebx, 16, 2},
    {"avx512dq", 7, 0, FeatureBit::Ebx, 17, 2},
    {"avx512ifma", 7, 0, FeatureBit::Ebx, 21, 2},
    {"avx512cd", 7, 0, FeatureBit::Ebx, 28, 2},
    {"avx512bw", 7, 0, FeatureBit::Ebx, 30, 2},
    {"avx512vl", 7, 0, FeatureBit::Ebx, 31, 2},
    {"avx512vbmi", 7, 0, FeatureBit::Ecx, 1, 2},
    {"avx512vbmi2", 7, 0, FeatureBit::Ecx, 6, 2},
    {"gfni", 7, 0, FeatureBit::Ecx, 8, 0},
    {"vaes", 7, 0, FeatureBit::Ecx, 9, 1},
    {"vpclmulqdq", 7, 0, FeatureBit::Ecx, 10, 1},
    {"avx512vnni", 7, 0, FeatureBit::Ecx, 11, 2},
    {"avx512bitalg", 7, 0, FeatureBit::Ecx, 12, 2},
    {"avx512vpopcntdq", 7, 0, FeatureBit::Ecx, 14, 2},
    {"avx512fp16", 7, 0, FeatureBit::Edx, 23, 2},
    {"avxvnni", 7, 1, FeatureBit::Eax, 4, 1},
    {"avx512bf16", 7, 1, FeatureBit::Eax, 5, 2},
    {"lzcnt", 0x80000001u, 0, FeatureBit::Ecx, 5, 0},
};

#if defined(__x86_64__)
/// The XCR0 bits of the register state the OS saves (0 without OSXSAVE).
uint64_t osRegisterState() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27)))
    return 0;
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool hasBit(const FeatureBit &feature) {
  unsigned regs[4] = {0, 0, 0, 0}; // eax, ebx, ecx, edx
  if (!__get_cpuid_count(feature.leaf, feature.subleaf, &regs[0], &regs[1],
                         &regs[2], &regs[3]))
    return false;
  unsigned value = feature.reg == FeatureBit::Eax   ? regs[0]
                   : feature.reg == FeatureBit::Ebx ? regs[1]
                   : feature.reg == FeatureBit::Ecx ? regs[2]
                                                    : regs[3];
  if (!(value & (1u << feature.bit)))
    return false;
  uint64_t xcr0 = feature.state ? osRegisterState() : 0;
  if (feature.state >= 1 && (xcr0 & 0x6) != 0x6) // XMM, YMM
    return false;
  if (feature.state >= 2 && (xcr0 & 0xe0) != 0xe0) // opmask, ZMM
    return false;
  return true;
}
#else
bool hasBit(const FeatureBit &) { return false; }
#endif

const FeatureBit *bitOf(std::string_view name) {
  for (const FeatureBit &feature : kBits)
    if (name == feature.name)
      return &feature;
  return nullptr;
}

} // namespace

bool isKnownCpuFeature(std::string_view name) {
  return std::any_of(std::begin(kHostCpuFeatures), std::end(kHostCpuFeatures),
                     [&](const char *known) { return name == known; });
}

bool cpuHasFeature(std::string_view name) {
  const FeatureBit *feature = bitOf(name);
  return feature && isKnownCpuFeature(name) && hasBit(*feature);
}

std::vector<std::string>
missingCpuFeatures(const std::vector<std::string> &required,
                   const std::function<bool(std::string_view)> &has) {
  std::vector<std::string> missing;
  for (const std::string &name : required)
    if (!has(name))
      missing.push_back(name);
  return missing;
}

Status checkCpuFeatures(const std::vector<std::string> &required,
                        const std::string &path) {
  std::vector<std::string> missing = missingCpuFeatures(required, cpuHasFeature);
  if (missing.empty())
    return Status::ok();
  std::string names;
  for (const std::string &name : missing)
    names += (names.empty() ? "" : ", ") + name;
  return Status::bundleError(
      "host object '" + path + "' needs CPU features this CPU lacks: " +
      names +
      " (it was built for another machine, e.g. with ce-gen "
      "--host-cpu=native; rebuild it with the default --host-cpu)");
}

} // namespace ce
