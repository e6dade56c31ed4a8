//===- CEOps.cpp - Cross-entropy dialect operations -----------------------===//
//
// Verifiers. The ops share one configuration and one set of shape
// rules, so they share one checker: each op lists its operands by role.
//
//===----------------------------------------------------------------------===//

#include "ce/Dialect/CE/IR/CEOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/Matchers.h"
#include "mlir/IR/OpImplementation.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"

#include <cmath>

using namespace mlir;
using namespace mlir::ce;

namespace {

/// A named operand, so diagnostics can say which buffer is wrong.
struct NamedValue {
  StringRef name;
  Value value;
};

/// Prints a shape as `[4, ?, 7]`.
std::string formatShape(ArrayRef<int64_t> shape) {
  std::string text = "[";
  llvm::raw_string_ostream os(text);
  llvm::interleaveComma(shape, os, [&](int64_t dim) {
    if (ShapedType::isDynamic(dim))
      os << "?";
    else
      os << dim;
  });
  os << "]";
  return text;
}

bool shapesCompatible(ArrayRef<int64_t> lhs, ArrayRef<int64_t> rhs) {
  if (lhs.size() != rhs.size())
    return false;
  for (auto [a, b] : llvm::zip_equal(lhs, rhs))
    if (!ShapedType::isDynamic(a) && !ShapedType::isDynamic(b) && a != b)
      return false;
  return true;
}

/// Checks shared by every cross-entropy op.
class CrossEntropyVerifier {
public:
  CrossEntropyVerifier(Operation *op, Layout layout)
      : op(op), layout(layout) {}

  /// Checks the logits' rank for the layout and their unit vocab stride, and
  /// derives the token shape that every per-token operand must have.
  LogicalResult verifyLogits(Value logits) {
    auto type = cast<MemRefType>(logits.getType());
    int64_t expectedRank = layout == Layout::flat ? 2 : 3;
    if (type.getRank() != expectedRank)
      return op->emitOpError("layout '")
             << stringifyLayout(layout) << "' expects rank-" << expectedRank
             << " logits, got rank " << type.getRank();
    SmallVector<int64_t> strides;
    int64_t offset;
    if (failed(type.getStridesAndOffset(strides, offset)) ||
        strides.back() != 1)
      return op->emitOpError(
          "logits must have a static unit stride in the vocabulary dimension");
    ArrayRef<int64_t> shape = type.getShape();
    vocab = shape.back();
    switch (layout) {
    case Layout::flat:
      tokenShape = {shape[0]};
      break;
    case Layout::sbv_bs:
      tokenShape = {shape[1], shape[0]};
      break;
    case Layout::sbv_sb:
      tokenShape = {shape[0], shape[1]};
      break;
    }
    return success();
  }

  /// A per-token operand must have the layout's token shape.
  LogicalResult verifyTokenOperand(NamedValue operand) {
    auto type = cast<MemRefType>(operand.value.getType());
    if (!shapesCompatible(type.getShape(), tokenShape))
      return op->emitOpError("'")
             << operand.name << "' shape " << formatShape(type.getShape())
             << " does not match the token shape " << formatShape(tokenShape)
             << " of layout '" << stringifyLayout(layout) << "'";
    return success();
  }

  /// An optional per-token operand (lse_low): the token shape when given.
  LogicalResult verifyOptionalTokenOperand(NamedValue operand) {
    return operand.value ? verifyTokenOperand(operand) : success();
  }

  /// The partial statistics: the token shape followed by 4.
  LogicalResult verifyStats(Value stats) {
    auto type = cast<MemRefType>(stats.getType());
    SmallVector<int64_t, 3> expected(tokenShape.begin(), tokenShape.end());
    expected.push_back(4);
    if (!shapesCompatible(type.getShape(), expected))
      return op->emitOpError("'stats' shape ")
             << formatShape(type.getShape()) << " does not match "
             << formatShape(expected)
             << " (the token shape followed by 4) of layout '"
             << stringifyLayout(layout) << "'";
    return success();
  }

