//===- BundleTest.cpp - Opening bundles through the C API -----------------===//
//
// Missing and broken bundles: each must fail with CE_ERROR_BUNDLE and a
// message that names the file and the problem, and never crash.
//
//===----------------------------------------------------------------------===//

#include "TestBundle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>

using namespace ce;
using namespace ce::test;
using ::testing::HasSubstr;

namespace {

/// Opens `dir`, expects CE_ERROR_BUNDLE, and returns the message.
std::string openFails(const std::string &dir) {
  ce_bundle *bundle = reinterpret_cast<ce_bundle *>(0x1);
  ce_status status = ce_bundle_open(dir.c_str(), &bundle);
  EXPECT_EQ(status, CE_ERROR_BUNDLE) << ce_last_error_message();
  EXPECT_EQ(bundle, nullptr);
  if (status == CE_OK)
    ce_bundle_close(bundle);
  return ce_last_error_message();
}

/// A bundle directory with the fake object and `manifest` as its manifest,
/// sealed again if it has a seal: a test that changes the text means the
/// check that change meets, not the seal's (ManifestTest.cpp and
/// BundleFaultTest.cpp test the seal).
std::string writeBundle(const TempDir &dir, const std::string &manifest) {
  dir.copyFakeKernels();
  dir.write("manifest.json", resealIfSealed(manifest));
  return dir.path();
}

/// The "version" member as manifestJson writes it.
const std::string kVersion =
    "\"version\": " + std::to_string(CE_RUNTIME_BUNDLE_VERSION);

std::string oneKernelManifest() {
  return manifestJson({{forwardKey(), "fake_forward_flat", {}}});
}

std::string replaceOnce(std::string text, const std::string &from,
                        const std::string &to) {
  size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos)
    text.replace(at, from.size(), to);
  return text;
}

TEST(BundleOpen, OpensAValidBundle) {
  TempDir dir;
  ce_bundle *bundle = nullptr;
  ASSERT_EQ(
      ce_bundle_open(writeBundle(dir, oneKernelManifest()).c_str(), &bundle),
      CE_OK)
      << ce_last_error_message();
  EXPECT_STREQ(ce_last_error_message(), "");
  EXPECT_EQ(ce_bundle_num_kernels(bundle), 1);
  EXPECT_EQ(ce_bundle_kernel_key(bundle, 0), forwardKey().str());
  EXPECT_EQ(ce_bundle_kernel_key(bundle, 1), nullptr);
  EXPECT_EQ(ce_bundle_kernel_key(bundle, -1), nullptr);
  ce_bundle_close(bundle);
}

