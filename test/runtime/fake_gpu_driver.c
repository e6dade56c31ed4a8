/*===- fake_gpu_driver.c - A CUDA driver and HIP runtime without a GPU -----===*
 *
 * Built twice, as libcuda.so.1 and as libamdhip64.so, into a directory that
 * runtime_gpu_test puts first on LD_LIBRARY_PATH, so that the runtime's
 * dlopen finds these instead of a real driver. Each copy implements the
 * entry points the runtime resolves (both APIs; each test uses one) over
 * host memory, and records what it was asked in `fake_gpu_state`, which the
 * test reads and steers through dlsym.
 *
 * A "code object" is text: one line per kernel, "SYMBOL PARAM_COUNT
 * [SIZES]", so that a launch knows how many parameters to record and, as a
 * real driver knows from the kernel's signature, how many bytes each one
 * has: SIZES holds one digit per parameter (8 for a pointer or an i64, 4
 * for an f32 such as a kernel's label_smoothing and z_loss values); without
 * it every parameter has 8. A launch copies exactly that many bytes of each
 * parameter into a zeroed 8-byte record slot. An object containing
 * "bad-ptx" fails to load with a JIT log.
 *
 *===----------------------------------------------------------------------===*/

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_PARAMS 80
#define MAX_KERNELS 16
#define MAX_DEVICES 4

/* Mirrors FakeGpuState in GpuTest.cpp. */
typedef struct FakeGpuState {
  /* Steering, set by the test. */
  int32_t initResult;
  int32_t deviceCount;
  int32_t ccMajor[MAX_DEVICES], ccMinor[MAX_DEVICES];
  char arch[MAX_DEVICES][64];
  int32_t capturing; /* stream-capture status to answer */
  int32_t idle;      /* stream query: 1 idle, 0 busy */
  int32_t failLaunch;
  /* The current context (CUDA) or device (HIP). */
  void *currentContext;
  int32_t currentDevice;
  /* Counters. */
  int64_t moduleLoads, moduleUnloads, launches, syncs, pushes, pops;
  int64_t hostAllocs, captureModeExchanges, setDevices;
  /* The last launch. */
  char symbol[64];
  uint32_t grid[3], block[3], sharedBytes;
  void *stream;
  void *launchContext;
  int32_t launchDevice;
  int32_t numParams;
  uint64_t params[MAX_PARAMS];
} FakeGpuState;

EXPORT FakeGpuState fake_gpu_state = {
    .deviceCount = 1,
    .ccMajor = {9, 9, 8, 9},
    .ccMinor = {0, 0, 0, 0},
    .arch = {"gfx942:sramecc+:xnack-", "gfx942", "gfx90a", "gfx950"},
    .idle = 1};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct FakeKernel {
  char symbol[64];
  int32_t numParams;
  char sizes[MAX_PARAMS + 1]; /* one digit per parameter, or empty */
} FakeKernel;

typedef struct FakeModule {
  int32_t count;
  FakeKernel kernels[MAX_KERNELS];
} FakeModule;

/* The text of a code object: PTX is text; an HSACO (an ELF file made by
 * fakeHsaco in TestBundle.cpp) carries it right after its program headers. */
static const char *textOf(const void *image) {
  const char *bytes = image;
  if (memcmp(bytes, "\177ELF", 4) == 0) {
    uint16_t count;
    memcpy(&count, bytes + 56, sizeof(count)); /* e_phnum */
    bytes += 64 + 56 * count;
  }
  return bytes;
}

static FakeModule *loadModule(const char *image) {
  FakeModule *module = calloc(1, sizeof(FakeModule));
  const char *line = image;
  while (line && *line && module->count < MAX_KERNELS) {
    FakeKernel *kernel = &module->kernels[module->count];
    kernel->sizes[0] = '\0';
    int fields = sscanf(line, "%63s %d %80[48]", kernel->symbol,
                        &kernel->numParams, kernel->sizes);
    /* A line whose SIZES do not match its count lists no kernel. */
    if (fields == 2 ||
        (fields == 3 && (int)strlen(kernel->sizes) == kernel->numParams))
      ++module->count;
    line = strchr(line, '\n');
    if (line)
      ++line;
  }
  return module;
}

static int getFunction(void **function, void *module, const char *name) {
  FakeModule *m = module;
  for (int i = 0; i < m->count; ++i)
    if (strcmp(m->kernels[i].symbol, name) == 0) {
      *function = &m->kernels[i];
      return 1;
    }
  return 0;
}

