//===- ManifestTest.cpp - The manifest checks, error by error -------------===//
//
// runtime/lib/Manifest.cpp's parseManifest on its own (compiled into the
// test from the runtime's sources), on manifests built as JSON trees that a
// test changes at one path: a manifest cut at every byte, every required key
// missing and given every wrong type, non-integers and out-of-range integers,
// duplicate keys, too-new and malformed versions, NUL characters, bad UTF-8
// and deep nesting, the per-kernel rules, and each kernel's `args` against
// BundleAbi.h's expectedRoles()/expectedArg() for every kind of variant
// (the tensors, then the seven value arguments, in that order only), and the
// refusal of format versions 1 and 2.
// Every failure must be CE_ERROR_BUNDLE with the file's path, and the
// message, and the byte offset where the problem has one, are checked.
// BundleTest.cpp opens whole bundles through the C API.
//
//===----------------------------------------------------------------------===//

#include "Json.h"
#include "Manifest.h"
#include "TestBundle.h"

#include "ce/runtime/BundleAbi.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using namespace ce;
using namespace ce::test;
using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

const std::string kPath = "/bundles/b/manifest.json";

//--- JSON trees that a test changes at one path ---------------------------//

/// A JSON value: a scalar as written, an array or an object.
struct Node {
  enum class Kind { Scalar, Array, Object } kind = Kind::Scalar;
  std::string text; ///< A scalar's JSON text.
  std::vector<Node> items;
  std::vector<std::pair<std::string, Node>> members;
};

Node scalar(std::string text) {
  Node node;
  node.text = std::move(text);
  return node;
}
Node str(const std::string &value) { return scalar("\"" + value + "\""); }
Node num(int64_t value) { return scalar(std::to_string(value)); }
Node arr(std::vector<Node> items) {
  Node node;
  node.kind = Node::Kind::Array;
  node.items = std::move(items);
  return node;
}
Node obj(std::vector<std::pair<std::string, Node>> members) {
  Node node;
  node.kind = Node::Kind::Object;
  node.members = std::move(members);
  return node;
}

/// Writes `node`; the offset of `mark` (if it is written) goes to `*offset`.
void write(const Node &node, std::string &out, const Node *mark = nullptr,
           size_t *offset = nullptr) {
  if (&node == mark)
    *offset = out.size();
  switch (node.kind) {
  case Node::Kind::Scalar:
    out += node.text;
    return;
  case Node::Kind::Array:
    out += "[";
    for (size_t i = 0; i < node.items.size(); ++i) {
      out += i ? ", " : "";
      write(node.items[i], out, mark, offset);
    }
    out += "]";
    return;
  case Node::Kind::Object:
    out += "{";
    for (size_t i = 0; i < node.members.size(); ++i) {
      out += (i ? ", \"" : "\"") + node.members[i].first + "\": ";
      write(node.members[i].second, out, mark, offset);
    }
    out += "}";
    return;
  }
}

/// The member `key` of an object node, or null.
Node *member(Node &node, const std::string &key) {
  for (auto &[name, value] : node.members)
    if (name == key)
      return &value;
  return nullptr;
}

/// The node at `path` ("kernels[0].args[2].rank"), or null.
Node *at(Node &root, const std::string &path) {
  Node *node = &root;
  size_t i = 0;
  while (node && i < path.size()) {
    if (path[i] == '.') {
      ++i;
      continue;
    }
    if (path[i] == '[') {
      size_t close = path.find(']', i);
      size_t index = std::stoul(path.substr(i + 1, close - i - 1));
      node = index < node->items.size() ? &node->items[index] : nullptr;
      i = close + 1;
      continue;
    }
    size_t end = path.find_first_of(".[", i);
    end = end == std::string::npos ? path.size() : end;
    node = member(*node, path.substr(i, end - i));
    i = end;
  }
  return node;
}

/// Removes the member at `path` (an object member).
void erase(Node &root, const std::string &path) {
  size_t dot = path.rfind('.');
  Node *parent = dot == std::string::npos ? &root : at(root, path.substr(0, dot));
  ASSERT_NE(parent, nullptr) << path;
  std::string key = dot == std::string::npos ? path : path.substr(dot + 1);
  auto &members = parent->members;
  size_t before = members.size();
  members.erase(std::remove_if(members.begin(), members.end(),
                               [&](auto &m) { return m.first == key; }),
                members.end());
  ASSERT_EQ(members.size() + 1, before) << path;
}

//--- Manifests --------------------------------------------------------------//

const std::string kZeros(64, '0');
const std::string kSomeHash = std::string(32, 'a') + std::string(32, '5');

/// The `args` of a kernel of `key` as BundleAbi.h defines them: its
/// tensors, then the value arguments. Before version 3 a kernel took its
/// tensors only (version 1), or its tensors and the flags (version 2).
Node abiArgs(const KernelVariantKey &key,
             int64_t version = kBundleFormatVersion) {
  std::vector<ArgRole> roles =
      version >= 3 ? expectedRoles(key) : tensorRoles(key);
  if (version == 2)
    roles.push_back(ArgRole::Flags);
  std::vector<Node> args;
  for (ArgRole role : roles) {
    ArgShape shape = expectedArg(key, role);
    args.push_back(obj({{"role", str(stringify(role))},
                        {"rank", num(shape.rank)},
                        {"dtype", str(stringify(shape.dtype))}}));
  }
  return arr(std::move(args));
}

