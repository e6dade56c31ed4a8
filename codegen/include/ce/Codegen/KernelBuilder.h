//===- KernelBuilder.h - Kernel functions from variant keys -----*- C++ -*-===//
//
// Turns a variant key into a `func.func` holding one ce op, with the
// argument list of the bundle ABI (ce/runtime/BundleAbi.h), and reads the
// variant and the argument roles back from such a function.
//
//===----------------------------------------------------------------------===//

#ifndef CE_CODEGEN_KERNELBUILDER_H
#define CE_CODEGEN_KERNELBUILDER_H

#include "ce/runtime/BundleAbi.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Interfaces/FunctionInterfaces.h"
#include "mlir/IR/BuiltinOps.h"

#include <string>
#include <vector>

namespace mlir::ce {

/// One kernel argument as the manifest describes it.
struct EmittedArg {
  ::ce::ArgRole role;
  int64_t rank;
  ::ce::ElemType dtype;
};

/// A kernel function ce-gen emitted and what the manifest says about it
/// (the runtime reads the same entry into its own ce::KernelInfo).
struct EmittedKernel {
  std::string name;
  ::ce::KernelVariantKey key;
  std::vector<EmittedArg> args;
  /// How the runtime calls it (docs/bundle-format.md).
  std::string symbol;
  std::string abi = ::ce::kMemrefDescriptorAbi;
  unsigned blockSize = 0;
  /// Dynamic shared memory to reserve at launch (caps blocks per SM).
  unsigned ldsBytes = 0;
  /// The kernel serves rows of at least this many elements
  /// (`launch.min_vocab`; 0: any).
  int64_t minVocab = 0;
};

/// The symbol of the `index`-th kernel of a module: `ce_<op>_<index>`.
std::string kernelSymbol(const ::ce::KernelVariantKey &key, size_t index);

/// Adds `func.func @name` computing `key` to `module` (host kernels).
func::FuncOp buildKernel(ModuleOp module, StringRef name,
                         const ::ce::KernelVariantKey &key);

/// Adds `gpu.func @name` computing `key` to `module`, a kernel whose memrefs
/// are in the global address space.
gpu::GPUFuncOp buildGpuKernel(gpu::GPUModuleOp module, StringRef name,
                              const ::ce::KernelVariantKey &key);

/// Recovers the variant and argument roles of a function whose body is one
/// ce op fed directly by the function's arguments. Fails with a diagnostic
/// on the function otherwise.
FailureOr<EmittedKernel> describeKernel(FunctionOpInterface func);

} // namespace mlir::ce

#endif // CE_CODEGEN_KERNELBUILDER_H
