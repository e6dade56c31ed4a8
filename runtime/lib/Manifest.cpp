//===- Manifest.cpp - Reading and checking manifest.json ------------------===//
//
// Implements docs/bundle-format.md, version 3: required keys, their
// types, the variant keys, and the agreement of each kernel's argument list
// with its variant. Unknown keys are ignored so that newer writers stay
// readable.
//
//===----------------------------------------------------------------------===//

#include "Manifest.h"
#include "CpuFeatures.h"
#include "Json.h"
#include "Sha256.h"

#include <limits>
#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

namespace ce {

static_assert(kBundleFormatVersion == CE_RUNTIME_BUNDLE_VERSION,
              "BundleAbi.h and ce_runtime.h must name the same version");

bool isCudaTarget(std::string_view target) {
  if (target.size() < 4 || target.substr(0, 3) != "sm_")
    return false;
  std::string_view digits = target.substr(3);
  if (digits.back() == 'a')
    digits.remove_suffix(1);
  return !digits.empty() &&
         std::all_of(digits.begin(), digits.end(),
                     [](char c) { return c >= '0' && c <= '9'; });
}

bool isHipTarget(std::string_view target) {
  if (target.size() < 4 || target.substr(0, 3) != "gfx")
    return false;
  return std::all_of(target.begin() + 3, target.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  });
}

namespace {

/// "an object", "a string", ...
std::string withArticle(const char *noun) {
  bool vowel = std::string_view("aeiou").find(noun[0]) != std::string::npos;
  return std::string(vowel ? "an " : "a ") + noun;
}

/// Walks the JSON tree and produces messages that name the file, the byte
/// offset and the path of the offending value ("kernels[2].args[0].rank").
class ManifestReader {
public:
  ManifestReader(std::string_view text, const std::string &path)
      : text(text), path(path) {}

  Status read(Manifest &manifest);

private:
  Status errorAt(const json::Value &value, const std::string &what) const {
    return Status::bundleError(path + ": byte " +
                               std::to_string(value.offset()) + ": " + what);
  }

  /// A required member of `object` with kind `kind`.
  Status require(const json::Value &object, const std::string &where,
                 const char *key, json::Value::Kind kind,
                 const json::Value *&member) const {
    member = object.get(key);
    std::string name = where.empty() ? key : where + "." + key;
    if (!member)
      return errorAt(object, "missing required key \"" + name + "\"");
    if (member->kind() != kind)
      return errorAt(*member,
                     "\"" + name + "\" must be " +
                         withArticle(json::Value::kindName(kind)) + ", not " +
                         withArticle(json::Value::kindName(member->kind())));
    return Status::ok();
  }

  Status requireString(const json::Value &object, const std::string &where,
                       const char *key, std::string &out) const {
    const json::Value *member;
    if (Status status =
            require(object, where, key, json::Value::Kind::String, member);
        !status.isOk())
      return status;
    out = member->getString();
    // A "\u0000" escape would cut the name a C API sees (dlsym, open).
    if (out.find('\0') != std::string::npos)
      return errorAt(*member, "\"" + (where.empty() ? key : where + "." + key) +
                                  "\" must not contain a NUL character");
    return Status::ok();
  }

  Status requireInteger(const json::Value &object, const std::string &where,
                        const char *key, int64_t min, int64_t max,
                        int64_t &out) const {
    const json::Value *member;
    if (Status status =
            require(object, where, key, json::Value::Kind::Number, member);
        !status.isOk())
      return status;
    std::optional<int64_t> value = member->getInteger();
    if (!value || *value < min || *value > max)
      return errorAt(
          *member, "\"" + where + "." + key + "\" must be an integer in [" +
                       std::to_string(min) + ", " + std::to_string(max) + "]");
    out = *value;
    return Status::ok();
  }

  Status checkSeal(const json::Value &root) const;
  Status readObject(const json::Value &value, const std::string &where,
                    ObjectInfo &object) const;
  Status readKernel(const json::Value &value, const std::string &where,
                    const Manifest &manifest, KernelInfo &kernel) const;
  Status readArgs(const json::Value &args, const std::string &where,
                  KernelInfo &kernel) const;
  Status readLaunch(const json::Value &kernelValue, const std::string &where,
                    KernelInfo &kernel) const;