/// A manifest of one kernel of `key` for `target` ("host" or "sm_90"), of
/// the current version by default (older versions have the current keys and
/// args here: only their refusal is tested).
Node manifest(const KernelVariantKey &key,
              int64_t version = kBundleFormatVersion,
              const std::string &target = "host") {
  bool host = target == "host";
  std::string file = host ? "host-x86_64.so" : target + ".ptx";
  Node object = obj({{"file", str(file)},
                     {"target", str(target)},
                     {"kind", str(host ? "shared-object" : "ptx")}});
  if (version >= 2)
    object.members.push_back({"sha256", str(kSomeHash)});
  Node launch = host ? obj({{"block_size", num(0)},
                            {"rows_per_block", num(0)},
                            {"lds_bytes", num(0)}})
                     : obj({{"block_size", num(256)},
                            {"rows_per_block", num(1)},
                            {"lds_bytes", num(64)},
                            {"min_vocab", num(0)}});
  Node kernel = obj(
      {{"key", str(key.str())},
       {"target", str(target)},
       {"object", str(file)},
       {"symbol", str("ce_kernel_0")},
       {"abi", str(host ? kMemrefDescriptorAbi : kMemrefDescriptorFieldsAbi)},
       {"args", abiArgs(key, version)},
       {"launch", launch}});
  Node root = obj({{"format", str(kBundleFormatName)},
                   {"version", num(version)},
                   {"generator", str("ManifestTest")},
                   {"objects", arr({object})},
                   {"kernels", arr({kernel})}});
  if (version >= 2)
    root.members.push_back({kManifestSealKey, str(kZeros)});
  return root;
}

/// The text of `root`, sealed as ce-gen seals it when it has a seal of
/// zeros; the offset of `mark` goes to `*offset`.
std::string text(const Node &root, const Node *mark = nullptr,
                 size_t *offset = nullptr) {
  std::string out;
  write(root, out, mark, offset);
  if (out.find(std::string("\"") + kManifestSealKey + "\": \"" + kZeros) !=
      std::string::npos)
    out = sealManifest(out);
  return out;
}

/// Expects parseManifest to fail on `text`; returns the message.
std::string fails(const std::string &text) {
  Manifest parsed;
  Status status = parseManifest(text, kPath, parsed);
  EXPECT_EQ(status.code(), CE_ERROR_BUNDLE) << "accepted:\n" << text;
  EXPECT_THAT(status.message(), StartsWith(kPath));
  return status.message();
}

/// Expects parseManifest to accept `text`.
Manifest accepts(const std::string &text) {
  Manifest parsed;
  Status status = parseManifest(text, kPath, parsed);
  EXPECT_TRUE(status.isOk()) << status.message() << "\n" << text;
  return parsed;
}

std::string at(size_t offset) {
  return kPath + ": byte " + std::to_string(offset) + ": ";
}

KernelVariantKey variant(KernelOp op, LabelLayout layout = LabelLayout::Flat,
                         ElemType logits = ElemType::F32,
                         ElemType labels = ElemType::I64) {
  KernelVariantKey key = forwardKey(layout);
  key.op = op;
  key.logits = logits;
  key.labels = labels;
  if (op == KernelOp::Fused)
    key.weights = WeightsKind::Token;
  return key;
}

//--- Tests ------------------------------------------------------------------//

TEST(Manifest, TheBuiltManifestsAreAccepted) {
  EXPECT_EQ(kBundleFormatVersion, 5);
  EXPECT_EQ(kBundleFormatVersion, CE_RUNTIME_BUNDLE_VERSION);
  for (const char *target : {"host", "sm_90"}) {
    SCOPED_TRACE(target);
    Manifest parsed =
        accepts(text(manifest(forwardKey(), kBundleFormatVersion, target)));
    EXPECT_EQ(parsed.version, 5);
    EXPECT_EQ(parsed.generator, "ManifestTest");
    ASSERT_EQ(parsed.objects.size(), 1u);
    EXPECT_EQ(parsed.objects[0].sha256, kSomeHash);
    ASSERT_EQ(parsed.kernels.size(), 1u);
    EXPECT_EQ(parsed.kernels[0].key, forwardKey().str());
    EXPECT_EQ(parsed.kernels[0].symbol, "ce_kernel_0");
    // 8 tensors (lse_low since version 4, entropy and argmax since
    // version 5) and the 8 values (logit_scale and logit_softcap since
    // issue 17).
    EXPECT_EQ(parsed.kernels[0].args.size(), 16u);
  }
}

TEST(Manifest, OlderVersionsAreRefusedNamingBoth) {
  // Versions 1 and 2 compiled the option values into the kernels: their
  // kernels take no value arguments; version 3's take no lse_low, version
  // 4's no entropy and argmax. This runtime cannot call them. The refusal
  // comes before anything else is read (a version 1 manifest has no hashes,
  // a version 2 one the old keys and args).
  for (int64_t version : {int64_t(1), int64_t(2), int64_t(3), int64_t(4)}) {
    SCOPED_TRACE(version);
    {
      Node root = manifest(forwardKey(), version);
      *at(root, "kernels[0].key") =
          str("op=forward,logits=f32,labels=i64,layout=flat,ignore_index=none,"
              "label_smoothing=0,z_loss=0,overwrite=0,weights=none");
      size_t offset = 0;
      std::string manifestText = text(root, at(root, "version"), &offset);
      EXPECT_EQ(fails(manifestText),
                at(offset) + "bundle format version " +
                    std::to_string(version) +
                    " is older than version 5, the only one this runtime "
                    "reads (since version 3 option values such as "
                    "ignore_index, label_smoothing and z_loss are kernel "
                    "arguments, not compiled in; since version 4 forward, "
                    "fused and backward kernels take lse's low part, "
                    "lse_low; since version 5 forward and fused kernels "
                    "take the entropy and argmax outputs); regenerate the "
                    "bundle with this version's ce-gen");
    }
  }
  // Version 5 with version 2's key is not a version 5 manifest either.
  Node root = manifest(forwardKey());
  std::string v2Key = "op=forward,logits=f32,labels=i64,layout=flat,"
                      "ignore_index=none,label_smoothing=0,z_loss=0,"
                      "overwrite=0,weights=none";
  *at(root, "kernels[0].key") = str(v2Key);
  size_t offset = 0;
  std::string manifestText = text(root, at(root, "kernels[0].key"), &offset);
  EXPECT_EQ(fails(manifestText),
            at(offset) + "kernels[0].key \"" + v2Key +
                "\" is not a variant key as KernelVariantKey::str() spells it");
}

