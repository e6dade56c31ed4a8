//===- HostObjectLoadTest.cpp - Host objects load from their checked bytes ===//
//
// The runtime loads a bundle's host object through a sealed copy of the
// bytes it checked (runtime/lib/HostObject.cpp), never by the file's path:
// - each open is a load of its own, of a copy no one can change or cut;
// - a file replaced at the same path (a cache rebuilding a damaged entry),
//   rewritten in place, or cut in place while an open bundle uses it: the
//   open bundle keeps working on its copy and a new open loads the new bytes
//   or fails cleanly, never the stale mapping (which glibc would return for
//   a path or inode it has loaded, and which faults past a cut);
// - a name another loaded object holds is not reused, and an object that
//   outlives its bundle keeps its name until it is gone;
// - both kinds of copy (memfd, private file) directly, and their failures.
// The cases that could die of a signal run in a child process.
//
//===----------------------------------------------------------------------===//

#include "HostObject.h"
#include "TestBundle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <link.h>
#include <sys/mman.h>
#include <memory>
#include <set>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

using namespace ce;
using namespace ce::test;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

namespace {

const std::string kObject = "host-x86_64.so";

/// Runs `body` in a child process and returns what it returns ("" when all
/// went well), or how the child died.
std::string inChild(const std::function<std::string()> &body) {
  int signal = 0;
  std::string report = runInChild(body, signal);
  if (signal > 0)
    return report + "killed by signal " + std::to_string(signal) + " (" +
           strsignal(signal) + ")";
  return report;
}

/// Collects what went wrong in a child.
class Problems {
public:
  void expect(bool ok, const std::string &what) {
    if (!ok)
      text += what + "; ";
  }
  std::string text;
};

/// A bundle opened through the C API, with the host object the runtime
/// loaded for it (null if the open loaded none).
struct Opened {
  ce_status status = CE_OK;
  std::string message;
  ce_bundle *bundle = nullptr;
  void *object = nullptr;

  explicit Opened(const std::string &dir) {
    std::set<uintptr_t> before = loadedObjects();
    status = ce_bundle_open(dir.c_str(), &bundle);
    message = ce_last_error_message();
    if (status == CE_OK)
      object = newlyLoadedObject(before, "ce_fake_record");
  }
  ~Opened() {
    // Our reference first, so that closing the bundle unloads the object.
    if (object)
      ::dlclose(object);
    ce_bundle_close(bundle);
  }
  Opened(const Opened &) = delete;
  Opened &operator=(const Opened &) = delete;

  /// Which build of fake_kernels.c the object is (1 or 2), or 0.
  int build() const {
    auto *value = object ? static_cast<const int *>(
                               ::dlsym(object, "ce_fake_kernels_build"))
                         : nullptr;
    return value ? *value : 0;
  }
  bool works() const { return object && fakeForwardWorks(bundle, object); }
};

/// The name the dynamic loader knows `object` by.
std::string loadedName(void *object) {
  link_map *map = nullptr;
  if (!object || ::dlinfo(object, RTLD_DI_LINKMAP, &map) != 0 || !map)
    return "";
  return map->l_name;
}

std::string buildA() { return fakeKernelBytes(); }
std::string buildB() { return readFile(CE_FAKE_KERNELS_B_PATH); }

/// Writes a bundle of `object` into `dir`, the object by writing
/// a new file and renaming it over the old one (a new inode, as a cache or
/// an atomic copy makes).
void writeBundleAtomically(const std::string &dir, const std::string &object) {
  {
    std::ofstream out(dir + "/.new", std::ios::binary | std::ios::trunc);
    out << object;
  }
  std::filesystem::rename(dir + "/.new", dir + "/" + kObject);
  std::ofstream(dir + "/manifest.json", std::ios::binary | std::ios::trunc)
      << manifestJson({{forwardKey(), "fake_forward_flat", {}}},
                      CE_RUNTIME_BUNDLE_VERSION, sha256Of(object));
}

/// Rewrites the object of `dir` in place (the same inode) with `object`,
/// and its manifest to match.
void rewriteInPlace(const std::string &dir, const std::string &object) {
  std::ofstream(dir + "/" + kObject, std::ios::binary | std::ios::trunc)
      << object;
  std::ofstream(dir + "/manifest.json", std::ios::binary | std::ios::trunc)
      << manifestJson({{forwardKey(), "fake_forward_flat", {}}},
                      CE_RUNTIME_BUNDLE_VERSION, sha256Of(object));
}

ino_t inodeOf(const std::string &path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 ? info.st_ino : 0;
}

TEST(HostObjectLoad, EachOpenLoadsASealedCopyOfItsOwn) {
  TempDir dir;
  writeBundleAtomically(dir.path(), buildA());
  std::string path = dir.path() + "/" + kObject;
  Opened first(dir.path());
  ASSERT_EQ(first.status, CE_OK) << first.message;
  ASSERT_NE(first.object, nullptr);
  EXPECT_TRUE(first.works());
  // Loaded through its memfd, not by the bundle's path.
  std::string name = loadedName(first.object);
  EXPECT_EQ(name, "/proc/" + std::to_string(::getpid()) + "/fd/" +
                      name.substr(name.rfind('/') + 1));
  EXPECT_EQ(::dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD), nullptr);
  // The copy holds the checked bytes, and nothing can change or cut it.
  EXPECT_EQ(sha256Of(readFile(name)), sha256Of(buildA()));
  int fd = ::open(name.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL;
  EXPECT_EQ(::fcntl(fd, F_GET_SEALS), seals);
  if (::fcntl(fd, F_GET_SEALS) == seals) { // else the tries would cut it
    errno = 0;
    EXPECT_EQ(::pwrite(fd, "x", 1, 100), -1);
    EXPECT_EQ(errno, EPERM);
    errno = 0;
    EXPECT_EQ(::ftruncate(fd, 1000), -1);
    EXPECT_EQ(errno, EPERM);
    EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, 0), -1); // F_SEAL_SEAL
  }
  ::close(fd);

  // Opening the same bundle again is another load, and closing one leaves
  // the other working.
  auto second = std::make_unique<Opened>(dir.path());
  ASSERT_EQ(second->status, CE_OK) << second->message;
  ASSERT_NE(second->object, nullptr) << "no new load for the second open";
  EXPECT_NE(second->object, first.object);
  EXPECT_NE(loadedName(second->object), name);
  EXPECT_TRUE(second->works());
  second.reset();
  EXPECT_TRUE(first.works());
}

