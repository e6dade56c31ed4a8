//===- Variants.h - Kernel variants from ce-gen's options -------*- C++ -*-===//
//
// The variant options of ce-gen (comma lists whose cartesian product is
// emitted, or canonical variant keys) turned into variant keys, with every
// value checked and its allowed range named in the message.
//
//===----------------------------------------------------------------------===//

#ifndef CE_CODEGEN_VARIANTS_H
#define CE_CODEGEN_VARIANTS_H

#include "ce/runtime/VariantKey.h"

#include "mlir/Support/LLVM.h"

#include <string>
#include <vector>

namespace mlir::ce {

/// Each field a list of values as given on the command line; an empty list
/// takes the default (forward, bf16, i64, sbv_bs, off, off, 0, token, off).
/// Option values (ignore_index, the coefficients, a shard's bounds and
/// smoothing) are kernel arguments, not variants.
struct VariantOptions {
  std::vector<std::string> ops, logits, labels, layouts, smoothings, zLosses,
      overwrites, weights, softcaps;
  /// Canonical variant keys (`--variant=KEY`, KernelVariantKey::str()),
  /// taken as they are; they cannot be combined with the lists above.
  std::vector<std::string> keys;
  /// Every variant of a target (`--all`): every value of every list.
  bool all = false;

  /// Whether any list or key was given.
  bool any() const;
};

/// The variants `options` select, in order, without duplicates.
/// Inapplicable combinations of lists (overwrite for a forward, a shard for
/// a fused kernel) are skipped; with `all`, softcap kernels are made only
/// without smoothing and z-loss (the prebuilt set stays small; the others
/// are one --variant away); a value no kernel can take (a z-loss for
/// shard_stats, whose z-loss applies after the shards are combined) is an
/// error, as is a selection of no kernel.
FailureOr<std::vector<::ce::KernelVariantKey>>
expandVariants(const VariantOptions &options, std::string &error);

} // namespace mlir::ce

#endif // CE_CODEGEN_VARIANTS_H
