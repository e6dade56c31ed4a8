//===- Bundle.h - An opened kernel bundle -----------------------*- C++ -*-===//
//
// Internal to the runtime (not installed). A Bundle is a validated manifest
// plus the host code objects it names, each loaded from the bytes that were
// checked (HostObject.h) with dlopen(RTLD_LOCAL) so that two bundles never
// see each other's symbols. It is immutable once opened and safe to share
// between threads.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_BUNDLE_H
#define CE_RUNTIME_BUNDLE_H

#include "HostObject.h"
#include "Manifest.h"
#include "Status.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ce {

/// The target name host kernels carry in a manifest.
inline constexpr const char *kHostTarget = "host";

class Bundle {
public:
  /// Opens the bundle in `directory`: reads and validates manifest.json,
  /// reads every object file and checks its structure and SHA-256
  /// (ObjectCheck.h), loads each host object from those bytes (a load of
  /// this bundle's own, HostObject.h) and resolves every host kernel's
  /// symbol. Any failure is CE_ERROR_BUNDLE with a message naming the file.
  static Status open(const std::string &directory,
                     std::unique_ptr<Bundle> &bundle);

  Bundle(const Bundle &) = delete;
  Bundle &operator=(const Bundle &) = delete;
  ~Bundle();

  /// A process-unique id; never reused, unlike the object's address.
  uint64_t id() const { return bundleId; }
  const std::string &directory() const { return bundleDirectory; }
  const Manifest &manifest() const { return bundleManifest; }
  const std::vector<KernelInfo> &kernels() const {
    return bundleManifest.kernels;
  }

  /// The kernel for `target` with variant key `key` that serves rows of
  /// `vocab` elements (the largest `launch.min_vocab` <= vocab), or null.
  const KernelInfo *findKernel(std::string_view target, std::string_view key,
                               int64_t vocab) const;

  /// The resolved entry point of a host kernel of this bundle, or null for
  /// kernels of other targets.
  void *hostEntry(const KernelInfo &kernel) const;

  /// The path of an object file of this bundle (`ObjectInfo::file`).
  std::string objectPath(const std::string &file) const;

  /// Reads the object file `file` (an `ObjectInfo::file` of this bundle)
  /// and checks its structure and SHA-256 again (ObjectCheck.h), so that
  /// what a GPU driver loads is what was checked, even if the file changed
  /// since the bundle was opened.
  Status readObject(const std::string &file, std::string &bytes) const;

private:
  Bundle() = default;

  uint64_t bundleId = 0;
  std::string bundleDirectory;
  Manifest bundleManifest;
  /// (target, key) -> indices into the manifest's kernels, by decreasing
  /// `launch.min_vocab`.
  std::map<std::pair<std::string, std::string>, std::vector<size_t>> index;
  /// The host objects, loaded from their checked bytes (HostObject.h).
  std::vector<LoadedHostObject> hostObjects;
  /// Host entry points, parallel to the manifest's kernels.
  std::vector<void *> entries;
};

} // namespace ce

#endif // CE_RUNTIME_BUNDLE_H