TEST(Manifest, CutAtEveryByteFailsWithTheOffset) {
  KernelVariantKey backward = variant(KernelOp::Backward, LabelLayout::SbvBs);
  {
    const std::string whole = manifestJson(
        {{forwardKey(), "fake_forward_flat", {}}, {backward, "b", {}}});
    size_t last = whole.rfind('}');
    size_t failures = 0;
    for (size_t length = 0; length < whole.size(); ++length) {
      Manifest parsed;
      Status status = parseManifest(whole.substr(0, length), kPath, parsed);
      std::string expected;
      if (length <= last) {
        size_t line = 1, column = 1;
        for (size_t i = 0; i < length; ++i) {
          column = whole[i] == '\n' ? 1 : column + 1;
          line += whole[i] == '\n';
        }
        expected = kPath + ": invalid JSON at byte " + std::to_string(length) +
                   " (line " + std::to_string(line) + ", column " +
                   std::to_string(column) + "): unexpected end of input";
      } else {
        // Whole JSON without its final newline: the seal covers every byte.
        expected = kPath + " has changed since ce-gen wrote it";
      }
      bool ok = expected.empty()
                    ? status.isOk()
                    : status.code() == CE_ERROR_BUNDLE &&
                          status.message().rfind(expected, 0) == 0;
      if (!ok && ++failures <= 10)
        ADD_FAILURE() << "cut to " << length << " bytes: "
                      << ce_status_string(status.code()) << " "
                      << status.message() << "\n  expected: "
                      << (expected.empty() ? "CE_OK" : expected);
    }
    EXPECT_EQ(failures, 0u);
  }
}

/// The required keys of a manifest, by path, with the JSON kind each must
/// have and the name the message gives it. `args[1]` stands for every
/// argument.
struct RequiredKey {
  std::string path;
  json::Value::Kind kind;
  std::string name;
};

std::vector<RequiredKey> requiredKeys(const KernelVariantKey &key,
                                      bool gpu) {
  using K = json::Value::Kind;
  std::string kernelName = "kernels[0] (\"" + key.str() + "\")";
  std::vector<RequiredKey> keys = {
      {"format", K::String, "format"},
      {"version", K::Number, "version"},
      {"objects", K::Array, "objects"},
      {"kernels", K::Array, "kernels"},
      {kManifestSealKey, K::String, kManifestSealKey},
      {"objects[0].file", K::String, "objects[0].file"},
      {"objects[0].target", K::String, "objects[0].target"},
      {"objects[0].kind", K::String, "objects[0].kind"},
      {"objects[0].sha256", K::String, "objects[0].sha256"},
      {"kernels[0].key", K::String, "kernels[0].key"},
      {"kernels[0].target", K::String, "kernels[0].target"},
      {"kernels[0].object", K::String, "kernels[0].object"},
      {"kernels[0].symbol", K::String, "kernels[0].symbol"},
      {"kernels[0].abi", K::String, "kernels[0].abi"},
      {"kernels[0].args", K::Array, "kernels[0].args"},
      {"kernels[0].args[1].role", K::String, kernelName + ".args[1].role"},
      {"kernels[0].args[1].rank", K::Number, kernelName + ".args[1].rank"},
      {"kernels[0].args[1].dtype", K::String, kernelName + ".args[1].dtype"},
      {"kernels[0].launch.block_size", K::Number,
       "kernels[0].launch.block_size"},
      {"kernels[0].launch.rows_per_block", K::Number,
       "kernels[0].launch.rows_per_block"},
      {"kernels[0].launch.lds_bytes", K::Number,
       "kernels[0].launch.lds_bytes"},
  };
  if (gpu)
    keys.push_back({"kernels[0].launch", K::Object, "kernels[0].launch"});
  return keys;
}

const char *article(json::Value::Kind kind) {
  return kind == json::Value::Kind::Array || kind == json::Value::Kind::Object
             ? "an "
             : "a ";
}

TEST(Manifest, EveryRequiredKeyMissing) {
  for (const char *target : {"host", "sm_90"}) {
    bool gpu = std::string(target) != "host";
    for (const RequiredKey &key : requiredKeys(forwardKey(), gpu)) {
      SCOPED_TRACE(std::string(target) + " " + key.path);
      Node root = manifest(forwardKey(), kBundleFormatVersion, target);
      size_t dot = key.path.rfind('.');
      Node *parent = dot == std::string::npos
                         ? &root
                         : at(root, key.path.substr(0, dot));
      ASSERT_NE(parent, nullptr);
      erase(root, key.path);
      size_t offset = 0;
      std::string manifestText = text(root, parent, &offset);
      // The missing key is named with its path, at its object's offset.
      EXPECT_EQ(fails(manifestText),
                at(offset) + "missing required key \"" + key.name + "\"");
    }
  }
  // What is optional: the generator, a host kernel's launch shape and a
  // kernel's min_vocab.
  for (const char *path : {"generator", "kernels[0].launch"}) {
    Node root = manifest(forwardKey());
    erase(root, path);
    accepts(text(root));
  }
  Node gpu = manifest(forwardKey(), kBundleFormatVersion, "sm_90");
  erase(gpu, "kernels[0].launch.min_vocab");
  accepts(text(gpu));
}

