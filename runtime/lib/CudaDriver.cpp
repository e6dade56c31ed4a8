//===- CudaDriver.cpp - CE_DEVICE_CUDA through the CUDA driver API --------===//
//
// libcuda.so.1 is opened on first use; a machine without it, or whose driver
// has no device, answers CE_ERROR_NO_DEVICE. Kernels run in the context
// current on the calling thread when it belongs to the tensors' device (the
// primary context PyTorch makes current), else in that device's primary
// context, retained once and pushed for the duration of a call.
//
//===----------------------------------------------------------------------===//

#include "CudaApi.h"
#include "GpuDriver.h"

#include <dlfcn.h>
#include <mutex>
#include <vector>

namespace ce {

using namespace ce::cuda;

namespace {

constexpr const char *kLibraryName = "libcuda.so.1";

} // namespace

class CudaDriver final : public GpuDriver {
public:
  ce_device_type deviceType() const override { return CE_DEVICE_CUDA; }
  const char *apiName() const override { return "CUDA"; }

  Status available() override {
    std::call_once(initialized, [this] { initStatus = initialize(); });
    return initStatus;
  }

  Status checkDevice(int32_t index) override {
    if (index < 0 || index >= deviceCount)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no CUDA device " + std::to_string(index) +
                               ": this machine has " +
                               std::to_string(deviceCount) + " CUDA device" +
                               (deviceCount == 1 ? "" : "s"));
    return Status::ok();
  }

  Status deviceTarget(int32_t index, std::string &target,
                      std::string &description) override {
    std::lock_guard<std::mutex> lock(mutex);
    DeviceInfo &device = devices[index];
    if (device.target.empty()) {
      int major = 0, minor = 0;
      if (Status status =
              check(api.cuDeviceGetAttribute(
                        &major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                        device.handle),
                    "cuDeviceGetAttribute");
          !status.isOk())
        return status;
      if (Status status =
              check(api.cuDeviceGetAttribute(
                        &minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                        device.handle),
                    "cuDeviceGetAttribute");
          !status.isOk())
        return status;
      device.target = "sm_" + std::to_string(major) + std::to_string(minor);
      device.description = "CUDA device " + std::to_string(index) +
                           " (compute capability " + std::to_string(major) +
                           "." + std::to_string(minor) + ")";
    }
    target = device.target;
    description = device.description;
    return Status::ok();
  }

  Status enter(int32_t index, DeviceScope &scope) override {
    CUdevice wanted = devices[index].handle;
    CUcontext current = nullptr;
    if (api.cuCtxGetCurrent(&current) == CUDA_SUCCESS && current) {
      CUdevice device = -1;
      if (api.cuCtxGetDevice(&device) == CUDA_SUCCESS && device == wanted) {
        scope.contextId = reinterpret_cast<uintptr_t>(current);
        return Status::ok();
      }
    }
    CUcontext primary = nullptr;
    if (Status status = primaryContext(index, primary); !status.isOk())
      return status;
    if (Status status =
            check(api.cuCtxPushCurrent(primary), "cuCtxPushCurrent");
        !status.isOk())
      return status;
    scope.driver = this;
    scope.restore = true;
    scope.contextId = reinterpret_cast<uintptr_t>(primary);
    return Status::ok();
  }