TEST(BundleOpen, NullArguments) {
  ce_bundle *bundle = nullptr;
  EXPECT_EQ(ce_bundle_open(nullptr, &bundle), CE_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(ce_last_error_message(), HasSubstr("directory is NULL"));
  EXPECT_EQ(ce_bundle_open("/tmp", nullptr), CE_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ce_bundle_num_kernels(nullptr), 0);
  EXPECT_EQ(ce_bundle_kernel_key(nullptr, 0), nullptr);
  ce_bundle_close(nullptr); // A no-op.
}

TEST(BundleOpen, MissingDirectory) {
  std::string message = openFails("/nonexistent/ce-bundle");
  EXPECT_THAT(message, HasSubstr("'/nonexistent/ce-bundle' does not exist"));
  EXPECT_THAT(message, HasSubstr("ce_bundle_open: "));
}

TEST(BundleOpen, NotADirectory) {
  TempDir dir;
  dir.write("file", "x");
  EXPECT_THAT(openFails(dir.path() + "/file"), HasSubstr("not a directory"));
}

TEST(BundleOpen, MissingManifest) {
  TempDir dir;
  dir.copyFakeKernels();
  std::string message = openFails(dir.path());
  EXPECT_THAT(message, HasSubstr("no manifest.json"));
  EXPECT_THAT(message, HasSubstr(dir.path()));
}

TEST(BundleOpen, ManifestThatIsNotAFile) {
  TempDir dir;
  std::filesystem::create_directory(dir.path() + "/manifest.json");
  EXPECT_THAT(openFails(dir.path()), HasSubstr("manifest.json' is not a file"));
}

TEST(BundleOpen, EmptyBundle) {
  TempDir dir;
  dir.write("manifest.json",
            sealManifest(R"({"format": "cegen-bundle", )" + kVersion + R"(,
                                 "objects": [], "kernels": [],
                                 "manifest_sha256": ")" +
                         std::string(64, '0') + "\"}"));
  ce_bundle *bundle = nullptr;
  ASSERT_EQ(ce_bundle_open(dir.path().c_str(), &bundle), CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(ce_bundle_num_kernels(bundle), 0);
  ce_bundle_close(bundle);
}

TEST(BundleOpen, TruncatedJsonGivesFileAndOffset) {
  TempDir dir;
  std::string manifest = oneKernelManifest();
  for (size_t length :
       {size_t(0), size_t(1), manifest.size() / 2, manifest.size() - 3}) {
    SCOPED_TRACE(length);
    std::string message =
        openFails(writeBundle(dir, manifest.substr(0, length)));
    EXPECT_THAT(message, HasSubstr(dir.path() + "/manifest.json"));
    EXPECT_THAT(message, HasSubstr("invalid JSON at byte "));
    EXPECT_THAT(message, HasSubstr("unexpected end of input"));
  }
  // The offset is exact: the end of the truncated text.
  std::string message = openFails(writeBundle(dir, manifest.substr(0, 40)));
  EXPECT_THAT(message, HasSubstr("at byte 40 "));
}

TEST(BundleOpen, CorruptJsonGivesOffset) {
  TempDir dir;
  std::string manifest = oneKernelManifest();
  size_t at = manifest.find("\"version\"");
  manifest.insert(at, "@");
  std::string message = openFails(writeBundle(dir, manifest));
  EXPECT_THAT(message, HasSubstr("byte " + std::to_string(at)));
  EXPECT_THAT(message, HasSubstr("line 3"));
  EXPECT_THAT(message, HasSubstr("unexpected '@'"));

  for (const char *bad : {"{\"a\": [1, 2,]}", "{\"a\": 01}", "[1] 2",
                          "{\"a\": \"\\q\"}", "{\"a\": 1, \"a\": 2}", "nul"}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(openFails(writeBundle(dir, bad)), HasSubstr("invalid JSON"));
  }
  std::string deep(1000, '[');
  EXPECT_THAT(openFails(writeBundle(dir, deep)), HasSubstr("nested"));
}

TEST(BundleOpen, NotAnObject) {
  TempDir dir;
  EXPECT_THAT(openFails(writeBundle(dir, "[1, 2]")),
              HasSubstr("must be a JSON object"));
}

TEST(BundleOpen, WrongFormat) {
  TempDir dir;
  std::string message = openFails(
      writeBundle(dir, replaceOnce(oneKernelManifest(), "\"cegen-bundle\"",
                                   "\"other-bundle\"")));
  EXPECT_THAT(message, HasSubstr("\"other-bundle\""));
  EXPECT_THAT(message, HasSubstr("expected \"cegen-bundle\""));
}

TEST(BundleOpen, NewerVersionNamesBothVersions) {
  TempDir dir;
  std::string manifest =
      replaceOnce(oneKernelManifest(), kVersion, "\"version\": 6");
  // A newer version may change anything, so nothing else is read.
  manifest = replaceOnce(manifest, "\"kernels\"", "\"kernels-v6\"");
  std::string message = openFails(writeBundle(dir, manifest));
  EXPECT_THAT(message, HasSubstr("bundle format version 6 is newer than "
                                 "version 5"));
}

TEST(BundleOpen, OlderVersionsAreRefusedNamingBothVersions) {
  // Versions 1 and 2 compiled the option values into the kernels, which
  // took no value arguments; version 3's took no lse_low, version 4's no
  // entropy and argmax: a version 5 runtime cannot call them.
  for (int version : {1, 2, 3, 4}) {
    SCOPED_TRACE(version);
    TempDir dir;
    std::string message = openFails(writeBundle(
        dir, manifestJson({{forwardKey(), "fake_forward_flat", {}}}, version)));
    EXPECT_THAT(message, HasSubstr(dir.path() + "/manifest.json"));
    EXPECT_THAT(message,
                HasSubstr("bundle format version " + std::to_string(version) +
                          " is older than version 5"));
    EXPECT_THAT(message, HasSubstr("regenerate the bundle"));
  }
}

TEST(BundleOpen, BadVersion) {
  TempDir dir;
  for (const char *version : {"0", "-1", "1.5", "\"1\"", "null"}) {
    SCOPED_TRACE(version);
    std::string message = openFails(
        writeBundle(dir, replaceOnce(oneKernelManifest(), kVersion,
                                     std::string("\"version\": ") + version)));
    EXPECT_THAT(message, HasSubstr("\"version\""));
  }
}

TEST(BundleOpen, MissingRequiredKeys) {
  TempDir dir;
  const std::string manifest = oneKernelManifest();
  for (const char *key : {"format", "version", "objects", "kernels"}) {
    SCOPED_TRACE(key);
    std::string renamed = replaceOnce(manifest, std::string("\"") + key + "\"",
                                      std::string("\"x") + key + "\"");
    EXPECT_THAT(openFails(writeBundle(dir, renamed)),
                HasSubstr(std::string("missing required key \"") + key));
  }
  for (const char *key :
       {"file", "kind", "symbol", "abi", "args", "role", "rank", "dtype"}) {
    SCOPED_TRACE(key);
    std::string renamed = replaceOnce(manifest, std::string("\"") + key + "\"",
                                      std::string("\"x") + key + "\"");
    std::string message = openFails(writeBundle(dir, renamed));
    EXPECT_THAT(message, HasSubstr("missing required key"));
    EXPECT_THAT(message, HasSubstr(std::string(".") + key + "\""));
  }
}

TEST(BundleOpen, UnknownKeysAreIgnored) {
  TempDir dir;
  std::string manifest =
      replaceOnce(oneKernelManifest(), "\"format\"",
                  "\"future\": {\"x\": [1, 2.5e3, true, null]}, \"format\"");
  manifest = replaceOnce(manifest, "\"symbol\"", "\"extra\": 7, \"symbol\"");
  ce_bundle *bundle = nullptr;
  EXPECT_EQ(ce_bundle_open(writeBundle(dir, manifest).c_str(), &bundle), CE_OK)
      << ce_last_error_message();
  ce_bundle_close(bundle);
}

TEST(BundleOpen, WrongTypes) {
  TempDir dir;
  EXPECT_THAT(openFails(writeBundle(
                  dir, replaceOnce(oneKernelManifest(), "\"objects\": [",
                                   "\"objects\": {\"a\": 1}, \"o\": ["))),
              HasSubstr("\"objects\" must be an array, not an object"));
  EXPECT_THAT(
      openFails(writeBundle(
          dir, replaceOnce(oneKernelManifest(), "\"rank\": 2", "\"rank\": 9"))),
      HasSubstr("must be an integer in [0, 3]"));
}

TEST(BundleOpen, MissingObjectFile) {
  TempDir dir;
  dir.write("manifest.json", oneKernelManifest());
  std::string message = openFails(dir.path());
  EXPECT_THAT(message, HasSubstr(dir.path() + "/host-x86_64.so"));
  EXPECT_THAT(message, HasSubstr("does not exist"));
}

TEST(BundleOpen, ObjectOutsideTheBundle) {
  TempDir dir;
  for (const char *file :
       {"../host-x86_64.so", "/lib/libc.so.6", "a/../../b", ""}) {
    SCOPED_TRACE(file);
    std::string manifest = oneKernelManifest();
    manifest = replaceOnce(manifest, "\"file\": \"host-x86_64.so\"",
                           std::string("\"file\": \"") + file + "\"");
    EXPECT_THAT(openFails(writeBundle(dir, manifest)),
                HasSubstr("must be a relative path inside the bundle"));
  }
}

TEST(BundleOpen, ObjectThatIsNotASharedObject) {
  TempDir dir;
  dir.write("host-x86_64.so", "not an ELF file, but longer than an ELF header "
                              "so that the magic number is what is wrong");
  dir.write("manifest.json", oneKernelManifest());
  std::string message = openFails(dir.path());
  EXPECT_THAT(message, HasSubstr(dir.path() + "/host-x86_64.so"));
  EXPECT_THAT(message, HasSubstr("is damaged (not a valid x86-64 shared "
                                 "object): not an ELF file"));
  // A GPU code object where the host one should be.
  dir.write("host-x86_64.so", fakeHsaco(""));
  EXPECT_THAT(openFails(dir.path()),
              HasSubstr("ELF machine 224, expected 62 (x86-64)"));
}

TEST(BundleOpen, MissingSymbol) {
  TempDir dir;
  std::string message = openFails(writeBundle(
      dir,
      manifestJson({{forwardKey(), "fake_forward_flat", {}},
                    {forwardKey(LabelLayout::SbvBs), "no_such_kernel", {}}})));
  EXPECT_THAT(message, HasSubstr("symbol 'no_such_kernel'"));
  EXPECT_THAT(message, HasSubstr(forwardKey(LabelLayout::SbvBs).str()));
  EXPECT_THAT(message, HasSubstr("host-x86_64.so"));
}

TEST(BundleOpen, KernelObjectNotListed) {
  TempDir dir;
  std::string manifest =
      replaceOnce(oneKernelManifest(), "\"object\": \"host-x86_64.so\"",
                  "\"object\": \"other.so\"");
  EXPECT_THAT(openFails(writeBundle(dir, manifest)),
              HasSubstr("\"other.so\" is not listed"));
}

TEST(BundleOpen, InvalidVariantKey) {
  TempDir dir;
  std::string key = forwardKey().str();
  for (const std::string &bad :
       {std::string("op=forward"), replaceOnce(key, "op=forward", "op=fwd"),
        replaceOnce(key, "label_smoothing=off", "label_smoothing=0"),
        replaceOnce(key, "z_loss=off", "z_loss=OFF"),
        replaceOnce(key, "overwrite=0", "overwrite=1"),
        replaceOnce(key, "weights=none", "weights=token"),
        replaceOnce(key, "weights=none", "weights=none,shard=local"),
        key + ",x=1",
        // A version 2 key: the option values were part of it.
        replaceOnce(key, "label_smoothing=off,z_loss=off",
                    "ignore_index=none,label_smoothing=0,z_loss=0")}) {
    SCOPED_TRACE(bad);
    std::string message =
        openFails(writeBundle(dir, replaceOnce(oneKernelManifest(), key, bad)));
    EXPECT_THAT(message, HasSubstr("kernels[0]"));
  }
}

TEST(BundleOpen, DuplicateKernel) {
  TempDir dir;
  EXPECT_THAT(
      openFails(writeBundle(
          dir, manifestJson({{forwardKey(), "fake_forward_flat", {}},
                             {forwardKey(), "fake_forward_flat", {}}}))),
      HasSubstr("listed twice"));
}

TEST(BundleOpen, ArgsMustFitTheVariant) {
  using Args = std::vector<std::tuple<std::string, int, std::string>>;
  const Args canonical = canonicalArgs(forwardKey());
  // canonical: logits, labels, loss, lse, lse_low, entropy, argmax,
  // status, then the eight values.
  auto with = [&](const std::function<void(Args &)> &change) {
    Args args = canonical;
    change(args);
    return args;
  };
  struct Case {
    Args args;
    std::string message;
  } cases[] = {
      {with([](Args &a) { a.erase(a.begin() + 3); }),
       "args[3]: argument role \"lse_low\" where this variant takes \"lse\""},
      {with([](Args &a) {
         a[0] = {"logits", 3, "f32"};
       }),
       "\"logits\" is f32 of rank 3, expected f32 of rank 2"},
      {with([](Args &a) {
         a[0] = {"logits", 2, "bf16"};
       }),
       "expected f32 of rank 2"},
      {with([](Args &a) {
         a.insert(a.begin() + 7, {"grad", 2, "f32"});
       }),
       "args[7]: argument role \"grad\" where this variant takes "
       "\"status\""},
      // A version 3 kernel's list: no lse_low, entropy or argmax.
      {with([](Args &a) { a.erase(a.begin() + 4, a.begin() + 7); }),
       "args[4]: argument role \"status\" where this variant takes "
       "\"lse_low\""},
      // A version 4 kernel's list: no entropy or argmax.
      {with([](Args &a) { a.erase(a.begin() + 5, a.begin() + 7); }),
       "args[5]: argument role \"status\" where this variant takes "
       "\"entropy\""},
      // The two outputs in the other order.
      {with([](Args &a) { std::swap(a[5], a[6]); }),
       "args[5]: argument role \"argmax\" where this variant takes "
       "\"entropy\""},
      // The outputs' element types are the ABI's: f32 entropy, i64 argmax.
      {with([](Args &a) {
         a[6] = {"argmax", 1, "f32"};
       }),
       "\"argmax\" is f32 of rank 1, expected i64 of rank 1"},
      {with([](Args &a) {
         a[5] = {"entropy", 1, "i64"};
       }),
       "\"entropy\" is i64 of rank 1, expected f32 of rank 1"},
      {with([](Args &a) {
         a[5] = {"entropy", 2, "f32"};
       }),
       "\"entropy\" is f32 of rank 2, expected f32 of rank 1"},
      {with([](Args &a) {
         a.insert(a.begin() + 3, {"loss", 1, "f32"});
       }),
       "args[3]: argument role \"loss\" where this variant takes \"lse\""},
      // The tensors in another order (the manifest cannot reorder a
      // kernel's parameters).
      {with([](Args &a) { std::swap(a[2], a[3]); }),
       "args[2]: argument role \"lse\" where this variant takes \"loss\""},
      // The tensors and the flags only.
      {with([](Args &a) { a.resize(9); }),
       "missing argument role \"ignore_index\""},
      // The tensors only.
      {with([](Args &a) { a.resize(8); }), "missing argument role \"flags\""},
      {with([](Args &a) {
         a.push_back({"flags", 0, "i64"});
       }),
       "unexpected argument role \"flags\" after the last one, "
       "\"logit_softcap\""},
      // A list without the logit scale (bundle format 4 before issue 17).
      {with([](Args &a) {
         a.pop_back();
         a.pop_back();
       }),
       "missing argument role \"logit_scale\""},
      // A list without the logit softcap (before the softcap kernels).
      {with([](Args &a) { a.pop_back(); }),
       "missing argument role \"logit_softcap\""},
  };
  TempDir dir;
  for (const Case &c : cases) {
    SCOPED_TRACE(c.message);
    EXPECT_THAT(
        openFails(writeBundle(
            dir, manifestJson({{forwardKey(), "fake_forward_flat", c.args}}))),
        HasSubstr(c.message));
  }
}

TEST(BundleOpen, ValuesAreTrailingScalarsInAFixedOrder) {
  using Args = std::vector<std::tuple<std::string, int, std::string>>;
  const Args canonical = canonicalArgs(forwardKey());
  ASSERT_EQ(canonical.size(), 16u);
  auto with = [&](size_t index, std::tuple<std::string, int, std::string> arg) {
    Args args = canonical;
    args[index] = std::move(arg);
    return args;
  };
  Args valuesFirst = canonical;
  std::rotate(valuesFirst.begin(), valuesFirst.begin() + 8, valuesFirst.end());
  Args swapped = canonical;
  std::swap(swapped[10], swapped[11]);
  struct Case {
    Args args;
    const char *message; ///< nullptr: the bundle opens
  } cases[] = {
      {canonical, nullptr},
      {with(8, {"flags", 1, "i64"}),
       "argument \"flags\" is i64 of rank 1, expected i64 of rank 0 (by "
       "value)"},
      {with(9, {"ignore_index", 0, "i32"}),
       "argument \"ignore_index\" is i32 of rank 0, expected i64 of rank 0 "
       "(by value)"},
      {with(10, {"label_smoothing", 0, "i64"}),
       "argument \"label_smoothing\" is i64 of rank 0, expected f32 of rank "
       "0 (by value)"},
      {with(11, {"z_loss", 0, "bf16"}),
       "argument \"z_loss\" is bf16 of rank 0, expected f32 of rank 0"},
      {with(13, {"shard_vocab", 0, "f32"}),
       "argument \"shard_vocab\" is f32 of rank 0, expected i64 of rank 0"},
      {with(14, {"logit_scale", 0, "i64"}),
       "argument \"logit_scale\" is i64 of rank 0, expected f32 of rank 0"},
      {with(15, {"logit_softcap", 0, "i64"}),
       "argument \"logit_softcap\" is i64 of rank 0, expected f32 of rank 0"},
      {valuesFirst, "args[0]: argument role \"flags\" where this variant takes "
                    "\"logits\""},
      {swapped, "args[10]: argument role \"z_loss\" where this variant takes "
                "\"label_smoothing\""},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.message ? c.message : "opens");
    TempDir dir;
    dir.copyFakeKernels();
    dir.write("manifest.json",
              manifestJson({{forwardKey(), "fake_forward_flat", c.args}}));
    ce_bundle *bundle = nullptr;
    ce_status status = ce_bundle_open(dir.path().c_str(), &bundle);
    if (!c.message) {
      EXPECT_EQ(status, CE_OK) << ce_last_error_message();
    } else {
      EXPECT_EQ(status, CE_ERROR_BUNDLE);
      EXPECT_THAT(ce_last_error_message(), HasSubstr(c.message));
    }
    ce_bundle_close(bundle);
  }
}

TEST(BundleOpen, GpuKernelsNeedALaunchShape) {
  TempDir dir;
  dir.copyFakeKernels();
  std::string object = fakeHsaco("");
  dir.write("gfx942.hsaco", object);
  std::string manifest = R"({"format": "cegen-bundle", )" + kVersion + R"(,
    "objects": [{"file": "gfx942.hsaco", "target": "gfx942", "kind": "hsaco",
                 "sha256": "HASH"}],
    "kernels": [{"key": "KEY", "target": "gfx942", "object": "gfx942.hsaco",
                 "symbol": "k", "abi": "memref-descriptor-fields", "args": ARGS}],
    "manifest_sha256": "SEAL"})";
  manifest = replaceOnce(manifest, "HASH", sha256Of(object));
  manifest = replaceOnce(manifest, "SEAL", std::string(64, '0'));
  manifest = replaceOnce(manifest, "KEY", forwardKey().str());
  manifest =
      replaceOnce(manifest, "ARGS", argsJson(canonicalArgs(forwardKey())));
  EXPECT_THAT(openFails(writeBundle(dir, manifest)),
              HasSubstr("missing required key \"kernels[0].launch\""));
  // With a launch shape, a GPU-only bundle opens (nothing is loaded).
  manifest = replaceOnce(manifest, "\"args\"",
                         "\"launch\": {\"block_size\": 256, "
                         "\"rows_per_block\": 1, \"lds_bytes\": 64}, \"args\"");
  ce_bundle *bundle = nullptr;
  ASSERT_EQ(ce_bundle_open(writeBundle(dir, manifest).c_str(), &bundle), CE_OK)
      << ce_last_error_message();
  EXPECT_EQ(ce_bundle_num_kernels(bundle), 1);
  EXPECT_STREQ(ce_bundle_kernel_target(bundle, 0), "gfx942");
  EXPECT_EQ(ce_bundle_kernel_target(bundle, 1), nullptr);
  EXPECT_EQ(ce_bundle_kernel_target(nullptr, 0), nullptr);
  ce_bundle_close(bundle);
}

