//===- CudaApi.h - The CUDA driver API, declared for dlopen -----*- C++ -*-===//
//
// Internal to the runtime (not installed). The few types, constants and entry
// points of the CUDA driver API (libcuda.so.1) that the CUDA backend uses,
// declared here so that the runtime builds without the CUDA toolkit and one
// build runs everywhere: the library is opened with dlopen on first use, as
// IREE's "dynamic symbols" and Triton's driver.c do.
//
// Values, signatures and the versioned symbol names (the `_v2` suffixes that
// cuda.h's #defines add) follow the driver API as documented for CUDA 12 and
// 13; every entry point here has kept its ABI since CUDA 10 or earlier.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_CUDAAPI_H
#define CE_RUNTIME_CUDAAPI_H

#include <cstddef>

namespace ce::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st *;
using CUmodule = struct CUmod_st *;
using CUfunction = struct CUfunc_st *;
using CUstream = struct CUstream_st *;

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
inline constexpr CUresult CUDA_ERROR_DEINITIALIZED = 4;
inline constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
inline constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
inline constexpr CUresult CUDA_ERROR_NOT_READY = 600;

/// CUdevice_attribute values.
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
/// CUfunction_attribute: opt-in dynamic shared memory above 48 KiB.
inline constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
/// CUjit_option values for cuModuleLoadDataEx.
inline constexpr int CU_JIT_ERROR_LOG_BUFFER = 5;
inline constexpr int CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6;
/// cuMemHostAlloc flags.
inline constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x01;
inline constexpr unsigned CU_MEMHOSTALLOC_DEVICEMAP = 0x02;
/// CUstreamCaptureStatus and CUstreamCaptureMode values.
inline constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;
inline constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;

/// The entry points, resolved with dlsym. `name` is the exported symbol.
#define CE_CUDA_DRIVER_FUNCTIONS(X)                                            \
  X(cuInit, "cuInit", CUresult, unsigned)                                      \
  X(cuGetErrorName, "cuGetErrorName", CUresult, CUresult, const char **)       \
  X(cuGetErrorString, "cuGetErrorString", CUresult, CUresult, const char **)   \
  X(cuDeviceGetCount, "cuDeviceGetCount", CUresult, int *)                     \
  X(cuDeviceGet, "cuDeviceGet", CUresult, CUdevice *, int)                     \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute", CUresult, int *, int,        \
    CUdevice)                                                                  \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", CUresult, CUcontext *)                 \
  X(cuCtxGetDevice, "cuCtxGetDevice", CUresult, CUdevice *)                    \
  X(cuCtxPushCurrent, "cuCtxPushCurrent_v2", CUresult, CUcontext)              \
  X(cuCtxPopCurrent, "cuCtxPopCurrent_v2", CUresult, CUcontext *)              \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", CUresult,            \
    CUcontext *, CUdevice)                                                     \
  X(cuModuleLoadDataEx, "cuModuleLoadDataEx", CUresult, CUmodule *,            \
    const void *, unsigned, int *, void **)                                    \
  X(cuModuleUnload, "cuModuleUnload", CUresult, CUmodule)                      \
  X(cuModuleGetFunction, "cuModuleGetFunction", CUresult, CUfunction *,        \
    CUmodule, const char *)                                                    \
  X(cuFuncSetAttribute, "cuFuncSetAttribute", CUresult, CUfunction, int, int)  \
  X(cuLaunchKernel, "cuLaunchKernel", CUresult, CUfunction, unsigned,          \
    unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,      \
    void **, void **)                                                          \
  X(cuStreamIsCapturing, "cuStreamIsCapturing", CUresult, CUstream, int *)     \
  X(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode",    \
    CUresult, int *)                                                           \
  X(cuStreamQuery, "cuStreamQuery", CUresult, CUstream)                        \
  X(cuStreamSynchronize, "cuStreamSynchronize", CUresult, CUstream)            \
  X(cuMemHostAlloc, "cuMemHostAlloc", CUresult, void **, size_t, unsigned)     \
  X(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2", CUresult,       \
    CUdeviceptr *, void *, unsigned)                                           \
  X(cuMemcpyDtoH, "cuMemcpyDtoH_v2", CUresult, void *, CUdeviceptr, size_t)

/// The resolved entry points of one libcuda.
struct DriverApi {
#define CE_CUDA_DECLARE(member, name, result, ...)                             \
  result (*member)(__VA_ARGS__);
  CE_CUDA_DRIVER_FUNCTIONS(CE_CUDA_DECLARE)
#undef CE_CUDA_DECLARE
};

} // namespace ce::cuda

#endif // CE_RUNTIME_CUDAAPI_H
