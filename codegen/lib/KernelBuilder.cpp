//===- KernelBuilder.cpp - Kernel functions from variant keys -------------===//

#include "ce/Codegen/KernelBuilder.h"
#include "ce/Dialect/CE/IR/CEOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"

using namespace mlir;
using namespace mlir::ce;
using ::ce::ElemType;
using ::ce::KernelOp;
using ::ce::KernelVariantKey;
using ::ce::LabelLayout;
using ::ce::WeightsKind;
using ::ce::ArgRole;

static_assert(static_cast<int64_t>(kFlagMegatronLabels) ==
                  static_cast<int64_t>(::ce::kFlagMegatronLabels),
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
/// memrefs have a unit inner stride, a rank-0 integer is passed by value.
static Type argType(Builder &b, ::ce::ArgRole role, ::ce::ArgShape shape,
                    Attribute memorySpace) {
  Type element = toMlirType(b, shape.dtype);
  switch (role) {
  case ::ce::ArgRole::Flags:
    return element;
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

/// The kernel's argument types: the bundle ABI's roles, then the flags.
static SmallVector<Type> kernelArgTypes(Builder &b, const KernelVariantKey &key,
                                        Attribute memorySpace) {
  std::vector<::ce::ArgRole> roles = ::ce::expectedRoles(key);
  roles.push_back(::ce::ArgRole::Flags);
  SmallVector<Type> argTypes;
  for (::ce::ArgRole role : roles)
    argTypes.push_back(
        argType(b, role, ::ce::expectedArg(key, role), memorySpace));
  return argTypes;
}

/// Builds the ce op of `key` over the kernel's arguments at `b`.
static void buildKernelOp(OpBuilder &b, Location loc, ValueRange args,
                          const KernelVariantKey &key) {
  Value logits = args[0], labels = args[1];
  Value status = args[args.size() - 2], flags = args.back();
  auto layout = LayoutAttr::get(b.getContext(), toLayout(key.layout));
  IntegerAttr ignore =
      key.ignoreIndex ? b.getI64IntegerAttr(*key.ignoreIndex) : IntegerAttr();
  FloatAttr smoothing = b.getF32FloatAttr(key.labelSmoothing);
  FloatAttr zLoss = b.getF32FloatAttr(key.zLoss);
  UnitAttr overwrite = key.overwrite ? b.getUnitAttr() : UnitAttr();
  ShardAttr shard =
      key.shard ? ShardAttr::get(b.getContext(), key.shard->start,
                                 key.shard->vocab, key.shard->globalSmoothing)
                : ShardAttr();
  switch (key.op) {
  case KernelOp::Forward:
    ForwardOp::create(b, loc, logits, labels, args[2], args[3], status, flags,
                      layout, ignore, smoothing, zLoss, shard);
    break;
  case KernelOp::ShardStats:
    ShardStatsOp::create(b, loc, logits, labels, args[2], status, flags, layout,
                         ignore, smoothing, zLoss, shard);
    break;
  case KernelOp::Backward:
    BackwardOp::create(b, loc, logits, labels, args[2], args[3],
                       key.overwrite ? logits : args[4], status, flags, layout,
                       ignore, smoothing, zLoss, shard, overwrite);
    break;
  case KernelOp::Fused:
    FusedOp::create(b, loc, logits, labels, args[2], args[3], args[4],
                    key.overwrite ? logits : args[5], status, flags, layout,
                    ignore, smoothing, zLoss, shard, overwrite);
    break;
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

  FailureOr<std::vector<EmittedArg>> finish() {
    std::vector<EmittedArg> args;
    for (auto [i, role] : llvm::enumerate(roles)) {
      if (!role)
        return func.emitError("argument #")
               << i << " does not feed the ce op directly";
      Type type = func.getArgumentTypes()[i];
      // A scalar (the flags) is passed by value; the manifest gives rank 0.
      auto memref = dyn_cast<MemRefType>(type);
      Type elementType = memref ? memref.getElementType() : type;
      FailureOr<ElemType> element = fromMlirType(elementType);
      if (failed(element))
        return func.emitError("unsupported element type ") << elementType;
      args.push_back({*role, memref ? memref.getRank() : 0, *element});
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
    if (isa<ForwardOp, BackwardOp, FusedOp, ShardStatsOp>(op))
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
    if (ShardAttr shard = op.getShardAttr())
      key.shard = ::ce::VocabShard{shard.getStart(), shard.getVocab(),
                                   shard.getGlobalSmoothing()};
    if (!op.getStatus())
      return op.emitError("a kernel for a bundle needs a status operand to "
                          "report out-of-range labels");
    key.logits = *fromMlirType(op.getLogits().getType().getElementType());
    key.labels = *fromMlirType(op.getLabels().getType().getElementType());
    key.layout = fromLayout(op.getLayout());
    if (IntegerAttr ignore = op.getIgnoreIndexAttr())
      key.ignoreIndex = ignore.getInt();
    key.labelSmoothing = op.getLabelSmoothing().convertToFloat();
    key.zLoss = op.getZLoss().convertToFloat();
    if (failed(roles.add(ArgRole::Logits, op.getLogits())) ||
        failed(roles.add(ArgRole::Labels, op.getLabels())))
      return failure();
    return success();
  };
  // Optional: a kernel without run-time flags serves requests with none.
  auto addFlags = [&](auto op) -> LogicalResult {
    return op.getFlags() ? roles.add(ArgRole::Flags, op.getFlags()) : success();
  };
  LogicalResult result = success();
  if (auto op = dyn_cast<ForwardOp>(ceOps[0])) {
    key.op = KernelOp::Forward;
    result = LogicalResult::success(
        succeeded(common(op)) && succeeded(roles.add(ArgRole::Loss, op.getLoss())) &&
        succeeded(roles.add(ArgRole::Lse, op.getLse())) &&
        succeeded(roles.add(ArgRole::Status, op.getStatus())) &&
        succeeded(addFlags(op)));
  } else if (auto op = dyn_cast<ShardStatsOp>(ceOps[0])) {
    key.op = KernelOp::ShardStats;
    result = LogicalResult::success(
        succeeded(common(op)) && succeeded(roles.add(ArgRole::Stats, op.getStats())) &&
        succeeded(roles.add(ArgRole::Status, op.getStatus())) &&
        succeeded(addFlags(op)));
  } else if (auto op = dyn_cast<BackwardOp>(ceOps[0])) {
    key.op = KernelOp::Backward;
    key.overwrite = op.getOverwriteInput();
    result = LogicalResult::success(
        succeeded(common(op)) && succeeded(roles.add(ArgRole::Lse, op.getLse())) &&
        succeeded(roles.add(ArgRole::GradLoss, op.getGradLoss())) &&
        succeeded(roles.add(ArgRole::Grad, op.getGrad())) &&
        succeeded(roles.add(ArgRole::Status, op.getStatus())) &&
        succeeded(addFlags(op)));
  } else if (auto op = dyn_cast<FusedOp>(ceOps[0])) {
    key.op = KernelOp::Fused;
    key.overwrite = op.getOverwriteInput();
    key.weights = op.getWeights().getType().getRank() == 0
                      ? WeightsKind::Scalar
                      : WeightsKind::Token;
    result = LogicalResult::success(
        succeeded(common(op)) &&
        succeeded(roles.add(ArgRole::Weights, op.getWeights())) &&
        succeeded(roles.add(ArgRole::Loss, op.getLoss())) &&
        succeeded(roles.add(ArgRole::Lse, op.getLse())) &&
        succeeded(roles.add(ArgRole::Grad, op.getGrad())) &&
        succeeded(roles.add(ArgRole::Status, op.getStatus())) &&
        succeeded(addFlags(op)));
  }
  if (failed(result))
    return failure();
  FailureOr<std::vector<EmittedArg>> args = roles.finish();
  if (failed(args))
    return failure();
  info.args = std::move(*args);
  return info;
}
