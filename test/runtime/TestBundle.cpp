//===- TestBundle.cpp - Hand-made bundles for runtime tests ---------------===//

#include "TestBundle.h"

#include "Sha256.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <link.h>
#include <sys/wait.h>
#include <tuple>
#include <unistd.h>

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
    args.push_back({"lse_low", tokenRank, "f32"});
    args.push_back({"entropy", tokenRank, "f32"});
    args.push_back({"argmax", tokenRank, "i64"});
    break;
  case KernelOp::ShardStats:
    args.push_back({"stats", tokenRank + 1, "f32"});
    args.push_back({"entropy", tokenRank, "f32"});
    args.push_back({"argmax", tokenRank, "i64"});
    break;
  case KernelOp::Backward:
    args.push_back({"lse", tokenRank, "f32"});
    args.push_back({"lse_low", tokenRank, "f32"});
    args.push_back({"grad_loss", tokenRank, "f32"});
    if (!key.overwrite)
      args.push_back({"grad", tokenRank + 1, logits});
    break;
  case KernelOp::Fused:
    args.push_back({"weights", tokenRank, "f32"});
    args.push_back({"loss", tokenRank, "f32"});
    args.push_back({"lse", tokenRank, "f32"});
    args.push_back({"lse_low", tokenRank, "f32"});
    args.push_back({"entropy", tokenRank, "f32"});
    args.push_back({"argmax", tokenRank, "i64"});
    if (!key.overwrite)
      args.push_back({"grad", tokenRank + 1, logits});
    break;
  case KernelOp::Rescale:
    args = {{"grad", tokenRank + 1, logits},
            {"weights", tokenRank, "f32"},
            {"grad_loss", tokenRank, "f32"}};
    break;
  }
  if (key.op != KernelOp::Rescale) // the one kernel without a status word
    args.push_back({"status", 1, "i64"});
  for (const char *role : {"flags", "ignore_index"})
    args.push_back({role, 0, "i64"});
  for (const char *role : {"label_smoothing", "z_loss"})
    args.push_back({role, 0, "f32"});
  for (const char *role : {"shard_start", "shard_vocab"})
    args.push_back({role, 0, "i64"});
  args.push_back({"logit_scale", 0, "f32"});
  args.push_back({"logit_softcap", 0, "f32"});
  return args;
}

bool isValueArg(const std::string &role) {
  for (const char *value :
       {"flags", "ignore_index", "label_smoothing", "z_loss", "shard_start",
        "shard_vocab", "logit_scale", "logit_softcap"})
    if (role == value)
      return true;
  return false;
}

std::string
argsJson(const std::vector<std::tuple<std::string, int, std::string>> &args) {
  std::string json = "[";
  for (size_t a = 0; a < args.size(); ++a) {
    json += a ? ", " : "";
    json += "{\"role\": \"" + std::get<0>(args[a]) +
            "\", \"rank\": " + std::to_string(std::get<1>(args[a])) +
            ", \"dtype\": \"" + std::get<2>(args[a]) + "\"}";
  }
  return json + "]";
}

std::string manifestJson(const std::vector<KernelSpec> &kernels, int version,
                         const std::string &objectSha256) {
  std::string hash;
  if (version >= 2)
    hash = ", \"sha256\": \"" +
           (objectSha256.empty() ? sha256Of(fakeKernelBytes()) : objectSha256) +
           "\"";
  std::string json = R"({
  "format": "cegen-bundle",
  "version": )" + std::to_string(version) +
                     R"(,
  "generator": "runtime_bundle_test",
  "objects": [
    {"file": "host-x86_64.so", "target": "host", "kind": "shared-object")" +
                     hash + R"(}
  ],
  "kernels": [)";
  for (size_t i = 0; i < kernels.size(); ++i) {
    const KernelSpec &spec = kernels[i];
    auto args = spec.args.empty() ? canonicalArgs(spec.key) : spec.args;
    json += i ? ",\n    {" : "\n    {";
    json += "\"key\": \"" + spec.key.str() + "\", \"target\": \"host\", ";
    json += "\"object\": \"host-x86_64.so\", \"symbol\": \"" + spec.symbol +
            "\", \"abi\": \"memref-descriptor-pointers\",\n      \"args\": " +
            argsJson(args) +
            ",\n      \"launch\": {\"block_size\": 0, \"rows_per_block\": 0, "
            "\"lds_bytes\": 0}}";
  }
  json += "\n  ]";
  if (version >= 2)
    json += ",\n  \"manifest_sha256\": \"" + std::string(64, '0') + "\"";
  json += "\n}\n";
  return version >= 2 ? sealManifest(json) : json;
}