  LogicalResult verifyGradient(Value logits, Value grad) {
    auto logitsType = cast<MemRefType>(logits.getType());
    auto gradType = cast<MemRefType>(grad.getType());
    if (gradType.getElementType() != logitsType.getElementType())
      return op->emitOpError("gradient element type ")
             << gradType.getElementType()
             << " differs from the logits element type "
             << logitsType.getElementType();
    if (!shapesCompatible(gradType.getShape(), logitsType.getShape()))
      return op->emitOpError("gradient shape ")
             << formatShape(gradType.getShape())
             << " does not match the logits shape "
             << formatShape(logitsType.getShape());
    SmallVector<int64_t> strides;
    int64_t offset;
    if (failed(gradType.getStridesAndOffset(strides, offset)) ||
        strides.back() != 1)
      return op->emitOpError("gradient must have a static unit stride in the "
                             "vocabulary dimension");
    return success();
  }

  LogicalResult verifyStatus(Value status) {
    if (!status)
      return success();
    auto type = cast<MemRefType>(status.getType());
    if (type.getRank() != 1 ||
        (!ShapedType::isDynamic(type.getDimSize(0)) && type.getDimSize(0) != 1))
      return op->emitOpError("status must be a memref<1xi64>, got ") << type;
    return success();
  }

  /// The option attributes' ranges, and each option given once: as an
  /// attribute or as a run-time operand.
  template <typename OpT>
  LogicalResult verifyConfig(OpT op) {
    float labelSmoothing = op.getLabelSmoothing().convertToFloat();
    float zLoss = op.getZLoss().convertToFloat();
    if (!(labelSmoothing >= 0.0f && labelSmoothing < 1.0f))
      return op->emitOpError("label_smoothing must be in [0, 1), got ")
             << labelSmoothing;
    if (!(zLoss >= 0.0f) || std::isinf(zLoss))
      return op->emitOpError("z_loss must be finite and non-negative, got ")
             << zLoss;
    if (op.getIgnoreIndexValue() && op.getIgnoreIndexAttr())
      return op->emitOpError("ignore_index is given both as an attribute "
                             "and as an operand");
    if (op.getLabelSmoothingValue() && labelSmoothing != 0.0f)
      return op->emitOpError("label_smoothing is given both as an attribute "
                             "and as an operand");
    if (op.getZLossValue() && zLoss != 0.0f)
      return op->emitOpError("z_loss is given both as an attribute and as an "
                             "operand");
    // A logit scale known here (a constant operand) must be one the runtime
    // would accept: finite and positive.
    APFloat scale(0.0f);
    if (Value logitScale = op.getLogitScale();
        logitScale && matchPattern(logitScale, m_ConstantFloat(&scale))) {
      float value = scale.convertToFloat();
      if (!(value > 0.0f) || std::isinf(value))
        return op->emitOpError("logit_scale must be finite and positive, got ")
               << value;
    }
    APFloat cap(0.0f);
    if (Value logitSoftcap = op.getLogitSoftcap();
        logitSoftcap && matchPattern(logitSoftcap, m_ConstantFloat(&cap))) {
      float value = cap.convertToFloat();
      if (!(value > 0.0f) || std::isinf(value))
        return op->emitOpError(
                   "logit_softcap must be finite and positive, got ")
               << value;
    }
    ShardAttr shard = op.getShardAttr();
    bool runtimeBounds = static_cast<bool>(op.getShardStart());
    if (runtimeBounds != static_cast<bool>(op.getShardVocab()))
      return op->emitOpError("shard_bounds needs both start and vocab");
    if (runtimeBounds && !shard)
      return op->emitOpError("shard_bounds needs a 'shard' attribute");
    if (shard && runtimeBounds == shard.hasBounds())
      return op->emitOpError(runtimeBounds
                                 ? "a shard with run-time bounds must not "
                                   "give start and vocab in its attribute"
                                 : "a shard without start and vocab needs "
                                   "shard_bounds operands");
    if (shard && shard.hasBounds() && !ShapedType::isDynamic(vocab) &&
        shard.getStart() + vocab > shard.getVocab())
      return op->emitOpError("shard [")
             << shard.getStart() << ", " << shard.getStart() + vocab
             << ") of the logits exceeds the vocabulary of "
             << shard.getVocab();
    return success();
  }

