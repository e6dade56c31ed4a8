//===- TestBundle.h - Hand-made bundles for runtime tests -------*- C++ -*-===//
//
// Builds bundle directories in a temporary location: a manifest written from
// a list of kernel specs and a copy of the fake kernel object
// (fake_kernels.c), and gives access to what the fake kernels record.
//
//===----------------------------------------------------------------------===//

#ifndef CE_TEST_RUNTIME_TESTBUNDLE_H
#define CE_TEST_RUNTIME_TESTBUNDLE_H

#include "ce/runtime/VariantKey.h"
#include "ce/runtime/ce_runtime.h"

#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ce::test {

/// Mirrors FakeRecord in fake_kernels.c.
struct FakeRecord {
  int64_t calls;
  int32_t numArgs;
  int32_t ranks[10];
  void *allocated[10];
  void *aligned[10];
  int64_t offsets[10];
  int64_t sizes[10][3];
  int64_t strides[10][3];
  int64_t statusOnEntry;
  /// The value arguments of the last call.
  int64_t flags;
  int64_t ignoreIndex;
  float labelSmoothing;
  float zLoss;
  int64_t shardStart;
  int64_t shardVocab;
  float logitScale;
  float logitSoftcap;
};

/// One kernel entry of a manifest.
struct KernelSpec {
  KernelVariantKey key;
  std::string symbol;
  /// (role, rank, dtype) in call order; empty means the canonical order for
  /// `key`, as ce-gen writes it.
  std::vector<std::tuple<std::string, int, std::string>> args;
};

/// The canonical args of `key` per docs/bundle-format.md (version 4): its
/// tensors, then the eight values by value (flags, ignore_index,
/// label_smoothing, z_loss, shard_start, shard_vocab, logit_scale,
/// logit_softcap; rank 0).
std::vector<std::tuple<std::string, int, std::string>>
canonicalArgs(const KernelVariantKey &key);
/// Whether `role` names one of the value arguments (passed by value).
bool isValueArg(const std::string &role);
/// `args` as the JSON array a manifest holds.
std::string
argsJson(const std::vector<std::tuple<std::string, int, std::string>> &args);

/// The JSON text of a manifest holding `kernels` in host-x86_64.so, the
/// current format version by default. From version 2 on, the object carries
/// `objectSha256` (by default the fake kernels' SHA-256) and the manifest is
/// sealed (sealManifest). Older versions are written only for the tests
/// that the runtime refuses them (their keys and args are version 3's).
std::string manifestJson(const std::vector<KernelSpec> &kernels,
                         int version = CE_RUNTIME_BUNDLE_VERSION,
                         const std::string &objectSha256 = "");

/// The SHA-256 of `bytes` as the manifest spells it (the runtime's
/// implementation, compiled into the tests; Sha256Test.cpp checks it).
std::string sha256Of(const std::string &bytes);
/// The contents of the file at `path`.
std::string readFile(const std::string &path);
/// The fake kernel object's bytes.
std::string fakeKernelBytes();
/// `text` with its `manifest_sha256` value recomputed as ce-gen computes it
/// (the SHA-256 of the text with that value's digits as zeros).
std::string sealManifest(std::string text);
/// sealManifest where `text` holds a whole `manifest_sha256` value (64
/// characters); `text` unchanged otherwise. For tests that change a sealed
/// manifest to reach a check that comes after the seal's.
std::string resealIfSealed(std::string text);

/// A PTX text that passes the runtime's checks, with `payload` (lines
/// "symbol parameter-count" for fake_gpu_driver.c) before its one function.
std::string fakePtx(const std::string &payload);
/// A minimal ELF64 ET_DYN/ET_EXEC object of `machine` that passes the
/// runtime's checks: one PT_LOAD over the file, a PT_DYNAMIC with empty
/// symbol and string tables, and `payload` right after the program headers,
/// where fake_gpu_driver.c reads it.
std::string fakeElf(uint16_t machine, uint16_t type, uint8_t osAbi,
                    const std::string &payload);
/// fakeElf for AMDGPU (an HSA code object).
std::string fakeHsaco(const std::string &payload);

/// Runs `body` in a forked child and returns the text it returned; `signal`
/// is the signal that killed the child (0 when it exited, -1 when no child
/// could be started). The child leaves by _exit: no atexit handlers, no leak
/// check; the parent judges.
std::string runInChild(const std::function<std::string()> &body, int &signal);

/// The objects the dynamic loader has loaded now (their load addresses).
std::set<uintptr_t> loadedObjects();
/// A handle (dlopen RTLD_NOLOAD, to dlclose) of the one object loaded since
/// `before` that defines `symbol`: the host object the runtime loaded from a
/// private copy of a bundle's file, which a dlopen of the bundle's path
/// would not give. Null if there is none, or more than one.
void *newlyLoadedObject(const std::set<uintptr_t> &before,
                        const char *symbol);

/// Calls fake_forward_flat (the bundle's forward kernel of forwardKey())
/// through `bundle` on a small problem and checks what it recorded in
/// `object` (newlyLoadedObject's handle of the bundle's host object) and
/// what it computed.
bool fakeForwardWorks(ce_bundle *bundle, void *object);

/// A temporary directory removed on destruction.
class TempDir {
public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir &) = delete;
  TempDir &operator=(const TempDir &) = delete;
  const std::string &path() const { return dirPath; }
  /// Writes `contents` to `path()/name`.
  void write(const std::string &name, const std::string &contents) const;
  /// Copies the fake kernel object to `path()/name`.
  void copyFakeKernels(const std::string &name = "host-x86_64.so") const;

private:
  std::string dirPath;
};

/// A bundle directory with the fake kernels and a manifest for `kernels`,
/// opened through the C API.
class FakeBundle {
public:
  explicit FakeBundle(const std::vector<KernelSpec> &kernels,
                      int version = CE_RUNTIME_BUNDLE_VERSION);
  ~FakeBundle();
  FakeBundle(const FakeBundle &) = delete;
  FakeBundle &operator=(const FakeBundle &) = delete;

  ce_bundle *get() const { return bundle; }
  const std::string &path() const { return dir.path(); }
  /// What the fake kernels of this bundle's object recorded.
  FakeRecord &record() const { return *fakeRecord; }
  int64_t calls() const { return fakeRecord->calls; }

private:
  TempDir dir;
  ce_bundle *bundle = nullptr;
  void *handle = nullptr;
  FakeRecord *fakeRecord = nullptr;
};

/// The variant every test starts from: forward, f32 logits, i64 labels.
KernelVariantKey forwardKey(LabelLayout layout = LabelLayout::Flat);

/// A host tensor view of `data`.
ce_tensor view(void *data, ce_dtype dtype, std::vector<int64_t> sizes,
               std::vector<int64_t> strides);
/// A packed (row-major) host tensor view of `data`.
ce_tensor packed(void *data, ce_dtype dtype, std::vector<int64_t> sizes);

/// Stores `value` in a C enum field as a C caller may, even outside the
/// enumerators (a C++ cast to the enum type would be undefined behavior).
template <typename Enum> void setRawEnum(Enum &field, int32_t value) {
  static_assert(sizeof(Enum) == sizeof(value), "C enums are ints here");
  std::memcpy(&field, &value, sizeof(value));
}

/// Options from ce_options_init.
ce_options defaultOptions();

} // namespace ce::test

#endif // CE_TEST_RUNTIME_TESTBUNDLE_H