  Status loadModule(const std::string &image, const std::string &name,
                    void *&module) override {
    // The JIT's error log says what is wrong with a PTX file.
    char log[8192] = {0};
    int options[] = {CU_JIT_ERROR_LOG_BUFFER,
                     CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *values[] = {log, reinterpret_cast<void *>(sizeof(log) - 1)};
    CUmodule loaded = nullptr;
    CUresult result =
        api.cuModuleLoadDataEx(&loaded, image.c_str(), 2, options, values);
    if (result != CUDA_SUCCESS)
      return Status::error(
          CE_ERROR_BACKEND,
          "cannot load '" + name +
              "' on CUDA: cuModuleLoadDataEx failed: " + errorText(result) +
              (log[0] ? std::string("; JIT log: ") + log : std::string()));
    module = loaded;
    return Status::ok();
  }

  void unloadModule(int32_t index, uint64_t context, void *module) override {
    (void)index;
    CUcontext owner = reinterpret_cast<CUcontext>(context);
    if (api.cuCtxPushCurrent(owner) != CUDA_SUCCESS)
      return;
    api.cuModuleUnload(static_cast<CUmodule>(module));
    CUcontext popped;
    api.cuCtxPopCurrent(&popped);
  }

  Status getFunction(void *module, const std::string &symbol, int64_t ldsBytes,
                     void *&function) override {
    CUfunction found = nullptr;
    CUresult result = api.cuModuleGetFunction(
        &found, static_cast<CUmodule>(module), symbol.c_str());
    if (result != CUDA_SUCCESS)
      return Status::bundleError(
          "kernel symbol '" + symbol +
          "' not found in the CUDA module: " + errorText(result));
    // Static and dynamic shared memory together may not pass 48 KB unless
    // the function opts in; the kernel's static slots come on top of
    // `ldsBytes`, so any dynamic amount opts in.
    if (ldsBytes > 0)
      if (Status status =
              check(api.cuFuncSetAttribute(
                        found, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        static_cast<int>(ldsBytes)),
                    "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");
          !status.isOk())
        return status;
    function = found;
    return Status::ok();
  }

  Status launch(void *function, uint32_t gridSize, uint32_t blockSize,
                uint32_t ldsBytes, void *stream, void **params) override {
    return check(api.cuLaunchKernel(static_cast<CUfunction>(function), gridSize,
                                    1, 1, blockSize, 1, 1, ldsBytes,
                                    static_cast<CUstream>(stream), params,
                                    nullptr),
                 "cuLaunchKernel");
  }

  Status isCapturing(void *stream, bool &capturing) override {
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    if (Status error = check(
            api.cuStreamIsCapturing(static_cast<CUstream>(stream), &status),
            "cuStreamIsCapturing");
        !error.isOk())
      return error;
    capturing = status != CU_STREAM_CAPTURE_STATUS_NONE;
    return Status::ok();
  }

  Status isIdle(void *stream, bool &idle) override {
    CUresult result = api.cuStreamQuery(static_cast<CUstream>(stream));
    idle = result == CUDA_SUCCESS;
    if (result == CUDA_SUCCESS || result == CUDA_ERROR_NOT_READY)
      return Status::ok();
    return check(result, "cuStreamQuery");
  }

  Status synchronize(void *stream) override {
    return check(api.cuStreamSynchronize(static_cast<CUstream>(stream)),
                 "cuStreamSynchronize");
  }

  Status allocateMapped(size_t bytes, void *&host, void *&device) override {
    if (Status status = check(api.cuMemHostAlloc(&host, bytes,
                                                 CU_MEMHOSTALLOC_PORTABLE |
                                                     CU_MEMHOSTALLOC_DEVICEMAP),
                              "cuMemHostAlloc");
        !status.isOk())
      return status;
    CUdeviceptr mapped = 0;
    if (Status status = check(api.cuMemHostGetDevicePointer(&mapped, host, 0),
                              "cuMemHostGetDevicePointer");
        !status.isOk())
      return status;
    device = reinterpret_cast<void *>(static_cast<uintptr_t>(mapped));
    return Status::ok();
  }

  Status copyToHost(void *host, const void *device, size_t bytes) override {
    return check(
        api.cuMemcpyDtoH(
            host, static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(device)),
            bytes),
        "cuMemcpyDtoH");
  }

  int relaxCaptureMode() override {
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    if (api.cuThreadExchangeStreamCaptureMode(&mode) != CUDA_SUCCESS)
      return -1;
    return mode;
  }

  void restoreCaptureMode(int mode) override {
    if (mode >= 0)
      api.cuThreadExchangeStreamCaptureMode(&mode);
  }

protected:
  void leave(DeviceScope &scope) override {
    if (scope.restore) {
      CUcontext popped;
      api.cuCtxPopCurrent(&popped);
    }
  }

private:
  struct DeviceInfo {
    CUdevice handle = 0;
    CUcontext primary = nullptr;
    std::string target, description;
  };

