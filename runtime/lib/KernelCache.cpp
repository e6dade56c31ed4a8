//===- KernelCache.cpp - Loaded kernels, shared between threads -----------===//
//
// Loads run under the cache's lock. They are rare (once per variant and
// device) and, for GPU modules, not free, so serializing them costs nothing
// that matters and keeps two threads from loading the same module twice.
//
//===----------------------------------------------------------------------===//

#include "KernelCache.h"

#include <vector>

namespace ce {

KernelCache &KernelCache::global() {
  // Never destroyed: a launch from another thread during exit must not meet
  // a destroyed mutex.
  static KernelCache *cache = new KernelCache();
  return *cache;
}

Status KernelCache::getOrLoad(const KernelCacheKey &key, const Loader &load,
                              LoadedKernel &kernel) {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  auto found = entries.find(key);
  if (found != entries.end()) {
    kernel = found->second;
    return Status::ok();
  }
  LoadedKernel loaded;
  if (Status status = load(loaded); !status.isOk())
    return status;
  entries.emplace(key, loaded);
  kernel = loaded;
  return Status::ok();
}

Status KernelCache::getOrLoadModule(const ModuleCacheKey &key,
                                    const ModuleLoader &load,
                                    LoadedModule &module) {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  auto found = modules.find(key);
  if (found != modules.end()) {
    module = found->second;
    return Status::ok();
  }
  LoadedModule loaded;
  if (Status status = load(loaded); !status.isOk())
    return status;
  modules.emplace(key, loaded);
  module = loaded;
  return Status::ok();
}

void KernelCache::evictBundle(uint64_t bundleId) {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  auto first = entries.lower_bound(KernelCacheKey{bundleId, "", {}, 0, 0});
  auto last = entries.lower_bound(KernelCacheKey{bundleId + 1, "", {}, 0, 0});
  entries.erase(first, last);
  auto firstModule =
      modules.lower_bound(ModuleCacheKey{bundleId, "", {}, 0, 0});
  auto lastModule =
      modules.lower_bound(ModuleCacheKey{bundleId + 1, "", {}, 0, 0});
  for (auto it = firstModule; it != lastModule; ++it)
    if (it->second.driver)
      it->second.driver->unloadModule(it->first.deviceIndex, it->first.context,
                                      it->second.module);
  modules.erase(firstModule, lastModule);
}

size_t KernelCache::size() const {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  return entries.size();
}

} // namespace ce
