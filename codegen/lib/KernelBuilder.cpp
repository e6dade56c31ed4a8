//===- KernelBuilder.cpp - Kernel functions from variant keys -------------===//

#include "ce/Codegen/KernelBuilder.h"
#include "ce/Dialect/CE/IR/CEOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"

#include <iterator>

using namespace mlir;
using namespace mlir::ce;
using ::ce::ElemType;
using ::ce::KernelOp;
using ::ce::KernelVariantKey;
using ::ce::LabelLayout;
using ::ce::WeightsKind;
using ::ce::ArgRole;

static_assert(static_cast<int64_t>(kFlagMegatronLabels) ==
                      static_cast<int64_t>(::ce::kFlagMegatronLabels) &&
                  static_cast<int64_t>(kFlagIgnoreIndex) ==
                      static_cast<int64_t>(::ce::kFlagIgnoreIndex) &&
                  static_cast<int64_t>(kFlagGlobalSmoothing) ==
                      static_cast<int64_t>(::ce::kFlagGlobalSmoothing) &&
                  static_cast<int64_t>(kFlagLseLow) ==
                      static_cast<int64_t>(::ce::kFlagLseLow) &&
                  static_cast<int64_t>(kFlagEntropy) ==
                      static_cast<int64_t>(::ce::kFlagEntropy) &&
                  static_cast<int64_t>(kFlagArgmax) ==
                      static_cast<int64_t>(::ce::kFlagArgmax),
              "the dialect's and the bundle ABI's flag bits must agree");

static Type toMlirType(Builder &b, ElemType type) {
  switch (type) {
  case ElemType::BF16:
    return b.getBF16Type();
  case ElemType::F16:
    return b.getF16Type();
  case ElemType::F32:
    return b.getF32Type();
  case ElemType::I32:
    return b.getI32Type();
  case ElemType::I64:
    return b.getI64Type();
  }
  llvm_unreachable("unknown element type");
}

static FailureOr<ElemType> fromMlirType(Type type) {
  if (type.isBF16())
    return ElemType::BF16;
  if (type.isF16())
    return ElemType::F16;
  if (type.isF32())
    return ElemType::F32;
  if (type.isInteger(32))
    return ElemType::I32;
  if (type.isInteger(64))
    return ElemType::I64;
  return failure();
}

static Layout toLayout(LabelLayout layout) {
  switch (layout) {
  case LabelLayout::Flat:
    return Layout::flat;
  case LabelLayout::SbvBs:
    return Layout::sbv_bs;
  case LabelLayout::SbvSb:
    return Layout::sbv_sb;
  }
  llvm_unreachable("unknown layout");
}

static LabelLayout fromLayout(Layout layout) {
  switch (layout) {
  case Layout::flat:
    return LabelLayout::Flat;
  case Layout::sbv_bs:
    return LabelLayout::SbvBs;
  case Layout::sbv_sb:
    return LabelLayout::SbvSb;
  }
  llvm_unreachable("unknown layout");
}

/// A memref of `rank` dynamic sizes and strides (the last stride 1 when
/// `unitInnerStride`) at a dynamic offset: any strided view of the caller's.
static MemRefType stridedMemRef(int64_t rank, Type element,
                                bool unitInnerStride,
                                Attribute memorySpace = {}) {
  SmallVector<int64_t> shape(rank, ShapedType::kDynamic);
  SmallVector<int64_t> strides(rank, ShapedType::kDynamic);
  if (unitInnerStride && rank > 0)
    strides.back() = 1;
  auto layout = StridedLayoutAttr::get(element.getContext(),
                                       ShapedType::kDynamic, strides);
  return MemRefType::get(shape, element, layout, memorySpace);
}

/// The type of an argument of `shape` in `memorySpace`: logits-like
/// memrefs have a unit inner stride, the value roles are passed by value.
static Type argType(Builder &b, ::ce::ArgRole role, ::ce::ArgShape shape,
                    Attribute memorySpace) {
  Type element = toMlirType(b, shape.dtype);
  if (::ce::isValueRole(role))
    return element;
  switch (role) {
  case ::ce::ArgRole::Status:
    return MemRefType::get({1}, element, MemRefLayoutAttrInterface(),
                           memorySpace);
  case ::ce::ArgRole::Logits:
  case ::ce::ArgRole::Grad:
    return stridedMemRef(shape.rank, element, true, memorySpace);
  default:
    return stridedMemRef(shape.rank, element, false, memorySpace);
  }
}

