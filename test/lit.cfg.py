# -*- Python -*-
"""lit configuration for cegen's FileCheck tests."""

import os
import shutil

import lit.formats
from lit.llvm import llvm_config

config.name = "CEGEN"
config.test_format = lit.formats.ShTest(not llvm_config.use_lit_shell)
config.suffixes = [".mlir", ".test"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.ce_obj_root, "test")
config.excludes = ["CMakeLists.txt", "lit.cfg.py", "lit.site.cfg.py",
                   "runtime", "python"]

config.environment["FILECHECK_OPTS"] = "--enable-var-scope"
config.substitutions.append(("%PATH%", config.environment["PATH"]))

llvm_config.with_system_environment(["HOME", "INCLUDE", "LIB", "TMP", "TEMP"])
llvm_config.use_default_substitutions()

tool_dirs = [config.ce_tools_dir, config.llvm_tools_dir]
llvm_config.add_tool_substitutions(
    ["ce-opt", "ce-gen", "ce-demo", "llvm-readelf", "llvm-objdump", "llvm-nm",
     "not"],
    tool_dirs)

# Hardware features: GPU tests need a device and never run in CI.
if shutil.which("nvidia-smi"):
    config.available_features.add("cuda")

# Inputs/ folders hold files that RUN lines read; they are not tests.
config.excludes.append("Inputs")
# `foo.test.mlir` companions of .test files are inputs too.
config.excludes.append("input-file.test.mlir")