/// A one-kernel GPU manifest for `target` with the given object kind, abi
/// and launch shape; the object's hash is that of `objectBytes`.
std::string gpuManifest(const std::string &target, const std::string &file,
                        const std::string &kind, const std::string &abi,
                        const std::string &launch,
                        const std::string &objectBytes) {
  return sealManifest(
      R"({"format": "cegen-bundle", )" + kVersion +
      R"(, "objects": [{"file": ")" + file + R"(", "target": ")" + target +
      R"(", "kind": ")" + kind + R"(", "sha256": ")" + sha256Of(objectBytes) +
      R"("}], "kernels": [{"key": ")" + forwardKey().str() +
      R"(", "target": ")" + target + R"(", "object": ")" + file +
      R"(", "symbol": "ce_forward_0", "abi": ")" + abi + R"(", "launch": )" +
      launch + R"(, "args": )" + argsJson(canonicalArgs(forwardKey())) +
      R"(}], "manifest_sha256": ")" + std::string(64, '0') + "\"}");
}

TEST(BundleOpen, GpuKernelsFollowTheGpuAbi) {
  TempDir dir;
  const std::map<std::string, std::string> objects = {
      {"sm_90.ptx", fakePtx("")},
      {"sm_90.cubin",
       fakeElf(/*EM_CUDA=*/190, /*ET_EXEC=*/2, /*OS ABI=*/0x33, "")},
      {"gfx90a.hsaco", fakeHsaco("")}};
  for (const auto &[file, bytes] : objects)
    dir.write(file, bytes);
  auto gpuManifest = [&](const std::string &target, const std::string &file,
                         const std::string &kind, const std::string &abi,
                         const std::string &launch) {
    return ::gpuManifest(target, file, kind, abi, launch, objects.at(file));
  };
  const std::string fields = "memref-descriptor-fields";
  const std::string shape =
      R"({"block_size": 1024, "rows_per_block": 1, "lds_bytes": 0})";
  for (auto [target, file, kind] :
       {std::tuple{"sm_90", "sm_90.ptx", "ptx"},
        std::tuple{"sm_90", "sm_90.cubin", "cubin"},
        std::tuple{"sm_90a", "sm_90.ptx", "ptx"},
        std::tuple{"gfx90a", "gfx90a.hsaco", "hsaco"}}) {
    SCOPED_TRACE(std::string(target) + " " + kind);
    ce_bundle *bundle = nullptr;
    ASSERT_EQ(ce_bundle_open(writeBundle(dir, gpuManifest(target, file, kind,
                                                          fields, shape))
                                 .c_str(),
                             &bundle),
              CE_OK)
        << ce_last_error_message();
    EXPECT_STREQ(ce_bundle_kernel_target(bundle, 0), target);
    ce_bundle_close(bundle);
  }
  struct Case {
    std::string manifest, message;
  };
  std::vector<Case> cases = {
      {gpuManifest("sm_90", "sm_90.ptx", "ptx", "memref-descriptor-pointers",
                   shape),
       "unknown abi \"memref-descriptor-pointers\" for sm_90 (expected "
       "\"memref-descriptor-fields\")"},
      {gpuManifest("sm_90", "sm_90.ptx", "hsaco", fields, shape),
       "sm_90 object \"sm_90.ptx\" has kind \"hsaco\", expected \"ptx\" or "
       "\"cubin\""},
      {gpuManifest("gfx90a", "gfx90a.hsaco", "ptx", fields, shape),
       "expected \"hsaco\""},
      {gpuManifest("sm_90", "sm_90.ptx", "ptx", fields,
                   R"({"block_size": 0, "rows_per_block": 1, "lds_bytes": 0})"),
       "block_size\" must be in [1, 1024] for a GPU kernel"},
      {gpuManifest(
           "sm_90", "sm_90.ptx", "ptx", fields,
           R"({"block_size": 2048, "rows_per_block": 1, "lds_bytes": 0})"),
       "block_size\" must be in [1, 1024] for a GPU kernel"},
      {gpuManifest(
           "gfx90a", "gfx90a.hsaco", "hsaco", fields,
           R"({"block_size": 256, "rows_per_block": 0, "lds_bytes": 0})"),
       "rows_per_block\" must be at least 1 for a GPU kernel"},
      {gpuManifest("sm_90", "sm_90.ptx", "ptx", fields,
                   R"({"block_size": 256, "rows_per_block": 1})"),
       "missing required key \"kernels[0].launch.lds_bytes\""},
      {gpuManifest("sm_90", "sm_90.ptx", "ptx", fields,
                   R"({"block_size": 256, "rows_per_block": 1, "lds_bytes": 0,
                       "min_vocab": -1})"),
       "kernels[0].launch.min_vocab"},
      {gpuManifest("sm_90", "sm_90.ptx", "ptx", fields,
                   R"({"block_size": 256, "rows_per_block": 1, "lds_bytes": 0,
                       "min_vocab": "65537"})"),
       "kernels[0].launch.min_vocab"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.message);
    EXPECT_THAT(openFails(writeBundle(dir, c.manifest)), HasSubstr(c.message));
  }
}

