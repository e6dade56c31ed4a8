//===- KernelCache.h - Loaded kernels, shared between threads ---*- C++ -*-===//
//
// Internal to the runtime (not installed). Loading a kernel for a device
// (resolving a host entry point; getting a GPU function from a module loaded
// once per code object and device) happens once per (bundle, variant key,
// device, context) and is cached here. The cache is process-wide and guarded
// by a mutex; entries of a bundle are dropped, and its GPU modules unloaded,
// when the bundle is closed.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_KERNELCACHE_H
#define CE_RUNTIME_KERNELCACHE_H

#include "GpuDriver.h"
#include "Manifest.h"
#include "Status.h"
#include "ce/runtime/ce_runtime.h"

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace ce {

/// What identifies one loaded kernel.
struct KernelCacheKey {
  uint64_t bundleId = 0;
  std::string variantKey; ///< The variant key, a newline and the symbol.
  ce_device_type device = CE_DEVICE_HOST;
  int32_t deviceIndex = 0;
  /// The CUDA context the kernel is loaded in; 0 for host and HIP kernels.
  uint64_t context = 0;

  bool operator<(const KernelCacheKey &other) const {
    return std::tie(bundleId, variantKey, device, deviceIndex, context) <
           std::tie(other.bundleId, other.variantKey, other.device,
                    other.deviceIndex, other.context);
  }
};

/// What identifies one loaded GPU code object: every kernel of a bundle's
/// object shares one module per device and context.
struct ModuleCacheKey {
  uint64_t bundleId = 0;
  std::string object;
  ce_device_type device = CE_DEVICE_HOST;
  int32_t deviceIndex = 0;
  uint64_t context = 0;

  bool operator<(const ModuleCacheKey &other) const {
    return std::tie(bundleId, object, device, deviceIndex, context) <
           std::tie(other.bundleId, other.object, other.device,
                    other.deviceIndex, other.context);
  }
};

/// A loaded GPU module and who unloads it.
struct LoadedModule {
  void *module = nullptr;
  GpuDriver *driver = nullptr;
};

/// A kernel ready to launch on one device.
struct LoadedKernel {
  const KernelInfo *info = nullptr; ///< Owned by the bundle.
  void *entry = nullptr;            ///< Host entry point, or GPU function.
};

class KernelCache {
public:
  using Loader = std::function<Status(LoadedKernel &)>;
  using ModuleLoader = std::function<Status(LoadedModule &)>;

  /// The process-wide cache.
  static KernelCache &global();

  /// Returns the cached kernel for `key`, or calls `load` once to make it.
  /// Concurrent callers for the same key wait for the first load; a failed
  /// load is not cached.
  Status getOrLoad(const KernelCacheKey &key, const Loader &load,
                   LoadedKernel &kernel);

  /// Returns the cached module for `key`, or calls `load` once to make it.
  /// May be called from a kernel Loader.
  Status getOrLoadModule(const ModuleCacheKey &key, const ModuleLoader &load,
                         LoadedModule &module);

  /// Drops every entry of bundle `bundleId` and unloads its GPU modules.
  void evictBundle(uint64_t bundleId);

  /// Number of cached kernels (for tests).
  size_t size() const;

private:
  /// Recursive: a kernel loader loads its module through the cache.
  mutable std::recursive_mutex mutex;
  std::map<KernelCacheKey, LoadedKernel> entries;
  std::map<ModuleCacheKey, LoadedModule> modules;
};

} // namespace ce

#endif // CE_RUNTIME_KERNELCACHE_H
