//===- FuseForwardBackward.cpp - Fuse ce.forward with ce.backward ---------===//
//
// A forward followed by the backward that consumes its lse becomes one
// ce.fused when the upstream gradient already exists at the forward, so the
// kernel can write the gradient while the row is still hot.
//
//===----------------------------------------------------------------------===//

#include "ce/Dialect/CE/IR/CEOps.h"
#include "ce/Transforms/Passes.h"

#include "mlir/IR/Dominance.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

namespace mlir::ce {
#define GEN_PASS_DEF_CEFUSEFORWARDBACKWARD
#include "ce/Transforms/Passes.h.inc"
} // namespace mlir::ce

using namespace mlir;
using namespace mlir::ce;

namespace {

/// Does `op` have an effect of kind `EffectT` on `buffer` (or an unknown one)?
template <typename EffectT>
bool mayHaveEffectOn(Operation *op, Value buffer) {
  auto iface = dyn_cast<MemoryEffectOpInterface>(op);
  if (!iface)
    return !isPure(op);
  SmallVector<MemoryEffects::EffectInstance> effects;
  iface.getEffects(effects);
  for (const MemoryEffects::EffectInstance &effect : effects) {
    if (!isa<EffectT>(effect.getEffect()))
      continue;
    // An effect on no particular value may touch anything.
    if (!effect.getValue() || effect.getValue() == buffer)
      return true;
    // Distinct SSA values can still be views of one allocation; only values
    // whose defining ops are distinct allocations are known apart.
    Operation *a = effect.getValue().getDefiningOp();
    Operation *b = buffer.getDefiningOp();
    bool distinctAllocs = a && b && a != b &&
                          hasSingleEffect<MemoryEffects::Allocate>(a) &&
                          hasSingleEffect<MemoryEffects::Allocate>(b);
    if (!distinctAllocs)
      return true;
  }
  return false;
}

bool sameConfig(ForwardOp fwd, BackwardOp bwd) {
  return fwd.getLayout() == bwd.getLayout() &&
         fwd.getIgnoreIndexAttr() == bwd.getIgnoreIndexAttr() &&
         fwd.getLabelSmoothing() == bwd.getLabelSmoothing() &&
         fwd.getZLoss() == bwd.getZLoss() && fwd.getShard() == bwd.getShard() &&
         fwd.getIgnoreIndexValue() == bwd.getIgnoreIndexValue() &&
         fwd.getLabelSmoothingValue() == bwd.getLabelSmoothingValue() &&
         fwd.getZLossValue() == bwd.getZLossValue() &&
         fwd.getShardStart() == bwd.getShardStart() &&
         fwd.getShardVocab() == bwd.getShardVocab();
}

/// Returns a reason why `fwd` and `bwd` cannot be fused, or an empty string.
std::string whyNotFusable(ForwardOp fwd, BackwardOp bwd) {
  if (bwd.getLogits() != fwd.getLogits())
    return "the backward reads other logits than the forward";
  if (bwd.getLabels() != fwd.getLabels())
    return "the backward reads other labels than the forward";
  if (!sameConfig(fwd, bwd))
    return "forward and backward differ in layout, ignore_index, smoothing, "
           "z-loss or shard";
  if (fwd.getFlags() != bwd.getFlags())
    return "forward and backward take different run-time flags";
  if (fwd.getLogitScale() != bwd.getLogitScale())
    return "forward and backward take different logit scales";
  if (fwd.getLogitSoftcap() != bwd.getLogitSoftcap())
    return "forward and backward take different logit softcaps";
  if (fwd->getBlock() != bwd->getBlock())
    return "forward and backward are in different blocks";
  Value gradLoss = bwd.getGradLoss();
  // The fused op would read its weights from a buffer it writes.
  if (gradLoss == fwd.getLoss() || gradLoss == fwd.getLse() ||
      gradLoss == fwd.getLseLow() || gradLoss == fwd.getEntropy())
    return std::string("the upstream gradient is the forward's own ") +
           (gradLoss == fwd.getLoss()      ? "loss"
            : gradLoss == fwd.getLse()     ? "lse"
            : gradLoss == fwd.getLseLow()  ? "lse_low"
                                           : "entropy") +
           " buffer, which the fused op writes";
  // The fused op writes the forward's lse_low; the backward only read one.
  if (bwd.getLseLow() && bwd.getLseLow() != fwd.getLseLow())
    return "the backward reads an lse_low the forward does not write";
  if (Operation *def = gradLoss.getDefiningOp()) {
    if (def->getBlock() == fwd->getBlock() && !def->isBeforeInBlock(fwd))
      return "the upstream gradient is defined after the forward";
  }
  // Everything the fused op reads early or writes late must be left alone by
  // the ops in between.
  for (Operation *op = fwd->getNextNode(); op != bwd; op = op->getNextNode()) {
    Value buffers[] = {fwd.getLogits(), fwd.getLabels(), gradLoss,
                       bwd.getGrad(), fwd.getLse(), fwd.getLseLow()};
    for (Value buffer : buffers)
      if (buffer && mayHaveEffectOn<MemoryEffects::Write>(op, buffer))
        return "an operation between forward and backward may write a "
               "buffer the fused op reads or writes ('" +
               op->getName().getStringRef().str() + "')";
    if (mayHaveEffectOn<MemoryEffects::Read>(op, bwd.getGrad()))
      return "an operation between forward and backward reads the gradient "
             "buffer before the backward writes it ('" +
             op->getName().getStringRef().str() + "')";
  }
  return "";
}

struct CEFuseForwardBackwardPass
    : mlir::ce::impl::CEFuseForwardBackwardBase<CEFuseForwardBackwardPass> {
  void runOnOperation() override {
    SmallVector<BackwardOp> backwards;
    getOperation()->walk([&](BackwardOp op) { backwards.push_back(op); });
    for (BackwardOp bwd : backwards) {
      // The ops have no results: the forward is the closest one before the
      // backward in its block that writes the backward's lse buffer.
      ForwardOp fwd;
      for (Operation *op = bwd->getPrevNode(); op && !fwd;
           op = op->getPrevNode()) {
        auto candidate = dyn_cast<ForwardOp>(op);
        if (candidate && candidate.getLse() == bwd.getLse())
          fwd = candidate;
      }
      if (!fwd) {
        bwd->emitRemark("not fused: no ce.forward in this block writes the "
                        "backward's lse");
        continue;
      }
      std::string reason = whyNotFusable(fwd, bwd);
      if (!reason.empty()) {
        bwd->emitRemark("not fused: ") << reason;
        continue;
      }
      OpBuilder builder(fwd);
      Value status = fwd.getStatus() ? fwd.getStatus() : bwd.getStatus();
      FusedOp::create(builder, fwd.getLoc(), fwd.getLogits(), fwd.getLabels(),
                      bwd.getGradLoss(), fwd.getLoss(), fwd.getLse(),
                      bwd.getGrad(), fwd.getLseLow(), fwd.getEntropy(),
                      fwd.getArgmax(), status, fwd.getFlags(),
                      fwd.getIgnoreIndexValue(), fwd.getLabelSmoothingValue(),
                      fwd.getZLossValue(), fwd.getShardStart(),
                      fwd.getShardVocab(), fwd.getLogitScale(),
                      fwd.getLogitSoftcap(), fwd.getLayoutAttr(),
                      fwd.getIgnoreIndexAttr(), fwd.getLabelSmoothingAttr(),
                      fwd.getZLossAttr(), fwd.getShardAttr(),
                      bwd.getOverwriteInputAttr());
      bwd.erase();
      fwd.erase();
    }
  }
};

} // namespace
