//===- CpuFeatures.h - The x86-64 features this CPU has ---------*- C++ -*-===//
//
// Internal to the runtime. A host object records the CPU features its code
// needs (ce/runtime/BundleAbi.h's kHostCpuFeatures); the bundle is refused
// before dlopen when this CPU lacks one, instead of dying of SIGILL at the
// first call.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_CPUFEATURES_H
#define CE_RUNTIME_CPUFEATURES_H

#include "Status.h"

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace ce {

/// Whether `name` is one of kHostCpuFeatures.
bool isKnownCpuFeature(std::string_view name);

/// Whether this CPU, with this OS's register state, has `name` (a known
/// feature; false for any other name).
bool cpuHasFeature(std::string_view name);

/// The features of `required` that `has` says are missing, in order.
std::vector<std::string>
missingCpuFeatures(const std::vector<std::string> &required,
                   const std::function<bool(std::string_view)> &has);

/// CE_ERROR_BUNDLE naming `path` and the missing features when this CPU
/// lacks any of `required`; ok otherwise.
Status checkCpuFeatures(const std::vector<std::string> &required,
                        const std::string &path);

} // namespace ce

#endif // CE_RUNTIME_CPUFEATURES_H
