//===- Sha256.h - SHA-256 of code objects -----------------------*- C++ -*-===//
//
// Internal to the runtime (not installed). The manifest records the SHA-256
// of every code object (`objects[i].sha256`, bundle format version 2) and the
// runtime checks it before loading the object. The runtime links no crypto
// library, so this is FIPS 180-4's SHA-256, small and unoptimized: a bundle's
// objects are a few MB at most and are hashed once per open or module load.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_SHA256_H
#define CE_RUNTIME_SHA256_H

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ce {

/// An incremental SHA-256 (FIPS 180-4).
class Sha256 {
public:
  Sha256();
  /// Appends `size` bytes at `data` to the message.
  void update(const void *data, size_t size);
  /// Pads the message and returns its digest; the object is spent.
  std::array<uint8_t, 32> finish();

private:
  void compress(const uint8_t *block);

  std::array<uint32_t, 8> state;
  std::array<uint8_t, 64> buffer{};
  size_t buffered = 0;
  uint64_t totalBytes = 0;
};

/// The SHA-256 of `bytes` as 64 lowercase hexadecimal digits, as the
/// manifest spells it.
std::string sha256Hex(std::string_view bytes);

/// Whether `text` is 64 lowercase hexadecimal digits.
bool isSha256Hex(std::string_view text);

} // namespace ce

#endif // CE_RUNTIME_SHA256_H
