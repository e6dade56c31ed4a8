//===- Bundle.cpp - Opening a kernel bundle -------------------------------===//
//
// Everything that can be checked without a device is checked when a bundle is
// opened, so that a broken bundle fails at load time with a message about the
// bundle rather than at the first launch with a message about a kernel.
//
//===----------------------------------------------------------------------===//

#include "Bundle.h"
#include "CpuFeatures.h"
#include "HostObject.h"
#include "ObjectCheck.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <dlfcn.h>
#include <fstream>
#include <sstream>
#include <sys/stat.h>

namespace ce {

namespace {

/// Manifests are small; anything bigger than this is not a manifest.
constexpr std::streamoff kMaxManifestBytes = 64 << 20;

std::atomic<uint64_t> nextBundleId{1};

std::string joinPath(const std::string &directory, const std::string &file) {
  if (!directory.empty() && directory.back() == '/')
    return directory + file;
  return directory + "/" + file;
}

Status readFile(const std::string &path, std::string &contents) {
  std::ifstream stream(path, std::ios::binary | std::ios::ate);
  if (!stream)
    return Status::bundleError("cannot open '" + path +
                               "': " + std::strerror(errno));
  std::streamoff size = stream.tellg();
  if (size < 0 || size > kMaxManifestBytes)
    return Status::bundleError("'" + path + "' is not a manifest (" +
                               std::to_string(size) + " bytes)");
  contents.resize(static_cast<size_t>(size));
  stream.seekg(0);
  if (!stream.read(contents.data(), size))
    return Status::bundleError("cannot read '" + path + "'");
  return Status::ok();
}

} // namespace

Status Bundle::open(const std::string &directory,
                    std::unique_ptr<Bundle> &result) {
  result.reset();
  std::unique_ptr<Bundle> bundle(new Bundle());
  bundle->bundleId = nextBundleId.fetch_add(1);
  bundle->bundleDirectory = directory;

  struct stat info;
  if (::stat(directory.c_str(), &info) != 0) {
    if (errno == ENOENT)
      return Status::bundleError("bundle directory '" + directory +
                                 "' does not exist (ce-gen -o DIR writes one)");
    return Status::bundleError("cannot access bundle directory '" + directory +
                               "': " + std::strerror(errno));
  }
  if (!S_ISDIR(info.st_mode))
    return Status::bundleError("bundle path '" + directory +
                               "' is not a directory");

  std::string manifestPath = joinPath(directory, kManifestFile);
  if (::stat(manifestPath.c_str(), &info) != 0)
    return Status::bundleError("no manifest.json in bundle directory '" +
                               directory +
                               "' (ce-gen -o DIR writes DIR/manifest.json)");
  if (!S_ISREG(info.st_mode))
    return Status::bundleError("'" + manifestPath + "' is not a file");
  std::string text;
  if (Status status = readFile(manifestPath, text); !status.isOk())
    return status;
  if (Status status = parseManifest(text, manifestPath, bundle->bundleManifest);
      !status.isOk())
    return status;

  const Manifest &manifest = bundle->bundleManifest;
  std::map<std::string, void *> hostHandles;
  for (size_t i = 0; i < manifest.objects.size(); ++i) {
    const ObjectInfo &object = manifest.objects[i];
    std::string path = joinPath(directory, object.file);
    if (::stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode))
      return Status::bundleError("object file '" + path + "' named by " +
                                 manifestPath + " (objects[" +
                                 std::to_string(i) + "]) does not exist");
    // Every object is checked now, so that a damaged bundle fails here; a
    // host object must be, since dlopen faults on a truncated object. (GPU
    // objects are checked again when they are read for loading.)
    std::string bytes;
    if (Status status = readCodeObject(path, object, i, bytes); !status.isOk())
      return status;
    if (object.target != kHostTarget)
      continue;
    // Code built for a newer CPU would die of SIGILL at the first call.
    if (Status status = checkCpuFeatures(object.cpuFeatures, path);
        !status.isOk())
      return status;
    // The bytes checked are the bytes loaded, through a copy of them that
    // no later change to the file reaches, and each open is a load of its
    // own (HostObject.h).
    LoadedHostObject loaded;
    if (Status status = loadHostObject(bytes, path, loaded); !status.isOk())
      return status;
    hostHandles[object.file] = loaded.handle();
    bundle->hostObjects.push_back(std::move(loaded));
  }

  bundle->entries.assign(manifest.kernels.size(), nullptr);
  for (size_t i = 0; i < manifest.kernels.size(); ++i) {
    const KernelInfo &kernel = manifest.kernels[i];
    // The manifest reader allows one kernel per minimum.
    std::vector<size_t> &candidates = bundle->index[{kernel.target, kernel.key}];
    candidates.push_back(i);
    std::sort(candidates.begin(), candidates.end(), [&](size_t a, size_t b) {
      return manifest.kernels[a].launch.minVocab >
             manifest.kernels[b].launch.minVocab;
    });
    if (kernel.target != kHostTarget)
      continue;
    void *handle = hostHandles.at(kernel.object);
    ::dlerror();
    void *entry = ::dlsym(handle, kernel.symbol.c_str());
    if (!entry)
      return Status::bundleError("symbol '" + kernel.symbol + "' of kernel \"" +
                                 kernel.key + "\" not found in '" +
                                 joinPath(directory, kernel.object) + "'");
    bundle->entries[i] = entry;
  }
  result = std::move(bundle);
  return Status::ok();
}

Bundle::~Bundle() = default;

const KernelInfo *Bundle::findKernel(std::string_view target,
                                     std::string_view key,
                                     int64_t vocab) const {
  auto found = index.find({std::string(target), std::string(key)});
  if (found == index.end())
    return nullptr;
  for (size_t i : found->second)
    if (bundleManifest.kernels[i].launch.minVocab <= vocab)
      return &bundleManifest.kernels[i];
  return nullptr;
}

std::string Bundle::objectPath(const std::string &file) const {
  return joinPath(bundleDirectory, file);
}

Status Bundle::readObject(const std::string &file, std::string &bytes) const {
  const std::vector<ObjectInfo> &objects = bundleManifest.objects;
  for (size_t i = 0; i < objects.size(); ++i)
    if (objects[i].file == file)
      return readCodeObject(objectPath(file), objects[i], i, bytes);
  return Status::error(CE_ERROR_BACKEND, "object '" + file +
                                             "' is not listed in the "
                                             "manifest of bundle '" +
                                             bundleDirectory + "'");
}

void *Bundle::hostEntry(const KernelInfo &kernel) const {
  size_t position = &kernel - bundleManifest.kernels.data();
  if (position >= entries.size())
    return nullptr;
  return entries[position];
}

} // namespace ce
