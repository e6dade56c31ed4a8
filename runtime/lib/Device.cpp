//===- Device.cpp - Which device backends this runtime has ----------------===//
//
// Host tensors run on the host backend; CUDA and HIP tensors on the GPU
// drivers, opened on first use. A device whose driver is missing is answered
// with CE_ERROR_NO_DEVICE rather than with a fallback: copying device memory
// to the host behind the caller's back would be slow and surprising.
//
//===----------------------------------------------------------------------===//

#include "Bundle.h"
#include "GpuDriver.h"
#include "LabelStatusTracker.h"
#include "Launch.h"

#include <string>

namespace ce {

GpuDriver &cudaDriver();
GpuDriver &hipDriver();

GpuDriver *GpuDriver::forDevice(ce_device_type device) {
  switch (device) {
  case CE_DEVICE_CUDA:
    return &cudaDriver();
  case CE_DEVICE_HIP:
    return &hipDriver();
  case CE_DEVICE_HOST:
    break;
  }
  return nullptr;
}

Status checkDeviceAvailable(ce_device_type device, int32_t deviceIndex) {
  if (device == CE_DEVICE_HOST)
    return Status::ok();
  GpuDriver *driver = GpuDriver::forDevice(device);
  if (!driver)
    return Status::invalidArgument("invalid device type " +
                                   std::to_string(static_cast<int>(device)));
  Status status = driver->available();
  if (status.isOk())
    status = driver->checkDevice(deviceIndex);
  if (!status.isOk())
    return Status::error(status.code(), status.message() +
                                            "; the tensors are on " +
                                            driver->apiName() + " device " +
                                            std::to_string(deviceIndex));
  return Status::ok();
}

Status deviceTarget(ce_device_type device, int32_t deviceIndex,
                    std::string &target, std::string &description) {
  if (Status status = checkDeviceAvailable(device, deviceIndex); !status.isOk())
    return status;
  if (device == CE_DEVICE_HOST) {
    target = kHostTarget;
    description.clear();
    return Status::ok();
  }
  return GpuDriver::forDevice(device)->deviceTarget(deviceIndex, target,
                                                    description);
}

Status checkLabelStatus(ce_device_type device, int32_t deviceIndex,
                        void *stream, bool wait) {
  // Host launches report at the call; nothing is ever pending there.
  if (device == CE_DEVICE_HOST)
    return Status::ok();
  GpuDriver &driver = *GpuDriver::forDevice(device);
  Status status = driver.available();
  if (status.isOk())
    status = driver.checkDevice(deviceIndex);
  if (!status.isOk())
    return Status::error(status.code(), status.message() + "; asked about " +
                                            driver.apiName() + " device " +
                                            std::to_string(deviceIndex));
  DeviceScope scope;
  if (Status status = driver.enter(deviceIndex, scope); !status.isOk())
    return status;
  return LabelStatusTracker::global().check(driver, deviceIndex, stream, wait);
}

} // namespace ce