  /// Outputs must be distinct buffers and must not be inputs. The one
  /// exception, the gradient written over the logits, is `overwrite_input`'s
  /// business and is checked by `verifyOverwrite`.
  LogicalResult verifyNoAliasing(ArrayRef<NamedValue> inputs,
                                 ArrayRef<NamedValue> outputs) {
    for (auto [i, out] : llvm::enumerate(outputs)) {
      if (!out.value)
        continue;
      for (const NamedValue &other : outputs.drop_front(i + 1))
        if (other.value == out.value)
          return op->emitOpError("outputs '")
                 << out.name << "' and '" << other.name
                 << "' are the same buffer";
      for (const NamedValue &in : inputs)
        if (in.value && in.value == out.value &&
            !(in.name == "logits" && out.name == "grad"))
          return op->emitOpError("output '")
                 << out.name << "' is the same buffer as input '" << in.name
                 << "'";
    }
    return success();
  }

  LogicalResult verifyOverwrite(Value logits, Value grad, bool overwrite) {
    if (overwrite && grad != logits)
      return op->emitOpError("overwrite_input requires the gradient buffer to "
                             "be the logits buffer");
    if (!overwrite && grad == logits)
      return op->emitOpError("gradient buffer is the logits buffer; set "
                             "overwrite_input to write the gradient over the "
                             "logits");
    return success();
  }

private:
  Operation *op;
  Layout layout;
  int64_t vocab = ShapedType::kDynamic;
  SmallVector<int64_t, 2> tokenShape;
};

} // namespace

/// Prints the layout as a bare keyword: `layout = sbv_bs`.
static void printLayout(OpAsmPrinter &printer, Operation *, LayoutAttr layout) {
  printer << stringifyLayout(layout.getValue());
}

static ParseResult parseLayout(OpAsmParser &parser, LayoutAttr &layout) {
  StringRef keyword;
  SMLoc loc = parser.getCurrentLocation();
  if (parser.parseKeyword(&keyword))
    return failure();
  std::optional<Layout> value = symbolizeLayout(keyword);
  if (!value)
    return parser.emitError(loc, "unknown layout '")
           << keyword << "'; expected flat, sbv_bs or sbv_sb";
  layout = LayoutAttr::get(parser.getContext(), *value);
  return success();
}

LogicalResult ForwardOp::verify() {
  if (getShardAttr())
    return emitOpError("a vocab-parallel forward yields partial statistics: "
                       "use ce.shard_stats, combine them across ranks, then "
                       "ce.backward with the same shard");
  CrossEntropyVerifier verifier(*this, getLayout());
  if (failed(verifier.verifyLogits(getLogits())) ||
      failed(verifier.verifyTokenOperand({"labels", getLabels()})) ||
      failed(verifier.verifyTokenOperand({"loss", getLoss()})) ||
      failed(verifier.verifyTokenOperand({"lse", getLse()})) ||
      failed(verifier.verifyOptionalTokenOperand({"lse_low", getLseLow()})) ||
      failed(verifier.verifyOptionalTokenOperand({"entropy", getEntropy()})) ||
      failed(verifier.verifyOptionalTokenOperand({"argmax", getArgmax()})) ||
      failed(verifier.verifyStatus(getStatus())) ||
      failed(verifier.verifyConfig(*this)))
    return failure();
  return verifier.verifyNoAliasing(
      {{"logits", getLogits()}, {"labels", getLabels()}},
      {{"loss", getLoss()},
       {"lse", getLse()},
       {"lse_low", getLseLow()},
       {"entropy", getEntropy()},
       {"argmax", getArgmax()},
       {"status", getStatus()}});
}

