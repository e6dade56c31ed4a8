/*===- emulator_hip.c - A HIP runtime whose device is an emulator ----------===*
 *
 * Built as libamdhip64.so (soname libamdhip64.so) by test/amd/run_emulated.py
 * and loaded into its process before libce_runtime, so that the runtime's
 * dlopen("libamdhip64.so") finds this library. It implements the HIP entry
 * points the runtime resolves (runtime/include/ce/runtime/HipApi.h) over host
 * memory: one device, whose gcnArchName the launcher sets, and whose
 * hipModuleLaunchKernel hands the code object, the kernel's name, the launch
 * shape and the runtime's parameter array to a hook (a ctypes callback) that
 * packs the kernel arguments from the code object's metadata, as HIP does,
 * and runs the kernel in the emulator. "Device" pointers are host pointers.
 *
 * The parameters are not copied or counted here: HIP packs `params` by the
 * kernel's own metadata, so the hook does the same from the ELF.
 *
 *===----------------------------------------------------------------------===*/

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int hipError_t;
enum {
  kSuccess = 0,
  kInvalidImage = 200,
  kNotFound = 500,
  kLaunchFailure = 719
};

/* Returns 0, or a nonzero hipError_t after a failed launch. */
typedef int (*EmulatorLaunchHook)(const void *image, uint64_t imageBytes,
                                  const char *symbol, const uint32_t *grid,
                                  const uint32_t *block, uint32_t sharedBytes,
                                  void **params);

#define MAX_DEVICES 8

static EmulatorLaunchHook launchHook;
/* One device per chip the launcher emulates ("gfx942:sramecc+:xnack-"...):
 * the runtime caches a device's target, so each chip is a device index. */
static char deviceArch[MAX_DEVICES][64];
static int deviceCount;
static int currentDevice;
static int64_t launches;

EXPORT void emulator_hip_set_launch_hook(EmulatorLaunchHook hook) {
  launchHook = hook;
}
/* Adds a device of gcnArchName `arch`; returns its index, or -1. */
EXPORT int emulator_hip_add_device(const char *arch) {
  if (deviceCount == MAX_DEVICES)
    return -1;
  snprintf(deviceArch[deviceCount], sizeof(deviceArch[0]), "%s", arch);
  return deviceCount++;
}
EXPORT int64_t emulator_hip_launches(void) { return launches; }
EXPORT int emulator_hip_current_device(void) { return currentDevice; }

typedef struct Module {
  uint64_t bytes;
  unsigned char *image;
} Module;

typedef struct Function {
  Module *module;
  char symbol[256];
} Function;

/* An ELF64 file's length from its headers: the furthest end of the header
 * tables and of every section's bytes (0 for something that is no ELF64). */
static uint64_t elfBytes(const unsigned char *elf) {
  if (memcmp(elf, "\177ELF", 4) != 0 || elf[4] != 2 /* ELFCLASS64 */)
    return 0;
  uint64_t phoff, shoff;
  uint16_t phentsize, phnum, shentsize, shnum;
  memcpy(&phoff, elf + 0x20, 8);
  memcpy(&shoff, elf + 0x28, 8);
  memcpy(&phentsize, elf + 0x36, 2);
  memcpy(&phnum, elf + 0x38, 2);
  memcpy(&shentsize, elf + 0x3a, 2);
  memcpy(&shnum, elf + 0x3c, 2);
  uint64_t end = 64;
  if (phoff + (uint64_t)phentsize * phnum > end)
    end = phoff + (uint64_t)phentsize * phnum;
  if (shoff + (uint64_t)shentsize * shnum > end)
    end = shoff + (uint64_t)shentsize * shnum;
  for (uint16_t i = 0; i < shnum; ++i) {
    const unsigned char *header = elf + shoff + (uint64_t)i * shentsize;
    uint32_t type;
    uint64_t offset, size;
    memcpy(&type, header + 4, 4);
    memcpy(&offset, header + 0x18, 8);
    memcpy(&size, header + 0x20, 8);
    if (type != 8 /* SHT_NOBITS */ && offset + size > end)
      end = offset + size;
  }
  return end;
}

