//===- Registration.h - What ce-opt and ce-gen register ---------*- C++ -*-===//

#ifndef CE_CODEGEN_REGISTRATION_H
#define CE_CODEGEN_REGISTRATION_H

namespace mlir {
class DialectRegistry;
} // namespace mlir

namespace mlir::ce {

/// Registers the CE dialect and the upstream dialects our pipelines produce
/// or parse, plus the interfaces their conversions to LLVM need.
void registerCEDialects(DialectRegistry &registry);

/// Registers the CE passes, the upstream passes our pipelines use (so
/// `ce-opt` can replay any stage) and the named pipelines.
void registerCEPassesAndPipelines();

} // namespace mlir::ce

#endif // CE_CODEGEN_REGISTRATION_H
