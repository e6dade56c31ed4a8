//===- HostObject.cpp - Loading a host object from its checked bytes ------===//
//
// glibc's dlopen() returns an object it already has when the name it is
// given matches a loaded object's name, or the file it opens has a loaded
// object's device and inode. Loading the bundle's file by its path therefore
// gave a process that had the file loaded its old mapping back after the
// file was replaced, and a mapping of pages that had changed (or faulted:
// SIGBUS past a cut) after it was rewritten in place; and the file could
// change between the checks and dlopen. Here the checked bytes are written
// to a new memfd, sealed against every change, and dlopen()ed through
// /proc/PID/fd/N: a new inode for every load, and a name that no loaded
// object has (checked with RTLD_NOLOAD; the memfd stays open, so its number
// stays ours, while the object is loaded: until the bundle is closed, or
// later if something else keeps the object loaded).
//
//===----------------------------------------------------------------------===//

#include "HostObject.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <fcntl.h>
#include <mutex>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>
#include <vector>

namespace ce {

namespace {

std::string errnoText() { return std::strerror(errno); }

/// Closes a file descriptor unless released.
class FdGuard {
public:
  explicit FdGuard(int fd) : fd(fd) {}
  ~FdGuard() {
    if (fd >= 0)
      ::close(fd);
  }
  FdGuard(const FdGuard &) = delete;
  FdGuard &operator=(const FdGuard &) = delete;
  int get() const { return fd; }
  void reset(int other) {
    if (fd >= 0)
      ::close(fd);
    fd = other;
  }
  int release() {
    int result = fd;
    fd = -1;
    return result;
  }

private:
  int fd;
};

bool writeAll(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    ssize_t wrote = ::write(fd, bytes.data(), bytes.size());
    if (wrote < 0 && errno == EINTR)
      continue;
    if (wrote <= 0)
      return false;
    bytes.remove_prefix(static_cast<size_t>(wrote));
  }
  return true;
}

/// Whether the file of `fd` can be mapped executable (not on a noexec
/// mount, not a memfd the kernel made non-executable); else why not.
bool mapsExecutable(int fd, std::string &why) {
  void *page = ::mmap(nullptr, 1, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
  if (page == MAP_FAILED) {
    why = "it cannot be mapped executable (" + errnoText() + ")";
    return false;
  }
  ::munmap(page, 1);
  return true;
}

/// Whether the dynamic loader has an object under `name` already (one
/// loaded earlier by a name that has been reused since, and kept loaded by
/// another reference): dlopen(name) would hand that one back.
bool nameTaken(const std::string &name) {
  void *old = ::dlopen(name.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (!old) {
    ::dlerror();
    return false;
  }
  ::dlclose(old);
  return true;
}

/// Memfds of objects that outlived their bundle (another reference keeps
/// them loaded, or they are marked NODELETE): kept open so that the number,
/// and so the object's name, is not reused while the object is loaded, and
/// closed once it is gone.
class HeldMemfds {
public:
  static HeldMemfds &get() {
    static HeldMemfds *instance = new HeldMemfds(); // never destroyed
    return *instance;
  }
  void hold(int fd, std::string name) {
    std::lock_guard<std::mutex> lock(mutex);
    held.push_back({fd, std::move(name)});
  }
  /// Closes the memfds whose objects are gone.
  void releaseUnloaded() {
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t i = 0; i < held.size();) {
      if (nameTaken(held[i].second)) {
        ++i;
        continue;
      }
      ::close(held[i].first);
      held.erase(held.begin() + i);
    }
  }

private:
  std::mutex mutex;
  std::vector<std::pair<int, std::string>> held;
};

} // namespace

LoadedHostObject::LoadedHostObject(LoadedHostObject &&other) noexcept
    : dlHandle(other.dlHandle), fd(other.fd), name(std::move(other.name)) {
  other.dlHandle = nullptr;
  other.fd = -1;
}

LoadedHostObject &
LoadedHostObject::operator=(LoadedHostObject &&other) noexcept {
  if (this != &other) {
    reset();
    dlHandle = other.dlHandle;
    fd = other.fd;
    name = std::move(other.name);
    other.dlHandle = nullptr;
    other.fd = -1;
  }
  return *this;
}

LoadedHostObject::~LoadedHostObject() { reset(); }

void LoadedHostObject::reset() {
  if (dlHandle)
    ::dlclose(dlHandle);
  // The name must stay unique while the object is loaded: if something else
  // keeps it loaded, so does its memfd stay open.
  if (fd >= 0) {
    if (dlHandle && nameTaken(name))
      HeldMemfds::get().hold(fd, name);
    else
      ::close(fd);
  }
  dlHandle = nullptr;
  fd = -1;
  name.clear();
}

/// Makes the copies; each way answers Loaded, Unavailable (this kind of
/// copy cannot be made here: try the other) or Failed (dlopen refused the
/// object: its own fault), with the reason in `problem`.
class HostObjectLoader {
public:
  enum class Outcome { Loaded, Unavailable, Failed };

