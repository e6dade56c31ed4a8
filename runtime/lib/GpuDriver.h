//===- GpuDriver.h - CUDA and HIP behind one interface ---------*- C++ -*-===//
//
// Internal to the runtime (not installed). A GpuDriver wraps one vendor API,
// opened with dlopen on first use: the CUDA driver API (libcuda.so.1) for
// CE_DEVICE_CUDA and HIP's module API (libamdhip64.so) for CE_DEVICE_HIP. A
// machine without the library, without a driver or without devices gets
// CE_ERROR_NO_DEVICE ("no CUDA device: ...") from available(), never a crash.
//
// Calls that touch a device run inside a DeviceScope, which makes the
// device's context current on the calling thread for its lifetime: the
// context already current when it is on that device (the one PyTorch made
// current), else the device's primary context (CUDA) or device (HIP).
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_GPUDRIVER_H
#define CE_RUNTIME_GPUDRIVER_H

#include "Status.h"
#include "ce/runtime/ce_runtime.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace ce {

class GpuDriver;

/// Keeps a device current on the calling thread; see GpuDriver::enter.
class DeviceScope {
public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope &) = delete;
  DeviceScope &operator=(const DeviceScope &) = delete;
  ~DeviceScope();

  /// The context kernels are loaded into and launched in (CUDA); 0 on HIP,
  /// whose modules belong to the device.
  uint64_t context() const { return contextId; }

private:
  friend class CudaDriver;
  friend class HipDriver;
  GpuDriver *driver = nullptr;
  bool restore = false;
  uintptr_t saved = 0;
  uint64_t contextId = 0;
};

/// One vendor API. Thread-safe; one instance per device type, never
/// destroyed (launches may race with process exit).
class GpuDriver {
public:
  virtual ~GpuDriver() = default;

  /// The driver for `device` (CUDA or HIP), or null for other types.
  static GpuDriver *forDevice(ce_device_type device);

  virtual ce_device_type deviceType() const = 0;
  /// "CUDA" or "HIP", for messages.
  virtual const char *apiName() const = 0;

  /// Loads the library and initializes it, once per process. Fails with
  /// CE_ERROR_NO_DEVICE ("no CUDA device: ...") when there is no library,
  /// driver or device.
  virtual Status available() = 0;
  /// CE_ERROR_NO_DEVICE unless device `index` exists.
  virtual Status checkDevice(int32_t index) = 0;
  /// The bundle target of device `index` ("sm_90", "gfx942") and a
  /// description for messages ("CUDA device 0 (compute capability 9.0)").
  virtual Status deviceTarget(int32_t index, std::string &target,
                              std::string &description) = 0;

  /// Makes device `index` current on this thread until `scope` ends.
  virtual Status enter(int32_t index, DeviceScope &scope) = 0;

  /// Loads a code object (PTX text with its NUL, cubin, or HSACO) into the
  /// current context. `name` identifies it in messages.
  virtual Status loadModule(const std::string &image, const std::string &name,
                            void *&module) = 0;
  /// Unloads a module loaded in `context` on device `index`; errors (a
  /// driver already shut down at exit) are ignored.
  virtual void unloadModule(int32_t index, uint64_t context, void *module) = 0;
  /// The kernel `symbol` of `module`, allowed `ldsBytes` of dynamic shared
  /// memory.
  virtual Status getFunction(void *module, const std::string &symbol,
                             int64_t ldsBytes, void *&function) = 0;
  /// Enqueues `function` on `stream` with a 1-D grid and block.
  virtual Status launch(void *function, uint32_t gridSize, uint32_t blockSize,
                        uint32_t ldsBytes, void *stream, void **params) = 0;

  /// Whether `stream` is capturing a graph.
  virtual Status isCapturing(void *stream, bool &capturing) = 0;
  /// Whether all work enqueued on `stream` has finished (never blocks).
  virtual Status isIdle(void *stream, bool &idle) = 0;
  /// Waits for all work enqueued on `stream`.
  virtual Status synchronize(void *stream) = 0;
  /// Page-locked host memory the device can write, mapped at `device`.
  virtual Status allocateMapped(size_t bytes, void *&host, void *&device) = 0;
  /// Copies `bytes` from device-accessible memory to the host; blocking.
  virtual Status copyToHost(void *host, const void *device, size_t bytes) = 0;

  /// Sets this thread's stream-capture mode to relaxed and returns the old
  /// one, so that module loads and allocations may run while another stream
  /// captures a graph; restoreCaptureMode puts it back.
  virtual int relaxCaptureMode() = 0;
  virtual void restoreCaptureMode(int mode) = 0;

protected:
  friend class DeviceScope;
  virtual void leave(DeviceScope &scope) = 0;
};

inline DeviceScope::~DeviceScope() {
  if (driver)
    driver->leave(*this);
}

/// Relaxed stream-capture mode for the lifetime of the guard.
class RelaxedCaptureMode {
public:
  explicit RelaxedCaptureMode(GpuDriver &driver)
      : driver(driver), previous(driver.relaxCaptureMode()) {}
  ~RelaxedCaptureMode() { driver.restoreCaptureMode(previous); }
  RelaxedCaptureMode(const RelaxedCaptureMode &) = delete;
  RelaxedCaptureMode &operator=(const RelaxedCaptureMode &) = delete;

private:
  GpuDriver &driver;
  int previous;
};

} // namespace ce

#endif // CE_RUNTIME_GPUDRIVER_H
