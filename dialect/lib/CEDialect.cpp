//===- CEDialect.cpp - Cross-entropy dialect ------------------------------===//

#include "ce/Dialect/CE/IR/CEDialect.h"
#include "ce/Dialect/CE/IR/CEAttrs.h"
#include "ce/Dialect/CE/IR/CEOps.h"

using namespace mlir;
using namespace mlir::ce;

#include "ce/Dialect/CE/IR/CEDialect.cpp.inc"

void CEDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "ce/Dialect/CE/IR/CEOps.cpp.inc"
      >();
  registerAttributes();
}