TEST(Manifest, EveryRequiredKeyWithEveryWrongType) {
  using K = json::Value::Kind;
  const std::pair<K, Node> values[] = {
      {K::String, str("x")},   {K::Number, num(7)},  {K::Bool, scalar("true")},
      {K::Null, scalar("null")}, {K::Array, arr({})}, {K::Object, obj({})},
  };
  size_t cases = 0;
  for (const char *target : {"host", "sm_90"}) {
    bool gpu = std::string(target) != "host";
    for (const RequiredKey &key : requiredKeys(forwardKey(), gpu))
      for (const auto &[kind, value] : values) {
        if (kind == key.kind)
          continue;
        SCOPED_TRACE(std::string(target) + " " + key.path + " = " +
                     json::Value::kindName(kind));
        Node root = manifest(forwardKey(), kBundleFormatVersion, target);
        Node *node = at(root, key.path);
        ASSERT_NE(node, nullptr);
        *node = value;
        size_t offset = 0;
        std::string manifestText = text(root, node, &offset);
        EXPECT_EQ(fails(manifestText),
                  at(offset) + "\"" + key.name + "\" must be " +
                      article(key.kind) + json::Value::kindName(key.kind) +
                      ", not " + article(kind) + json::Value::kindName(kind));
        ++cases;
      }
  }
  EXPECT_EQ(cases, 5u * (21 + 22));
}

TEST(Manifest, ElementsAndOptionalKeysOfTheWrongType) {
  struct Case {
    std::string path;
    Node value;
    std::string message;
  };
  std::string kernelName = "kernels[0] (\"" + forwardKey().str() + "\")";
  std::vector<Case> cases = {
      {"objects[0]", str("host-x86_64.so"), "objects[0] must be an object"},
      {"kernels[0]", arr({}), "kernels[0] must be an object"},
      {"kernels[0].args[2]", num(1), kernelName + ".args[2] must be an object"},
      {"generator", num(1), "\"generator\" must be a string"},
  };
  for (Case &c : cases) {
    SCOPED_TRACE(c.path);
    Node root = manifest(forwardKey());
    Node *node = at(root, c.path);
    ASSERT_NE(node, nullptr);
    *node = c.value;
    size_t offset = 0;
    std::string manifestText = text(root, node, &offset);
    EXPECT_EQ(fails(manifestText), at(offset) + c.message);
  }
  for (const char *root : {"[]", "\"manifest\"", "1", "null"})
    EXPECT_THAT(fails(root),
                HasSubstr(": byte 0: the manifest must be a JSON object, not "));
}

TEST(Manifest, IntegersMustBeWholeAndInRange) {
  std::string kernelName = "kernels[0] (\"" + forwardKey().str() + "\")";
  struct Case {
    std::string path, value, message;
  } cases[] = {
      {"kernels[0].args[0].rank", "1.5", ".args[0].rank\" must be an integer "
                                         "in [0, 3]"},
      {"kernels[0].args[0].rank", "2.0", "in [0, 3]"},
      {"kernels[0].args[0].rank", "2e0", "in [0, 3]"},
      {"kernels[0].args[0].rank", "-1", "in [0, 3]"},
      {"kernels[0].args[0].rank", "4", "in [0, 3]"},
      {"kernels[0].args[0].rank", "9223372036854775808", "in [0, 3]"},
      {"kernels[0].args[0].rank", "-9223372036854775809", "in [0, 3]"},
      {"kernels[0].launch.block_size", "2147483649",
       "\"kernels[0].launch.block_size\" must be an integer in [0, "
       "2147483648]"},
      {"kernels[0].launch.lds_bytes", "-1",
       "\"kernels[0].launch.lds_bytes\" must be an integer in [0, "
       "2147483648]"},
      {"kernels[0].launch.min_vocab", "-1",
       "\"kernels[0].launch.min_vocab\" must be an integer in [0, "
       "9223372036854775807]"},
      {"kernels[0].launch.min_vocab", "9223372036854775808",
       "in [0, 9223372036854775807]"},
      {"kernels[0].launch.min_vocab", "65536.5", "in [0, 9223372036854775807]"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.path + " = " + c.value);
    Node root = manifest(forwardKey(), kBundleFormatVersion, "sm_90");
    Node *node = at(root, c.path);
    ASSERT_NE(node, nullptr);
    *node = scalar(c.value);
    size_t offset = 0;
    std::string message = fails(text(root, node, &offset));
    EXPECT_THAT(message, StartsWith(at(offset)));
    EXPECT_THAT(message, HasSubstr(c.message));
  }
  // The limits themselves are accepted.
  Node root = manifest(forwardKey(), kBundleFormatVersion, "sm_90");
  *at(root, "kernels[0].launch.min_vocab") = scalar("9223372036854775807");
  EXPECT_EQ(accepts(text(root)).kernels.at(0).launch.minVocab,
            std::numeric_limits<int64_t>::max());
  // A number past a double's range is not even JSON.
  *at(root, "kernels[0].launch.min_vocab") = scalar("1e400");
  size_t offset = 0;
  std::string manifestText = text(root, at(root, "kernels[0].launch.min_vocab"),
                                  &offset);
  EXPECT_THAT(fails(manifestText),
              HasSubstr("invalid JSON at byte " + std::to_string(offset) +
                        " (line 1, column " + std::to_string(offset + 1) +
                        "): number 1e400 is outside the range of a double"));
}

