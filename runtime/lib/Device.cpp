//===- Device.cpp - Which device backends this runtime has ----------------===//
//
// Only the host backend exists so far. CUDA and HIP tensors are answered with
// CE_ERROR_NO_DEVICE rather than with a fallback: copying device memory to
// the host behind the caller's back would be slow and surprising.
//
//===----------------------------------------------------------------------===//

#include "ce/runtime/Launch.h"

#include <string>

namespace ce {

Status checkDeviceAvailable(ce_device_type device, int32_t deviceIndex) {
  switch (device) {
  case CE_DEVICE_HOST:
    return Status::ok();
  case CE_DEVICE_CUDA:
  case CE_DEVICE_HIP: {
    std::string name = device == CE_DEVICE_CUDA ? "CUDA" : "HIP";
    return Status::error(
        CE_ERROR_NO_DEVICE,
        "no " + name +
            " device backend available on this machine: tensors "
            "are on " +
            name + " device " + std::to_string(deviceIndex) +
            ", but this runtime has only the host backend (CE_DEVICE_HOST); "
            "GPU backends are not implemented yet");
  }
  }
  return Status::invalidArgument("invalid device type " +
                                 std::to_string(static_cast<int>(device)));
}

} // namespace ce