TEST(HostObjectLoad, AFileReplacedAtTheSamePathIsLoadedAnew) {
  // A cache rebuilding an entry writes a new file over the old one's path
  // while a bundle of the old one is open: a new open must load the new
  // bytes, not glibc's mapping of the old path.
  EXPECT_EQ(inChild([] {
              Problems problems;
              TempDir dir;
              writeBundleAtomically(dir.path(), buildA());
              Opened old(dir.path());
              problems.expect(old.status == CE_OK && old.build() == 1 &&
                                  old.works(),
                              "the first open: " + old.message);
              ino_t before = inodeOf(dir.path() + "/" + kObject);
              writeBundleAtomically(dir.path(), buildB());
              problems.expect(inodeOf(dir.path() + "/" + kObject) != before,
                              "the replacement has the old inode");
              Opened fresh(dir.path());
              problems.expect(fresh.status == CE_OK, "reopen: " +
                                                         fresh.message);
              problems.expect(fresh.object != nullptr,
                              "the reopen loaded no new object");
              problems.expect(fresh.build() == 2,
                              "the reopen runs build " +
                                  std::to_string(fresh.build()) +
                                  " of the kernels, expected 2");
              problems.expect(fresh.works(), "the new bundle's kernel");
              problems.expect(old.build() == 1 && old.works(),
                              "the old bundle's kernel");
              return problems.text;
            }),
            "");
}

TEST(HostObjectLoad, AFileRewrittenInPlaceIsLoadedAnew) {
  // The same inode with other bytes: glibc matches a loaded object by inode
  // too, and a mapping of the file itself would now show the new bytes.
  EXPECT_EQ(inChild([] {
              Problems problems;
              TempDir dir;
              writeBundleAtomically(dir.path(), buildA());
              Opened old(dir.path());
              problems.expect(old.status == CE_OK && old.works(),
                              "the first open: " + old.message);
              ino_t before = inodeOf(dir.path() + "/" + kObject);
              rewriteInPlace(dir.path(), buildB());
              problems.expect(inodeOf(dir.path() + "/" + kObject) == before,
                              "the rewrite changed the inode");
              problems.expect(old.build() == 1 && old.works(),
                              "the old bundle's kernel after the rewrite");
              Opened fresh(dir.path());
              problems.expect(fresh.status == CE_OK,
                              "reopen: " + fresh.message);
              problems.expect(fresh.build() == 2,
                              "the reopen runs build " +
                                  std::to_string(fresh.build()) +
                                  " of the kernels, expected 2");
              problems.expect(fresh.works(), "the new bundle's kernel");
              return problems.text;
            }),
            "");
}

