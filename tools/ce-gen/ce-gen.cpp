//===- ce-gen.cpp - Emit cross-entropy kernels ----------------------------===//
//
// ce-gen builds kernels from variant options (a cartesian product of comma
// lists) or from an .mlir file of kernel functions, lowers them, and writes
// a bundle that the runtime loads (docs/bundle-format.md). `--emit=` stops
// the pipeline at a stage and prints it, like Toy's toyc.
//
// Exit status: 0 on success, 2 for bad options or input, 1 for internal
// failures (a failed link, say).
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/BundleWriter.h"
#include "ce/Codegen/GpuCodegen.h"
#include "ce/Codegen/HostCodegen.h"
#include "ce/Codegen/KernelBuilder.h"
#include "ce/Codegen/Pipelines.h"
#include "ce/Codegen/Registration.h"
#include "ce/Transforms/Passes.h"

#include "mlir/IR/AsmState.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/ToolOutputFile.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <set>

using namespace mlir;
using namespace mlir::ce;
namespace cl = llvm::cl;

namespace {

enum class EmitStage { Mlir, Loops, Gpu, Llvm, Isa, Obj, Bundle };

cl::OptionCategory category("ce-gen options");

cl::opt<std::string> inputFile(cl::Positional, cl::desc("[kernels.mlir]"),
                               cl::init(""), cl::cat(category));
cl::opt<std::string> outputPath("o", cl::desc("Output directory (bundle) or "
                                              "file ('-' for stdout)"),
                                cl::init("-"), cl::cat(category));
cl::opt<EmitStage> emitStage(
    "emit", cl::desc("Stop after this stage and write its result"),
    cl::values(clEnumValN(EmitStage::Mlir, "mlir", "ce dialect kernels"),
               clEnumValN(EmitStage::Loops, "loops", "row loop nests (host)"),
               clEnumValN(EmitStage::Gpu, "gpu",
                          "workgroup-mapped kernels (GPU targets)"),
               clEnumValN(EmitStage::Llvm, "llvm", "optimized LLVM IR"),
               clEnumValN(EmitStage::Isa, "isa", "target assembly (PTX for sm_90)"),
               clEnumValN(EmitStage::Obj, "obj", "object file (host, AMDGPU)"),
               clEnumValN(EmitStage::Bundle, "bundle",
                          "code objects + manifest.json (default)")),
    cl::init(EmitStage::Bundle), cl::cat(category));
cl::list<std::string> targets("target",
                              cl::desc("Targets: host, sm_90, gfx942, gfx950, "
                                       "gfx90a (several go into one bundle)"),
                              cl::CommaSeparated, cl::cat(category));

// Variant options: comma lists whose cartesian product is emitted.
cl::list<std::string> ops("op",
                          cl::desc("forward,backward,fused,shard_stats"),
                          cl::CommaSeparated, cl::cat(category));
cl::list<std::string> logitsTypes("logits", cl::desc("bf16,f16,f32"),
                                  cl::CommaSeparated, cl::cat(category));
cl::list<std::string> labelTypes("labels", cl::desc("i32,i64"),
                                 cl::CommaSeparated, cl::cat(category));
cl::list<std::string> layouts("layout", cl::desc("flat,sbv_bs,sbv_sb"),
                              cl::CommaSeparated, cl::cat(category));
cl::list<std::string> ignoreIndices("ignore-index",
                                    cl::desc("none or integers"),
                                    cl::CommaSeparated, cl::cat(category));
cl::list<std::string> smoothings("label-smoothing", cl::desc("in [0, 1)"),
                                 cl::CommaSeparated, cl::cat(category));
cl::list<std::string> zLosses("z-loss", cl::desc(">= 0"), cl::CommaSeparated,
                              cl::cat(category));
cl::list<std::string> overwrites("overwrite", cl::desc("0,1"),
                                 cl::CommaSeparated, cl::cat(category));
cl::list<std::string> weightKinds("weights",
                                  cl::desc("scalar,token (fused only)"),
                                  cl::CommaSeparated, cl::cat(category));
cl::list<std::string> shards(
    "shard",
    cl::desc("none, or START/VOCAB/local|global: a tensor-parallel slice "
             "of global ids [START, START + V_local) of VOCAB, smoothing over "
             "V_local (Megatron's) or VOCAB (shard_stats and backward only)"),
    cl::CommaSeparated, cl::cat(category));

cl::opt<unsigned> vectorWidth("vector-width",
                              cl::desc("Lanes per vector (host)"),
                              cl::init(8), cl::cat(category));
cl::opt<unsigned> unroll("unroll",
                         cl::desc("Vectors per step (default: 4 on the host; "
                                  "16-byte loads per thread and step on GPUs, "
                                  "the chip's default)"),
                         cl::init(0), cl::cat(category));
cl::opt<unsigned> blockSize("block-size",
                            cl::desc("Threads per workgroup on GPUs "
                                     "(default: the chip's)"),
                            cl::init(0), cl::cat(category));
cl::opt<unsigned> rowsPerSM(
    "rows-per-sm",
    cl::desc("At most this many rows in flight per SM/CU on GPUs, enforced "
             "by reserving shared memory at launch (default: the chip's "
             "per-op table; 0: no cap)"),
    cl::init(0), cl::cat(category));
cl::opt<unsigned> rowCache(
    "row-cache",
    cl::desc("Bytes of workgroup memory per fused GPU kernel that keep the "
             "first chunks of a row between its statistics and gradient "
             "sweeps, rounded down to whole chunks (default: the chip's "
             "per-op table; 0: none)"),
    cl::init(0), cl::cat(category));
cl::opt<bool> asyncCopy(
    "async-copy",
    cl::desc("Fill fused kernels' row caches by asynchronous copies "
             "(default: on for NVIDIA targets, which are the only ones that "
             "have them)"),
    cl::init(true), cl::cat(category));
cl::opt<unsigned> streamStages(
    "stream-stages",
    cl::desc("Forward and shard_stats GPU kernels stream their chunks "
             "through a ring of this many chunks of shared memory by "
             "asynchronous copies (NVIDIA; 0: off, else at least 2; default: "
             "the chip's per-op table)"),
    cl::init(0), cl::cat(category));
cl::opt<bool> flushDenormals(
    "flush-denormals",
    cl::desc("GPU kernels flush f32 denormals (results below 2^-126 become "
             "0; default: the chip's per-op table)"),
    cl::init(false), cl::cat(category));
cl::opt<bool> noFuse("no-fuse",
                     cl::desc("Do not fuse forward and backward ops"),
                     cl::init(false), cl::cat(category));
cl::opt<std::string> hostCpu("host-cpu",
                             cl::desc("LLVM CPU for host kernels ('native': "
                                      "this machine)"),
                             cl::init("native"), cl::cat(category));
cl::opt<std::string> dumpDir("dump-dir",
                             cl::desc("Also write kernel.ll, kernel.opt.ll "
                                      "and kernel.s here"),
                             cl::init(""), cl::cat(category));

/// A usage error: printed, then exit status 2.
int usageError(const llvm::Twine &message) {
  llvm::errs() << "ce-gen: error: " << message << "\n";
  return 2;
}

/// Target options, checked before any work (IREE's ROCMTarget style).
struct TargetOptions {
  std::vector<std::string> targets;