std::string sha256Of(const std::string &bytes) { return sha256Hex(bytes); }

std::string readFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot read " << path;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string fakeKernelBytes() {
  static const std::string bytes = readFile(CE_FAKE_KERNELS_PATH);
  return bytes;
}

std::string sealManifest(std::string text) {
  const std::string key = "\"manifest_sha256\": \"";
  size_t at = text.find(key);
  EXPECT_NE(at, std::string::npos) << "no manifest_sha256 to seal";
  if (at == std::string::npos || text.size() < at + key.size() + 64)
    return text;
  at += key.size();
  text.replace(at, 64, std::string(64, '0'));
  text.replace(at, 64, sha256Of(text));
  return text;
}

std::string resealIfSealed(std::string text) {
  const std::string key = "\"manifest_sha256\": \"";
  size_t at = text.find(key);
  if (at == std::string::npos || text.size() < at + key.size() + 64)
    return text;
  return sealManifest(std::move(text));
}

std::string fakePtx(const std::string &payload) {
  return "//\n// fake PTX for the runtime tests\n//\n\n.version 8.0\n"
         ".target sm_90\n.address_size 64\n\n" +
         payload + "\n.visible .entry ce_fake_entry()\n{\n\tret;\n}\n";
}

std::string fakeElf(uint16_t machine, uint16_t type, uint8_t osAbi,
                    const std::string &payload) {
  // ELF header, PT_LOAD and PT_DYNAMIC, the payload (NUL-terminated, padded
  // to 8), the dynamic section, a DT_HASH table of one empty bucket, the
  // null symbol and an empty string table.
  constexpr uint64_t kPayloadAt = 64 + 2 * 56;
  uint64_t dynamicAt = (kPayloadAt + payload.size() + 1 + 7) / 8 * 8;
  uint64_t hashAt = dynamicAt + 5 * 16, symbolsAt = hashAt + 16,
           stringsAt = symbolsAt + 24, size = stringsAt + 8;
  std::string file(size, '\0');
  auto put = [&](uint64_t at, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i)
      file[at + i] = char(value >> (8 * i));
  };
  std::memcpy(file.data(), "\x7f\x45\x4c\x46\x02\x01\x01", 7); // ELF64 LSB
  file[7] = char(osAbi);
  put(16, type, 2);
  put(18, machine, 2);
  put(20, 1, 4);         // e_version
  put(32, 64, 8);        // e_phoff
  put(52, 64, 2);        // e_ehsize
  put(54, 56, 2);        // e_phentsize
  put(56, 2, 2);         // e_phnum
  put(64, 1, 4);         // PT_LOAD
  put(64 + 4, 4, 4);     // PF_R
  put(64 + 32, size, 8); // p_filesz
  put(64 + 40, size, 8); // p_memsz
  put(64 + 48, 4096, 8); // p_align
  put(120, 2, 4);        // PT_DYNAMIC
  put(120 + 4, 4, 4);    // PF_R
  put(120 + 8, dynamicAt, 8);
  put(120 + 16, dynamicAt, 8);
  put(120 + 32, 5 * 16, 8);
  put(120 + 40, 5 * 16, 8);
  put(120 + 48, 8, 8);
  std::memcpy(file.data() + kPayloadAt, payload.data(), payload.size());
  uint64_t entries[][2] = {
      {6, symbolsAt}, {5, stringsAt}, {10, 1}, {4, hashAt}, {0, 0}};
  for (int i = 0; i < 5; ++i) {
    put(dynamicAt + 16 * i, entries[i][0], 8);
    put(dynamicAt + 16 * i + 8, entries[i][1], 8);
  }
  put(hashAt, 1, 4);     // nbucket
  put(hashAt + 4, 1, 4); // nchain: the null symbol
  return file;
}

std::string fakeHsaco(const std::string &payload) {
  return fakeElf(/*EM_AMDGPU=*/224, /*ET_DYN=*/3, /*ELFOSABI_AMDGPU_HSA=*/64,
                 payload);
}