TEST(HostObjectLoad, AFileCutInPlaceWhileLoaded) {
  // A mapping of the file itself faults (SIGBUS) on its pages past the cut;
  // the open bundle runs its own copy, and a new open fails cleanly.
  EXPECT_EQ(inChild([] {
              Problems problems;
              TempDir dir;
              writeBundleAtomically(dir.path(), buildA());
              Opened old(dir.path());
              problems.expect(old.status == CE_OK && old.works(),
                              "the first open: " + old.message);
              std::string path = dir.path() + "/" + kObject;
              problems.expect(::truncate(path.c_str(), 1000) == 0,
                              "truncate");
              problems.expect(old.works(), "the old bundle's kernel after "
                                           "the cut");
              Opened fresh(dir.path());
              problems.expect(fresh.status == CE_ERROR_BUNDLE &&
                                  fresh.message.find(path + "' (objects[0]") !=
                                      std::string::npos &&
                                  fresh.message.find("is damaged") !=
                                      std::string::npos,
                              "reopen: " + fresh.message);
              problems.expect(old.works(), "the old bundle's kernel after "
                                           "the failed reopen");
              return problems.text;
            }),
            "");
}

TEST(HostObjectLoad, ANameAnotherLoadedObjectHoldsIsNotReused) {
  // Something else loaded an object through /proc/PID/fd/M and closed M:
  // the name is a loaded object's while M is free. The next bundle's memfd
  // gets M, and dlopen() of that name would hand back the other object.
  EXPECT_EQ(inChild([] {
              Problems problems;
              TempDir dir;
              writeBundleAtomically(dir.path(), buildB());
              int other = ::memfd_create("other", MFD_CLOEXEC);
              std::string bytes = buildA();
              problems.expect(other >= 0 && ::write(other, bytes.data(),
                                                    bytes.size()) ==
                                                ssize_t(bytes.size()),
                              "the other memfd");
              std::string otherName = "/proc/" + std::to_string(::getpid()) +
                                      "/fd/" + std::to_string(other);
              void *stale = ::dlopen(otherName.c_str(), RTLD_NOW | RTLD_LOCAL);
              problems.expect(stale != nullptr, "loading the other object");
              ::close(other);
              // Every lower number in use: the runtime's next descriptor
              // gets M.
              std::vector<int> fillers;
              int fd;
              while ((fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) < other)
                fillers.push_back(fd);
              problems.expect(fd == other, "the other number is not free");
              ::close(fd);
              {
                Opened opened(dir.path());
                problems.expect(opened.status == CE_OK,
                                "the open: " + opened.message);
                problems.expect(opened.build() == 2,
                                "the bundle runs build " +
                                    std::to_string(opened.build()) +
                                    " of the kernels (the other object's is "
                                    "1), expected 2");
                problems.expect(loadedName(opened.object) != otherName,
                                "the bundle's object is named '" + otherName +
                                    "' too");
                problems.expect(opened.works(), "the bundle's kernel");
              }
              for (int filler : fillers)
                ::close(filler);
              if (stale)
                ::dlclose(stale);
              return problems.text;
            }),
            "");
}

