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

#include "Bundle.h"
#include "Status.h"
#include "Validation.h"

#include <cstdint>
#include <string>

namespace ce {

/// Validates and runs `request` on `bundle`. Nothing is launched when
/// validation fails or when there are no tokens.
Status launch(const Bundle &bundle, const LaunchRequest &request);

/// CE_OK if kernels can run on `device` in this process, else
/// CE_ERROR_NO_DEVICE saying why ("no CUDA device: ...").
Status checkDeviceAvailable(ce_device_type device, int32_t deviceIndex);

/// The kernel of `bundle` for `target` that serves `plan`: its own variant,
/// or for a smoothing or z-loss coefficient of 0 one that computes the term
/// anyway. Null when the bundle has neither.
const KernelInfo *findServingKernel(const Bundle &bundle,
                                    const std::string &target,
                                    const LaunchPlan &plan);

/// The error for a variant `bundle` lacks for `target`: the requested key,
/// how to make it with ce-gen, the nearest keys the bundle has for that
/// target and the targets it has the key for. `deviceDescription` names the
/// device that asked ("CUDA device 0 (compute capability 9.0)"), or is empty.
Status variantNotFoundError(const Bundle &bundle, const std::string &target,
                            const LaunchPlan &plan,
                            const std::string &deviceDescription = "");

/// The bundle target of a device ("host", "sm_90", "gfx942") and, for GPUs,
/// a description for messages. Fails like checkDeviceAvailable.
Status deviceTarget(ce_device_type device, int32_t deviceIndex,
                    std::string &target, std::string &description);

/// Enqueues `kernel`, the variant of a validated plan with at least one
/// token for its GPU device's target, on `stream`: loads it through the
/// kernel cache (a module once per code object, device and context) and
/// passes a status word from the LabelStatusTracker. Never synchronizes.
Status launchGpuKernel(const Bundle &bundle, const KernelInfo &kernel,
                       const LaunchPlan &plan, void *stream);

/// ce_check_label_status.
Status checkLabelStatus(ce_device_type device, int32_t deviceIndex,
                        void *stream, bool wait);

} // namespace ce

#endif // CE_RUNTIME_LAUNCH_H
