//===- GpuBackend.cpp - Launching GPU kernels -----------------------------===//
//
// The GPU kernel ABI (docs/bundle-format.md, "memref-descriptor-fields"):
// every field of every argument's memref descriptor is a kernel parameter of
// its own, in manifest order: allocated, aligned, offset, sizes[R],
// strides[R]. The grid has one block per `rows_per_block` tokens, the block
// `block_size` threads, and `lds_bytes` of dynamic shared memory.
//
// The launch path does not synchronize: no copies, no waits, and the status
// word comes from the LabelStatusTracker (read later by
// ce_check_label_status), so a launch can be captured into a CUDA graph.
//
//===----------------------------------------------------------------------===//

#include "GpuDriver.h"
#include "KernelCache.h"
#include "LabelStatusTracker.h"
#include "Launch.h"

#include <array>
#include <climits>
#include <cstring>
#include <iterator>

namespace ce {

namespace {

/// At most 10 tensors (a fused kernel's with lse_low, entropy and argmax)
/// and the value arguments.
constexpr size_t kMaxArgs = 10 + std::size(kValueRoles);
/// allocated, aligned, offset, sizes[3], strides[3].
constexpr size_t kMaxFieldsPerArg = 3 + 2 * CE_MAX_RANK;

const char *functionName(KernelOp op) {
  switch (op) {
  case KernelOp::Forward:
    return "ce_forward";
  case KernelOp::Backward:
    return "ce_backward";
  case KernelOp::Fused:
    return "ce_fused";
  case KernelOp::ShardStats:
    return "ce_shard_stats";
  case KernelOp::Rescale:
    return "ce_rescale";
  }
  return "?";
}

/// The kernel parameters of one launch: values and the pointers to them
/// that cuLaunchKernel/hipModuleLaunchKernel take.
class KernelParams {
public:
  void addPointer(const void *pointer) {
    values[count] = reinterpret_cast<uintptr_t>(pointer);
    add();
  }
  void addInteger(int64_t value) {
    values[count] = static_cast<uint64_t>(value);
    add();
  }
  /// An f32 parameter: its 4 bytes at the start of the slot.
  void addFloat(float value) {
    values[count] = 0;
    std::memcpy(&values[count], &value, sizeof(value));
    add();
  }
  /// The descriptor fields of `tensor`, as a memref of rank `tensor.ndim`.
  void addDescriptor(const ce_tensor &tensor) {
    addPointer(tensor.data); // allocated: unused by the kernels
    addPointer(tensor.data); // aligned
    addInteger(0);           // offset: a view starts at its data pointer
    for (int i = 0; i < tensor.ndim; ++i)
      addInteger(tensor.sizes[i]);
    for (int i = 0; i < tensor.ndim; ++i)
      addInteger(tensor.strides[i]);
  }
  void **pointers() { return addresses.data(); }

private:
  void add() {
    addresses[count] = &values[count];
    ++count;
  }
  std::array<uint64_t, kMaxArgs * kMaxFieldsPerArg> values{};
  std::array<void *, kMaxArgs * kMaxFieldsPerArg> addresses{};
  size_t count = 0;
};

} // namespace

Status launchGpuKernel(const Bundle &bundle, const KernelInfo &info,
                       const LaunchPlan &plan, void *stream) {
  GpuDriver &driver = *GpuDriver::forDevice(plan.device);
  if (info.args.size() > kMaxArgs)
    return Status::error(CE_ERROR_BACKEND,
                         "kernel \"" + info.key + "\" takes " +
                             std::to_string(info.args.size()) +
                             " arguments; the GPU ABI has at most " +
                             std::to_string(kMaxArgs));
  int64_t rowsPerBlock = info.launch.rowsPerBlock;
  int64_t blocks = (plan.numTokens + rowsPerBlock - 1) / rowsPerBlock;
  if (blocks > INT32_MAX)
    return Status::invalidArgument(
        "too many tokens for one launch: " + std::to_string(plan.numTokens) +
        " tokens need " + std::to_string(blocks) +
        " blocks, more than the 2^31 - 1 a grid dimension holds");

  DeviceScope scope;
  if (Status status = driver.enter(plan.deviceIndex, scope); !status.isOk())
    return status;

  KernelCacheKey cacheKey{bundle.id(), info.key + '\n' + info.symbol,
                          plan.device, plan.deviceIndex,
                          scope.context()};
  LoadedKernel kernel;
  if (Status status = KernelCache::global().getOrLoad(
          cacheKey,
          [&](LoadedKernel &loaded) {
            ModuleCacheKey moduleKey{bundle.id(), info.object, plan.device,
                                     plan.deviceIndex, scope.context()};
            LoadedModule module;
            if (Status status = KernelCache::global().getOrLoadModule(
                    moduleKey,
                    [&](LoadedModule &fresh) {
                      std::string path = bundle.objectPath(info.object);
                      std::string image;
                      if (Status status = bundle.readObject(info.object, image);
                          !status.isOk())
                        return status;
                      // Loading while a graph is captured elsewhere in
                      // global mode would otherwise be refused.
                      RelaxedCaptureMode relaxed(driver);
                      fresh.driver = &driver;
                      return driver.loadModule(image, path, fresh.module);
                    },
                    module);
                !status.isOk())
              return status;
            loaded.info = &info;
            if (Status status =
                    driver.getFunction(module.module, info.symbol,
                                       info.launch.ldsBytes, loaded.entry);
                !status.isOk())
              return Status::error(status.code(),
                                   status.message() + " (kernel \"" + info.key +
                                       "\" of '" +
                                       bundle.objectPath(info.object) + "')");
            return Status::ok();
          },
          kernel);
      !status.isOk())
    return status;

  bool capturing = false;
  if (Status status = driver.isCapturing(stream, capturing); !status.isOk())
    return status;
  LaunchRecord record;
  record.function = functionName(plan.variant.op);
  record.context = labelContext(plan);
  void *statusWord = nullptr;
  if (Status status = LabelStatusTracker::global().acquire(
          driver, plan.deviceIndex, stream, capturing, record, statusWord);
      !status.isOk())
    return status;

  KernelParams params;
  KernelValues values = plan.values();
  for (const KernelArg &arg : info.args) {
    switch (arg.role) {
    case ArgRole::Flags:
      params.addInteger(values.flags);
      continue;
    case ArgRole::IgnoreIndex:
      params.addInteger(values.ignoreIndex);
      continue;
    case ArgRole::LabelSmoothing:
      params.addFloat(values.labelSmoothing);
      continue;
    case ArgRole::ZLoss:
      params.addFloat(values.zLoss);
      continue;
    case ArgRole::ShardStart:
      params.addInteger(values.shardStart);
      continue;
    case ArgRole::ShardVocab:
      params.addInteger(values.shardVocab);
      continue;
    case ArgRole::LogitScale:
      params.addFloat(values.logitScale);
      continue;
    case ArgRole::LogitSoftcap:
      params.addFloat(values.logitSoftcap);
      continue;
    default:
      break;
    }
    if (arg.role == ArgRole::Status) {
      ce_tensor word{};
      word.data = statusWord;
      word.dtype = CE_DTYPE_I64;
      word.ndim = 1;
      word.sizes[0] = 1;
      word.strides[0] = 1;
      params.addDescriptor(word);
      continue;
    }
    if (!plan.provides(arg.role))
      return Status::error(CE_ERROR_BACKEND,
                           "kernel \"" + info.key + "\" takes argument '" +
                               stringify(arg.role) +
                               "' that this call does not provide");
    const ce_tensor &tensor = plan.argument(arg.role);
    if (tensor.ndim != arg.rank)
      return Status::error(CE_ERROR_BACKEND,
                           "kernel \"" + info.key + "\" expects argument '" +
                               stringify(arg.role) + "' of rank " +
                               std::to_string(arg.rank) + ", the call has " +
                               std::to_string(tensor.ndim));
    params.addDescriptor(tensor);
  }
  return driver.launch(kernel.entry, static_cast<uint32_t>(blocks),
                       static_cast<uint32_t>(info.launch.blockSize),
                       static_cast<uint32_t>(info.launch.ldsBytes), stream,
                       params.pointers());
}

} // namespace ce