TEST(VariantKey, ParsesOnlyCanonicalKeys) {
  KernelVariantKey key;
  key.op = KernelOp::Fused;
  key.logits = ElemType::F16;
  key.labels = ElemType::I32;
  key.layout = LabelLayout::SbvSb;
  key.smoothing = true;
  key.zLoss = true;
  key.overwrite = true;
  key.weights = WeightsKind::Token;
  EXPECT_EQ(key.str(), "op=fused,logits=f16,labels=i32,layout=sbv_sb,"
                       "label_smoothing=on,z_loss=on,overwrite=1,"
                       "weights=token");
  std::optional<KernelVariantKey> parsed = parseKernelVariantKey(key.str());
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->str(), key.str());
  EXPECT_TRUE(parsed->smoothing);
  EXPECT_TRUE(parsed->zLoss);

  // Backward and shard_stats keys carry no shard field: every such kernel
  // takes its vocabulary slice and how it smooths at run time.
  KernelVariantKey backward;
  backward.op = KernelOp::Backward;
  backward.smoothing = true;
  EXPECT_EQ(backward.str(), "op=backward,logits=bf16,labels=i64,layout=flat,"
                            "label_smoothing=on,z_loss=off,overwrite=0,"
                            "weights=none");
  KernelVariantKey stats;
  stats.op = KernelOp::ShardStats;
  EXPECT_EQ(stats.str(), "op=shard_stats,logits=bf16,labels=i64,layout=flat,"
                         "label_smoothing=off,z_loss=off,overwrite=0,"
                         "weights=none");
  for (const KernelVariantKey &k : {backward, stats}) {
    parsed = parseKernelVariantKey(k.str());
    ASSERT_TRUE(parsed);
    EXPECT_EQ(parsed->op, k.op);
    EXPECT_EQ(parsed->str(), k.str());
  }

  for (const std::string &bad :
       {std::string(""), key.str() + ",", "," + key.str(),
        replaceOnce(key.str(), "label_smoothing=on", "label_smoothing=0.1"),
        replaceOnce(key.str(), "z_loss=on", "z_loss=1e-4"),
        replaceOnce(key.str(), "z_loss=on", "z_loss=On"),
        replaceOnce(key.str(), "overwrite=1", "overwrite=true"),
        replaceOnce(key.str(), "op=fused,", ""),
        replaceOnce(key.str(), ",weights=token", ""), key.str() + ",shard=none",
        key.str() + ",shard=",
        // The shard field and scalar weights are gone (run-time slice,
        // stride-0 weights).
        backward.str() + ",shard=local", backward.str() + ",shard=global",
        stats.str() + ",shard=local", backward.str() + ",shard=5/10/local",
        replaceOnce(key.str(), "weights=token", "weights=scalar"),
        backward.str() + ",x=1",
        // Version 2 keys held the values.
        std::string("op=forward,logits=bf16,labels=i64,layout=sbv_bs,"
                    "ignore_index=-100,label_smoothing=0.1,z_loss=0,"
                    "overwrite=0,weights=none"),
        std::string("op=forward,logits=bf16,labels=i64,layout=sbv_bs,"
                    "ignore_index=none,label_smoothing=0,z_loss=0,"
                    "overwrite=0,weights=none")}) {
    SCOPED_TRACE(bad);
    EXPECT_FALSE(parseKernelVariantKey(bad));
  }
}