/// The kernel's argument types: the bundle ABI's roles, tensors then values.
static SmallVector<Type> kernelArgTypes(Builder &b, const KernelVariantKey &key,
                                        Attribute memorySpace) {
  std::vector<::ce::ArgRole> roles = ::ce::expectedRoles(key);
  SmallVector<Type> argTypes;
  for (::ce::ArgRole role : roles)
    argTypes.push_back(
        argType(b, role, ::ce::expectedArg(key, role), memorySpace));
  return argTypes;
}

/// Builds the ce op of `key` over the kernel's arguments at `b`: the option
/// values are the run-time arguments (the smoothing, z-loss and shard ones
/// only where the variant computes them).
static void buildKernelOp(OpBuilder &b, Location loc, ValueRange args,
                          const KernelVariantKey &key) {
  constexpr size_t numValues = std::size(::ce::kValueRoles);
  ValueRange values = args.take_back(numValues);
  ValueRange tensors = args.drop_back(numValues);
  auto layout = LayoutAttr::get(b.getContext(), toLayout(key.layout));
  if (key.op == KernelOp::Rescale) {
    // Grad, weights, grad_loss; the value arguments are unused.
    RescaleOp::create(b, loc, tensors[0], tensors[1], tensors[2], layout);
    return;
  }
  Value logits = tensors[0], labels = tensors[1], status = tensors.back();
  Value flags = values[0], ignoreIndex = values[1];
  Value smoothingValue = key.smoothing ? values[2] : Value();
  Value zLossValue = key.zLoss ? values[3] : Value();
  // Backward and shard_stats kernels take a vocabulary slice (an unsharded
  // backward is the slice [0, V) of V); its smoothing is a flag.
  bool sharded = key.op == KernelOp::Backward || key.op == KernelOp::ShardStats;
  Value shardStart = sharded ? values[4] : Value();
  Value shardVocab = sharded ? values[5] : Value();
  // Every kernel reads the logit scale (1 costs nothing measurable).
  Value logitScale = values[6];
  // Only a softcap kernel reads its cap (the tanh is a compile-time variant).
  Value logitSoftcap = key.softcap ? values[7] : Value();
  IntegerAttr ignore;
  FloatAttr smoothing = b.getF32FloatAttr(0.0f);
  FloatAttr zLoss = b.getF32FloatAttr(0.0f);
  UnitAttr overwrite = key.overwrite ? b.getUnitAttr() : UnitAttr();
  ShardAttr shard =
      sharded ? ShardAttr::get(b.getContext(), 0, 0, false) : ShardAttr();
  switch (key.op) {
  case KernelOp::Forward:
    // logits, labels, loss, lse, lse_low, entropy, argmax, status.
    ForwardOp::create(b, loc, logits, labels, tensors[2], tensors[3],
                      tensors[4], tensors[5], tensors[6], status, flags,
                      ignoreIndex, smoothingValue, zLossValue, shardStart,
                      shardVocab, logitScale, logitSoftcap, layout, ignore,
                      smoothing, zLoss, shard);
    break;
  case KernelOp::ShardStats:
    // logits, labels, stats, entropy, argmax, status.
    ShardStatsOp::create(b, loc, logits, labels, tensors[2], tensors[3],
                         tensors[4], status, flags, ignoreIndex, smoothingValue,
                         zLossValue, shardStart, shardVocab, logitScale,
                         logitSoftcap, layout, ignore, smoothing, zLoss, shard);
    break;
  case KernelOp::Backward:
    // logits, labels, lse, lse_low, grad_loss[, grad], status.
    BackwardOp::create(b, loc, logits, labels, tensors[2], tensors[4],
                       key.overwrite ? logits : tensors[5], tensors[3], status,
                       flags, ignoreIndex, smoothingValue, zLossValue,
                       shardStart, shardVocab, logitScale, logitSoftcap, layout,
                       ignore, smoothing, zLoss, shard, overwrite);
    break;
  case KernelOp::Fused:
    // logits, labels, weights, loss, lse, lse_low, entropy, argmax[, grad],
    // status.
    FusedOp::create(b, loc, logits, labels, tensors[2], tensors[3], tensors[4],
                    key.overwrite ? logits : tensors[8], tensors[5], tensors[6],
                    tensors[7], status, flags, ignoreIndex, smoothingValue,
                    zLossValue, shardStart, shardVocab, logitScale,
                    logitSoftcap, layout, ignore, smoothing, zLoss, shard,
                    overwrite);
    break;
  case KernelOp::Rescale:
    break; // built above
  }
}