  std::string_view text;
  const std::string &path;
};

Status ManifestReader::read(Manifest &manifest) {
  json::Value root;
  json::ParseError parseError;
  if (!json::parse(text, root, parseError))
    return Status::bundleError(
        path + ": invalid JSON at byte " + std::to_string(parseError.offset) +
        " (line " + std::to_string(parseError.line) + ", column " +
        std::to_string(parseError.column) + "): " + parseError.message);
  if (!root.isObject())
    return errorAt(root, "the manifest must be a JSON object, not " +
                             withArticle(json::Value::kindName(root.kind())));

  // The format and version come first: a newer version may have changed
  // everything else, so nothing else is looked at before they are accepted.
  std::string format;
  if (Status status = requireString(root, "", "format", format); !status.isOk())
    return status;
  if (format != kBundleFormatName)
    return errorAt(*root.get("format"),
                   "\"format\" is \"" + format + "\", expected \"" +
                       kBundleFormatName + "\" (not a cegen kernel bundle)");
  const json::Value *version;
  if (Status status =
          require(root, "", "version", json::Value::Kind::Number, version);
      !status.isOk())
    return status;
  if (!version->getInteger() || *version->getInteger() < 1)
    return errorAt(*version, "\"version\" must be a positive integer");
  manifest.version = *version->getInteger();
  if (manifest.version < kBundleFormatVersion)
    return errorAt(
        *version,
        "bundle format version " + std::to_string(manifest.version) +
            " is older than version " + std::to_string(kBundleFormatVersion) +
            ", the only one this runtime reads (since version 3 option values "
            "such as ignore_index, label_smoothing and z_loss are kernel "
            "arguments, not compiled in; since version 4 forward, fused and "
            "backward kernels take lse's low part, lse_low; since version 5 "
            "forward and fused kernels take the entropy and argmax "
            "outputs); regenerate the "
            "bundle with this version's ce-gen");
  if (manifest.version > kBundleFormatVersion)
    return errorAt(
        *version,
        "bundle format version " + std::to_string(manifest.version) +
            " is newer than version " +
            std::to_string(kBundleFormatVersion) +
            ", the newest this runtime reads; use a runtime that reads "
            "version " +
            std::to_string(manifest.version) +
            " or regenerate the bundle with a matching ce-gen");

  if (Status status = checkSeal(root); !status.isOk())
    return status;

  if (const json::Value *generator = root.get("generator")) {
    if (!generator->isString())
      return errorAt(*generator, "\"generator\" must be a string");
    manifest.generator = generator->getString();
  }

  const json::Value *objects;
  if (Status status =
          require(root, "", "objects", json::Value::Kind::Array, objects);
      !status.isOk())
    return status;
  for (size_t i = 0; i < objects->getArray().size(); ++i) {
    ObjectInfo object;
    if (Status status =
            readObject(objects->getArray()[i],
                       "objects[" + std::to_string(i) + "]", object);
        !status.isOk())
      return status;
    for (const ObjectInfo &other : manifest.objects)
      if (other.file == object.file)
        return errorAt(objects->getArray()[i],
                       "object file \"" + object.file + "\" listed twice");
    manifest.objects.push_back(std::move(object));
  }

  const json::Value *kernels;
  if (Status status =
          require(root, "", "kernels", json::Value::Kind::Array, kernels);
      !status.isOk())
    return status;
  std::set<std::tuple<std::string, std::string, int64_t>> seen;
  for (size_t i = 0; i < kernels->getArray().size(); ++i) {
    const json::Value &value = kernels->getArray()[i];
    KernelInfo kernel;
    if (Status status = readKernel(value, "kernels[" + std::to_string(i) + "]",
                                   manifest, kernel);
        !status.isOk())
      return status;
    // One kernel per target, key and minimum row length.
    if (!seen.insert({kernel.target, kernel.key, kernel.launch.minVocab})
             .second)
      return errorAt(value, "kernel \"" + kernel.key + "\" for target \"" +
                                kernel.target + "\" with min_vocab " +
                                std::to_string(kernel.launch.minVocab) +
                                " listed twice");
    manifest.kernels.push_back(std::move(kernel));
  }
  return Status::ok();
}

Status ManifestReader::checkSeal(const json::Value &root) const {
  // `manifest_sha256` is the SHA-256 of this text with its own 64 digits
  // written as zeros: any change to the manifest, down to a byte of
  // whitespace, is an error, so that a damaged manifest cannot describe its
  // kernels wrongly (another variant's key, another launch shape).
  const json::Value *seal = nullptr;
  if (Status status =
          require(root, "", kManifestSealKey, json::Value::Kind::String, seal);
      !status.isOk())
    return status;
  const std::string &recorded = seal->getString();
  if (!isSha256Hex(recorded) ||
      text.compare(seal->offset(), recorded.size() + 2,
                   "\"" + recorded + "\"") != 0)
    return errorAt(*seal, std::string("\"") + kManifestSealKey +
                              "\" must be a SHA-256 written as 64 lowercase "
                              "hex digits");
  std::string zeroed(text);
  zeroed.replace(seal->offset() + 1, recorded.size(), recorded.size(), '0');
  std::string actual = sha256Hex(zeroed);
  if (actual != recorded)
    return Status::bundleError(
        path + " has changed since ce-gen wrote it: its SHA-256 (with \"" +
        kManifestSealKey + "\" as zeros) is " + actual + ", \"" +
        kManifestSealKey + "\" records " + recorded +
        "; the manifest is damaged or incompletely copied: regenerate or "
        "copy the bundle again");
  return Status::ok();
}

Status ManifestReader::readObject(const json::Value &value,
                                  const std::string &where,
                                  ObjectInfo &object) const {
  if (!value.isObject())
    return errorAt(value, where + " must be an object");
  if (Status status = requireString(value, where, "file", object.file);
      !status.isOk())
    return status;
  if (Status status = requireString(value, where, "target", object.target);
      !status.isOk())
    return status;
  if (Status status = requireString(value, where, "kind", object.kind);
      !status.isOk())
    return status;
  // The object's content hash ties the manifest to the objects of its own
  // ce-gen run.
  if (Status status = requireString(value, where, "sha256", object.sha256);
      !status.isOk())
    return status;
  if (!isSha256Hex(object.sha256))
    return errorAt(*value.get("sha256"),
                   where + ".sha256 \"" + object.sha256 +
                       "\" is not a SHA-256 (64 lowercase hex digits)");
  // The CPU features a host object needs: names the runtime can check.
  if (const json::Value *features = value.get("cpu_features")) {
    if (!features->isArray())
      return errorAt(*features, where + ".cpu_features must be an array");
    for (const json::Value &feature : features->getArray()) {
      if (!feature.isString())
        return errorAt(feature,
                       where + ".cpu_features must hold strings");
      if (!isKnownCpuFeature(feature.getString()))
        return errorAt(feature, where + ".cpu_features names \"" +
                                    feature.getString() +
                                    "\", a CPU feature this runtime cannot "
                                    "check (a newer ce-gen's bundle?)");
      object.cpuFeatures.push_back(feature.getString());
    }
  }
  // Code objects live inside the bundle: a manifest must not make the
  // runtime load an arbitrary file from elsewhere.
  const std::string &file = object.file;
  bool escapes =
      file.empty() || file[0] == '/' || file == ".." ||
      file.rfind("../", 0) == 0 || file.find("/../") != std::string::npos ||
      (file.size() >= 3 && file.compare(file.size() - 3, 3, "/..") == 0);
  if (escapes)
    return errorAt(*value.get("file"),
                   where + ".file \"" + file +
                       "\" must be a relative path inside the bundle");
  return Status::ok();
}

Status ManifestReader::readKernel(const json::Value &value,
                                  const std::string &where,
                                  const Manifest &manifest,
                                  KernelInfo &kernel) const {
  if (!value.isObject())
    return errorAt(value, where + " must be an object");
  for (auto [key, out] :
       {std::pair{"key", &kernel.key}, std::pair{"target", &kernel.target},
        std::pair{"object", &kernel.object},
        std::pair{"symbol", &kernel.symbol}, std::pair{"abi", &kernel.abi}})
    if (Status status = requireString(value, where, key, *out); !status.isOk())
      return status;

  std::optional<KernelVariantKey> variant = parseKernelVariantKey(kernel.key);
  if (!variant)
    return errorAt(*value.get("key"),
                   where + ".key \"" + kernel.key +
                       "\" is not a variant key as KernelVariantKey::str() "
                       "spells it");
  kernel.variant = *variant;
  std::string name = where + " (\"" + kernel.key + "\")";
  KernelOp op = kernel.variant.op;
  if ((op == KernelOp::Forward || op == KernelOp::ShardStats) &&
      kernel.variant.overwrite)
    return errorAt(value, name + ": a " + stringify(op) +
                              " kernel cannot overwrite");
  if (op == KernelOp::ShardStats && kernel.variant.zLoss)
    return errorAt(value, name + ": a shard_stats kernel has no z-loss");
  // A rescale key is canonical (parseKernelVariantKey): it takes weights.
  bool fused = kernel.variant.op == KernelOp::Fused ||
               kernel.variant.op == KernelOp::Rescale;
  if (fused != (kernel.variant.weights != WeightsKind::None))
    return errorAt(value, name +
                              ": weights=" + stringify(kernel.variant.weights) +
                              (fused ? " is not valid for a fused kernel "
                                       "(token)"
                                     : " is only valid for a fused kernel"));

  auto object = std::find_if(
      manifest.objects.begin(), manifest.objects.end(),
      [&](const ObjectInfo &info) { return info.file == kernel.object; });
  if (object == manifest.objects.end())
    return errorAt(*value.get("object"), name + ": object \"" + kernel.object +
                                             "\" is not listed in \"objects\"");
  if (object->target != kernel.target)
    return errorAt(*value.get("object"),
                   name + ": object \"" + kernel.object +
                       "\" is for target \"" + object->target +
                       "\", the kernel for target \"" + kernel.target + "\"");
  if (kernel.target == "host") {
    if (kernel.abi != kMemrefDescriptorAbi)
      return errorAt(*value.get("abi"), name + ": unknown abi \"" + kernel.abi +
                                            "\" (expected \"" +
                                            kMemrefDescriptorAbi + "\")");
    if (object->kind != kObjectKindSharedObject)
      return errorAt(*value.get("object"),
                     name + ": host object \"" + object->file +
                         "\" has kind \"" + object->kind +
                         "\", expected \"shared-object\"");
  } else if (isCudaTarget(kernel.target) || isHipTarget(kernel.target)) {
    if (kernel.abi != kMemrefDescriptorFieldsAbi)
      return errorAt(*value.get("abi"), name + ": unknown abi \"" + kernel.abi +
                                            "\" for " + kernel.target +
                                            " (expected \"" +
                                            kMemrefDescriptorFieldsAbi + "\")");
    bool cuda = isCudaTarget(kernel.target);
    bool kindOk = cuda ? object->kind == kObjectKindPtx ||
                                object->kind == kObjectKindCubin
                       : object->kind == kObjectKindHsaco;
    if (!kindOk)
      return errorAt(*value.get("object"),
                     name + ": " + kernel.target + " object \"" + object->file +
                         "\" has kind \"" + object->kind + "\", expected " +
                         (cuda ? "\"ptx\" or \"cubin\"" : "\"hsaco\""));
  }

  const json::Value *args;
  if (Status status =
          require(value, where, "args", json::Value::Kind::Array, args);
      !status.isOk())
    return status;
  if (Status status = readArgs(*args, name, kernel); !status.isOk())
    return status;
  return readLaunch(value, where, kernel);
}

Status ManifestReader::readArgs(const json::Value &args,
                                const std::string &name,
                                KernelInfo &kernel) const {
  // Every role of the variant, in call order (BundleAbi.h): the tensors,
  // then the value arguments.
  std::vector<ArgRole> expected = expectedRoles(kernel.variant);
  const std::vector<json::Value> &list = args.getArray();
  for (size_t i = 0; i < list.size(); ++i) {
    const json::Value &value = list[i];
    std::string where = name + ".args[" + std::to_string(i) + "]";
    if (!value.isObject())
      return errorAt(value, where + " must be an object");
    std::string roleName, dtypeName;
    int64_t rank;
    if (Status status = requireString(value, where, "role", roleName);
        !status.isOk())
      return status;
    if (Status status =
            requireInteger(value, where, "rank", 0, CE_MAX_RANK, rank);
        !status.isOk())
      return status;
    if (Status status = requireString(value, where, "dtype", dtypeName);
        !status.isOk())
      return status;
    if (i >= expected.size())
      return errorAt(value, name + ": unexpected argument role \"" +
                                roleName + "\" after the last one, \"" +
                                stringify(expected.back()) + "\"");
    ArgRole role = expected[i];
    if (roleName != stringify(role))
      return errorAt(value, where + ": argument role \"" + roleName +
                                "\" where this variant takes \"" +
                                stringify(role) + "\"");
    ArgShape want = expectedArg(kernel.variant, role);
    if (rank != want.rank || dtypeName != stringify(want.dtype))
      return errorAt(value, name + ": argument \"" + roleName + "\" is " +
                                dtypeName + " of rank " + std::to_string(rank) +
                                ", expected " + stringify(want.dtype) +
                                " of rank " + std::to_string(want.rank) +
                                (isValueRole(role) ? " (by value)" : ""));
    kernel.args.push_back({role, want.rank, want.dtype});
  }
  if (list.size() < expected.size())
    return errorAt(args, name + ": missing argument role \"" +
                             std::string(stringify(expected[list.size()])) +
                             "\"");
  return Status::ok();
}

Status ManifestReader::readLaunch(const json::Value &kernelValue,
                                  const std::string &where,
                                  KernelInfo &kernel) const {
  const json::Value *launch = kernelValue.get("launch");
  // Host kernels have no launch shape; GPU kernels cannot run without one.
  if (!launch && kernel.target == "host")
    return Status::ok();
  if (Status status = require(kernelValue, where, "launch",
                              json::Value::Kind::Object, launch);
      !status.isOk())
    return status;
  std::string launchWhere = where + ".launch";
  constexpr int64_t maxValue = int64_t(1) << 31;
  for (auto [key, out] :
       {std::pair{"block_size", &kernel.launch.blockSize},
        std::pair{"rows_per_block", &kernel.launch.rowsPerBlock},
        std::pair{"lds_bytes", &kernel.launch.ldsBytes}})
    if (Status status =
            requireInteger(*launch, launchWhere, key, 0, maxValue, *out);
        !status.isOk())
      return status;
  if (launch->get("min_vocab"))
    if (Status status = requireInteger(*launch, launchWhere, "min_vocab", 0,
                                       std::numeric_limits<int64_t>::max(),
                                       kernel.launch.minVocab);
        !status.isOk())
      return status;
  if (isCudaTarget(kernel.target) || isHipTarget(kernel.target)) {
    // What a launch needs: a block of at most 1024 threads over at least one
    // row. Device limits beyond these are the driver's to enforce.
    if (kernel.launch.blockSize < 1 || kernel.launch.blockSize > 1024)
      return errorAt(*launch->get("block_size"),
                     "\"" + launchWhere +
                         ".block_size\" must be in [1, 1024] for a GPU "
                         "kernel");
    if (kernel.launch.rowsPerBlock < 1)
      return errorAt(*launch->get("rows_per_block"),
                     "\"" + launchWhere +
                         ".rows_per_block\" must be at least 1 for a GPU "
                         "kernel");
  }
  return Status::ok();
}

} // namespace

Status parseManifest(std::string_view text, const std::string &path,
                     Manifest &manifest) {
  manifest = Manifest();
  return ManifestReader(text, path).read(manifest);
}

} // namespace ce