TEST(Manifest, DuplicateKeysAreErrors) {
  // The JSON reader refuses duplicate member names anywhere, so a manifest
  // cannot say two things at once (readers differ on which one wins).
  for (const char *path :
       {"", "objects[0]", "kernels[0]", "kernels[0].args[3]",
        "kernels[0].launch"}) {
    SCOPED_TRACE(path);
    Node root = manifest(forwardKey());
    Node *object = *path ? at(root, path) : &root;
    ASSERT_NE(object, nullptr);
    std::pair<std::string, Node> copy = object->members.front();
    object->members.push_back(copy);
    // The offset of the second name: its value's offset less `"name": `.
    size_t offset = 0;
    std::string manifestText =
        text(root, &object->members.back().second, &offset);
    offset -= copy.first.size() + 4;
    EXPECT_THAT(fails(manifestText),
                HasSubstr("invalid JSON at byte " + std::to_string(offset) +
                          " (line 1, column " + std::to_string(offset + 1) +
                          "): duplicate member name \"" + copy.first + "\""));
  }
  // The same object file twice: its second entry.
  Node root = manifest(forwardKey());
  Node *objects = at(root, "objects");
  objects->items.push_back(objects->items[0]);
  size_t offset = 0;
  std::string manifestText = text(root, &objects->items[1], &offset);
  EXPECT_EQ(fails(manifestText),
            at(offset) + "object file \"host-x86_64.so\" listed twice");
}