std::string mlir::ce::kernelSymbol(const KernelVariantKey &key,
                                   size_t index) {
  return "ce_" + std::string(::ce::stringify(key.op)) + "_" +
         std::to_string(index);
}

func::FuncOp mlir::ce::buildKernel(ModuleOp module, StringRef name,
                                   const KernelVariantKey &key) {
  OpBuilder b = OpBuilder::atBlockEnd(module.getBody());
  Location loc = module.getLoc();
  SmallVector<Type> argTypes = kernelArgTypes(b, key, Attribute());
  auto func = func::FuncOp::create(b, loc, name,
                                   b.getFunctionType(argTypes, TypeRange{}));
  func->setAttr("llvm.emit_c_interface", b.getUnitAttr());
  Block *entry = func.addEntryBlock();
  b.setInsertionPointToStart(entry);
  buildKernelOp(b, loc, entry->getArguments(), key);
  func::ReturnOp::create(b, loc);
  return func;
}

gpu::GPUFuncOp mlir::ce::buildGpuKernel(gpu::GPUModuleOp module, StringRef name,
                                        const KernelVariantKey &key) {
  OpBuilder b = OpBuilder::atBlockTerminator(module.getBody());
  Location loc = module.getLoc();
  auto global =
      gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Global);
  SmallVector<Type> argTypes = kernelArgTypes(b, key, global);
  auto func = gpu::GPUFuncOp::create(b, loc, name,
                                     b.getFunctionType(argTypes, TypeRange{}));
  func->setAttr(gpu::GPUDialect::getKernelFuncAttrName(), b.getUnitAttr());
  b.setInsertionPointToStart(&func.getBody().front());
  buildKernelOp(b, loc, func.getArguments(), key);
  gpu::ReturnOp::create(b, loc);
  return func;
}

namespace {
/// Records which function argument feeds which role of the ce op.
class RoleMap {
public:
  explicit RoleMap(FunctionOpInterface func)
      : func(func), roles(func.getNumArguments()) {}

  LogicalResult add(::ce::ArgRole role, Value value) {
    auto arg = dyn_cast<BlockArgument>(value);
    if (!arg || arg.getOwner() != &func.getFunctionBody().front())
      return func.emitError("operand '")
             << ::ce::stringify(role)
             << "' of the ce op must be a function argument";
    std::optional<::ce::ArgRole> &slot = roles[arg.getArgNumber()];
    if (!slot)
      slot = role;
    return success();
  }

  /// The argument list, which must be the bundle ABI's for `key`: its
  /// tensors, then every value role (a value the variant does not compute
  /// with, such as the smoothing of a kernel without smoothing, is an unused
  /// argument of the right type).
  FailureOr<std::vector<EmittedArg>> finish(const KernelVariantKey &key) {
    std::vector<::ce::ArgRole> expected = ::ce::expectedRoles(key);
    if (roles.size() != expected.size())
      return func.emitError("a kernel of \"")
             << key.str() << "\" takes " << expected.size()
             << " arguments (its tensors, then flags, ignore_index, "
                "label_smoothing, z_loss, shard_start, shard_vocab, "
                "logit_scale and logit_softcap by value), this function "
             << roles.size();
    std::vector<EmittedArg> args;
    for (auto [i, role] : llvm::enumerate(roles)) {
      if (role ? *role != expected[i] : !::ce::isValueRole(expected[i]))
        return func.emitError("argument #")
               << i << " must feed the ce op's '"
               << ::ce::stringify(expected[i]) << "'";
      Type type = func.getArgumentTypes()[i];
      auto memref = dyn_cast<MemRefType>(type);
      Type elementType = memref ? memref.getElementType() : type;
      FailureOr<ElemType> element = fromMlirType(elementType);
      ::ce::ArgShape want = ::ce::expectedArg(key, expected[i]);
      if (failed(element) || *element != want.dtype ||
          (memref ? memref.getRank() : 0) != want.rank ||
          ::ce::isValueRole(expected[i]) == static_cast<bool>(memref))
        return func.emitError("argument #")
               << i << " ('" << ::ce::stringify(expected[i]) << "') has type "
               << type << ", expected " << ::ce::stringify(want.dtype)
               << (::ce::isValueRole(expected[i])
                       ? " by value"
                       : " memref of rank " + std::to_string(want.rank));
      args.push_back({expected[i], want.rank, want.dtype});
    }
    return args;
  }

private:
  FunctionOpInterface func;
  std::vector<std::optional<::ce::ArgRole>> roles;
};
} // namespace