/// Whether `fd` is an open descriptor.
bool isOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(HostObjectLoad, AnObjectThatOutlivesItsBundleKeepsItsName) {
  // Another reference keeps bundle A's object loaded after A is closed: its
  // memfd stays open, so no later load takes the name, and is closed once
  // the object is gone.
  TempDir dirA, dirB;
  writeBundleAtomically(dirA.path(), buildA());
  writeBundleAtomically(dirB.path(), buildB());
  auto a = std::make_unique<Opened>(dirA.path());
  ASSERT_EQ(a->status, CE_OK) << a->message;
  std::string nameA = loadedName(a->object);
  int number = std::atoi(nameA.substr(nameA.rfind('/') + 1).c_str());
  ASSERT_GT(number, 2) << nameA;
  void *held = ::dlopen(nameA.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  ASSERT_NE(held, nullptr);
  a.reset();
  EXPECT_TRUE(isOpen(number)) << "A's memfd was closed while its object is "
                                 "loaded";
  {
    Opened b(dirB.path());
    ASSERT_EQ(b.status, CE_OK) << b.message;
    EXPECT_EQ(b.build(), 2);
    EXPECT_NE(loadedName(b.object), nameA);
    EXPECT_TRUE(b.works());
  }
  ::dlclose(held);
  ASSERT_EQ(::dlopen(nameA.c_str(), RTLD_LAZY | RTLD_NOLOAD), nullptr)
      << "A's object is still loaded";
  // The next load finds the object gone and closes its memfd (its own
  // memfd may then take the number).
  {
    Opened again(dirA.path());
    ASSERT_EQ(again.status, CE_OK) << again.message;
    EXPECT_TRUE(again.works());
    EXPECT_TRUE(!isOpen(number) || loadedName(again.object) == nameA);
  }
  EXPECT_FALSE(isOpen(number));
}

size_t openDescriptors() {
  size_t count = 0;
  if (DIR *dir = ::opendir("/proc/self/fd")) {
    while (::readdir(dir))
      ++count;
    ::closedir(dir);
  }
  return count;
}

TEST(HostObjectLoad, ClosingABundleClosesItsCopy) {
  TempDir dir;
  writeBundleAtomically(dir.path(), buildA());
  size_t before = openDescriptors();
  for (int i = 0; i < 20; ++i) {
    ce_bundle *bundle = nullptr;
    ASSERT_EQ(ce_bundle_open(dir.path().c_str(), &bundle), CE_OK)
        << ce_last_error_message();
    ce_bundle_close(bundle);
  }
  EXPECT_EQ(openDescriptors(), before);
}

TEST(HostObjectLoad, EachKindOfCopyDirectly) {
  const std::string path = "/bundles/b/host-x86_64.so";
  for (HostObjectCopy copy : {HostObjectCopy::Memfd, HostObjectCopy::PrivateFile}) {
    bool memfd = copy == HostObjectCopy::Memfd;
    SCOPED_TRACE(memfd ? "memfd" : "private file");
    LoadedHostObject first, second;
    Status loaded = loadHostObject(buildA(), path, copy, first);
    ASSERT_TRUE(loaded.isOk()) << loaded.message();
    loaded = loadHostObject(buildA(), path, copy, second);
    ASSERT_TRUE(loaded.isOk()) << loaded.message();
    ASSERT_NE(first.handle(), nullptr);
    EXPECT_NE(first.handle(), second.handle());
    EXPECT_NE(first.loadedName(), second.loadedName());
    EXPECT_EQ(loadedName(first.handle()), first.loadedName());
    auto *build = static_cast<const int *>(
        ::dlsym(first.handle(), "ce_fake_kernels_build"));
    ASSERT_NE(build, nullptr);
    EXPECT_EQ(*build, 1);
    if (memfd) {
      EXPECT_THAT(first.loadedName(), StartsWith("/proc/"));
    } else {
      const char *tmp = std::getenv("TMPDIR");
      EXPECT_THAT(first.loadedName(),
                  StartsWith(std::string(tmp && *tmp ? tmp : "/tmp") +
                             "/ce-host-object-"));
      // Removed once loaded.
      EXPECT_FALSE(std::filesystem::exists(first.loadedName()));
    }
    // Moved-from objects own nothing; the destination unloads.
    LoadedHostObject moved = std::move(first);
    EXPECT_EQ(first.handle(), nullptr);
    EXPECT_NE(moved.handle(), nullptr);

    // An object dlopen refuses: the message names the bundle's file, not
    // the copy.
    LoadedHostObject refused;
    Status status = loadHostObject(fakeHsaco(""), path, copy, refused);
    EXPECT_EQ(status.code(), CE_ERROR_BUNDLE);
    EXPECT_THAT(status.message(),
                StartsWith("cannot load host object '" + path + "': " + path));
    EXPECT_THAT(status.message(), Not(HasSubstr("/proc/")));
    EXPECT_THAT(status.message(), Not(HasSubstr("ce-host-object-")));
    EXPECT_EQ(refused.handle(), nullptr);
  }
}

TEST(HostObjectLoad, APrivateFileNeedsAUsableTmpdir) {
  const char *saved = std::getenv("TMPDIR");
  std::string savedValue = saved ? saved : "";
  ::setenv("TMPDIR", "/nonexistent/ce-tmp", 1);
  LoadedHostObject object;
  Status status = loadHostObject(buildA(), "/b/host-x86_64.so",
                                 HostObjectCopy::PrivateFile, object);
  if (saved)
    ::setenv("TMPDIR", savedValue.c_str(), 1);
  else
    ::unsetenv("TMPDIR");
  EXPECT_EQ(status.code(), CE_ERROR_BUNDLE);
  EXPECT_THAT(status.message(),
              StartsWith("cannot load host object '/b/host-x86_64.so': cannot "
                         "create a private copy in '/nonexistent/ce-tmp' "
                         "(TMPDIR): No such file or directory"));
}

} // namespace