  LogicalResult verify(std::string &error) const {
    std::set<std::string> seen;
    for (const std::string &target : targets) {
      if (target != "host" && !GpuTarget::lookup(target)) {
        error = "unknown target '" + target +
                "'; expected one of: host, sm_90, gfx942, gfx950, gfx90a";
        return failure();
      }
      if (!seen.insert(target).second) {
        error = "target '" + target + "' is given twice";
        return failure();
      }
    }
    return success();
  }
};

template <typename T>
LogicalResult parseEach(const cl::list<std::string> &values,
                        std::vector<std::string> defaults, StringRef what,
                        function_ref<std::optional<T>(StringRef)> parse,
                        std::vector<T> &out, std::string &error) {
  std::vector<std::string> list(values.begin(), values.end());
  if (list.empty())
    list = std::move(defaults);
  for (const std::string &text : list) {
    std::optional<T> value = parse(text);
    if (!value) {
      error = "invalid --" + what.str() + " value '" + text + "'";
      return failure();
    }
    out.push_back(*value);
  }
  return success();
}

std::optional<float> parseFloat(StringRef text) {
  double value;
  if (text.getAsDouble(value))
    return std::nullopt;
  return static_cast<float>(value);
}

/// Expands the variant options into keys (inapplicable combinations, such
/// as overwrite for a forward, are skipped; duplicates are dropped).
FailureOr<std::vector<::ce::KernelVariantKey>>
expandVariants(std::string &error) {
  using namespace ::ce;
  std::vector<KernelOp> opList;
  std::vector<ElemType> logitsList, labelsList;
  std::vector<LabelLayout> layoutList;
  std::vector<std::optional<int64_t>> ignoreList;
  std::vector<float> smoothingList, zList;
  std::vector<bool> overwriteList;
  std::vector<WeightsKind> weightsList;
  std::vector<std::optional<VocabShard>> shardList;
  auto parseOp = [](StringRef s) -> std::optional<KernelOp> {
    return llvm::StringSwitch<std::optional<KernelOp>>(s)
        .Case("forward", KernelOp::Forward)
        .Case("backward", KernelOp::Backward)
        .Case("fused", KernelOp::Fused)
        .Case("shard_stats", KernelOp::ShardStats)
        .Default(std::nullopt);
  };
  auto parseLogits = [](StringRef s) -> std::optional<ElemType> {
    return llvm::StringSwitch<std::optional<ElemType>>(s)
        .Case("bf16", ElemType::BF16)
        .Case("f16", ElemType::F16)
        .Case("f32", ElemType::F32)
        .Default(std::nullopt);
  };
  auto parseLabels = [](StringRef s) -> std::optional<ElemType> {
    return llvm::StringSwitch<std::optional<ElemType>>(s)
        .Case("i32", ElemType::I32)
        .Case("i64", ElemType::I64)
        .Default(std::nullopt);
  };
  auto parseLayout = [](StringRef s) -> std::optional<LabelLayout> {
    return llvm::StringSwitch<std::optional<LabelLayout>>(s)
        .Case("flat", LabelLayout::Flat)
        .Case("sbv_bs", LabelLayout::SbvBs)
        .Case("sbv_sb", LabelLayout::SbvSb)
        .Default(std::nullopt);
  };
  auto parseIgnore =
      [](StringRef s) -> std::optional<std::optional<int64_t>> {
    if (s == "none")
      return std::optional<int64_t>();
    int64_t value;
    if (s.getAsInteger(10, value))
      return std::nullopt;
    return std::optional<int64_t>(value);
  };
  auto parseSmoothing = [](StringRef s) -> std::optional<float> {
    std::optional<float> value = parseFloat(s);
    if (!value || !(*value >= 0.0f && *value < 1.0f))
      return std::nullopt;
    return value;
  };
  auto parseZ = [](StringRef s) -> std::optional<float> {
    std::optional<float> value = parseFloat(s);
    if (!value || !(*value >= 0.0f) || std::isinf(*value))
      return std::nullopt;
    return value;
  };
  auto parseBool = [](StringRef s) -> std::optional<bool> {
    if (s == "0")
      return false;
    if (s == "1")
      return true;
    return std::nullopt;
  };
  auto parseWeights = [](StringRef s) -> std::optional<WeightsKind> {
    return llvm::StringSwitch<std::optional<WeightsKind>>(s)
        .Case("scalar", WeightsKind::Scalar)
        .Case("token", WeightsKind::Token)
        .Default(std::nullopt);
  };
  auto parseShard =
      [](StringRef s) -> std::optional<std::optional<VocabShard>> {
    if (s == "none")
      return std::optional<VocabShard>();
    std::optional<VocabShard> shard = parseVocabShard(s);
    if (!shard || shard->vocab <= 0 || shard->start < 0 ||
        shard->start >= shard->vocab)
      return std::nullopt;
    return shard;
  };
  if (failed(parseEach<KernelOp>(ops, {"forward"}, "op", parseOp, opList,
                                 error)) ||
      failed(parseEach<ElemType>(logitsTypes, {"bf16"}, "logits",
                                 parseLogits, logitsList, error)) ||
      failed(parseEach<ElemType>(labelTypes, {"i64"}, "labels", parseLabels,
                                 labelsList, error)) ||
      failed(parseEach<LabelLayout>(layouts, {"sbv_bs"}, "layout",
                                    parseLayout, layoutList, error)) ||
      failed(parseEach<std::optional<int64_t>>(ignoreIndices, {"none"},
                                               "ignore-index", parseIgnore,
                                               ignoreList, error)) ||
      failed(parseEach<float>(smoothings, {"0"}, "label-smoothing",
                              parseSmoothing, smoothingList, error)) ||
      failed(parseEach<float>(zLosses, {"0"}, "z-loss", parseZ, zList,
                              error)) ||
      failed(parseEach<bool>(overwrites, {"0"}, "overwrite", parseBool,
                             overwriteList, error)) ||
      failed(parseEach<WeightsKind>(weightKinds, {"scalar"}, "weights",
                                    parseWeights, weightsList, error)) ||
      failed(parseEach<std::optional<VocabShard>>(
          shards, {"none"}, "shard", parseShard, shardList, error)))
    return failure();

  std::vector<KernelVariantKey> keys;
  std::set<std::string> seen;
  for (KernelOp op : opList)
    for (ElemType logits : logitsList)
      for (ElemType labels : labelsList)
        for (LabelLayout layout : layoutList)
          for (const std::optional<int64_t> &ignore : ignoreList)
            for (float smoothing : smoothingList)
              for (float z : zList)
                for (bool overwrite : overwriteList)
                  for (WeightsKind weights : weightsList)
                  for (const std::optional<VocabShard> &shard : shardList) {
                    // Shards have partial statistics and a backward; the
                    // z-loss applies after the statistics are combined.
                    bool sharded = shard.has_value();
                    if (sharded != (op == KernelOp::ShardStats) &&
                        op != KernelOp::Backward)
                      continue;
                    KernelVariantKey key;
                    key.op = op;
                    key.logits = logits;
                    key.labels = labels;
                    key.layout = layout;
                    key.ignoreIndex = ignore;
                    key.labelSmoothing = smoothing;
                    key.zLoss = op == KernelOp::ShardStats ? 0.0f : z;
                    key.overwrite = (op == KernelOp::Backward ||
                                     op == KernelOp::Fused) &&
                                    overwrite;
                    key.weights =
                        op == KernelOp::Fused ? weights : WeightsKind::None;
                    key.shard = shard;
                    if (seen.insert(key.str()).second)
                      keys.push_back(key);
                  }
  return keys;
}

/// Writes `text` to `path` ('-' is stdout).
LogicalResult writeOutput(StringRef path, StringRef text) {
  std::string error;
  auto file = openOutputFile(path, &error);
  if (!file) {
    llvm::errs() << "ce-gen: error: " << error << "\n";
    return failure();
  }
  file->os() << text;
  file->keep();
  return success();
}

/// Prints `module` to the output (the --emit=mlir/loops/gpu stages).
int printModule(Operation *module) {
  std::string text;
  llvm::raw_string_ostream os(text);
  module->print(os);
  return failed(writeOutput(outputPath, text)) ? 1 : 0;
}

int runHostCodegen(ModuleOp module, std::vector<KernelInfo> kernels,
                   std::vector<BundleObject> &objects) {
  HostTargetOptions hostOptions;
  hostOptions.cpu = hostCpu;
  std::string error;
  auto machine = createHostTargetMachine(hostOptions, error);
  if (failed(machine))
    return usageError("host target: " + error);
  llvm::LLVMContext llvmContext;
  std::unique_ptr<llvm::Module> llvmModule = translateAndOptimize(
      module, llvmContext, **machine, hostOptions.optLevel, error);
  if (!llvmModule) {
    llvm::errs() << "ce-gen: error: " << error << "\n";
    return 1;
  }
  std::string assembly, object;
  if (!dumpDir.empty() || emitStage == EmitStage::Isa) {
    if (failed(emitMachineCode(*llvmModule, **machine, false, assembly,
                               error))) {
      llvm::errs() << "ce-gen: error: " << error << "\n";
      return 1;
    }
  }
  if (!dumpDir.empty()) {
    std::string ir;
    llvm::raw_string_ostream os(ir);
    llvmModule->print(os, nullptr);
    if (failed(writeOutput(dumpDir + "/kernel.opt.ll", ir)) ||
        failed(writeOutput(dumpDir + "/kernel.s", assembly)))
      return 1;
  }
  if (emitStage == EmitStage::Llvm) {
    std::string ir;
    llvm::raw_string_ostream os(ir);
    llvmModule->print(os, nullptr);
    return failed(writeOutput(outputPath, ir)) ? 1 : 0;
  }
  if (emitStage == EmitStage::Isa)
    return failed(writeOutput(outputPath, assembly)) ? 1 : 0;
  if (failed(emitMachineCode(*llvmModule, **machine, true, object, error))) {
    llvm::errs() << "ce-gen: error: " << error << "\n";
    return 1;
  }
  if (emitStage == EmitStage::Obj)
    return failed(writeOutput(outputPath, object)) ? 1 : 0;

  // Bundle: link the object into a shared object beside the manifest.
  std::string objectPath = outputPath + "/host-x86_64.o";
  std::string soName = "host-x86_64.so";
  if (failed(writeOutput(objectPath, object)))
    return 1;
  LogicalResult linked = linkSharedObject(
      CE_LD_LLD, objectPath, outputPath + "/" + soName, error);
  llvm::sys::fs::remove(objectPath);
  if (failed(linked)) {
    llvm::errs() << "ce-gen: error: linking host kernels: " << error << "\n";
    return 1;
  }
  objects.push_back(
      BundleObject{soName, "host", "shared-object", std::move(kernels)});
  return 0;
}

/// Bytes per logit of `type`.
unsigned elementBytes(::ce::ElemType type) {
  return type == ::ce::ElemType::F32 ? 4 : 2;
}

/// Builds, lowers and emits the kernels of `keys` for one GPU chip.
int runGpuCodegen(MLIRContext &context,
                  ArrayRef<::ce::KernelVariantKey> keys,
                  const GpuTarget &target, std::vector<BundleObject> &objects) {
  OwningOpRef<ModuleOp> module = ModuleOp::create(UnknownLoc::get(&context));
  (*module)->setAttr(gpu::GPUDialect::getContainerModuleAttrName(),
                     UnitAttr::get(&context));
  OpBuilder builder = OpBuilder::atBlockEnd(module->getBody());
  auto kernelModule =
      gpu::GPUModuleOp::create(builder, module->getLoc(), "ce_kernels");
  GpuPipelineOptions options;
  options.target = target.amd ? "rocdl" : "nvvm";
  options.chipset = target.chip;
  options.subgroupSize = target.subgroupSize;
  options.asyncCopy = asyncCopy && !target.amd;
  // AMD has no packed bf16 maximum (gfx9's v_pk_max_f16 is f16 only, with
  // maxNum semantics).
  options.packedMax = !target.amd;
  if (streamStages == 1) {
    llvm::errs() << "ce-gen: --stream-stages must be 0 (off) or at least 2\n";
    return 2;
  }
  // --block-size/--unroll/--row-cache set every kernel's; else the chip's
  // per-op default. The mapping pass reads them from the kernel's
  // attributes.
  bool overridden = blockSize || unroll || rowCache.getNumOccurrences();
  auto tuningOf = [&](GpuTuning tuning) {
    if (blockSize)
      tuning.blockSize = blockSize;
    if (unroll)
      tuning.unroll = unroll;
    if (rowsPerSM.getNumOccurrences())
      tuning.rowsPerSM = rowsPerSM;
    if (rowCache.getNumOccurrences())
      tuning.rowCacheBytes = rowCache;
    if (streamStages.getNumOccurrences())
      tuning.streamStages = streamStages;
    if (flushDenormals.getNumOccurrences())
      tuning.flushDenormals = flushDenormals;
    return tuning;
  };
  std::vector<KernelInfo> kernels;
  auto emit = [&](const ::ce::KernelVariantKey &key, const std::string &name,
                  const GpuTuning &tuning, int64_t minVocab) -> LogicalResult {
    gpu::GPUFuncOp func = buildGpuKernel(kernelModule, name, key);
    unsigned cacheBytes = key.op == ::ce::KernelOp::Fused
                              ? GpuTarget::rowCacheBytesFor(
                                    tuning, tuning.rowCacheBytes)
                              : 0;
    if (cacheBytes > target.maxSharedBytesPerWorkgroup()) {
      llvm::errs() << "ce-gen: --row-cache=" << cacheBytes
                   << " exceeds the workgroup memory of " << target.chip
                   << " (" << target.maxSharedBytesPerWorkgroup()
                   << " bytes)\n";
      return failure();
    }
    func->setAttr("ce.block_size", builder.getI64IntegerAttr(tuning.blockSize));
    func->setAttr("ce.unroll", builder.getI64IntegerAttr(tuning.unroll));
    if (cacheBytes)
      func->setAttr("ce.row_cache_bytes", builder.getI64IntegerAttr(cacheBytes));
    if (tuning.flushDenormals)
      func->setAttr("ce.flush_denormals", builder.getUnitAttr());
    bool streamed = tuning.streamStages >= 2 && options.asyncCopy &&
                    (key.op == ::ce::KernelOp::Forward ||
                     key.op == ::ce::KernelOp::ShardStats);
    if (streamed) {
      func->setAttr("ce.stream_stages",
                    builder.getI64IntegerAttr(tuning.streamStages));
      cacheBytes = tuning.streamStages * tuning.chunkBytes();
      if (cacheBytes > target.maxSharedBytesPerWorkgroup()) {
        llvm::errs() << "ce-gen: --stream-stages=" << tuning.streamStages
                     << " needs " << cacheBytes
                     << " bytes of workgroup memory, more than " << target.chip
                     << " has (" << target.maxSharedBytesPerWorkgroup()
                     << ")\n";
        return failure();
      }
    }
    FailureOr<KernelInfo> info = describeKernel(func);
    if (failed(info))
      return failure();
    info->symbol = name;
    info->abi = "memref-descriptor-fields";
    info->blockSize = tuning.blockSize;
    info->ldsBytes = std::max(cacheBytes, target.ldsBytesFor(tuning.rowsPerSM));
    info->minVocab = minVocab;
    kernels.push_back(std::move(*info));
    return success();
  };
  for (auto [i, key] : llvm::enumerate(keys)) {
    std::string name =
        ("ce_" + llvm::Twine(::ce::stringify(key.op)) + "_" + llvm::Twine(i))
            .str();
    if (failed(emit(key, name, tuningOf(target.tuningFor(key.op)), 0)))
      return 2;
    // Longer rows get kernels of their own (the table's; not when the
    // command line sets the tuning).
    if (overridden)
      continue;
    for (const GpuTarget::LongerRows &rows : target.longerRowsFor(key.op))
      if (failed(emit(key, name + rows.suffix, tuningOf(rows.tuning),
                      rows.minRowBytes / elementBytes(key.logits) + 1)))
        return 2;
  }
  if (failed(verify(*module)))
    return 1;
  if (emitStage == EmitStage::Mlir)
    return printModule(*module);

  PassManager pm(&context);
  if (failed(applyPassManagerCLOptions(pm)))
    return 2;
  if (emitStage == EmitStage::Gpu || emitStage == EmitStage::Loops)
    buildGpuMappingPipeline(pm, options);
  else
    buildGpuPipeline(pm, options);
  if (failed(pm.run(*module)))
    return 2;
  if (emitStage == EmitStage::Gpu || emitStage == EmitStage::Loops)
    return printModule(*module);

  std::string error;
  auto machine = createGpuTargetMachine(target, error);
  if (failed(machine))
    return usageError(target.chip + ": " + error);
  llvm::LLVMContext llvmContext;
  std::unique_ptr<llvm::Module> llvmModule =
      translateGpuModule(kernelModule, llvmContext, **machine, error);
  if (!llvmModule) {
    llvm::errs() << "ce-gen: error: " << error << "\n";
    return 1;
  }
  std::string ir;
  if (emitStage == EmitStage::Llvm || !dumpDir.empty()) {
    llvm::raw_string_ostream os(ir);
    llvmModule->print(os, nullptr);
  }
  if (emitStage == EmitStage::Llvm)
    return failed(writeOutput(outputPath, ir)) ? 1 : 0;
  std::string assembly, object;
  if (failed(emitMachineCode(*llvmModule, **machine, false, assembly,
                             error))) {
    llvm::errs() << "ce-gen: error: " << error << "\n";
    return 1;
  }
  if (!dumpDir.empty() &&
      (failed(writeOutput(dumpDir + "/" + target.chip + ".opt.ll", ir)) ||
       failed(writeOutput(dumpDir + "/" + target.chip + ".s", assembly))))
    return 1;
  if (emitStage == EmitStage::Isa)
    return failed(writeOutput(outputPath, assembly)) ? 1 : 0;
  if (!target.amd) {
    // PTX is the code object: the driver compiles it for the device.
    if (emitStage == EmitStage::Obj)
      return failed(writeOutput(outputPath, assembly)) ? 1 : 0;
    if (failed(writeOutput(outputPath + "/" + target.objectFile(), assembly)))
      return 1;
    objects.push_back(BundleObject{target.objectFile(), target.chip, "ptx",
                                   std::move(kernels)});
    return 0;
  }
  if (failed(emitMachineCode(*llvmModule, **machine, true, object, error))) {
    llvm::errs() << "ce-gen: error: " << error << "\n";
    return 1;
  }
  if (emitStage == EmitStage::Obj)
    return failed(writeOutput(outputPath, object)) ? 1 : 0;
  // HSACO: the relocatable object linked into a shared object by lld.
  std::string objectPath = outputPath + "/" + target.chip + ".o";
  if (failed(writeOutput(objectPath, object)))
    return 1;
  LogicalResult linked = linkSharedObject(
      CE_LD_LLD, objectPath, outputPath + "/" + target.objectFile(), error,
      /*hostLibraries=*/false);
  llvm::sys::fs::remove(objectPath);
  if (failed(linked)) {
    llvm::errs() << "ce-gen: error: linking " << target.chip
                 << " code object: " << error << "\n";
    return 1;
  }
  objects.push_back(BundleObject{target.objectFile(), target.chip, "hsaco",
                                 std::move(kernels)});
  return 0;
}

/// Builds (or reads), lowers and emits the host kernels.
int emitHost(MLIRContext &context, ArrayRef<::ce::KernelVariantKey> keys,
             std::vector<BundleObject> &objects) {
  OwningOpRef<ModuleOp> module;
  if (!inputFile.empty()) {
    std::string readError;
    auto file = openInputFile(inputFile, &readError);
    if (!file)
      return usageError(readError);
    llvm::SourceMgr sourceMgr;
    sourceMgr.AddNewSourceBuffer(std::move(file), llvm::SMLoc());
    module = parseSourceFile<ModuleOp>(sourceMgr, &context);
    if (!module)
      return 2;
  } else {
    module = ModuleOp::create(UnknownLoc::get(&context));
    for (auto [i, key] : llvm::enumerate(keys))
      buildKernel(*module, ("ce_" + llvm::Twine(::ce::stringify(key.op)) +
                            "_" + llvm::Twine(i))
                               .str(),
                  key);
    if (failed(verify(*module)))
      return 1;
  }

  if (emitStage == EmitStage::Mlir)
    return printModule(*module);
  if (emitStage == EmitStage::Gpu)
    return usageError("--emit=gpu applies to GPU targets");

  // Fuse before describing: fusion changes which kernels exist.
  HostPipelineOptions pipelineOptions;
  pipelineOptions.fuse = !noFuse;
  pipelineOptions.vectorWidth = vectorWidth;
  pipelineOptions.unroll = unroll ? unroll.getValue() : 4;
  {
    PassManager pm(&context);
    if (failed(applyPassManagerCLOptions(pm)))
      return 2;
    if (pipelineOptions.fuse)
      pm.addPass(createCEFuseForwardBackward());
    if (failed(pm.run(*module)))
      return 2;
  }
  std::vector<KernelInfo> kernels;
  for (auto func : module->getOps<func::FuncOp>()) {
    FailureOr<KernelInfo> info = describeKernel(func);
    if (failed(info))
      return 2;
    func->setAttr("llvm.emit_c_interface", UnitAttr::get(&context));
    kernels.push_back(std::move(*info));
  }

  PassManager pm(&context);
  if (failed(applyPassManagerCLOptions(pm)))
    return 2;
  pipelineOptions.fuse = false;
  if (emitStage == EmitStage::Loops)
    buildHostLoopsPipeline(pm, pipelineOptions);
  else
    buildHostPipeline(pm, pipelineOptions);
  if (failed(pm.run(*module)))
    return 2;
  if (emitStage == EmitStage::Loops)
    return printModule(*module);
  return runHostCodegen(*module, std::move(kernels), objects);
}

} // namespace