static void recordLaunch(void *function, unsigned gx, unsigned gy, unsigned gz,
                         unsigned bx, unsigned by, unsigned bz, unsigned shared,
                         void *stream, void **params) {
  FakeKernel *kernel = function;
  pthread_mutex_lock(&lock);
  FakeGpuState *s = &fake_gpu_state;
  ++s->launches;
  snprintf(s->symbol, sizeof(s->symbol), "%s", kernel->symbol);
  s->grid[0] = gx, s->grid[1] = gy, s->grid[2] = gz;
  s->block[0] = bx, s->block[1] = by, s->block[2] = bz;
  s->sharedBytes = shared;
  s->stream = stream;
  s->launchContext = s->currentContext;
  s->launchDevice = s->currentDevice;
  s->numParams = kernel->numParams;
  for (int i = 0; i < kernel->numParams && i < MAX_PARAMS; ++i) {
    size_t bytes = kernel->sizes[0] ? (size_t)(kernel->sizes[i] - '0') : 8;
    s->params[i] = 0;
    memcpy(&s->params[i], params[i], bytes);
  }
  pthread_mutex_unlock(&lock);
}

/*===--- CUDA driver API
 * ---------------------------------------------------===*/

typedef int CUresult;
#define CONTEXT_OF(device) ((void *)(uintptr_t)(0x1000 + (device)))
/* A stack of pushed contexts (one thread pushes and pops at a time in the
 * tests that look at it). */
static __thread void *contextStack[16];
static __thread int contextDepth;

EXPORT CUresult cuInit(unsigned flags) {
  (void)flags;
  return fake_gpu_state.initResult;
}
EXPORT CUresult cuGetErrorName(CUresult error, const char **name) {
  *name = error == 100   ? "CUDA_ERROR_NO_DEVICE"
          : error == 218 ? "CUDA_ERROR_INVALID_PTX"
                         : "CUDA_ERROR_FAKE";
  return 0;
}
EXPORT CUresult cuGetErrorString(CUresult error, const char **text) {
  *text = error == 100 ? "no CUDA-capable device is detected" : "fake error";
  return 0;
}
EXPORT CUresult cuDeviceGetCount(int *count) {
  *count = fake_gpu_state.deviceCount;
  return 0;
}
EXPORT CUresult cuDeviceGet(int *device, int ordinal) {
  *device = ordinal;
  return 0;
}
EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  if (attribute == 75)
    *value = fake_gpu_state.ccMajor[device];
  else if (attribute == 76)
    *value = fake_gpu_state.ccMinor[device];
  else
    return 1;
  return 0;
}
EXPORT CUresult cuCtxGetCurrent(void **context) {
  *context = fake_gpu_state.currentContext;
  return 0;
}
EXPORT CUresult cuCtxGetDevice(int *device) {
  uintptr_t context = (uintptr_t)fake_gpu_state.currentContext;
  if (!context)
    return 201; /* CUDA_ERROR_INVALID_CONTEXT */
  *device = (int)(context & 0xff);
  return 0;
}
EXPORT CUresult cuCtxPushCurrent_v2(void *context) {
  contextStack[contextDepth++] = fake_gpu_state.currentContext;
  fake_gpu_state.currentContext = context;
  __atomic_add_fetch(&fake_gpu_state.pushes, 1, __ATOMIC_RELAXED);
  return 0;
}
EXPORT CUresult cuCtxPopCurrent_v2(void **context) {
  if (contextDepth == 0)
    return 201;
  *context = fake_gpu_state.currentContext;
  fake_gpu_state.currentContext = contextStack[--contextDepth];
  __atomic_add_fetch(&fake_gpu_state.pops, 1, __ATOMIC_RELAXED);
  return 0;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(void **context, int device) {
  *context = CONTEXT_OF(device);
  return 0;
}
EXPORT CUresult cuModuleLoadDataEx(void **module, const void *image,
                                   unsigned count, int *options,
                                   void **values) {
  image = textOf(image);
  if (strstr(image, "bad-ptx")) {
    for (unsigned i = 0; i < count; ++i)
      if (options[i] == 5) /* CU_JIT_ERROR_LOG_BUFFER */
        snprintf(values[i], 64, "ptxas fatal: fake syntax error");
    return 218;
  }
  __atomic_add_fetch(&fake_gpu_state.moduleLoads, 1, __ATOMIC_RELAXED);
  *module = loadModule(image);
  return 0;
}
EXPORT CUresult cuModuleUnload(void *module) {
  free(module);
  __atomic_add_fetch(&fake_gpu_state.moduleUnloads, 1, __ATOMIC_RELAXED);
  return 0;
}
EXPORT CUresult cuModuleGetFunction(void **function, void *module,
                                    const char *name) {
  return getFunction(function, module, name) ? 0 : 500;
}
EXPORT CUresult cuFuncSetAttribute(void *function, int attribute, int value) {
  (void)function, (void)attribute, (void)value;
  return 0;
}
EXPORT CUresult cuLaunchKernel(void *function, unsigned gx, unsigned gy,
                               unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, void *stream,
                               void **params, void **extra) {
  (void)extra;
  if (fake_gpu_state.failLaunch)
    return 1;
  recordLaunch(function, gx, gy, gz, bx, by, bz, shared, stream, params);
  return 0;
}
EXPORT CUresult cuStreamIsCapturing(void *stream, int *status) {
  (void)stream;
  *status = fake_gpu_state.capturing;
  return 0;
}
EXPORT CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
  static __thread int current = 0;
  int previous = current;
  current = *mode;
  *mode = previous;
  __atomic_add_fetch(&fake_gpu_state.captureModeExchanges, 1, __ATOMIC_RELAXED);
  return 0;
}
EXPORT CUresult cuStreamQuery(void *stream) {
  (void)stream;
  return fake_gpu_state.idle ? 0 : 600;
}
EXPORT CUresult cuStreamSynchronize(void *stream) {
  (void)stream;
  __atomic_add_fetch(&fake_gpu_state.syncs, 1, __ATOMIC_RELAXED);
  return 0;
}
EXPORT CUresult cuMemHostAlloc(void **pointer, size_t bytes, unsigned flags) {
  (void)flags;
  *pointer = calloc(1, bytes);
  __atomic_add_fetch(&fake_gpu_state.hostAllocs, 1, __ATOMIC_RELAXED);
  return 0;
}
EXPORT CUresult cuMemHostGetDevicePointer_v2(unsigned long long *device,
                                             void *host, unsigned flags) {
  (void)flags;
  *device = (uintptr_t)host;
  return 0;
}
EXPORT CUresult cuMemcpyDtoH_v2(void *host, unsigned long long device,
                                size_t bytes) {
  if (!device)
    return 1;
  memcpy(host, (void *)(uintptr_t)device, bytes);
  return 0;
}

