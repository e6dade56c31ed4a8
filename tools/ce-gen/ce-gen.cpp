//===- ce-gen.cpp - Emit cross-entropy kernels ----------------------------===//
//
// ce-gen builds kernels from variant options (a cartesian product of comma
// lists, or canonical variant keys) or from an .mlir file of kernel
// functions, and writes a bundle that the runtime loads
// (docs/bundle-format.md). It only parses options: the stages are the
// codegen library's (ce/Codegen/Stages.h), and `--emit=` stops them at a
// stage and prints it, like Toy's toyc.
//
// Exit status: 0 on success, 2 for bad options or input, 1 for internal
// failures (a failed link, say).
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/Registration.h"
#include "ce/Codegen/Stages.h"
#include "ce/Codegen/Variants.h"

#include "mlir/IR/AsmState.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/ToolOutputFile.h"
#include "llvm/Support/raw_ostream.h"


using namespace mlir;
using namespace mlir::ce;
namespace cl = llvm::cl;

namespace {

cl::OptionCategory category("ce-gen options");

cl::opt<std::string> inputFile(cl::Positional, cl::desc("[kernels.mlir]"),
                               cl::init(""), cl::cat(category));
cl::opt<std::string> outputPath(
    "o", cl::desc("Output directory (bundle) or file ('-' for stdout, the "
                  "default)"),
    cl::init("-"), cl::cat(category));
cl::opt<Stage> emitStage(
    "emit", cl::desc("Stop after this stage and write its result"),
    cl::values(clEnumValN(Stage::Mlir, "mlir", "ce dialect kernels"),
               clEnumValN(Stage::Loops, "loops", "row loop nests (host)"),
               clEnumValN(Stage::Gpu, "gpu",
                          "workgroup-mapped kernels (GPU targets)"),
               clEnumValN(Stage::Llvm, "llvm", "optimized LLVM IR"),
               clEnumValN(Stage::Isa, "isa", "target assembly (PTX for sm_90)"),
               clEnumValN(Stage::Obj, "obj", "object file (host, AMDGPU)"),
               clEnumValN(Stage::Bundle, "bundle",
                          "code objects + manifest.json (default)")),
    cl::init(Stage::Bundle), cl::cat(category));
cl::list<std::string> targets(
    "target",
    cl::desc("Targets: host (default), sm_90, gfx942, gfx950, gfx90a "
             "(several go into one bundle)"),
    cl::CommaSeparated, cl::cat(category));
cl::opt<bool> printTuning(
    "print-tuning",
    cl::desc("Print every GPU chip's facts and per-op tuning table, and exit"),
    cl::init(false), cl::cat(category));

// Variant options: comma lists whose cartesian product is emitted.
using VariantList = cl::list<std::string>;
VariantList ops("op", cl::desc("forward (default), backward, fused, shard_stats, rescale"),
                cl::CommaSeparated, cl::cat(category));
VariantList logitsTypes("logits", cl::desc("bf16 (default), f16, f32"),
                        cl::CommaSeparated, cl::cat(category));
VariantList labelTypes("labels", cl::desc("i32, i64 (default)"),
                       cl::CommaSeparated, cl::cat(category));
VariantList layouts("layout", cl::desc("flat, sbv_bs (default), sbv_sb"),
                    cl::CommaSeparated, cl::cat(category));
VariantList smoothings("label-smoothing",
                       cl::desc("off (default), on: kernels that compute "
                                "label smoothing (its value is a run-time "
                                "argument)"),
                       cl::CommaSeparated, cl::cat(category));
VariantList zLosses("z-loss",
                    cl::desc("off (default), on: kernels that compute a "
                             "z-loss (its value is a run-time argument)"),
                    cl::CommaSeparated, cl::cat(category));
VariantList overwrites("overwrite", cl::desc("0 (default), 1"),
                       cl::CommaSeparated, cl::cat(category));
VariantList weightKinds("weights",
                        cl::desc("token (default; scalar: the same kernel, "
                                 "fused only)"),
                        cl::CommaSeparated, cl::cat(category));
VariantList softcaps("softcap",
                     cl::desc("off (default), on: kernels that apply a logit "
                              "softcap (its value is a run-time argument)"),
                     cl::CommaSeparated, cl::cat(category));
cl::list<std::string> variantKeys(
    "variant",
    cl::desc("Canonical variant keys (as manifests and the runtime's "
             "messages print them), instead of the lists above"),
    cl::cat(category));
cl::opt<bool> allVariants(
    "all",
    cl::desc("Every kernel a trainer can ask for: every value of every "
             "variant list above, softcap kernels only without smoothing "
             "and z-loss (what the Python package ships)"),
    cl::init(false), cl::cat(category));

// Host and GPU tuning (unset: the target's default).
cl::opt<unsigned> vectorWidth("vector-width",
                              cl::desc("Lanes per vector (host; a power of "
                                       "two in [1, 64], default 8)"),
                              cl::init(8), cl::cat(category));
cl::opt<unsigned> unroll(
    "unroll",
    cl::desc("Vectors per step, in [1, 16] (default: 4 on the host; 16-byte "
             "loads per thread and step on GPUs, the chip's table)"),
    cl::cat(category));
cl::opt<unsigned> blockSize("block-size",
                            cl::desc("Threads per workgroup on GPUs, a "
                                     "multiple of the subgroup size up to "
                                     "1024 (default: the chip's table)"),
                            cl::cat(category));
cl::opt<unsigned> rowsPerSM(
    "rows-per-sm",
    cl::desc("At most this many rows in flight per SM/CU on GPUs, in "
             "[0, 64] (0: no cap; default: the chip's table)"),
    cl::cat(category));
cl::opt<unsigned> rowCache(
    "row-cache",
    cl::desc("Bytes of workgroup memory per fused GPU kernel that keep a "
             "row's first chunks between its two sweeps, rounded down to "
             "whole chunks (0: none; default: the chip's table)"),
    cl::cat(category));
cl::opt<bool> asyncCopy(
    "async-copy",
    cl::desc("Use asynchronous copies on chips that have them (default on)"),
    cl::init(true), cl::cat(category));
cl::opt<unsigned> streamStages(
    "stream-stages",
    cl::desc("Forward and shard_stats kernels stream their chunks through a "
             "ring of this many chunks (async-copy chips; 0: off, else "
             "[2, 8]; default: the chip's table)"),
    cl::cat(category));
cl::opt<bool> flushDenormals(
    "flush-denormals",
    cl::desc("GPU kernels flush f32 denormals (default: the chip's table)"),
    cl::cat(category));
cl::opt<bool> noFuse("no-fuse", cl::desc("Do not fuse forward and backward ops"),
                     cl::init(false), cl::cat(category));
cl::opt<std::string> hostCpu("host-cpu",
                             cl::desc("LLVM CPU for host kernels (default "
                                      "x86-64-v3; 'native': this machine's)"),
                             cl::init("x86-64-v3"), cl::cat(category));
cl::opt<std::string> dumpDir("dump-dir",
                             cl::desc("Also write the optimized LLVM IR and "
                                      "the assembly here"),
                             cl::init(""), cl::cat(category));

/// A usage error: printed, then exit status 2.
int usageError(const llvm::Twine &message) {
  llvm::errs() << "ce-gen: error: " << message << "\n";
  return 2;
}

/// The value of `option` if it was given.
template <typename T> std::optional<T> given(const cl::opt<T> &option) {
  return option.getNumOccurrences() ? std::optional<T>(option) : std::nullopt;
}

/// Writes `text` to `path` ('-' is stdout).
int writeOutput(StringRef path, StringRef text) {
  std::string error;
  auto file = openOutputFile(path, &error);
  if (!file)
    return usageError(error);
  file->os() << text;
  file->keep();
  return 0;
}

/// Checks the combination of input, variant options and stage.
LogicalResult verifyInputs(const std::vector<std::string> &targetList,
                           bool variantOptions, std::string &error) {
  bool fromFile = !inputFile.empty();
  bool anyGpu = llvm::any_of(targetList,
                             [](const std::string &t) { return t != "host"; });
  if (fromFile && variantOptions)
    error = "variant options (--op, --logits, --variant, ...) conflict with "
            "an input file; give one or the other";
  else if (fromFile && anyGpu)
    error = "GPU targets are emitted from variant options (--op, --logits, "
            "...), not from an input file";
  else if (emitStage != Stage::Bundle && targetList.size() != 1)
    error = "--emit=" +
            emitStage.getParser()
                .getOption(static_cast<int>(emitStage.getValue()))
                .str() +
            " prints one target's output; give a single --target";
  return failure(!error.empty());
}

} // namespace