  HostObjectLoader(std::string_view bytes, const std::string &path)
      : bytes(bytes), path(path) {}

  Outcome viaMemfd(LoadedHostObject &object);
  Outcome viaPrivateFile(LoadedHostObject &object);

  std::string problem;

private:
  Outcome unavailable(std::string why) {
    problem = std::move(why);
    return Outcome::Unavailable;
  }
  /// dlopen()s `name` into `object`.
  Outcome open(const std::string &name, LoadedHostObject &object);

  std::string_view bytes;
  const std::string &path;
};

HostObjectLoader::Outcome
HostObjectLoader::open(const std::string &name, LoadedHostObject &object) {
  ::dlerror();
  // RTLD_LOCAL keeps each bundle's symbols to itself; RTLD_NOW makes a
  // broken object fail here instead of at the first call.
  void *handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char *reason = ::dlerror();
    problem = reason ? reason : "dlopen failed";
    // dlerror() names the copy; the user knows the bundle's file.
    for (size_t at = problem.find(name); at != std::string::npos;
         at = problem.find(name, at + path.size()))
      problem.replace(at, name.size(), path);
    return Outcome::Failed;
  }
  object.dlHandle = handle;
  object.name = name;
  return Outcome::Loaded;
}

HostObjectLoader::Outcome
HostObjectLoader::viaMemfd(LoadedHostObject &object) {
  HeldMemfds::get().releaseUnloaded();
  // The memfd's name shows in /proc/PID/maps ("/memfd:ce-host:PATH").
  std::string label =
      "ce-host:" + path.substr(path.size() > 200 ? path.size() - 200 : 0);
  unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
  int made = -1;
#ifdef MFD_EXEC
  // Kernels from 6.3 on may make memfds non-executable unless asked.
  made = ::memfd_create(label.c_str(), flags | MFD_EXEC);
  if (made < 0 && errno == EINVAL)
#endif
    made = ::memfd_create(label.c_str(), flags);
  if (made < 0)
    return unavailable("memfd_create: " + errnoText());
  FdGuard fd(made);
  if (!writeAll(fd.get(), bytes))
    return unavailable("writing the memfd: " + errnoText());
  // Nothing can change or cut the loaded bytes from now on.
  if (::fcntl(fd.get(), F_ADD_SEALS,
              F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0)
    return unavailable("sealing the memfd: " + errnoText());
  std::string why;
  if (!mapsExecutable(fd.get(), why))
    return unavailable("the memfd: " + why);
  struct stat own;
  if (::fstat(fd.get(), &own) != 0)
    return unavailable("fstat of the memfd: " + errnoText());

  for (int attempt = 0; attempt < 64; ++attempt) {
    // /proc/PID/fd/N, which a debugger of this process can open too, or
    // /proc/self/fd/N where /proc shows another PID namespace: a name that
    // leads to this memfd.
    std::string number = std::to_string(fd.get()), name;
    for (std::string candidate :
         {"/proc/" + std::to_string(::getpid()) + "/fd/" + number,
          "/proc/self/fd/" + number}) {
      struct stat seen;
      if (::stat(candidate.c_str(), &seen) == 0 &&
          seen.st_dev == own.st_dev && seen.st_ino == own.st_ino) {
        name = candidate;
        break;
      }
    }
    if (name.empty())
      return unavailable("no /proc/self/fd/" + number + " for the memfd");
    if (!nameTaken(name)) {
      Outcome outcome = open(name, object);
      if (outcome == Outcome::Loaded)
        object.fd = fd.release();
      return outcome;
    }
    // An object loaded earlier by this fd number is loaded still: move the
    // memfd to another number.
    int moved = ::fcntl(fd.get(), F_DUPFD_CLOEXEC, fd.get() + 1);
    if (moved < 0)
      return unavailable("moving the memfd: " + errnoText());
    fd.reset(moved);
  }
  return unavailable("every /proc/self/fd name tried is an object loaded "
                     "already");
}

HostObjectLoader::Outcome
HostObjectLoader::viaPrivateFile(LoadedHostObject &object) {
  const char *tmp = std::getenv("TMPDIR");
  std::string directory = tmp && *tmp ? tmp : "/tmp";
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::string name = directory + "/ce-host-object-XXXXXX";
    int made = ::mkostemp(name.data(), O_CLOEXEC);
    if (made < 0)
      return unavailable("cannot create a private copy in '" + directory +
                         "' (TMPDIR): " + errnoText());
    FdGuard fd(made);
    // Removed once loaded: the mapping keeps the inode, and no one else
    // opens the file by its name.
    struct Remove {
      const std::string &name;
      ~Remove() { ::unlink(name.c_str()); }
    } remove{name};
    if (!writeAll(fd.get(), bytes))
      return unavailable("cannot write a private copy in '" + directory +
                         "' (TMPDIR): " + errnoText());
    std::string why;
    if (!mapsExecutable(fd.get(), why))
      return unavailable("a private copy in '" + directory + "' (TMPDIR): " +
                         why + "; set TMPDIR to a directory that allows "
                               "executable mappings");
    if (nameTaken(name))
      continue; // An older copy's name, still loaded: draw another.
    return open(name, object);
  }
  return unavailable("every private copy's name drawn is an object loaded "
                     "already");
}

