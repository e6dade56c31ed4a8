//===- CEAttrs.h - Cross-entropy dialect attributes -------------*- C++ -*-===//

#ifndef CE_DIALECT_CE_IR_CEATTRS_H
#define CE_DIALECT_CE_IR_CEATTRS_H

#include "mlir/IR/Attributes.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/DialectImplementation.h"

#include "ce/Dialect/CE/IR/CEEnums.h.inc"

#define GET_ATTRDEF_CLASSES
#include "ce/Dialect/CE/IR/CEAttrs.h.inc"

#endif // CE_DIALECT_CE_IR_CEATTRS_H