int main(int argc, char **argv) {
  llvm::InitLLVM initLLVM(argc, argv);
  registerAsmPrinterCLOptions();
  registerMLIRContextCLOptions();
  registerPassManagerCLOptions();
  registerCEPassesAndPipelines();
  cl::HideUnrelatedOptions({&category, &cl::getGeneralCategory()});
  if (!cl::ParseCommandLineOptions(argc, argv,
                                   "cegen kernel generator\n\n"
                                   "  ce-gen --target=host --op=forward,"
                                   "backward --logits=bf16 -o bundle/\n",
                                   &llvm::errs()))
    return 2;

  TargetOptions targetOptions;
  targetOptions.targets.assign(targets.begin(), targets.end());
  if (targetOptions.targets.empty())
    targetOptions.targets.push_back("host");
  std::string error;
  if (failed(targetOptions.verify(error)))
    return usageError(error);
  if (vectorWidth == 0 || (vectorWidth & (vectorWidth - 1)) != 0)
    return usageError("--vector-width must be a power of two");

  bool fromFile = !inputFile.empty();
  bool anyGpu = llvm::any_of(targetOptions.targets, [](const std::string &t) {
    return t != "host";
  });
  bool variantOptions = !ops.empty() || !logitsTypes.empty() ||
                        !labelTypes.empty() || !layouts.empty() ||
                        !ignoreIndices.empty() || !smoothings.empty() ||
                        !zLosses.empty() || !overwrites.empty() ||
                        !weightKinds.empty();
  if (fromFile && variantOptions)
    return usageError("variant options (--op, --logits, ...) conflict with "
                      "an input file; give one or the other");
  if (fromFile && anyGpu)
    return usageError("GPU targets are emitted from variant options (--op, "
                      "--logits, ...), not from an input file");
  if (emitStage != EmitStage::Bundle && targetOptions.targets.size() != 1)
    return usageError("--emit=" +
                      std::string(emitStage.getParser()
                                      .getOption(static_cast<int>(
                                          emitStage.getValue()))
                                      .str()) +
                      " prints one target's output; give a single --target");
  std::vector<::ce::KernelVariantKey> keys;
  if (!fromFile) {
    auto expanded = expandVariants(error);
    if (failed(expanded))
      return usageError(error);
    keys = std::move(*expanded);
    if (keys.empty())
      return usageError("the variant options select no kernel: --shard "
                        "takes --op=shard_stats or backward, and "
                        "--op=shard_stats needs a --shard");
  }
  if (emitStage == EmitStage::Bundle) {
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
  for (const std::string &target : targetOptions.targets) {
    int status = target == "host"
                     ? emitHost(context, keys, objects)
                     : runGpuCodegen(context, keys, *GpuTarget::lookup(target),
                                     objects);
    if (status != 0 || emitStage != EmitStage::Bundle)
      return status;
  }
  // The manifest records each object's SHA-256, so the objects are hashed
  // as they lie on disk, after lld has written them.
  if (failed(hashObjectFiles(outputPath, objects, error))) {
    llvm::errs() << "ce-gen: error: " << error << "\n";
    return 1;
  }
  std::string manifest;
  llvm::raw_string_ostream os(manifest);
  writeManifest(os, objects);
  return failed(writeOutput(outputPath + "/manifest.json", manifest)) ? 1 : 0;
}
