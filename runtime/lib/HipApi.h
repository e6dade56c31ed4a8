//===- HipApi.h - The HIP module API, declared for dlopen -------*- C++ -*-===//
//
// Internal to the runtime (not installed). The few types, constants and entry
// points of HIP (libamdhip64.so) that the HIP backend uses. Declared here
// rather than taken from <hip/hip_runtime_api.h> so that the runtime builds
// without ROCm and a single build runs on NVIDIA, AMD and CPU-only machines;
// the library is opened with dlopen on first use. Values follow ROCm 5 and 6.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_HIPAPI_H
#define CE_RUNTIME_HIPAPI_H

#include <cstddef>

namespace ce::hip {

using hipError_t = int;
using hipModule_t = struct ihipModule_t *;
using hipFunction_t = struct ihipModuleSymbol_t *;
using hipStream_t = struct ihipStream_t *;

inline constexpr hipError_t hipSuccess = 0;
inline constexpr hipError_t hipErrorNotReady = 600;

/// hipHostMalloc flags.
inline constexpr unsigned hipHostMallocPortable = 0x1;
inline constexpr unsigned hipHostMallocMapped = 0x2;
inline constexpr unsigned hipHostMallocCoherent = 0x40000000;
/// hipStreamCaptureStatus and hipStreamCaptureMode values.
inline constexpr int hipStreamCaptureStatusNone = 0;
inline constexpr int hipStreamCaptureModeRelaxed = 2;

/// hipDeviceProp_t changed layout in ROCm 6 (hipGetDevicePropertiesR0600);
/// only `gcnArchName` is read, at these offsets (char[256] in both).
inline constexpr size_t kR0600ArchNameOffset = 1160;
inline constexpr size_t kR0000ArchNameOffset = 396;
/// Room for either layout (1472 and 792 bytes) with margin.
inline constexpr size_t kDevicePropBytes = 4096;

/// The entry points, resolved with dlsym.
#define CE_HIP_FUNCTIONS(X)                                                    \
  X(hipInit, "hipInit", hipError_t, unsigned)                                  \
  X(hipGetErrorName, "hipGetErrorName", const char *, hipError_t)              \
  X(hipGetErrorString, "hipGetErrorString", const char *, hipError_t)          \
  X(hipGetDeviceCount, "hipGetDeviceCount", hipError_t, int *)                 \
  X(hipGetDevice, "hipGetDevice", hipError_t, int *)                           \
  X(hipSetDevice, "hipSetDevice", hipError_t, int)                             \
  X(hipModuleLoadData, "hipModuleLoadData", hipError_t, hipModule_t *,         \
    const void *)                                                              \
  X(hipModuleUnload, "hipModuleUnload", hipError_t, hipModule_t)               \
  X(hipModuleGetFunction, "hipModuleGetFunction", hipError_t, hipFunction_t *, \
    hipModule_t, const char *)                                                 \
  X(hipModuleLaunchKernel, "hipModuleLaunchKernel", hipError_t, hipFunction_t, \
    unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,      \
    hipStream_t, void **, void **)                                             \
  X(hipStreamIsCapturing, "hipStreamIsCapturing", hipError_t, hipStream_t,     \
    int *)                                                                     \
  X(hipThreadExchangeStreamCaptureMode, "hipThreadExchangeStreamCaptureMode",  \
    hipError_t, int *)                                                         \
  X(hipStreamQuery, "hipStreamQuery", hipError_t, hipStream_t)                 \
  X(hipStreamSynchronize, "hipStreamSynchronize", hipError_t, hipStream_t)     \
  X(hipHostMalloc, "hipHostMalloc", hipError_t, void **, size_t, unsigned)     \
  X(hipHostGetDevicePointer, "hipHostGetDevicePointer", hipError_t, void **,   \
    void *, unsigned)                                                          \
  X(hipMemcpyDtoH, "hipMemcpyDtoH", hipError_t, void *, void *, size_t)

/// The resolved entry points of one libamdhip64.
struct HipApi {
#define CE_HIP_DECLARE(member, name, result, ...) result (*member)(__VA_ARGS__);
  CE_HIP_FUNCTIONS(CE_HIP_DECLARE)
#undef CE_HIP_DECLARE
  /// hipGetDevicePropertiesR0600 (ROCm 6) or hipGetDeviceProperties (ROCm 5);
  /// `archNameOffset` says which layout it fills.
  hipError_t (*getDeviceProperties)(void *, int) = nullptr;
  size_t archNameOffset = 0;
};

} // namespace ce::hip

#endif // CE_RUNTIME_HIPAPI_H