TEST(StatusString, NamesEveryCode) {
  EXPECT_STREQ(ce_status_string(CE_OK), "CE_OK");
  EXPECT_STREQ(ce_status_string(CE_ERROR_INVALID_ARGUMENT),
               "CE_ERROR_INVALID_ARGUMENT");
  EXPECT_STREQ(ce_status_string(CE_ERROR_BUNDLE), "CE_ERROR_BUNDLE");
  EXPECT_STREQ(ce_status_string(CE_ERROR_VARIANT_NOT_FOUND),
               "CE_ERROR_VARIANT_NOT_FOUND");
  EXPECT_STREQ(ce_status_string(CE_ERROR_LABEL_OUT_OF_RANGE),
               "CE_ERROR_LABEL_OUT_OF_RANGE");
  EXPECT_STREQ(ce_status_string(CE_ERROR_NO_DEVICE), "CE_ERROR_NO_DEVICE");
  EXPECT_STREQ(ce_status_string(CE_ERROR_BACKEND), "CE_ERROR_BACKEND");
  // 7 is the largest value a C++ ce_status can hold without undefined
  // behavior (its enumerators need 3 bits); the runtime also copes with any
  // int a C caller passes.
  ce_status unknown;
  setRawEnum(unknown, 7);
  EXPECT_STREQ(ce_status_string(unknown), "unknown ce_status");
}

TEST(Options, Defaults) {
  ce_options options;
  std::memset(&options, 0x5a, sizeof(options));
  ce_options_init(&options);
  EXPECT_EQ(options.has_ignore_index, 0);
  EXPECT_EQ(options.label_smoothing, 0.0f);
  EXPECT_EQ(options.z_loss, 0.0f);
  EXPECT_EQ(options.overwrite_input, 0);
  EXPECT_EQ(options.label_layout, CE_LABELS_BS);
  EXPECT_EQ(options.label_policy, CE_LABEL_POLICY_STRICT);
  ce_options_init(nullptr); // A no-op.
}

} // namespace
