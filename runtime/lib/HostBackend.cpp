//===- HostBackend.cpp - Calling host kernels -----------------------------===//
//
// The descriptors live on this function's stack for the duration of the
// call, so concurrent launches share nothing. Offsets are always 0: a view's
// start is its data pointer, which is what `aligned` means to the kernel.
//
//===----------------------------------------------------------------------===//

#include "HostBackend.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <utility>

namespace ce {

namespace {

/// Room for a descriptor of any rank the ABI uses.
union AnyMemRef {
  StridedMemRef<0> rank0;
  StridedMemRef<1> rank1;
  StridedMemRef<2> rank2;
  StridedMemRef<3> rank3;
};

static_assert(sizeof(StridedMemRef<0>) == 24, "unexpected descriptor layout");
static_assert(sizeof(StridedMemRef<3>) == 72, "unexpected descriptor layout");

template <int Rank>
void *fillDescriptor(StridedMemRef<Rank> &desc, const ce_tensor &tensor) {
  desc.allocated = tensor.data;
  desc.aligned = tensor.data;
  desc.offset = 0;
  if constexpr (Rank > 0) {
    for (int i = 0; i < Rank; ++i) {
      desc.sizes[i] = tensor.sizes[i];
      desc.strides[i] = tensor.strides[i];
    }
  }
  return &desc;
}

void *fillDescriptor(AnyMemRef &storage, const ce_tensor &tensor) {
  switch (tensor.ndim) {
  case 0:
    return fillDescriptor(storage.rank0, tensor);
  case 1:
    return fillDescriptor(storage.rank1, tensor);
  case 2:
    return fillDescriptor(storage.rank2, tensor);
  default:
    return fillDescriptor(storage.rank3, tensor);
  }
}

/// Tensors per kernel: 3 (rescale) to 10 (fused with a gradient).
constexpr size_t kMinTensors = 3; // rescale: grad, weights, grad_loss
constexpr size_t kMaxTensors = 10; // fused: lse_low, entropy, argmax, grad
constexpr size_t kNumValues = std::size(kValueRoles);

/// `void *`, whatever the index; spells one parameter per index below.
template <size_t> using PointerParam = void *;

/// Calls `entry`, a kernel's C interface: one pointer to a memref descriptor
/// per tensor, then the value arguments by value as the C types of
/// kValueRoles (i64, i64, f32, f32, i64, i64, f32, f32).
template <size_t... Index>
void callWithPointers(void *entry, const std::array<void *, kMaxTensors> &args,
                      const KernelValues &values,
                      std::index_sequence<Index...>) {
  using Function = void (*)(PointerParam<Index>..., int64_t, int64_t, float,
                            float, int64_t, int64_t, float, float);
  Function function;
  static_assert(sizeof(function) == sizeof(entry), "function pointer size");
  std::memcpy(&function, &entry, sizeof(function));
  function(args[Index]..., values.flags, values.ignoreIndex,
           values.labelSmoothing, values.zLoss, values.shardStart,
           values.shardVocab, values.logitScale, values.logitSoftcap);
}

void callEntry(void *entry, const std::array<void *, kMaxTensors> &args,
               size_t tensors, const KernelValues &values) {
  switch (tensors) {
  case 3:
    return callWithPointers(entry, args, values, std::make_index_sequence<3>());
  case 4:
    return callWithPointers(entry, args, values, std::make_index_sequence<4>());
  case 5:
    return callWithPointers(entry, args, values, std::make_index_sequence<5>());
  case 6:
    return callWithPointers(entry, args, values, std::make_index_sequence<6>());
  case 7:
    return callWithPointers(entry, args, values, std::make_index_sequence<7>());
  case 8:
    return callWithPointers(entry, args, values, std::make_index_sequence<8>());
  case 9:
    return callWithPointers(entry, args, values, std::make_index_sequence<9>());
  case 10:
    return callWithPointers(entry, args, values,
                            std::make_index_sequence<10>());
  }
}

} // namespace

Status launchHostKernel(const LoadedKernel &kernel, const LaunchPlan &plan,
                        int64_t &status) {
  const KernelInfo &info = *kernel.info;
  // The manifest reader checked the list: the tensors, then kValueRoles.
  size_t tensors = info.args.size() - kNumValues;
  if (info.args.size() < kNumValues + kMinTensors ||
      info.args.size() > kNumValues + kMaxTensors)
    return Status::error(CE_ERROR_BACKEND,
                         "kernel \"" + info.key + "\" takes " +
                             std::to_string(info.args.size()) +
                             " arguments; the host ABI has 3 to 10 tensors "
                             "and " + std::to_string(kNumValues) + " values");
  std::array<AnyMemRef, kMaxTensors> storage;
  std::array<void *, kMaxTensors> pointers{};
  ce_tensor statusTensor{};
  statusTensor.data = &status;
  statusTensor.dtype = CE_DTYPE_I64;
  statusTensor.ndim = 1;
  statusTensor.sizes[0] = 1;
  statusTensor.strides[0] = 1;
  for (size_t i = 0; i < tensors; ++i) {
    const KernelArg &arg = info.args[i];
    const ce_tensor *tensor = &statusTensor;
    if (arg.role != ArgRole::Status) {
      if (!plan.provides(arg.role))
        return Status::error(CE_ERROR_BACKEND,
                             "kernel \"" + info.key + "\" takes argument '" +
                                 stringify(arg.role) +
                                 "' that this call does not provide");
      tensor = &plan.argument(arg.role);
    }
    if (tensor->ndim != arg.rank)
      return Status::error(CE_ERROR_BACKEND,
                           "kernel \"" + info.key + "\" expects argument '" +
                               stringify(arg.role) + "' of rank " +
                               std::to_string(arg.rank) + ", the call has " +
                               std::to_string(tensor->ndim));
    pointers[i] = fillDescriptor(storage[i], *tensor);
  }
  callEntry(kernel.entry, pointers, tensors, plan.values());
  return Status::ok();
}

} // namespace ce
