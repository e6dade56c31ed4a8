//===- CEDialect.h - Cross-entropy dialect ----------------------*- C++ -*-===//

#ifndef CE_DIALECT_CE_IR_CEDIALECT_H
#define CE_DIALECT_CE_IR_CEDIALECT_H

#include "mlir/IR/Dialect.h"

#include "ce/Dialect/CE/IR/CEDialect.h.inc"

#endif // CE_DIALECT_CE_IR_CEDIALECT_H
