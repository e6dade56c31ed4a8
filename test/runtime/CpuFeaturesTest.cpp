//===- CpuFeaturesTest.cpp - Host objects and the CPU they need -----------===//
//
// A host object's manifest entry lists the CPU features its code needs
// (`cpu_features`, issue 23 item 9): the runtime refuses the bundle before
// dlopen when this CPU lacks one, and refuses a name it cannot check.
//
//===----------------------------------------------------------------------===//

#include "CpuFeatures.h"
#include "TestBundle.h"

#include "ce/runtime/BundleAbi.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iterator>

using namespace ce;
using namespace ce::test;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

namespace {

/// A bundle of the fake kernels whose object lists `features`.
std::string bundleWithFeatures(const TempDir &dir,
                               const std::string &features) {
  KernelVariantKey key;
  std::string manifest = manifestJson({{key, "fake_forward_flat", {}}});
  const std::string kind = "\"kind\": \"shared-object\"";
  size_t at = manifest.find(kind);
  EXPECT_NE(at, std::string::npos);
  manifest.insert(at + kind.size(), ", \"cpu_features\": " + features);
  dir.write("manifest.json", sealManifest(manifest));
  dir.copyFakeKernels();
  return dir.path();
}

ce_status openBundle(const std::string &path, std::string &message) {
  ce_bundle *bundle = nullptr;
  ce_status status = ce_bundle_open(path.c_str(), &bundle);
  message = status == CE_OK ? "" : ce_last_error_message();
  if (bundle)
    ce_bundle_close(bundle);
  return status;
}

} // namespace

TEST(CpuFeatures, MissingOnesInOrder) {
  auto has = [](std::string_view name) { return name == "avx2"; };
  EXPECT_THAT(missingCpuFeatures({"avx512f", "avx2", "fma"}, has),
              ElementsAre("avx512f", "fma"));
  EXPECT_TRUE(missingCpuFeatures({}, has).empty());
}

TEST(CpuFeatures, EveryNameOfTheContractIsKnown) {
  for (const char *name : kHostCpuFeatures)
    EXPECT_TRUE(isKnownCpuFeature(name)) << name;
  EXPECT_FALSE(isKnownCpuFeature("avx10.2"));
  EXPECT_FALSE(cpuHasFeature("not-a-feature"));
}

TEST(CpuFeatures, ThisCpuRunsTheBaseline) {
  // CI and every machine these tests run on are x86-64-v2 or newer.
  EXPECT_TRUE(cpuHasFeature("sse4.2"));
  EXPECT_TRUE(cpuHasFeature("popcnt"));
}

TEST(CpuFeatures, BundleWithFeaturesTheCpuHasOpens) {
  TempDir dir;
  std::string message;
  EXPECT_EQ(openBundle(bundleWithFeatures(dir, "[\"sse4.1\", \"sse4.2\"]"),
                       message),
            CE_OK)
      << message;
}

TEST(CpuFeatures, UnknownFeatureIsRefused) {
  TempDir dir;
  std::string message;
  EXPECT_EQ(openBundle(bundleWithFeatures(dir, "[\"sse4.2\", \"avx10.2\"]"),
                       message),
            CE_ERROR_BUNDLE);
  EXPECT_THAT(message, HasSubstr("cpu_features names \"avx10.2\", a CPU "
                                 "feature this runtime cannot check"));
}

TEST(CpuFeatures, MalformedListIsRefused) {
  TempDir dir;
  std::string message;
  EXPECT_EQ(openBundle(bundleWithFeatures(dir, "\"avx2\""), message),
            CE_ERROR_BUNDLE);
  EXPECT_THAT(message, HasSubstr("cpu_features must be an array"));
}

TEST(CpuFeatures, FeatureTheCpuLacksIsRefusedBeforeLoading) {
  std::string lacking;
  for (const char *name : kHostCpuFeatures)
    if (!cpuHasFeature(name)) {
      lacking = name;
      break;
    }
  if (lacking.empty())
    GTEST_SKIP() << "this CPU has every feature of kHostCpuFeatures";
  TempDir dir;
  std::string message;
  EXPECT_EQ(openBundle(bundleWithFeatures(
                           dir, "[\"sse4.2\", \"" + lacking + "\"]"),
                       message),
            CE_ERROR_BUNDLE);
  EXPECT_THAT(message, HasSubstr("needs CPU features this CPU lacks: " +
                                 lacking));
  EXPECT_THAT(message, HasSubstr("host-x86_64.so"));
}
