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

constexpr size_t kMaxArgs = 8;

/// `void *`, whatever the index; spells one parameter per index below. The
/// flags argument (an i64 by value) is passed as one, which the SysV x86-64
/// calling convention treats alike (INTEGER class, 8 bytes).
template <size_t> using PointerParam = void *;

/// Calls `entry` as `void (*)(void *, ..., void *)`, one pointer per index.
template <size_t... Index>
void callWithPointers(void *entry, const std::array<void *, kMaxArgs> &args,
                      std::index_sequence<Index...>) {
  using Function = void (*)(PointerParam<Index>...);
  Function function;
  static_assert(sizeof(function) == sizeof(entry), "function pointer size");
  std::memcpy(&function, &entry, sizeof(function));
  function(args[Index]...);
}

void callEntry(void *entry, const std::array<void *, kMaxArgs> &args,
               size_t count) {
  switch (count) {
  case 4:
    return callWithPointers(entry, args, std::make_index_sequence<4>());
  case 5:
    return callWithPointers(entry, args, std::make_index_sequence<5>());
  case 6:
    return callWithPointers(entry, args, std::make_index_sequence<6>());
  case 7:
    return callWithPointers(entry, args, std::make_index_sequence<7>());
  case 8:
    return callWithPointers(entry, args, std::make_index_sequence<8>());
  }
}

} // namespace

Status launchHostKernel(const LoadedKernel &kernel, const LaunchPlan &plan,
                        int64_t &status) {
  const KernelInfo &info = *kernel.info;
  if (info.args.size() < 4 || info.args.size() > kMaxArgs)
    return Status::error(CE_ERROR_BACKEND,
                         "kernel \"" + info.key + "\" takes " +
                             std::to_string(info.args.size()) +
                             " arguments; the host ABI has 4 to 8");
  std::array<AnyMemRef, kMaxArgs> storage;
  std::array<void *, kMaxArgs> pointers{};
  ce_tensor statusTensor{};
  statusTensor.data = &status;
  statusTensor.dtype = CE_DTYPE_I64;
  statusTensor.ndim = 1;
  statusTensor.sizes[0] = 1;
  statusTensor.strides[0] = 1;
  for (size_t i = 0; i < info.args.size(); ++i) {
    const KernelArg &arg = info.args[i];
    if (arg.role == ArgRole::Flags) {
      // By value: an i64 travels in a pointer's slot of the SysV x86-64 ABI.
      pointers[i] =
          reinterpret_cast<void *>(static_cast<intptr_t>(plan.flags()));
      continue;
    }
    const ce_tensor *tensor = &statusTensor;
    if (arg.role != ArgRole::Status) {
      if (!plan.has(arg.role))
        return Status::error(CE_ERROR_BACKEND,
                             "kernel \"" + info.key + "\" takes argument '" +
                                 stringify(arg.role) +
                                 "' that this call does not provide");
      tensor = &plan.tensor(arg.role);
    }
    if (tensor->ndim != arg.rank)
      return Status::error(CE_ERROR_BACKEND,
                           "kernel \"" + info.key + "\" expects argument '" +
                               stringify(arg.role) + "' of rank " +
                               std::to_string(arg.rank) + ", the call has " +
                               std::to_string(tensor->ndim));
    pointers[i] = fillDescriptor(storage[i], *tensor);
  }
  callEntry(kernel.entry, pointers, info.args.size());
  return Status::ok();
}

} // namespace ce