FailureOr<EmittedKernel> mlir::ce::describeKernel(FunctionOpInterface func) {
  SmallVector<Operation *> ceOps;
  func.walk([&](Operation *op) {
    if (isa<ForwardOp, BackwardOp, FusedOp, ShardStatsOp, RescaleOp>(op))
      ceOps.push_back(op);
  });
  if (ceOps.size() != 1)
    return func.emitError("a kernel function must hold exactly one ce op, "
                          "found ")
           << ceOps.size();
  EmittedKernel info;
  info.name = func.getName().str();
  info.symbol = "_mlir_ciface_" + info.name;
  KernelVariantKey &key = info.key;
  RoleMap roles(func);
  auto common = [&](auto op) -> LogicalResult {
    ShardAttr shard = op.getShardAttr();
    if (op.getIgnoreIndexAttr() || !op.getLabelSmoothing().isZero() ||
        !op.getZLoss().isZero() || (shard && shard.hasBounds()))
      return op.emitError(
          "a kernel for a bundle takes ignore_index, label_smoothing, z_loss "
          "and a shard's bounds as run-time operands (bundle format version "
          "3), not as attributes");
    if (!op.getStatus() || !op.getFlags() || !op.getIgnoreIndexValue() ||
        !op.getLogitScale())
      return op.emitError("a kernel for a bundle needs status, flags, "
                          "ignore_index and logit_scale operands "
                          "(docs/bundle-format.md)");
    bool takesSlice = isa<BackwardOp, ShardStatsOp>(op.getOperation());
    if (takesSlice != static_cast<bool>(shard) ||
        (shard && shard.getGlobalSmoothing()))
      return op.emitError(
          "a kernel for a bundle: backward and shard_stats take a vocabulary "
          "slice (`#ce.shard<>` with shard_bounds operands; how it smooths is "
          "a run-time flag), forward and fused take none");
    key.logits = *fromMlirType(op.getLogits().getType().getElementType());
    key.labels = *fromMlirType(op.getLabels().getType().getElementType());
    key.layout = fromLayout(op.getLayout());
    key.smoothing = static_cast<bool>(op.getLabelSmoothingValue());
    key.zLoss = static_cast<bool>(op.getZLossValue());
    key.softcap = static_cast<bool>(op.getLogitSoftcap());
    auto addIf = [&](ArgRole role, Value value) {
      return value ? roles.add(role, value) : success();
    };
    return LogicalResult::success(
        succeeded(roles.add(ArgRole::Logits, op.getLogits())) &&
        succeeded(roles.add(ArgRole::Labels, op.getLabels())) &&
        succeeded(roles.add(ArgRole::Status, op.getStatus())) &&
        succeeded(roles.add(ArgRole::Flags, op.getFlags())) &&
        succeeded(roles.add(ArgRole::IgnoreIndex, op.getIgnoreIndexValue())) &&
        succeeded(
            addIf(ArgRole::LabelSmoothing, op.getLabelSmoothingValue())) &&
        succeeded(addIf(ArgRole::ZLoss, op.getZLossValue())) &&
        succeeded(addIf(ArgRole::ShardStart, op.getShardStart())) &&
        succeeded(addIf(ArgRole::ShardVocab, op.getShardVocab())) &&
        succeeded(roles.add(ArgRole::LogitScale, op.getLogitScale())) &&
        succeeded(addIf(ArgRole::LogitSoftcap, op.getLogitSoftcap())));
  };
  // Forward, fused and backward kernels take lse's low part (version 4).
  auto addLseLow = [&](Operation *op, Value lseLow) -> LogicalResult {
    if (!lseLow)
      return op->emitError("a kernel for a bundle passes an lse_low operand "
                           "to forward, fused and backward ops (bundle "
                           "format version 4; flag bit 3 says whether it is "
                           "in force)");
    return roles.add(ArgRole::LseLow, lseLow);
  };
  // Forward, fused and shard_stats kernels take the entropy and argmax
  // outputs (version 5).
  auto addOutputs = [&](Operation *op, Value entropy,
                        Value argmax) -> LogicalResult {
    if (!entropy || !argmax)
      return op->emitError("a kernel for a bundle passes entropy and argmax "
                           "operands to forward, fused and shard_stats ops "
                           "(bundle format "
                           "version 5; flag bits 4 and 5 say whether they are "
                           "in force)");
    return LogicalResult::success(
        succeeded(roles.add(ArgRole::Entropy, entropy)) &&
        succeeded(roles.add(ArgRole::Argmax, argmax)));
  };
  LogicalResult result = success();
  if (auto op = dyn_cast<ForwardOp>(ceOps[0])) {
    key.op = KernelOp::Forward;
    result = LogicalResult::success(
        succeeded(common(op)) && succeeded(roles.add(ArgRole::Loss, op.getLoss())) &&
        succeeded(roles.add(ArgRole::Lse, op.getLse())) &&
        succeeded(addLseLow(op, op.getLseLow())) &&
        succeeded(addOutputs(op, op.getEntropy(), op.getArgmax())));
  } else if (auto op = dyn_cast<ShardStatsOp>(ceOps[0])) {
    key.op = KernelOp::ShardStats;
    result = LogicalResult::success(
        succeeded(common(op)) && succeeded(roles.add(ArgRole::Stats, op.getStats())) &&
        succeeded(addOutputs(op, op.getEntropy(), op.getArgmax())));
  } else if (auto op = dyn_cast<BackwardOp>(ceOps[0])) {
    key.op = KernelOp::Backward;
    key.overwrite = op.getOverwriteInput();
    result = LogicalResult::success(
        succeeded(common(op)) && succeeded(roles.add(ArgRole::Lse, op.getLse())) &&
        succeeded(addLseLow(op, op.getLseLow())) &&
        succeeded(roles.add(ArgRole::GradLoss, op.getGradLoss())) &&
        succeeded(roles.add(ArgRole::Grad, op.getGrad())));
  } else if (auto op = dyn_cast<FusedOp>(ceOps[0])) {
    key.op = KernelOp::Fused;
    key.overwrite = op.getOverwriteInput();
    if (op.getWeights().getType().getRank() == 0)
      return op.emitError("a kernel for a bundle takes per-token weights (a "
                          "scalar weight is passed with stride 0)");
    key.weights = WeightsKind::Token;
    result = LogicalResult::success(
        succeeded(common(op)) &&
        succeeded(roles.add(ArgRole::Weights, op.getWeights())) &&
        succeeded(roles.add(ArgRole::Loss, op.getLoss())) &&
        succeeded(roles.add(ArgRole::Lse, op.getLse())) &&
        succeeded(addLseLow(op, op.getLseLow())) &&
        succeeded(addOutputs(op, op.getEntropy(), op.getArgmax())) &&
        succeeded(roles.add(ArgRole::Grad, op.getGrad())));
  } else if (auto op = dyn_cast<RescaleOp>(ceOps[0])) {
    key.op = KernelOp::Rescale;
    key.logits = *fromMlirType(op.getGrad().getType().getElementType());
    key.layout = fromLayout(op.getLayout());
    key.canonicalRescale();
    result = LogicalResult::success(
        succeeded(roles.add(ArgRole::Grad, op.getGrad())) &&
        succeeded(roles.add(ArgRole::Weights, op.getWeights())) &&
        succeeded(roles.add(ArgRole::GradLoss, op.getGradLoss())));
  }
  if (failed(result))
    return failure();
  FailureOr<std::vector<EmittedArg>> args = roles.finish(key);
  if (failed(args))
    return failure();
  info.args = std::move(*args);
  return info;
}