Status loadHostObject(std::string_view bytes, const std::string &path,
                      HostObjectCopy copy, LoadedHostObject &object) {
  object = LoadedHostObject();
  HostObjectLoader loader(bytes, path);
  HostObjectLoader::Outcome outcome = copy == HostObjectCopy::Memfd
                                          ? loader.viaMemfd(object)
                                          : loader.viaPrivateFile(object);
  if (outcome == HostObjectLoader::Outcome::Loaded)
    return Status::ok();
  return Status::bundleError("cannot load host object '" + path + "': " +
                             loader.problem);
}

Status loadHostObject(std::string_view bytes, const std::string &path,
                      LoadedHostObject &object) {
  object = LoadedHostObject();
  HostObjectLoader loader(bytes, path);
  HostObjectLoader::Outcome outcome = loader.viaMemfd(object);
  if (outcome == HostObjectLoader::Outcome::Unavailable) {
    std::string memfdProblem = loader.problem;
    outcome = loader.viaPrivateFile(object);
    if (outcome == HostObjectLoader::Outcome::Unavailable)
      return Status::bundleError(
          "cannot load host object '" + path +
          "': no private copy of it could be made to load (" + memfdProblem +
          "; " + loader.problem + ")");
  }
  if (outcome == HostObjectLoader::Outcome::Loaded)
    return Status::ok();
  return Status::bundleError("cannot load host object '" + path + "': " +
                             loader.problem);
}

} // namespace ce
