//===- ce-opt.cpp - cegen's optimizer driver ------------------------------===//
//
// Parses, verifies and transforms CE IR; what the lit tests drive.
//
//===----------------------------------------------------------------------===//

#include "ce/Codegen/Registration.h"

#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  mlir::ce::registerCEDialects(registry);
  mlir::ce::registerCEPassesAndPipelines();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "cegen optimizer driver\n", registry));
}
