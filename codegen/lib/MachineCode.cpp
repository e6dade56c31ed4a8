//===- MachineCode.cpp - LLVM modules to assembly, objects, links ---------===//

#include "ce/Codegen/MachineCode.h"

#include "llvm/IR/LegacyPassManager.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/Transforms/Utils/Cloning.h"

using namespace mlir;
using namespace mlir::ce;

LogicalResult mlir::ce::emitMachineCode(llvm::Module &module,
                                        llvm::TargetMachine &machine,
                                        bool asObject, std::string &out,
                                        std::string &error) {
  llvm::SmallString<0> buffer;
  llvm::raw_svector_ostream stream(buffer);
  // Codegen rewrites the IR it runs on (AMDGPU's structurizer inserts
  // llvm.amdgcn.if, for one), so each emission gets its own copy.
  std::unique_ptr<llvm::Module> copy = llvm::CloneModule(module);
  llvm::legacy::PassManager passes;
  if (machine.addPassesToEmitFile(passes, stream, nullptr,
                                  asObject ? llvm::CodeGenFileType::ObjectFile
                                           : llvm::CodeGenFileType::AssemblyFile)) {
    error = "the target machine cannot emit this file type";
    return failure();
  }
  passes.run(*copy);
  out.assign(buffer.begin(), buffer.end());
  return success();
}

LogicalResult mlir::ce::linkSharedObject(StringRef ldLld, StringRef objectPath,
                                         StringRef outputPath,
                                         std::string &error,
                                         bool hostLibraries) {
  SmallVector<StringRef> args = {ldLld, "-shared", "-o", outputPath,
                                 objectPath};
  // libm for the transcendental calls LLVM may leave; the dependency is
  // recorded so dlopen resolves it in any process.
  if (hostLibraries)
    args.append({"--as-needed", "-L/lib/x86_64-linux-gnu",
                 "-L/usr/lib/x86_64-linux-gnu", "-lm"});
  int status = llvm::sys::ExecuteAndWait(ldLld, args, std::nullopt, {}, 0, 0,
                                         &error);
  if (status != 0) {
    if (error.empty())
      error = "ld.lld exited with status " + std::to_string(status);
    return failure();
  }
  return success();
}

LogicalResult mlir::ce::writeFileIn(StringRef dir, StringRef name,
                                    StringRef bytes, std::string &error) {
  llvm::SmallString<256> path(dir);
  llvm::sys::path::append(path, name);
  std::error_code ec;
  llvm::raw_fd_ostream os(path, ec);
  if (ec) {
    error = "cannot write '" + path.str().str() + "': " + ec.message();
    return failure();
  }
  os << bytes;
  return success();
}

LogicalResult mlir::ce::linkObjectBytes(StringRef bytes, StringRef objectDir,
                                        StringRef stem, StringRef file,
                                        bool hostLibraries,
                                        std::string &error) {
  std::string objectName = (stem + ".o").str();
  if (failed(writeFileIn(objectDir, objectName, bytes, error)))
    return failure();
  llvm::SmallString<256> objectPath(objectDir), outputPath(objectDir);
  llvm::sys::path::append(objectPath, objectName);
  llvm::sys::path::append(outputPath, file);
  LogicalResult linked = linkSharedObject(CE_LD_LLD, objectPath, outputPath,
                                          error, hostLibraries);
  llvm::sys::fs::remove(objectPath);
  return linked;
}