LogicalResult BackwardOp::verify() {
  CrossEntropyVerifier verifier(*this, getLayout());
  if (failed(verifier.verifyLogits(getLogits())) ||
      failed(verifier.verifyTokenOperand({"labels", getLabels()})) ||
      failed(verifier.verifyTokenOperand({"lse", getLse()})) ||
      failed(verifier.verifyTokenOperand({"grad_loss", getGradLoss()})) ||
      failed(verifier.verifyOptionalTokenOperand({"lse_low", getLseLow()})) ||
      failed(verifier.verifyGradient(getLogits(), getGrad())) ||
      failed(verifier.verifyStatus(getStatus())) ||
      failed(verifier.verifyConfig(*this)) ||
      failed(verifier.verifyOverwrite(getLogits(), getGrad(),
                                      getOverwriteInput())))
    return failure();
  return verifier.verifyNoAliasing({{"logits", getLogits()},
                                    {"labels", getLabels()},
                                    {"lse", getLse()},
                                    {"lse_low", getLseLow()},
                                    {"grad_loss", getGradLoss()}},
                                   {{"grad", getGrad()},
                                    {"status", getStatus()}});
}

LogicalResult FusedOp::verify() {
  if (getShardAttr())
    return emitOpError("cannot fuse a vocab-parallel shard: its gradient "
                       "needs the statistics of every rank; use "
                       "ce.shard_stats and ce.backward");
  CrossEntropyVerifier verifier(*this, getLayout());
  if (failed(verifier.verifyLogits(getLogits())) ||
      failed(verifier.verifyTokenOperand({"labels", getLabels()})) ||
      failed(verifier.verifyTokenOperand({"loss", getLoss()})) ||
      failed(verifier.verifyTokenOperand({"lse", getLse()})) ||
      failed(verifier.verifyOptionalTokenOperand({"lse_low", getLseLow()})) ||
      failed(verifier.verifyOptionalTokenOperand({"entropy", getEntropy()})) ||
      failed(verifier.verifyOptionalTokenOperand({"argmax", getArgmax()})))
    return failure();
  if (getWeights().getType().getRank() != 0 &&
      failed(verifier.verifyTokenOperand({"weights", getWeights()})))
    return failure();
  if (failed(verifier.verifyGradient(getLogits(), getGrad())) ||
      failed(verifier.verifyStatus(getStatus())) ||
      failed(verifier.verifyConfig(*this)) ||
      failed(verifier.verifyOverwrite(getLogits(), getGrad(),
                                      getOverwriteInput())))
    return failure();
  return verifier.verifyNoAliasing({{"logits", getLogits()},
                                    {"labels", getLabels()},
                                    {"weights", getWeights()}},
                                   {{"loss", getLoss()},
                                    {"lse", getLse()},
                                    {"lse_low", getLseLow()},
                                    {"entropy", getEntropy()},
                                    {"argmax", getArgmax()},
                                    {"grad", getGrad()},
                                    {"status", getStatus()}});
}

LogicalResult ShardStatsOp::verify() {
  if (!getShardAttr())
    return emitOpError("requires a 'shard' attribute (the logits' slice of "
                       "the vocabulary)");
  if (!getZLoss().isZero() || getZLossValue())
    return emitOpError("z_loss applies to the combined log-sum-exp, not to "
                       "partial statistics; it must be 0 here");
  CrossEntropyVerifier verifier(*this, getLayout());
  if (failed(verifier.verifyLogits(getLogits())) ||
      failed(verifier.verifyTokenOperand({"labels", getLabels()})) ||
      failed(verifier.verifyStats(getStats())) ||
      failed(verifier.verifyOptionalTokenOperand({"entropy", getEntropy()})) ||
      failed(verifier.verifyOptionalTokenOperand({"argmax", getArgmax()})) ||
      failed(verifier.verifyStatus(getStatus())) ||
      failed(verifier.verifyConfig(*this)))
    return failure();
  return verifier.verifyNoAliasing(
      {{"logits", getLogits()}, {"labels", getLabels()}},
      {{"stats", getStats()},
       {"entropy", getEntropy()},
       {"argmax", getArgmax()},
       {"status", getStatus()}});
}

LogicalResult RescaleOp::verify() {
  CrossEntropyVerifier verifier(*this, getLayout());
  if (failed(verifier.verifyLogits(getGrad())) ||
      failed(verifier.verifyTokenOperand({"weights", getWeights()})) ||
      failed(verifier.verifyTokenOperand({"grad_loss", getGradLoss()})))
    return failure();
  // The weights and the upstream gradient are only read: they may be one
  // buffer (every row is then left alone).
  return success();
}

#define GET_OP_CLASSES
#include "ce/Dialect/CE/IR/CEOps.cpp.inc"
