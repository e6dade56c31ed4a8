//===- CEOps.h - Cross-entropy dialect operations ---------------*- C++ -*-===//

#ifndef CE_DIALECT_CE_IR_CEOPS_H
#define CE_DIALECT_CE_IR_CEOPS_H

#include "ce/Dialect/CE/IR/CEAttrs.h"
#include "ce/Dialect/CE/IR/CEDialect.h"
#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#define GET_OP_CLASSES
#include "ce/Dialect/CE/IR/CEOps.h.inc"

#endif // CE_DIALECT_CE_IR_CEOPS_H
