//===- ObjectCheck.cpp - Code objects are untrusted input -----------------===//
//
// The per-kind structural checks (ELF ones in ElfCheck.cpp, PTX here) and the
// manifest's SHA-256, applied to the bytes in hand before any loader sees
// them: at bundle open for every object (host objects are then dlopened) and
// again when a GPU object is read for a module load, so that the bytes handed
// to the driver are the bytes that were checked.
//
//===----------------------------------------------------------------------===//

#include "ObjectCheck.h"
#include "Sha256.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

namespace ce {

namespace {

/// Code objects are bigger than manifests, but not this big.
constexpr std::streamoff kMaxObjectBytes = std::streamoff(1) << 30;

/// Skips whitespace and comments from `at`; returns false inside an
/// unterminated block comment.
bool skipSpace(std::string_view text, size_t &at) {
  while (at < text.size()) {
    char c = text[at];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' ||
        c == '\f') {
      ++at;
    } else if (text.compare(at, 2, "//") == 0) {
      size_t end = text.find('\n', at);
      at = end == std::string_view::npos ? text.size() : end + 1;
    } else if (text.compare(at, 2, "/*") == 0) {
      size_t end = text.find("*/", at + 2);
      if (end == std::string_view::npos)
        return false;
      at = end + 2;
    } else {
      break;
    }
  }
  return true;
}

bool isIdentifierChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '_' || c == '$' || c == '.';
}

/// Whether the directive `word` (".version") starts at `at`.
bool directiveAt(std::string_view text, size_t at, std::string_view word) {
  return text.compare(at, word.size(), word) == 0 &&
         (at + word.size() == text.size() ||
          !isIdentifierChar(text[at + word.size()]));
}

const char *kindName(ElfKind kind) {
  switch (kind) {
  case ElfKind::HostSharedObject:
    return "x86-64 shared object";
  case ElfKind::Hsaco:
    return "AMDGPU code object";
  case ElfKind::Cubin:
    return "CUDA cubin";
  }
  return "?";
}

} // namespace

std::string checkPtx(std::string_view text) {
  if (text.empty())
    return "empty";
  for (size_t i = 0; i < text.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 && c != '\t' && c != '\n' && c != '\r' && c != '\v' &&
        c != '\f')
      return std::string(c == 0 ? "a NUL byte" : "a control byte") +
             " at offset " + std::to_string(i) + " (PTX is text)";
  }
  // PTX's first directive is .version, then .target (the PTX ISA, "PTX
  // module directives").
  size_t at = 0;
  if (!skipSpace(text, at))
    return "truncated: an unterminated comment";
  if (!directiveAt(text, at, ".version"))
    return "it does not start with a .version directive (not PTX)";
  at = std::min(text.find('\n', at), text.size());
  if (!skipSpace(text, at) || !directiveAt(text, at, ".target"))
    return "no .target directive after .version (not PTX, or truncated)";

  // Braces balance outside comments and strings, and the last thing in the
  // text is the closing brace of a function.
  int64_t depth = 0;
  bool entry = false, endsWithBrace = false;
  for (at = 0;;) {
    if (!skipSpace(text, at))
      return "truncated: an unterminated comment";
    if (at >= text.size())
      break;
    char c = text[at];
    endsWithBrace = false;
    if (c == '"') {
      size_t end = text.find('"', at + 1);
      if (end == std::string_view::npos)
        return "truncated: an unterminated string";
      at = end + 1;
    } else if (c == '{') {
      ++depth;
      ++at;
    } else if (c == '}') {
      if (--depth < 0)
        return "a '}' at offset " + std::to_string(at) + " closes nothing";
      endsWithBrace = depth == 0;
      ++at;
    } else if (isIdentifierChar(c)) {
      size_t start = at;
      while (at < text.size() && isIdentifierChar(text[at]))
        ++at;
      entry |= text.substr(start, at - start) == ".entry";
    } else {
      ++at;
    }
  }
  if (depth != 0)
    return "truncated: " + std::to_string(depth) +
           " unclosed '{' at the end of the text";
  if (!entry)
    return "no .entry (no kernel; truncated?)";
  if (!endsWithBrace)
    return "truncated: the text does not end with a function's closing '}'";
  return "";
}

Status checkCodeObject(std::string_view bytes, const ObjectInfo &object,
                       size_t index, const std::string &path) {
  std::string where = "code object '" + path + "' (objects[" +
                      std::to_string(index) + "], target " + object.target +
                      ", kind " + object.kind + ")";
  // Host objects are dlopened whatever their kind says; the manifest reader
  // rejects a host kernel whose object is not a shared object.
  std::string problem, what;
  if (object.target == "host" || object.kind == kObjectKindSharedObject) {
    what = kindName(ElfKind::HostSharedObject);
    problem = checkElf(bytes, ElfKind::HostSharedObject);
  } else if (object.kind == kObjectKindHsaco) {
    what = kindName(ElfKind::Hsaco);
    problem = checkElf(bytes, ElfKind::Hsaco);
  } else if (object.kind == kObjectKindCubin) {
    what = kindName(ElfKind::Cubin);
    problem = checkElf(bytes, ElfKind::Cubin);
  } else if (object.kind == kObjectKindPtx) {
    what = "PTX module";
    problem = checkPtx(bytes);
  }
  // Objects of other kinds belong to targets this runtime does not know; it
  // never loads them, but their hash is still checked.
  if (!problem.empty())
    return Status::bundleError(where + " is damaged (not a valid " + what +
                               "): " + problem +
                               "; the bundle is damaged or incompletely "
                               "copied: regenerate or copy it again");
  if (!object.sha256.empty()) {
    std::string actual = sha256Hex(bytes);
    if (actual != object.sha256)
      return Status::bundleError(
          where + " does not match its manifest: its SHA-256 is " + actual +
          ", the manifest records " + object.sha256 +
          " (the object and manifest.json come from different ce-gen runs, "
          "or the object was changed or incompletely copied); regenerate "
          "the bundle");
  }
  return Status::ok();
}

Status readCodeObject(const std::string &path, const ObjectInfo &object,
                      size_t index, std::string &bytes) {
  std::ifstream stream(path, std::ios::binary | std::ios::ate);
  if (!stream)
    return Status::bundleError("cannot open code object '" + path +
                               "': " + std::strerror(errno));
  std::streamoff size = stream.tellg();
  if (size <= 0 || size > kMaxObjectBytes)
    return Status::bundleError("code object '" + path + "' has " +
                               std::to_string(size) + " bytes");
  bytes.resize(static_cast<size_t>(size));
  stream.seekg(0);
  if (!stream.read(bytes.data(), size))
    return Status::bundleError("cannot read code object '" + path + "'");
  // PTX is text that the driver reads up to its NUL; std::string keeps one
  // past the end, which c_str() hands over.
  return checkCodeObject(bytes, object, index, path);
}

} // namespace ce