EXPORT hipError_t hipInit(unsigned flags) {
  (void)flags;
  return kSuccess;
}
EXPORT const char *hipGetErrorName(hipError_t error) {
  return error == kLaunchFailure  ? "hipErrorLaunchFailure"
         : error == kInvalidImage ? "hipErrorInvalidImage"
         : error == kNotFound     ? "hipErrorNotFound"
                                  : "hipErrorUnknown";
}
EXPORT const char *hipGetErrorString(hipError_t error) {
  return error == kLaunchFailure
             ? "the emulator failed to run the kernel (see the launcher's log)"
             : "emulated HIP error";
}
EXPORT hipError_t hipGetDeviceCount(int *count) {
  *count = deviceCount;
  return kSuccess;
}
EXPORT hipError_t hipGetDevice(int *device) {
  *device = currentDevice;
  return kSuccess;
}
EXPORT hipError_t hipSetDevice(int device) {
  if (device < 0 || device >= deviceCount)
    return 101; /* hipErrorInvalidDevice */
  currentDevice = device;
  return kSuccess;
}
/* ROCm 6's hipDeviceProp_t: gcnArchName at byte 1160 of 1472. */
EXPORT hipError_t hipGetDevicePropertiesR0600(void *properties, int device) {
  if (device < 0 || device >= deviceCount)
    return 101;
  memset(properties, 0, 1472);
  snprintf((char *)properties, 256, "AMD Instinct (emulated)");
  snprintf((char *)properties + 1160, 256, "%s", deviceArch[device]);
  return kSuccess;
}
EXPORT hipError_t hipModuleLoadData(void **module, const void *image) {
  uint64_t bytes = elfBytes(image);
  if (bytes == 0)
    return kInvalidImage;
  Module *loaded = calloc(1, sizeof(Module));
  loaded->bytes = bytes;
  loaded->image = malloc(bytes); /* HIP copies the image; so do we */
  memcpy(loaded->image, image, bytes);
  *module = loaded;
  return kSuccess;
}
EXPORT hipError_t hipModuleUnload(void *module) {
  Module *loaded = module;
  free(loaded->image);
  free(loaded);
  return kSuccess;
}
/* Every name resolves; the hook fails a launch of a kernel the ELF lacks.
 * Functions live as long as the process (the runtime caches them). */
EXPORT hipError_t hipModuleGetFunction(void **function, void *module,
                                       const char *name) {
  Function *found = calloc(1, sizeof(Function));
  found->module = module;
  snprintf(found->symbol, sizeof(found->symbol), "%s", name);
  *function = found;
  return kSuccess;
}
EXPORT hipError_t hipModuleLaunchKernel(void *function, unsigned gx,
                                        unsigned gy, unsigned gz, unsigned bx,
                                        unsigned by, unsigned bz,
                                        unsigned shared, void *stream,
                                        void **params, void **extra) {
  (void)stream;
  Function *f = function;
  if (!launchHook || extra)
    return kLaunchFailure;
  uint32_t grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
  ++launches; /* the hook knows the device: the runtime's hipSetDevice */
  return launchHook(f->module->image, f->module->bytes, f->symbol, grid, block,
                    shared, params);
}
/* Kernels run to completion inside the launch: streams are always idle. */
EXPORT hipError_t hipStreamIsCapturing(void *stream, int *status) {
  (void)stream;
  *status = 0;
  return kSuccess;
}
EXPORT hipError_t hipThreadExchangeStreamCaptureMode(int *mode) {
  static __thread int current;
  int previous = current;
  current = *mode;
  *mode = previous;
  return kSuccess;
}
EXPORT hipError_t hipStreamQuery(void *stream) {
  (void)stream;
  return kSuccess;
}
EXPORT hipError_t hipStreamSynchronize(void *stream) {
  (void)stream;
  return kSuccess;
}
EXPORT hipError_t hipHostMalloc(void **pointer, size_t bytes, unsigned flags) {
  (void)flags;
  *pointer = calloc(1, bytes);
  return *pointer ? kSuccess : 2; /* hipErrorOutOfMemory */
}
EXPORT hipError_t hipHostGetDevicePointer(void **device, void *host,
                                          unsigned flags) {
  (void)flags;
  *device = host;
  return kSuccess;
}
EXPORT hipError_t hipMemcpyDtoH(void *host, void *device, size_t bytes) {
  memcpy(host, device, bytes);
  return kSuccess;
}
