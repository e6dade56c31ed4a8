//===- TestBundle.cpp - Hand-made bundles for runtime tests ---------------===//

#include "TestBundle.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <dlfcn.h>
#include <filesystem>
#include <fstream>
#include <tuple>

namespace ce::test {

std::vector<std::tuple<std::string, int, std::string>>
canonicalArgs(const KernelVariantKey &key) {
  int tokenRank = key.layout == LabelLayout::Flat ? 1 : 2;
  std::string logits = stringify(key.logits);
  std::vector<std::tuple<std::string, int, std::string>> args = {
      {"logits", tokenRank + 1, logits},
      {"labels", tokenRank, stringify(key.labels)}};
  switch (key.op) {
  case KernelOp::Forward:
    args.push_back({"loss", tokenRank, "f32"});
    args.push_back({"lse", tokenRank, "f32"});
    break;
  case KernelOp::ShardStats:
    args.push_back({"stats", tokenRank + 1, "f32"});
    break;
  case KernelOp::Backward:
    args.push_back({"lse", tokenRank, "f32"});
    args.push_back({"grad_loss", tokenRank, "f32"});
    if (!key.overwrite)
      args.push_back({"grad", tokenRank + 1, logits});
    break;
  case KernelOp::Fused:
    args.push_back(
        {"weights", key.weights == WeightsKind::Scalar ? 0 : tokenRank, "f32"});
    args.push_back({"loss", tokenRank, "f32"});
    args.push_back({"lse", tokenRank, "f32"});
    if (!key.overwrite)
      args.push_back({"grad", tokenRank + 1, logits});
    break;
  }
  args.push_back({"status", 1, "i64"});
  return args;
}

std::string manifestJson(const std::vector<KernelSpec> &kernels, int version) {
  std::string json = R"({
  "format": "cegen-bundle",
  "version": )" + std::to_string(version) +
                     R"(,
  "generator": "runtime_bundle_test",
  "objects": [
    {"file": "host-x86_64.so", "target": "host", "kind": "shared-object"}
  ],
  "kernels": [)";
  for (size_t i = 0; i < kernels.size(); ++i) {
    const KernelSpec &spec = kernels[i];
    auto args = spec.args.empty() ? canonicalArgs(spec.key) : spec.args;
    json += i ? ",\n    {" : "\n    {";
    json += "\"key\": \"" + spec.key.str() + "\", \"target\": \"host\", ";
    json += "\"object\": \"host-x86_64.so\", \"symbol\": \"" + spec.symbol +
            "\", \"abi\": \"memref-descriptor-pointers\",\n      \"args\": [";
    for (size_t a = 0; a < args.size(); ++a) {
      json += a ? ", " : "";
      json += "{\"role\": \"" + std::get<0>(args[a]) +
              "\", \"rank\": " + std::to_string(std::get<1>(args[a])) +
              ", \"dtype\": \"" + std::get<2>(args[a]) + "\"}";
    }
    json += "],\n      \"launch\": {\"block_size\": 0, \"rows_per_block\": 0, "
            "\"lds_bytes\": 0}}";
  }
  json += "\n  ]\n}\n";
  return json;
}

TempDir::TempDir() {
  std::string pattern =
      (std::filesystem::temp_directory_path() / "ce-runtime-test-XXXXXX")
          .string();
  char *made = ::mkdtemp(pattern.data());
  if (!made)
    ADD_FAILURE() << "mkdtemp failed";
  dirPath = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(dirPath, ignored);
}

void TempDir::write(const std::string &name,
                    const std::string &contents) const {
  std::ofstream out(dirPath + "/" + name, std::ios::binary);
  out << contents;
}

void TempDir::copyFakeKernels(const std::string &name) const {
  std::filesystem::copy_file(CE_FAKE_KERNELS_PATH, dirPath + "/" + name,
                             std::filesystem::copy_options::overwrite_existing);
}

FakeBundle::FakeBundle(const std::vector<KernelSpec> &kernels, int version) {
  dir.copyFakeKernels();
  dir.write("manifest.json", manifestJson(kernels, version));
  ce_status status = ce_bundle_open(dir.path().c_str(), &bundle);
  EXPECT_EQ(status, CE_OK) << ce_last_error_message();
  // The same path gives the runtime's handle back, so the record is the one
  // the runtime's kernels write.
  handle =
      ::dlopen((dir.path() + "/host-x86_64.so").c_str(), RTLD_NOW | RTLD_LOCAL);
  EXPECT_NE(handle, nullptr) << ::dlerror();
  if (handle)
    fakeRecord = static_cast<FakeRecord *>(::dlsym(handle, "ce_fake_record"));
  EXPECT_NE(fakeRecord, nullptr);
  static FakeRecord empty;
  if (!fakeRecord)
    fakeRecord = &empty;
}

FakeBundle::~FakeBundle() {
  ce_bundle_close(bundle);
  if (handle)
    ::dlclose(handle);
}

KernelVariantKey forwardKey(LabelLayout layout) {
  KernelVariantKey key;
  key.op = KernelOp::Forward;
  key.logits = ElemType::F32;
  key.labels = ElemType::I64;
  key.layout = layout;
  return key;
}

ce_tensor view(void *data, ce_dtype dtype, std::vector<int64_t> sizes,
               std::vector<int64_t> strides) {
  ce_tensor tensor{};
  tensor.data = data;
  tensor.dtype = dtype;
  tensor.ndim = static_cast<int32_t>(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensor.sizes[i] = sizes[i];
    tensor.strides[i] = strides[i];
  }
  tensor.device = CE_DEVICE_HOST;
  tensor.device_index = 0;
  return tensor;
}

ce_tensor packed(void *data, ce_dtype dtype, std::vector<int64_t> sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= sizes[i];
  }
  return view(data, dtype, sizes, strides);
}

ce_options defaultOptions() {
  ce_options options;
  ce_options_init(&options);
  return options;
}

} // namespace ce::test
