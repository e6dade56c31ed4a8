//===- KernelCache.h - Loaded kernels, shared between threads ---*- C++ -*-===//
//
// Internal to the runtime (not installed). Loading a kernel for a device
// (resolving a host entry point today; loading a GPU module per device later)
// happens once per (bundle, variant key, device) and is cached here. The
// cache is process-wide and guarded by a mutex; entries of a bundle are
// dropped when the bundle is closed.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_KERNELCACHE_H
#define CE_RUNTIME_KERNELCACHE_H

#include "ce/runtime/Manifest.h"
#include "ce/runtime/Status.h"
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
  std::string variantKey;
  ce_device_type device = CE_DEVICE_HOST;
  int32_t deviceIndex = 0;

  bool operator<(const KernelCacheKey &other) const {
    return std::tie(bundleId, variantKey, device, deviceIndex) <
           std::tie(other.bundleId, other.variantKey, other.device,
                    other.deviceIndex);
  }
};

/// A kernel ready to launch on one device.
struct LoadedKernel {
  const KernelInfo *info = nullptr; ///< Owned by the bundle.
  void *entry = nullptr;            ///< Host entry point, or module handle.
};

class KernelCache {
public:
  using Loader = std::function<Status(LoadedKernel &)>;

  /// The process-wide cache.
  static KernelCache &global();

  /// Returns the cached kernel for `key`, or calls `load` once to make it.
  /// Concurrent callers for the same key wait for the first load; a failed
  /// load is not cached.
  Status getOrLoad(const KernelCacheKey &key, const Loader &load,
                   LoadedKernel &kernel);

  /// Drops every entry of bundle `bundleId`.
  void evictBundle(uint64_t bundleId);

  /// Number of cached kernels (for tests).
  size_t size() const;

private:
  mutable std::mutex mutex;
  std::map<KernelCacheKey, LoadedKernel> entries;
};

} // namespace ce

#endif // CE_RUNTIME_KERNELCACHE_H
