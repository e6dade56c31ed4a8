//===- HostObject.h - Loading a host object from its checked bytes -*- C++ -*-===//
//
// Internal to the runtime (not installed). A bundle's host object is read
// whole and checked (ObjectCheck.h) before it is loaded, and what is loaded
// must be those bytes: not the file again, which may have changed since (a
// cache rebuilding a damaged entry at the same path, a copy still being
// written), and not an object the dynamic loader already has under that
// path or inode (glibc hands back its old mapping of a path or inode it has
// loaded, whose pages change with the file and fault once it is cut short).
// So the bytes are copied into a sealed memfd (no one can change or cut it)
// and dlopen()ed by a name no other loaded object has; where memfds are not
// available or not executable, into a private temporary file instead.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_HOSTOBJECT_H
#define CE_RUNTIME_HOSTOBJECT_H

#include "Status.h"

#include <string>
#include <string_view>

namespace ce {

/// A host object loaded with dlopen(RTLD_NOW | RTLD_LOCAL); unloaded (and
/// its memfd closed) when destroyed.
class LoadedHostObject {
public:
  LoadedHostObject() = default;
  LoadedHostObject(LoadedHostObject &&other) noexcept;
  LoadedHostObject &operator=(LoadedHostObject &&other) noexcept;
  LoadedHostObject(const LoadedHostObject &) = delete;
  LoadedHostObject &operator=(const LoadedHostObject &) = delete;
  ~LoadedHostObject();

  /// The dlopen handle, or null.
  void *handle() const { return dlHandle; }
  /// The name the dynamic loader knows the object by: "/proc/PID/fd/N" of
  /// its memfd, or the (already removed) private file's path.
  const std::string &loadedName() const { return name; }

private:
  friend class HostObjectLoader;
  void reset();

  void *dlHandle = nullptr;
  /// The memfd, kept open while the object is loaded so that its number,
  /// and so the name, is this object's alone; -1 for a private file.
  int fd = -1;
  std::string name;
};

/// How a host object's bytes reach the dynamic loader.
enum class HostObjectCopy {
  Memfd,       ///< a sealed memfd, by /proc/PID/fd/N
  PrivateFile, ///< a file in $TMPDIR (or /tmp), removed once loaded
};

/// Loads `bytes`, the checked contents of the host object at `path` (named
/// in messages), through a copy of them: a sealed memfd, or a private file
/// where memfds are not available or not executable. Failures are
/// CE_ERROR_BUNDLE naming `path`.
Status loadHostObject(std::string_view bytes, const std::string &path,
                      LoadedHostObject &object);

/// Loads `bytes` through the given kind of copy only (tests use each).
Status loadHostObject(std::string_view bytes, const std::string &path,
                      HostObjectCopy copy, LoadedHostObject &object);

} // namespace ce

#endif // CE_RUNTIME_HOSTOBJECT_H