  Status initialize() {
    ::dlerror();
    void *handle = ::dlopen(kLibraryName, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char *reason = ::dlerror();
      return Status::error(CE_ERROR_NO_DEVICE,
                           std::string("no CUDA device: cannot load the CUDA "
                                       "driver library ") +
                               kLibraryName + " (" +
                               (reason ? reason : "dlopen failed") + ")");
    }
#define CE_CUDA_RESOLVE(member, name, ...)                                     \
  if (!(api.member =                                                           \
            reinterpret_cast<decltype(api.member)>(::dlsym(handle, name))))    \
    return Status::error(CE_ERROR_NO_DEVICE,                                   \
                         std::string("no CUDA device: ") + kLibraryName +      \
                             " has no " name                                   \
                             " (a CUDA driver of version 10 or newer is "      \
                             "needed)");
    CE_CUDA_DRIVER_FUNCTIONS(CE_CUDA_RESOLVE)
#undef CE_CUDA_RESOLVE
    // The library stays loaded: kernels and contexts outlive any caller.
    if (CUresult result = api.cuInit(0); result != CUDA_SUCCESS)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no CUDA device: cuInit failed: " +
                               errorText(result));
    int count = 0;
    if (CUresult result = api.cuDeviceGetCount(&count); result != CUDA_SUCCESS)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no CUDA device: cuDeviceGetCount failed: " +
                               errorText(result));
    if (count <= 0)
      return Status::error(CE_ERROR_NO_DEVICE,
                           "no CUDA device: the CUDA driver reports none");
    devices.resize(count);
    for (int i = 0; i < count; ++i)
      if (CUresult result = api.cuDeviceGet(&devices[i].handle, i);
          result != CUDA_SUCCESS)
        return Status::error(CE_ERROR_NO_DEVICE,
                             "no CUDA device: cuDeviceGet(" +
                                 std::to_string(i) +
                                 ") failed: " + errorText(result));
    deviceCount = count;
    return Status::ok();
  }

  Status primaryContext(int32_t index, CUcontext &context) {
    std::lock_guard<std::mutex> lock(mutex);
    DeviceInfo &device = devices[index];
    if (!device.primary)
      // Retained for the life of the process: modules loaded into it and
      // status words allocated in it are never torn down under a caller.
      if (Status status = check(
              api.cuDevicePrimaryCtxRetain(&device.primary, device.handle),
              "cuDevicePrimaryCtxRetain");
          !status.isOk())
        return status;
    context = device.primary;
    return Status::ok();
  }

  /// "CUDA_ERROR_X (description)".
  std::string errorText(CUresult result) const {
    const char *name = nullptr, *text = nullptr;
    if (api.cuGetErrorName)
      api.cuGetErrorName(result, &name);
    if (api.cuGetErrorString)
      api.cuGetErrorString(result, &text);
    std::string message = name ? name : "CUDA error " + std::to_string(result);
    if (text)
      message += std::string(" (") + text + ")";
    return message;
  }

  Status check(CUresult result, const char *call) const {
    if (result == CUDA_SUCCESS)
      return Status::ok();
    ce_status code = result == CUDA_ERROR_DEINITIALIZED ||
                             result == CUDA_ERROR_NOT_INITIALIZED
                         ? CE_ERROR_NO_DEVICE
                         : CE_ERROR_BACKEND;
    return Status::error(code,
                         std::string(call) + " failed: " + errorText(result));
  }

  std::once_flag initialized;
  Status initStatus;
  DriverApi api{};
  int deviceCount = 0;
  std::mutex mutex;
  std::vector<DeviceInfo> devices;
};

GpuDriver &cudaDriver() {
  // Never destroyed: launches from other threads may race with exit.
  static CudaDriver *driver = new CudaDriver();
  return *driver;
}

} // namespace ce
