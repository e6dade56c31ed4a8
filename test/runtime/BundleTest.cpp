//===- BundleTest.cpp - Opening bundles through the C API -----------------===//
//
// Missing and broken bundles: each must fail with CE_ERROR_BUNDLE and a
// message that names the file and the problem, and never crash.
//
//===----------------------------------------------------------------------===//

#include "TestBundle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
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

/// A bundle directory with the fake object and `manifest` as its manifest.
std::string writeBundle(const TempDir &dir, const std::string &manifest) {
  dir.copyFakeKernels();
  dir.write("manifest.json", manifest);
  return dir.path();
}

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
  dir.write("manifest.json", R"({"format": "cegen-bundle", "version": 1,
                                 "objects": [], "kernels": []})");
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
      replaceOnce(oneKernelManifest(), "\"version\": 1", "\"version\": 3");
  // A newer version may change anything, so nothing else is read.
  manifest = replaceOnce(manifest, "\"kernels\"", "\"kernels-v3\"");
  std::string message = openFails(writeBundle(dir, manifest));
  EXPECT_THAT(message, HasSubstr("version 3"));
  EXPECT_THAT(message, HasSubstr("version 2"));
}

TEST(BundleOpen, BadVersion) {
  TempDir dir;
  for (const char *version : {"0", "-1", "1.5", "\"1\"", "null"}) {
    SCOPED_TRACE(version);
    std::string message = openFails(
        writeBundle(dir, replaceOnce(oneKernelManifest(), "\"version\": 1",
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
        replaceOnce(key, "label_smoothing=0", "label_smoothing=0.0"),
        replaceOnce(key, "overwrite=0", "overwrite=1"),
        replaceOnce(key, "weights=none", "weights=token"), key + ",x=1"}) {
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
  TempDir dir;
  using Args = std::vector<std::tuple<std::string, int, std::string>>;
  struct Case {
    Args args;
    const char *message;
  } cases[] = {
      {{{"logits", 2, "f32"},
        {"labels", 1, "i64"},
        {"loss", 1, "f32"},
        {"status", 1, "i64"}},
       "missing argument role \"lse\""},
      {{{"logits", 3, "f32"},
        {"labels", 1, "i64"},
        {"loss", 1, "f32"},
        {"lse", 1, "f32"},
        {"status", 1, "i64"}},
       "\"logits\" is f32 of rank 3, expected f32 of rank 2"},
      {{{"logits", 2, "bf16"},
        {"labels", 1, "i64"},
        {"loss", 1, "f32"},
        {"lse", 1, "f32"},
        {"status", 1, "i64"}},
       "expected f32 of rank 2"},
      {{{"logits", 2, "f32"},
        {"labels", 1, "i64"},
        {"loss", 1, "f32"},
        {"lse", 1, "f32"},
        {"grad", 2, "f32"},
        {"status", 1, "i64"}},
       "unexpected argument role \"grad\""},
      {{{"logits", 2, "f32"},
        {"labels", 1, "i64"},
        {"loss", 1, "f32"},
        {"loss", 1, "f32"},
        {"lse", 1, "f32"},
        {"status", 1, "i64"}},
       "role \"loss\" twice"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.message);
    EXPECT_THAT(
        openFails(writeBundle(
            dir, manifestJson({{forwardKey(), "fake_forward_flat", c.args}}))),
        HasSubstr(c.message));
  }
}

TEST(BundleOpen, FlagsAreAVersionTwoTrailingScalar) {
  using Args = std::vector<std::tuple<std::string, int, std::string>>;
  Args canonical = canonicalArgs(forwardKey());
  Args withFlags = canonical;
  withFlags.push_back({"flags", 0, "i64"});
  Args flagsFirst = canonical;
  flagsFirst.insert(flagsFirst.begin(), {"flags", 0, "i64"});
  Args flagsAsMemref = canonical;
  flagsAsMemref.push_back({"flags", 1, "i64"});
  struct Case {
    Args args;
    int version;
    const char *message; ///< nullptr: the bundle opens
  } cases[] = {
      {withFlags, 2, nullptr},
      {canonical, 2, nullptr}, // flags are optional
      {withFlags, 1,
       "argument role \"flags\" needs bundle format version 2, the manifest "
       "is version 1"},
      {flagsFirst, 2, "argument role \"flags\" must be the last argument"},
      {flagsAsMemref, 2,
       "argument \"flags\" is i64 of rank 1, expected i64 of rank 0"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.message ? c.message : "opens");
    TempDir dir;
    dir.copyFakeKernels();
    dir.write("manifest.json",
              manifestJson({{forwardKey(), "fake_forward_flat_flags", c.args}},
                           c.version));
    ce_bundle *bundle = nullptr;
    ce_status status = ce_bundle_open(dir.path().c_str(), &bundle);
    if (!c.message) {
      EXPECT_EQ(status, CE_OK) << ce_last_error_message();
    } else {
      EXPECT_EQ(status, CE_ERROR_BUNDLE);
      EXPECT_NE(std::string(ce_last_error_message()).find(c.message),
                std::string::npos)
          << ce_last_error_message();
    }
    ce_bundle_close(bundle);
  }
}

TEST(BundleOpen, GpuKernelsNeedALaunchShape) {
  TempDir dir;
  dir.copyFakeKernels();
  dir.write("gfx942.hsaco", fakeHsaco(""));
  std::string manifest = R"({"format": "cegen-bundle", "version": 1,
    "objects": [{"file": "gfx942.hsaco", "target": "gfx942", "kind": "hsaco"}],
    "kernels": [{"key": "KEY", "target": "gfx942", "object": "gfx942.hsaco",
                 "symbol": "k", "abi": "memref-descriptor-fields", "args": ARGS}]})";
  std::string args = "[";
  for (auto &[role, rank, dtype] : canonicalArgs(forwardKey()))
    args += (args.size() > 1 ? ", " : "") +
            ("{\"role\": \"" + role + "\", \"rank\": " + std::to_string(rank) +
             ", \"dtype\": \"" + dtype + "\"}");
  args += "]";
  manifest = replaceOnce(manifest, "KEY", forwardKey().str());
  manifest = replaceOnce(manifest, "ARGS", args);
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
/// and launch shape.
std::string gpuManifest(const std::string &target, const std::string &file,
                        const std::string &kind, const std::string &abi,
                        const std::string &launch) {
  std::string args = "[";
  for (auto &[role, rank, dtype] : canonicalArgs(forwardKey()))
    args += (args.size() > 1 ? ", " : "") +
            ("{\"role\": \"" + role + "\", \"rank\": " + std::to_string(rank) +
             ", \"dtype\": \"" + dtype + "\"}");
  args += "]";
  return R"({"format": "cegen-bundle", "version": 1, "objects": [{"file": ")" +
         file + R"(", "target": ")" + target + R"(", "kind": ")" + kind +
         R"("}], "kernels": [{"key": ")" + forwardKey().str() +
         R"(", "target": ")" + target + R"(", "object": ")" + file +
         R"(", "symbol": "ce_forward_0", "abi": ")" + abi + R"(", "launch": )" +
         launch + R"(, "args": )" + args + "}]}";
}

TEST(BundleOpen, GpuKernelsFollowTheGpuAbi) {
  TempDir dir;
  dir.write("sm_90.ptx", fakePtx(""));
  dir.write("sm_90.cubin",
            fakeElf(/*EM_CUDA=*/190, /*ET_EXEC=*/2, /*OS ABI=*/0x33, ""));
  dir.write("gfx90a.hsaco", fakeHsaco(""));
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
  key.ignoreIndex = -100;
  key.labelSmoothing = 0.1f;
  key.zLoss = 1e-4f;
  key.overwrite = true;
  key.weights = WeightsKind::Token;
  std::optional<KernelVariantKey> parsed = parseKernelVariantKey(key.str());
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->str(), key.str());
  EXPECT_EQ(parsed->ignoreIndex, -100);
  EXPECT_EQ(parsed->labelSmoothing, 0.1f);
  EXPECT_FALSE(parseKernelVariantKey(""));
  EXPECT_FALSE(parseKernelVariantKey(key.str() + ","));
  EXPECT_FALSE(parseKernelVariantKey(
      replaceOnce(key.str(), "ignore_index=-100", "ignore_index=-1e2")));
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
