//===- CEAttrs.cpp - Cross-entropy dialect attributes ---------------------===//

#include "ce/Dialect/CE/IR/CEAttrs.h"
#include "ce/Dialect/CE/IR/CEDialect.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace mlir::ce;

#include "ce/Dialect/CE/IR/CEEnums.cpp.inc"

#define GET_ATTRDEF_CLASSES
#include "ce/Dialect/CE/IR/CEAttrs.cpp.inc"

LogicalResult ShardAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                int64_t start, int64_t vocab,
                                bool /*globalSmoothing*/) {
  // Neither bound: they are the op's run-time shard_bounds operands.
  if (vocab == 0 && start == 0)
    return success();
  if (vocab <= 0)
    return emitError() << "shard vocabulary size must be positive, got "
                       << vocab;
  if (start < 0 || start >= vocab)
    return emitError() << "shard start " << start
                       << " is outside the vocabulary [0, " << vocab << ")";
  return success();
}

LogicalResult TuningAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                 unsigned blockSize, unsigned unroll,
                                 unsigned /*rowCacheBytes*/,
                                 unsigned streamStages,
                                 bool /*flushDenormals*/,
                                 unsigned maxRegisters) {
  if (blockSize < 1 || blockSize > 1024)
    return emitError() << "tuning block_size " << blockSize
                       << " is outside [1, 1024]";
  if (unroll < 1 || unroll > 16)
    return emitError() << "tuning unroll " << unroll
                       << " is outside [1, 16] (16-byte vectors per thread "
                          "and step)";
  if (streamStages == 1 || streamStages > 8)
    return emitError() << "tuning stream_stages " << streamStages
                       << " must be 0 (off) or in [2, 8]";
  if (maxRegisters != 0 && (maxRegisters < 16 || maxRegisters > 255))
    return emitError() << "tuning max_registers " << maxRegisters
                       << " must be 0 (the compiler's choice) or in [16, 255]";
  return success();
}

void CEDialect::registerAttributes() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "ce/Dialect/CE/IR/CEAttrs.cpp.inc"
      >();
}