int main(int argc, char **argv) {
  llvm::InitLLVM initLLVM(argc, argv);
  registerAsmPrinterCLOptions();
  registerMLIRContextCLOptions();
  registerPassManagerCLOptions();
  registerCEPassesAndPipelines();
  // LLVM's and MLIR's own options still work; --help shows ce-gen's.
  cl::HideUnrelatedOptions(category);
  if (!cl::ParseCommandLineOptions(argc, argv,
                                   "cegen kernel generator\n\n"
                                   "  ce-gen --target=host --op=forward,"
                                   "backward --logits=bf16 -o bundle/\n",
                                   &llvm::errs()))
    return 2;
  if (printTuning) {
    printTuningTable(llvm::outs());
    return 0;
  }

  std::vector<std::string> targetList(targets.begin(), targets.end());
  if (targetList.empty())
    targetList.push_back("host");
  VariantOptions variants{{ops.begin(), ops.end()},
                          {logitsTypes.begin(), logitsTypes.end()},
                          {labelTypes.begin(), labelTypes.end()},
                          {layouts.begin(), layouts.end()},
                          {smoothings.begin(), smoothings.end()},
                          {zLosses.begin(), zLosses.end()},
                          {overwrites.begin(), overwrites.end()},
                          {weightKinds.begin(), weightKinds.end()},
                          {softcaps.begin(), softcaps.end()},
                          {variantKeys.begin(), variantKeys.end()},
                          allVariants};
  CodegenOptions options;
  options.stopAfter = emitStage;
  options.bundleDir = outputPath;
  options.dumpDir = dumpDir;
  options.fuse = !noFuse;
  options.vectorWidth = vectorWidth;
  options.hostUnroll = unroll.getNumOccurrences() ? unroll.getValue() : 4;
  options.hostCpu = hostCpu;
  options.tuning = {given(blockSize), given(unroll),       given(rowsPerSM),
                    given(rowCache),  given(streamStages), given(flushDenormals),
                    asyncCopy};
  options.configurePassManager = [](PassManager &pm) {
    return applyPassManagerCLOptions(pm);
  };
  std::string error;
  if (failed(verifyCodegenOptions(options, targetList, error)) ||
      failed(verifyInputs(targetList, variants.any(), error)))
    return usageError(error);
  std::vector<::ce::KernelVariantKey> keys;
  if (inputFile.empty()) {
    auto expanded = expandVariants(variants, error);
    if (failed(expanded))
      return usageError(error);
    keys = std::move(*expanded);
  }
  if (emitStage == Stage::Bundle) {
    if (outputPath == "-")
      return usageError("--emit=bundle needs an output directory (-o DIR)");
    if (std::error_code ec = llvm::sys::fs::create_directories(outputPath))
      return usageError("cannot create '" + outputPath + "': " +
                        ec.message());
  }

  DialectRegistry registry;
  registerCEDialects(registry);
  MLIRContext context(registry);
  context.loadAllAvailableDialects();

  std::vector<BundleObject> objects;
  for (const std::string &target : targetList) {
    StageResult result;
    StageStatus status;
    if (target != "host") {
      status = runGpuStages(context, keys, *GpuChip::lookup(target), options,
                            result);
    } else {
      OwningOpRef<ModuleOp> module =
          inputFile.empty() ? buildHostKernels(context, keys)
                            : readKernelFile(context, inputFile, error);
      if (!module)
        return usageError(error);
      status = runHostStages(*module, options, result);
    }
    if (status != StageStatus::Ok) {
      if (!result.error.empty())
        llvm::errs() << "ce-gen: error: " << result.error << "\n";
      return static_cast<int>(status);
    }
    if (emitStage != Stage::Bundle)
      return writeOutput(outputPath, result.output);
    for (BundleObject &object : result.objects)
      objects.push_back(std::move(object));
  }
  if (failed(writeBundleManifest(outputPath, objects, error))) {
    llvm::errs() << "ce-gen: error: " << error << "\n";
    return 1;
  }
  return 0;
}