TEST(Manifest, VersionsNewerThanTheRuntimeNameBothAndStopThere) {
  for (int64_t version :
       {kBundleFormatVersion + 1, std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE(version);
    Node root = manifest(forwardKey());
    *at(root, "version") = num(version);
    // A newer version may change anything else: nothing else is read (no
    // seal, objects of another shape, no kernels).
    *at(root, kManifestSealKey) = num(1);
    *at(root, "objects") = str("elsewhere");
    erase(root, "kernels");
    size_t offset = 0;
    std::string manifestText = text(root, at(root, "version"), &offset);
    std::string message = fails(manifestText);
    std::string v = std::to_string(version);
    std::string known = std::to_string(kBundleFormatVersion);
    EXPECT_EQ(message, at(offset) + "bundle format version " + v +
                           " is newer than version " + known +
                           ", the newest this runtime reads; use a runtime "
                           "that reads version " +
                           v + " or regenerate the bundle with a matching "
                               "ce-gen");
  }
  // The format is checked before the version.
  Node root = manifest(forwardKey());
  *at(root, "version") = num(kBundleFormatVersion + 1);
  *at(root, "format") = str("other-bundle");
  EXPECT_THAT(fails(text(root)),
              HasSubstr("\"format\" is \"other-bundle\", expected "
                        "\"cegen-bundle\" (not a cegen kernel bundle)"));
}

TEST(Manifest, VersionsThatAreNotPositiveIntegers) {
  for (const char *version :
       {"0", "-1", "-9223372036854775808", "9223372036854775808", "2.0", "1e0",
        "0.5"}) {
    SCOPED_TRACE(version);
    Node root = manifest(forwardKey());
    *at(root, "version") = scalar(version);
    size_t offset = 0;
    std::string manifestText = text(root, at(root, "version"), &offset);
    EXPECT_EQ(fails(manifestText),
              at(offset) + "\"version\" must be a positive integer");
  }
}

TEST(Manifest, StringsMustNotHoldNul) {
  // "\u0000" is valid JSON, but a C API reading the name would stop there
  // (dlsym would look up a prefix of the symbol, open() a prefix of the
  // path).
  for (auto [path, name, value] :
       {std::tuple{"kernels[0].symbol", "kernels[0].symbol",
                   "fake_forward_flat\\u0000x"},
        std::tuple{"objects[0].file", "objects[0].file",
                   "host-x86_64.so\\u0000.txt"},
        std::tuple{"kernels[0].object", "kernels[0].object",
                   "host-x86_64.so\\u0000"},
        std::tuple{"format", "format", "cegen-bundle\\u0000"}}) {
    SCOPED_TRACE(path);
    Node root = manifest(forwardKey());
    Node *node = at(root, path);
    *node = str(value);
    size_t offset = 0;
    std::string manifestText = text(root, node, &offset);
    EXPECT_EQ(fails(manifestText), at(offset) + "\"" + name +
                                       "\" must not contain a NUL character");
  }
}

TEST(Manifest, BadBytesInStringsAreInvalidJson) {
  struct Case {
    std::string bytes, message;
  } cases[] = {
      {"\xff", "invalid UTF-8 (byte 0xff) inside a string"},
      {"\xc0\xaf", "invalid UTF-8 (byte 0xc0) inside a string"},
      {"\xed\xa0\x80", "invalid UTF-8 (byte 0xed) inside a string"},
      {"\n", "control character (byte 0x0a) inside a string"},
      {std::string(1, '\0'), "control character (byte 0x00) inside a string"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.message);
    Node root = manifest(forwardKey());
    Node *node = at(root, "generator");
    *node = str("ce-gen " + c.bytes + " 0.1");
    size_t offset = 0;
    std::string manifestText = text(root, node, &offset);
    offset += 8; // past `"ce-gen `
    EXPECT_EQ(fails(manifestText),
              kPath + ": invalid JSON at byte " + std::to_string(offset) +
                  " (line 1, column " + std::to_string(offset + 1) +
                  "): " + c.message + (c.message[0] == 'c'
                                           ? " (missing '\"'?); JSON escapes it"
                                           : ""));
  }
}

TEST(Manifest, DeepNestingInAnUnknownKey) {
  // Unknown keys are ignored, but must still be JSON the reader can bound.
  auto nested = [](size_t depth) {
    return scalar(std::string(depth, '[') + std::string(depth, ']'));
  };
  Node root = manifest(forwardKey());
  root.members.insert(root.members.begin() + 2, {"future", nested(127)});
  accepts(text(root)); // 128 levels with the manifest object itself
  root.members[2].second = nested(128);
  size_t offset = 0;
  std::string manifestText = text(root, &root.members[2].second, &offset);
  EXPECT_THAT(fails(manifestText),
              HasSubstr("invalid JSON at byte " + std::to_string(offset + 127) +
                        " (line 1, column " + std::to_string(offset + 128) +
                        "): arrays and objects nested more than 128 levels "
                        "deep"));
}

TEST(Manifest, KernelRules) {
  auto withKey = [](KernelVariantKey key) {
    Node root = manifest(forwardKey());
    *at(root, "kernels[0].key") = str(key.str());
    return root;
  };
  KernelVariantKey forwardOverwrite = forwardKey();
  forwardOverwrite.overwrite = true;
  KernelVariantKey statsOverwrite = variant(KernelOp::ShardStats);
  statsOverwrite.overwrite = true;
  KernelVariantKey statsZLoss = variant(KernelOp::ShardStats);
  statsZLoss.zLoss = true;
  KernelVariantKey fusedNone = variant(KernelOp::Fused);
  fusedNone.weights = WeightsKind::None;
  KernelVariantKey backwardToken = variant(KernelOp::Backward);
  backwardToken.weights = WeightsKind::Token;
  struct Case {
    KernelVariantKey key;
    std::string message;
  } cases[] = {
      {forwardOverwrite, "a forward kernel cannot overwrite"},
      {statsOverwrite, "a shard_stats kernel cannot overwrite"},
      {statsZLoss, "a shard_stats kernel has no z-loss"},
      {fusedNone,
       "weights=none is not valid for a fused kernel (token)"},
      {backwardToken, "weights=token is only valid for a fused kernel"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.message);
    Node root = withKey(c.key);
    size_t offset = 0;
    std::string manifestText = text(root, at(root, "kernels[0]"), &offset);
    EXPECT_EQ(fails(manifestText), at(offset) + "kernels[0] (\"" +
                                       c.key.str() + "\"): " + c.message);
  }

  // Keys carry no shard field and no scalar weights since the vocabulary
  // slice and a scalar weight's stride 0 are run-time arguments: the
  // previous version 3 spellings are not keys.
  for (std::string key :
       {"op=shard_stats,logits=f32,labels=i64,layout=flat,"
        "label_smoothing=off,z_loss=off,overwrite=0,weights=none,shard=local",
        "op=backward,logits=f32,labels=i64,layout=flat,"
        "label_smoothing=on,z_loss=off,overwrite=0,weights=none,shard=global",
        "op=forward,logits=f32,labels=i64,layout=flat,"
        "label_smoothing=off,z_loss=off,overwrite=0,weights=none,shard=none",
        "op=fused,logits=f32,labels=i64,layout=flat,"
        "label_smoothing=off,z_loss=off,overwrite=0,weights=scalar"}) {
    SCOPED_TRACE(key);
    Node root = manifest(forwardKey());
    *at(root, "kernels[0].key") = str(key);
    size_t offset = 0;
    std::string manifestText = text(root, at(root, "kernels[0].key"), &offset);
    EXPECT_EQ(fails(manifestText),
              at(offset) + "kernels[0].key \"" + key +
                  "\" is not a variant key as KernelVariantKey::str() spells "
                  "it");
  }

  std::string name = "kernels[0] (\"" + forwardKey().str() + "\"): ";
  struct Change {
    std::string path, value, message;
  } changes[] = {
      {"kernels[0].abi", "memref-descriptor-fields",
       "unknown abi \"memref-descriptor-fields\" (expected "
       "\"memref-descriptor-pointers\")"},
      {"objects[0].kind", "hsaco",
       "host object \"host-x86_64.so\" has kind \"hsaco\", expected "
       "\"shared-object\""},
      {"objects[0].target", "sm_90",
       "object \"host-x86_64.so\" is for target \"sm_90\", the kernel for "
       "target \"host\""},
      {"kernels[0].object", "other.so",
       "object \"other.so\" is not listed in \"objects\""},
  };
  for (const Change &c : changes) {
    SCOPED_TRACE(c.path);
    Node root = manifest(forwardKey());
    *at(root, c.path) = str(c.value);
    std::string path = c.path == "kernels[0].abi" ? c.path : "kernels[0].object";
    size_t offset = 0;
    std::string manifestText = text(root, at(root, path), &offset);
    EXPECT_EQ(fails(manifestText), at(offset) + name + c.message);
  }
}

//--- args against BundleAbi.h ------------------------------------------------//

/// One of each kind of variant: every op, overwrite, token weights,
/// smoothing and z-loss, every layout, and dtypes other than f32/i64.
std::vector<KernelVariantKey> everyKindOfVariant() {
  std::vector<KernelVariantKey> keys = {
      variant(KernelOp::Forward),
      variant(KernelOp::Forward, LabelLayout::SbvBs, ElemType::BF16,
              ElemType::I32),
      variant(KernelOp::Backward, LabelLayout::SbvSb, ElemType::F16),
      variant(KernelOp::Fused, LabelLayout::SbvBs, ElemType::BF16),
      variant(KernelOp::ShardStats, LabelLayout::Flat, ElemType::BF16),
  };
  KernelVariantKey backwardOverwrite = variant(KernelOp::Backward);
  backwardOverwrite.overwrite = true;
  KernelVariantKey fusedTerms = variant(KernelOp::Fused);
  fusedTerms.smoothing = true;
  fusedTerms.zLoss = true;
  KernelVariantKey fusedOverwrite = variant(KernelOp::Fused, LabelLayout::SbvSb);
  fusedOverwrite.overwrite = true;
  KernelVariantKey smoothedBackward = variant(KernelOp::Backward);
  smoothedBackward.smoothing = true;
  KernelVariantKey sbStats = variant(KernelOp::ShardStats, LabelLayout::SbvSb);
  sbStats.smoothing = true;
  KernelVariantKey forwardZLoss = variant(KernelOp::Forward);
  forwardZLoss.zLoss = true;
  for (const KernelVariantKey &key :
       {backwardOverwrite, fusedTerms, fusedOverwrite, smoothedBackward,
        sbStats, forwardZLoss})
    keys.push_back(key);
  return keys;
}

TEST(ManifestArgs, TestBundlesCanonicalArgsAreBundleAbis) {
  // TestBundle.cpp spells every variant's arguments out by hand, as
  // docs/bundle-format.md gives them; BundleAbi.h must agree.
  for (const KernelVariantKey &key : everyKindOfVariant()) {
    SCOPED_TRACE(key.str());
    std::vector<std::tuple<std::string, int, std::string>> abi;
    for (ArgRole role : expectedRoles(key))
      abi.push_back({stringify(role), expectedArg(key, role).rank,
                     stringify(expectedArg(key, role).dtype)});
    EXPECT_EQ(canonicalArgs(key), abi);
  }
}

TEST(ManifestArgs, EveryKernelTakesTheEightValuesLast) {
  // Whatever the variant (with or without smoothing, z-loss or a shard),
  // its kernel takes all eight values, so that one C signature per tensor
  // count serves every variant.
  const std::vector<std::tuple<std::string, int, std::string>> values = {
      {"flags", 0, "i64"},           {"ignore_index", 0, "i64"},
      {"label_smoothing", 0, "f32"}, {"z_loss", 0, "f32"},
      {"shard_start", 0, "i64"},     {"shard_vocab", 0, "i64"},
      {"logit_scale", 0, "f32"},     {"logit_softcap", 0, "f32"}};
  for (const KernelVariantKey &key : everyKindOfVariant()) {
    SCOPED_TRACE(key.str());
    std::vector<ArgRole> roles = expectedRoles(key);
    std::vector<ArgRole> tensors = tensorRoles(key);
    ASSERT_EQ(roles.size(), tensors.size() + 8);
    EXPECT_TRUE(std::equal(tensors.begin(), tensors.end(), roles.begin()));
    for (size_t i = 0; i < roles.size(); ++i)
      EXPECT_EQ(isValueRole(roles[i]), i >= tensors.size()) << i;
    auto args = canonicalArgs(key);
    EXPECT_TRUE(std::equal(values.begin(), values.end(), args.end() - 8));
    EXPECT_EQ(tensors.back(), ArgRole::Status);
  }
}

/// `key`'s manifest with `args` as its kernel's arguments, and the offset
/// of `args[index]` (or of the array for -1).
std::string withArgs(const KernelVariantKey &key, Node args, int index,
                     size_t &offset) {
  Node root = manifest(key);
  Node *slot = at(root, "kernels[0].args");
  *slot = std::move(args);
  const Node *mark = index < 0 ? slot : &slot->items[index];
  return text(root, mark, &offset);
}

Node arg(const std::string &role, int64_t rank, const std::string &dtype) {
  return obj({{"role", str(role)}, {"rank", num(rank)}, {"dtype", str(dtype)}});
}

TEST(ManifestArgs, TheAbiArgsAreAccepted) {
  for (const KernelVariantKey &key : everyKindOfVariant()) {
    SCOPED_TRACE(key.str());
    size_t offset;
    Manifest parsed = accepts(withArgs(key, abiArgs(key), -1, offset));
    ASSERT_EQ(parsed.kernels.size(), 1u);
    std::vector<ArgRole> roles = expectedRoles(key);
    const std::vector<KernelArg> &args = parsed.kernels[0].args;
    ASSERT_EQ(args.size(), roles.size());
    for (size_t i = 0; i < roles.size(); ++i) {
      EXPECT_EQ(args[i].role, roles[i]);
      EXPECT_EQ(args[i].rank, expectedArg(key, roles[i]).rank);
      EXPECT_EQ(args[i].dtype, expectedArg(key, roles[i]).dtype);
    }
  }
}

TEST(ManifestArgs, OrderIsTheAbisOnly) {
  // ce-gen writes every kernel's parameters in the ABI's order (a kernel
  // from a .mlir file too: describeKernel refuses another order), so a
  // manifest that gives another order is damaged or from another writer.
  for (const KernelVariantKey &key : everyKindOfVariant()) {
    SCOPED_TRACE(key.str());
    std::vector<ArgRole> roles = expectedRoles(key);
    size_t tensors = tensorRoles(key).size();
    const std::string kernel = "kernels[0] (\"" + key.str() + "\")";
    // The tensors reversed: the first is the last tensor, status.
    Node args = abiArgs(key);
    std::reverse(args.items.begin(), args.items.begin() + tensors);
    size_t offset = 0;
    std::string manifestText = withArgs(key, args, 0, offset);
    EXPECT_EQ(fails(manifestText),
              at(offset) + kernel +
                  ".args[0]: argument role \"status\" where this variant "
                  "takes \"" +
                  stringify(roles[0]) + "\"");
    // The values reversed.
    args = abiArgs(key);
    std::reverse(args.items.begin() + tensors, args.items.end());
    manifestText = withArgs(key, args, int(tensors), offset);
    EXPECT_EQ(fails(manifestText),
              at(offset) + kernel + ".args[" + std::to_string(tensors) +
                  "]: argument role \"logit_softcap\" where this variant "
                  "takes \"flags\"");
  }
}

TEST(ManifestArgs, EveryMismatchWithTheAbiIsAnError) {
  const ElemType dtypes[] = {ElemType::BF16, ElemType::F16, ElemType::F32,
                             ElemType::I32, ElemType::I64};
  size_t cases = 0;
  for (const KernelVariantKey &key : everyKindOfVariant()) {
    SCOPED_TRACE(key.str());
    const std::string name = "kernels[0] (\"" + key.str() + "\")";
    const std::string kernel = name + ": ";
    const Node canonical = abiArgs(key);
    const std::vector<ArgRole> roles = expectedRoles(key);
    const size_t last = roles.size() - 1;
    auto expectError = [&](const Node &args, int index,
                           const std::string &message) {
      size_t offset = 0;
      std::string manifestText = withArgs(key, args, index, offset);
      EXPECT_EQ(fails(manifestText), at(offset) + message);
      ++cases;
    };
    // args[i] names `got` where the variant takes roles[i].
    auto misplaced = [&](size_t i, const std::string &got) {
      return name + ".args[" + std::to_string(i) + "]: argument role \"" + got +
             "\" where this variant takes \"" + stringify(roles[i]) + "\"";
    };
    const std::string afterLast = std::string("\" after the last one, \"") +
                                  stringify(roles[last]) + "\"";

    for (size_t i = 0; i < roles.size(); ++i) {
      std::string role = stringify(roles[i]);
      SCOPED_TRACE(role);
      ArgShape want = expectedArg(key, roles[i]);
      std::string expected = std::string(", expected ") +
                             stringify(want.dtype) + " of rank " +
                             std::to_string(want.rank) +
                             (isValueRole(roles[i]) ? " (by value)" : "");
      // Missing: the next role takes its place, or the list ends early.
      Node args = canonical;
      args.items.erase(args.items.begin() + i);
      if (i == last)
        expectError(args, -1,
                    kernel + "missing argument role \"" + role + "\"");
      else
        expectError(args, int(i), misplaced(i, stringify(roles[i + 1])));
      // Another rank.
      for (int64_t rank : {want.rank - 1, want.rank + 1}) {
        if (rank < 0 || rank > CE_MAX_RANK)
          continue;
        args = canonical;
        args.items[i] = arg(role, rank, stringify(want.dtype));
        expectError(args, int(i),
                    kernel + "argument \"" + role + "\" is " +
                        stringify(want.dtype) + " of rank " +
                        std::to_string(rank) + expected);
      }
      // Another dtype.
      for (ElemType dtype : dtypes) {
        if (dtype == want.dtype)
          continue;
        args = canonical;
        args.items[i] = arg(role, want.rank, stringify(dtype));
        expectError(args, int(i),
                    kernel + "argument \"" + role + "\" is " +
                        stringify(dtype) + " of rank " +
                        std::to_string(want.rank) + expected);
      }
      // Twice.
      args = canonical;
      args.items.insert(args.items.begin() + i + 1, canonical.items[i]);
      expectError(args, int(i) + 1,
                  i == last ? kernel + "unexpected argument role \"" + role +
                                  afterLast
                            : misplaced(i + 1, role));
      // Swapped with the next one.
      if (i < last) {
        args = canonical;
        std::swap(args.items[i], args.items[i + 1]);
        expectError(args, int(i), misplaced(i, stringify(roles[i + 1])));
      }
    }
    // A role this variant does not take, or no role at all, in the place
    // of the labels or after the last argument.
    std::vector<std::string> extras = {"bias", "LOGITS", "", "flag"};
    for (int r = 0; r < kNumArgRoles; ++r) {
      ArgRole role = static_cast<ArgRole>(r);
      if (std::find(roles.begin(), roles.end(), role) == roles.end())
        extras.push_back(stringify(role));
    }
    for (const std::string &extra : extras) {
      SCOPED_TRACE("extra " + extra);
      Node args = canonical;
      args.items.insert(args.items.begin() + 1, arg(extra, 1, "f32"));
      expectError(args, 1, misplaced(1, extra));
      args = canonical;
      args.items.push_back(arg(extra, 0, "i64"));
      expectError(args, int(roles.size()),
                  kernel + "unexpected argument role \"" + extra + afterLast);
    }
    // The lists of older versions: the tensors only (version 1), the
    // tensors and the flags (version 2).
    size_t tensors = tensorRoles(key).size();
    Node args = canonical;
    args.items.resize(tensors);
    expectError(args, -1, kernel + "missing argument role \"flags\"");
    args.items.push_back(canonical.items[tensors]);
    expectError(args, -1, kernel + "missing argument role \"ignore_index\"");
    // No arguments at all: the first role is missing.
    expectError(arr({}), -1,
                kernel + "missing argument role \"" + stringify(roles[0]) +
                    "\"");
  }
  EXPECT_GT(cases, 1000u);
}

} // namespace
