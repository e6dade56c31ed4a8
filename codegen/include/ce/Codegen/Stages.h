//===- Stages.h - Kernels from variants to a bundle, by stage ---*- C++ -*-===//
//
// The staged codegen API that ce-gen drives (Triton's `add_stages`, Toy's
// `--emit=`): each target's pipeline runs up to the stage asked for and
// returns that stage's text, or, for the last stage, writes the target's
// code object into the bundle directory and describes its kernels.
//
//   Mlir    ce dialect kernels
//   Loops   row loop nests (host)
//   Gpu     workgroup-mapped kernels (GPU targets)
//   Llvm    optimized LLVM IR
//   Isa     target assembly (PTX for sm_90)
//   Obj     object file (host, AMDGPU; PTX for sm_90)
//   Bundle  code objects + manifest.json
//
//===----------------------------------------------------------------------===//

#ifndef CE_CODEGEN_STAGES_H
#define CE_CODEGEN_STAGES_H

#include "ce/Codegen/BundleWriter.h"
#include "ce/Codegen/GpuTarget.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OwningOpRef.h"

#include <functional>
#include <optional>
#include <string>

namespace mlir {
class PassManager;
} // namespace mlir

namespace mlir::ce {

enum class Stage { Mlir, Loops, Gpu, Llvm, Isa, Obj, Bundle };

/// The outcome of a stage, as ce-gen's exit status.
enum class StageStatus {
  Ok = 0,
  /// A failure of the tool chain (a failed link, say).
  InternalError = 1,
  /// Bad options or input; the message (or a diagnostic) says which.
  BadInput = 2,
};

struct CodegenOptions {
  Stage stopAfter = Stage::Bundle;
  /// Stage::Bundle writes the code objects here.
  std::string bundleDir;
  /// Also write the optimized LLVM IR and the assembly here (when set).
  std::string dumpDir;

  // Host kernels.
  bool fuse = true;
  unsigned vectorWidth = 8;
  unsigned hostUnroll = 4;
  /// LLVM CPU name, or "native" for the machine ce-gen runs on (an opt-in:
  /// such a bundle refuses to load on a CPU that lacks its features).
  std::string hostCpu = "x86-64-v3";

  // GPU kernels.
  TuningOverrides tuning;

  /// Called on each pass manager before it runs (ce-gen applies
  /// `--mlir-print-ir-after-all` and the like).
  std::function<LogicalResult(PassManager &)> configurePassManager;
};

struct StageResult {
  /// The output of a stage before Stage::Bundle (text, or bytes for Obj).
  std::string output;
  /// Stage::Bundle: the code objects written into the bundle directory
  /// (one per target, but one per kernel for PTX, which the driver compiles
  /// when it loads a module: a launch then compiles only its own kernel).
  std::vector<BundleObject> objects;
  /// Why a stage failed, when no diagnostic said it already.
  std::string error;
};

/// A module of `func.func` host kernels, one per key (symbols
/// `ce_<op>_<i>`).
OwningOpRef<ModuleOp> buildHostKernels(MLIRContext &context,
                                       ArrayRef<::ce::KernelVariantKey> keys);

/// Parses an .mlir file of host kernel functions; null with `error` set
/// (or a diagnostic printed) when it cannot be read or parsed.
OwningOpRef<ModuleOp> readKernelFile(MLIRContext &context, StringRef path,
                                     std::string &error);

/// Runs the host pipeline on `module` (kernel functions holding one ce op
/// each) up to `options.stopAfter`.
StageStatus runHostStages(ModuleOp module, const CodegenOptions &options,
                          StageResult &result);

/// Builds the GPU kernels of `keys` for `chip` (each with its tuning as a
/// `ce.tuning` attribute) and runs the GPU pipeline up to
/// `options.stopAfter`.
StageStatus runGpuStages(MLIRContext &context,
                         ArrayRef<::ce::KernelVariantKey> keys,
                         const GpuChip &chip, const CodegenOptions &options,
                         StageResult &result);

/// Hashes `objects` as they lie in `bundleDir` and writes its manifest.
LogicalResult writeBundleManifest(StringRef bundleDir,
                                  MutableArrayRef<BundleObject> objects,
                                  std::string &error);

/// Checks `options` and `targets` (each known, none twice) before any
/// work; the message names the option and its allowed range.
LogicalResult verifyCodegenOptions(const CodegenOptions &options,
                                   ArrayRef<std::string> targets,
                                   std::string &error);

/// The stage named `name` (mlir, loops, gpu, llvm, isa, obj, bundle).
std::optional<Stage> parseStage(StringRef name);

} // namespace mlir::ce

#endif // CE_CODEGEN_STAGES_H
