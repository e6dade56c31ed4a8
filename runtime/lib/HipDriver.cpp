//===- HipDriver.cpp - CE_DEVICE_HIP through HIP's module API -------------===//
//
// libamdhip64 is opened on first use; a machine without it, or without an AMD
// GPU (hipInit fails, or no devices), answers CE_ERROR_NO_DEVICE. HIP has no
// contexts to speak of: a device is made current with hipSetDevice for the
// duration of a call and the previous one restored afterwards. A device's
// bundle target is its gcnArchName without the feature suffix ("gfx942" of
// "gfx942:sramecc+:xnack-").
//
//===----------------------------------------------------------------------===//

#include "GpuDriver.h"
#include "HipApi.h"

#include <cctype>
#include <cstring>
#include <dlfcn.h>
#include <mutex>
#include <vector>

namespace ce {

using namespace ce::hip;

namespace {

/// The development symlink first (what ROCm installs for linking), then the
/// runtime sonames of the releases this runtime knows.
constexpr const char *kLibraryNames[] = {"libamdhip64.so", "libamdhip64.so.7",
                                         "libamdhip64.so.6",
                                         "libamdhip64.so.5"};

/// The "gfxNNN" at `text` (hex digits after "gfx"), or "".
std::string archAt(const char *text, size_t room) {
  if (room < 4 || std::strncmp(text, "gfx", 3) != 0)
    return "";
  size_t end = 3;
  while (end < room && std::isxdigit(static_cast<unsigned char>(text[end])))
    ++end;
  if (end == 3 || end >= room || (text[end] != '\0' && text[end] != ':'))
    return "";
  return std::string(text, end);
}

} // namespace

class HipDriver final : public GpuDriver {
public:
  ce_device_type deviceType() const override { return CE_DEVICE_HIP; }
  const char *apiName() const override { return "HIP"; }

  Status available() override {
    std::call_once(initialized, [this] { initStatus = initialize(); });
    return initStatus;
  }

  Status checkDevice(int32_t index) override {
    if (index < 0 || index >= deviceCount)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no HIP device " + std::to_string(index) +
                               ": this machine has " +
                               std::to_string(deviceCount) + " HIP device" +
                               (deviceCount == 1 ? "" : "s"));
    return Status::ok();
  }

  Status deviceTarget(int32_t index, std::string &target,
                      std::string &description) override {
    std::lock_guard<std::mutex> lock(mutex);
    std::string &arch = archNames[index];
    if (arch.empty()) {
      std::vector<char> properties(kDevicePropBytes, '\0');
      if (Status status =
              check(api.getDeviceProperties(properties.data(), index),
                    "hipGetDeviceProperties");
          !status.isOk())
        return status;
      arch = archAt(properties.data() + api.archNameOffset,
                    kDevicePropBytes - api.archNameOffset);
      // A layout this runtime does not know: look for the name anywhere.
      for (size_t at = 0; arch.empty() && at + 4 < properties.size(); ++at)
        arch = archAt(properties.data() + at, properties.size() - at);
      if (arch.empty())
        return Status::error(CE_ERROR_BACKEND,
                             "cannot tell the architecture of HIP device " +
                                 std::to_string(index) +
                                 " (no gcnArchName in its properties)");
    }
    target = arch;
    description = "HIP device " + std::to_string(index) + " (" + arch + ")";
    return Status::ok();
  }

  Status enter(int32_t index, DeviceScope &scope) override {
    int current = -1;
    if (Status status = check(api.hipGetDevice(&current), "hipGetDevice");
        !status.isOk())
      return status;
    if (current == index)
      return Status::ok();
    if (Status status = check(api.hipSetDevice(index), "hipSetDevice");
        !status.isOk())
      return status;
    scope.driver = this;
    scope.restore = true;
    scope.saved = static_cast<uintptr_t>(current);
    return Status::ok();
  }

  Status loadModule(const std::string &image, const std::string &name,
                    void *&module) override {
    hipModule_t loaded = nullptr;
    if (hipError_t result = api.hipModuleLoadData(&loaded, image.data());
        result != hipSuccess)
      return Status::error(
          CE_ERROR_BACKEND,
          "cannot load '" + name +
              "' on HIP: hipModuleLoadData failed: " + errorText(result));
    module = loaded;
    return Status::ok();
  }

  void unloadModule(int32_t index, uint64_t context, void *module) override {
    (void)context;
    int current = -1;
    if (api.hipGetDevice(&current) != hipSuccess ||
        api.hipSetDevice(index) != hipSuccess)
      return;
    api.hipModuleUnload(static_cast<hipModule_t>(module));
    api.hipSetDevice(current);
  }

  Status getFunction(void *module, const std::string &symbol, int64_t ldsBytes,
                     void *&function) override {
    // Module kernels may use up to the device's LDS without opting in.
    (void)ldsBytes;
    hipFunction_t found = nullptr;
    if (hipError_t result = api.hipModuleGetFunction(
            &found, static_cast<hipModule_t>(module), symbol.c_str());
        result != hipSuccess)
      return Status::bundleError(
          "kernel symbol '" + symbol +
          "' not found in the HIP module: " + errorText(result));
    function = found;
    return Status::ok();
  }

  Status launch(void *function, uint32_t gridSize, uint32_t blockSize,
                uint32_t ldsBytes, void *stream, void **params) override {
    // HSA dispatches count work-items, not blocks, in 32 bits.
    if (uint64_t(gridSize) * blockSize > UINT32_MAX)
      return Status::invalidArgument(
          "too many tokens for one HIP launch: " + std::to_string(gridSize) +
          " blocks of " + std::to_string(blockSize) +
          " threads exceed 2^32 work-items");
    return check(api.hipModuleLaunchKernel(
                     static_cast<hipFunction_t>(function), gridSize, 1, 1,
                     blockSize, 1, 1, ldsBytes,
                     static_cast<hipStream_t>(stream), params, nullptr),
                 "hipModuleLaunchKernel");
  }