/*===--- HIP
 * ---------------------------------------------------------------===*/

typedef int hipError_t;

EXPORT hipError_t hipInit(unsigned flags) {
  (void)flags;
  return fake_gpu_state.initResult;
}
EXPORT const char *hipGetErrorName(hipError_t error) {
  return error == 100 ? "hipErrorNoDevice" : "hipErrorFake";
}
EXPORT const char *hipGetErrorString(hipError_t error) {
  return error == 100 ? "no ROCm-capable device is detected" : "fake error";
}
EXPORT hipError_t hipGetDeviceCount(int *count) {
  *count = fake_gpu_state.deviceCount;
  return 0;
}
EXPORT hipError_t hipGetDevice(int *device) {
  *device = fake_gpu_state.currentDevice;
  return 0;
}
EXPORT hipError_t hipSetDevice(int device) {
  fake_gpu_state.currentDevice = device;
  __atomic_add_fetch(&fake_gpu_state.setDevices, 1, __ATOMIC_RELAXED);
  return 0;
}
/* ROCm 6's layout: gcnArchName at byte 1160 of 1472. */
EXPORT hipError_t hipGetDevicePropertiesR0600(void *properties, int device) {
  memset(properties, 0, 1472);
  snprintf((char *)properties, 256, "AMD Instinct (fake)");
  snprintf((char *)properties + 1160, 256, "%s", fake_gpu_state.arch[device]);
  return 0;
}
EXPORT hipError_t hipModuleLoadData(void **module, const void *image) {
  image = textOf(image);
  if (strstr(image, "bad-ptx"))
    return 200;
  __atomic_add_fetch(&fake_gpu_state.moduleLoads, 1, __ATOMIC_RELAXED);
  *module = loadModule(image);
  return 0;
}
EXPORT hipError_t hipModuleUnload(void *module) {
  free(module);
  __atomic_add_fetch(&fake_gpu_state.moduleUnloads, 1, __ATOMIC_RELAXED);
  return 0;
}
EXPORT hipError_t hipModuleGetFunction(void **function, void *module,
                                       const char *name) {
  return getFunction(function, module, name) ? 0 : 500;
}
EXPORT hipError_t hipModuleLaunchKernel(void *function, unsigned gx,
                                        unsigned gy, unsigned gz, unsigned bx,
                                        unsigned by, unsigned bz,
                                        unsigned shared, void *stream,
                                        void **params, void **extra) {
  (void)extra;
  if (fake_gpu_state.failLaunch)
    return 1;
  recordLaunch(function, gx, gy, gz, bx, by, bz, shared, stream, params);
  return 0;
}
EXPORT hipError_t hipStreamIsCapturing(void *stream, int *status) {
  (void)stream;
  *status = fake_gpu_state.capturing;
  return 0;
}
EXPORT hipError_t hipThreadExchangeStreamCaptureMode(int *mode) {
  return cuThreadExchangeStreamCaptureMode(mode);
}
EXPORT hipError_t hipStreamQuery(void *stream) { return cuStreamQuery(stream); }
EXPORT hipError_t hipStreamSynchronize(void *stream) {
  return cuStreamSynchronize(stream);
}
EXPORT hipError_t hipHostMalloc(void **pointer, size_t bytes, unsigned flags) {
  return cuMemHostAlloc(pointer, bytes, flags);
}
EXPORT hipError_t hipHostGetDevicePointer(void **device, void *host,
                                          unsigned flags) {
  (void)flags;
  *device = host;
  return 0;
}
EXPORT hipError_t hipMemcpyDtoH(void *host, void *device, size_t bytes) {
  return cuMemcpyDtoH_v2(host, (uintptr_t)device, bytes);
}