namespace {
int collectObject(dl_phdr_info *info, size_t, void *data) {
  static_cast<std::vector<std::pair<uintptr_t, std::string>> *>(data)
      ->push_back({info->dlpi_addr, info->dlpi_name ? info->dlpi_name : ""});
  return 0;
}

std::vector<std::pair<uintptr_t, std::string>> objectList() {
  std::vector<std::pair<uintptr_t, std::string>> objects;
  ::dl_iterate_phdr(collectObject, &objects);
  return objects;
}
} // namespace

std::set<uintptr_t> loadedObjects() {
  std::set<uintptr_t> addresses;
  for (auto &[address, name] : objectList())
    addresses.insert(address);
  return addresses;
}

void *newlyLoadedObject(const std::set<uintptr_t> &before,
                        const char *symbol) {
  void *found = nullptr;
  for (auto &[address, name] : objectList()) {
    if (before.count(address) || name.empty())
      continue;
    // The name the object was loaded by gives the same object back.
    void *handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (!handle)
      continue;
    if (!::dlsym(handle, symbol)) {
      ::dlclose(handle);
      continue;
    }
    if (found) {
      ADD_FAILURE() << "more than one new object defines " << symbol;
      ::dlclose(handle);
      continue;
    }
    found = handle;
  }
  return found;
}

/// Calls fake_forward_flat through `bundle` on a small problem and checks
/// what it recorded (in `object`, the host object the runtime loaded for the
/// bundle) and computed.
bool fakeForwardWorks(ce_bundle *bundle, void *object) {
  if (!object)
    return false;
  auto *record = static_cast<FakeRecord *>(::dlsym(object, "ce_fake_record"));
  int64_t callsBefore = record ? record->calls : 0;
  const int64_t n = 3, v = 4;
  std::vector<float> logits(n * v), loss(n), lse(n);
  std::vector<int64_t> labels = {1, 3, 0};
  for (int64_t i = 0; i < n * v; ++i)
    logits[i] = float(i);
  ce_tensor tLogits = packed(logits.data(), CE_DTYPE_F32, {n, v});
  ce_tensor tLabels = packed(labels.data(), CE_DTYPE_I64, {n});
  ce_tensor tLoss = packed(loss.data(), CE_DTYPE_F32, {n});
  ce_tensor tLse = packed(lse.data(), CE_DTYPE_F32, {n});
  bool works = record && ce_forward(bundle, nullptr, &tLogits, &tLabels, &tLoss,
                                    &tLse, nullptr) == CE_OK;
  works = works && record->calls == callsBefore + 1 && record->numArgs == 8;
  for (int64_t t = 0; works && t < n; ++t)
    works = loss[t] == 1.5f && lse[t] == 2.5f + logits[t * v + labels[t]];
  return works;
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
  std::set<uintptr_t> before = loadedObjects();
  ce_status status = ce_bundle_open(dir.path().c_str(), &bundle);
  EXPECT_EQ(status, CE_OK) << ce_last_error_message();
  // The object the runtime loaded (from a private copy), so that the record
  // is the one the runtime's kernels write.
  handle = newlyLoadedObject(before, "ce_fake_record");
  EXPECT_NE(handle, nullptr) << "the runtime loaded no fake kernels";
  if (handle)
    fakeRecord = static_cast<FakeRecord *>(::dlsym(handle, "ce_fake_record"));
  EXPECT_NE(fakeRecord, nullptr);
  static FakeRecord empty;
  if (!fakeRecord)
    fakeRecord = &empty;
}

FakeBundle::~FakeBundle() {
  // Our reference first, so that closing the bundle unloads the object.
  if (handle)
    ::dlclose(handle);
  ce_bundle_close(bundle);
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

std::string runInChild(const std::function<std::string()> &body, int &signal) {
  signal = -1;
  int fds[2];
  if (::pipe(fds) != 0)
    return std::string("pipe: ") + std::strerror(errno);
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string report = body();
    for (size_t done = 0; done < report.size();) {
      ssize_t wrote =
          ::write(fds[1], report.data() + done, report.size() - done);
      if (wrote <= 0 && errno != EINTR)
        break;
      done += wrote > 0 ? size_t(wrote) : 0;
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string report;
  char buffer[4096];
  for (;;) {
    ssize_t got = ::read(fds[0], buffer, sizeof(buffer));
    if (got > 0)
      report.append(buffer, size_t(got));
    else if (got == 0 || errno != EINTR)
      break;
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  return report;
}

} // namespace ce::test
