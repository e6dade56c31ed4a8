//===- CEDialect.cpp - Cross-entropy dialect ------------------------------===//

#include "ce/Dialect/CE/IR/CEDialect.h"
#include "ce/Dialect/CE/IR/CEAttrs.h"
#include "ce/Dialect/CE/IR/CEOps.h"

#include "mlir/Interfaces/FunctionInterfaces.h"

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

LogicalResult CEDialect::verifyOperationAttribute(Operation *op,
                                                  NamedAttribute attribute) {
  // The dialect's one discardable attribute: a misspelt name is an error
  // here rather than a tuning silently left at its default.
  if (attribute.getName() != TuningAttr::getAttrName())
    return op->emitError("'")
           << attribute.getName().getValue()
           << "' is not an attribute of the ce dialect (kernel tuning is '"
           << TuningAttr::getAttrName() << " = #ce.tuning<...>')";
  if (!isa<TuningAttr>(attribute.getValue()))
    return op->emitError("'")
           << attribute.getName().getValue() << "' must be a #ce.tuning<...>, got "
           << attribute.getValue();
  if (!isa<FunctionOpInterface>(op))
    return op->emitError("'")
           << attribute.getName().getValue() << "' belongs on a kernel function";
  return success();
}
