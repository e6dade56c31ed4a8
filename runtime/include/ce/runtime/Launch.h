//===- Launch.h - From a C API call to a kernel launch ----------*- C++ -*-===//
//
// Internal to the runtime (not installed). The sequence every entry point
// follows: validate, pick the device backend, find the variant, load it
// through the kernel cache, launch, and turn the kernel's status word into an
// error.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_LAUNCH_H
#define CE_RUNTIME_LAUNCH_H

#include "ce/runtime/Bundle.h"
#include "ce/runtime/Status.h"
#include "ce/runtime/Validation.h"

#include <cstdint>

namespace ce {

/// Validates and runs `request` on `bundle`. Nothing is launched when
/// validation fails or when there are no tokens.
Status launch(const Bundle &bundle, const LaunchRequest &request);

/// CE_OK if kernels can run on `device` in this process, else
/// CE_ERROR_NO_DEVICE saying why.
Status checkDeviceAvailable(ce_device_type device, int32_t deviceIndex);

/// The error for a kernel's non-zero status word `status` (1 + the linear
/// index of a token whose label is out of range): names the token, its
/// coordinates in the token shape, its label and the valid range.
Status labelStatusError(int64_t status, const LaunchPlan &plan);

/// The error for a variant `bundle` lacks: the requested key, how to make
/// it with ce-gen, and the nearest keys the bundle has.
Status variantNotFoundError(const Bundle &bundle, const char *target,
                            const LaunchPlan &plan);

} // namespace ce

#endif // CE_RUNTIME_LAUNCH_H