  Status isCapturing(void *stream, bool &capturing) override {
    int status = hipStreamCaptureStatusNone;
    if (Status error = check(
            api.hipStreamIsCapturing(static_cast<hipStream_t>(stream), &status),
            "hipStreamIsCapturing");
        !error.isOk())
      return error;
    capturing = status != hipStreamCaptureStatusNone;
    return Status::ok();
  }

  Status isIdle(void *stream, bool &idle) override {
    hipError_t result = api.hipStreamQuery(static_cast<hipStream_t>(stream));
    idle = result == hipSuccess;
    if (result == hipSuccess || result == hipErrorNotReady)
      return Status::ok();
    return check(result, "hipStreamQuery");
  }

  Status synchronize(void *stream) override {
    return check(api.hipStreamSynchronize(static_cast<hipStream_t>(stream)),
                 "hipStreamSynchronize");
  }

  Status allocateMapped(size_t bytes, void *&host, void *&device) override {
    if (Status status = check(api.hipHostMalloc(&host, bytes,
                                                hipHostMallocMapped |
                                                    hipHostMallocPortable |
                                                    hipHostMallocCoherent),
                              "hipHostMalloc");
        !status.isOk())
      return status;
    return check(api.hipHostGetDevicePointer(&device, host, 0),
                 "hipHostGetDevicePointer");
  }

  Status copyToHost(void *host, const void *device, size_t bytes) override {
    return check(api.hipMemcpyDtoH(host, const_cast<void *>(device), bytes),
                 "hipMemcpyDtoH");
  }

  int relaxCaptureMode() override {
    int mode = hipStreamCaptureModeRelaxed;
    if (api.hipThreadExchangeStreamCaptureMode(&mode) != hipSuccess)
      return -1;
    return mode;
  }

  void restoreCaptureMode(int mode) override {
    if (mode >= 0)
      api.hipThreadExchangeStreamCaptureMode(&mode);
  }

protected:
  void leave(DeviceScope &scope) override {
    if (scope.restore)
      api.hipSetDevice(static_cast<int>(scope.saved));
  }

private:
  Status initialize() {
    void *handle = nullptr;
    std::string reasons;
    for (const char *name : kLibraryNames) {
      ::dlerror();
      if ((handle = ::dlopen(name, RTLD_NOW | RTLD_LOCAL)))
        break;
      const char *reason = ::dlerror();
      if (reasons.empty())
        reasons = reason ? reason : "dlopen failed";
    }
    if (!handle)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no HIP device: cannot load the HIP runtime "
                           "library libamdhip64.so (" +
                               reasons + ")");
#define CE_HIP_RESOLVE(member, name, ...)                                      \
  if (!(api.member =                                                           \
            reinterpret_cast<decltype(api.member)>(::dlsym(handle, name))))    \
    return Status::error(CE_ERROR_NO_DEVICE,                                   \
                         "no HIP device: libamdhip64 has no " name             \
                         " (ROCm 5.2 or newer is needed)");
    CE_HIP_FUNCTIONS(CE_HIP_RESOLVE)
#undef CE_HIP_RESOLVE
    if (void *r0600 = ::dlsym(handle, "hipGetDevicePropertiesR0600")) {
      api.getDeviceProperties =
          reinterpret_cast<decltype(api.getDeviceProperties)>(r0600);
      api.archNameOffset = kR0600ArchNameOffset;
    } else if (void *r0000 = ::dlsym(handle, "hipGetDeviceProperties")) {
      api.getDeviceProperties =
          reinterpret_cast<decltype(api.getDeviceProperties)>(r0000);
      api.archNameOffset = kR0000ArchNameOffset;
    } else {
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no HIP device: libamdhip64 has no "
                           "hipGetDeviceProperties");
    }
    if (hipError_t result = api.hipInit(0); result != hipSuccess)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no HIP device: hipInit failed: " +
                               errorText(result));
    int count = 0;
    if (hipError_t result = api.hipGetDeviceCount(&count); result != hipSuccess)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no HIP device: hipGetDeviceCount failed: " +
                               errorText(result));
    if (count <= 0)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no HIP device: the HIP runtime reports none");
    deviceCount = count;
    archNames.resize(count);
    return Status::ok();
  }

  /// "hipErrorX (description)".
  std::string errorText(hipError_t result) const {
    const char *name =
        api.hipGetErrorName ? api.hipGetErrorName(result) : nullptr;
    const char *text =
        api.hipGetErrorString ? api.hipGetErrorString(result) : nullptr;
    std::string message = name ? name : "HIP error " + std::to_string(result);
    if (text && (!name || std::strcmp(text, name) != 0))
      message += std::string(" (") + text + ")";
    return message;
  }

  Status check(hipError_t result, const char *call) const {
    if (result == hipSuccess)
      return Status::ok();
    return Status::error(CE_ERROR_BACKEND,
                         std::string(call) + " failed: " + errorText(result));
  }

  std::once_flag initialized;
  Status initStatus;
  HipApi api{};
  int deviceCount = 0;
  std::mutex mutex;
  std::vector<std::string> archNames;
};

GpuDriver &hipDriver() {
  static HipDriver *driver = new HipDriver();
  return *driver;
}

} // namespace ce
