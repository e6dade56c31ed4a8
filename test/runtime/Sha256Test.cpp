//===- Sha256Test.cpp - Known answers for the runtime's SHA-256 -----------===//
//
// The runtime hashes code objects and manifests with its own SHA-256
// (runtime/lib/Sha256.cpp, compiled into this test) and compares the result
// with what ce-gen computed with LLVM's: FIPS 180-4's examples, messages
// around the 55/56/64-byte padding boundaries, a million bytes, and
// incremental updates split at every offset.
//
//===----------------------------------------------------------------------===//

#include "Sha256.h"

#include <gtest/gtest.h>

#include <string>

using namespace ce;

namespace {

std::string hexOf(Sha256 &hash) {
  std::string hex;
  static const char digits[] = "0123456789abcdef";
  for (uint8_t byte : hash.finish()) {
    hex += digits[byte >> 4];
    hex += digits[byte & 15];
  }
  return hex;
}

TEST(Sha256, KnownAnswers) {
  // FIPS 180-4 examples (NIST CSRC "SHA256.pdf") and the million-a message.
  EXPECT_EQ(sha256Hex(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256Hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(
      sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(
      sha256Hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmn"
                "hijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"),
      "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PaddingBoundaries) {
  // n bytes of 'a' (coreutils sha256sum): the length field fits after 55
  // bytes of a block, not after 56.
  struct Case {
    size_t length;
    const char *digest;
  } cases[] = {
      {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
      {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
      {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
      {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
      {65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0"},
      {119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"},
      {120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"},
  };
  for (const Case &c : cases)
    EXPECT_EQ(sha256Hex(std::string(c.length, 'a')), c.digest) << c.length;
}

TEST(Sha256, IncrementalUpdatesMatchOneShot) {
  std::string message;
  for (int i = 0; i < 300; ++i)
    message += char(i * 37 + 11);
  std::string expected = sha256Hex(message);
  for (size_t split = 0; split <= message.size(); ++split) {
    Sha256 hash;
    hash.update(message.data(), split);
    hash.update(message.data() + split, message.size() - split);
    ASSERT_EQ(hexOf(hash), expected) << "split at " << split;
  }
  Sha256 bytewise;
  for (char c : message)
    bytewise.update(&c, 1);
  EXPECT_EQ(hexOf(bytewise), expected);
}

TEST(Sha256, HexSpelling) {
  EXPECT_TRUE(isSha256Hex(sha256Hex("x")));
  EXPECT_FALSE(isSha256Hex(""));
  EXPECT_FALSE(isSha256Hex(std::string(63, 'a')));
  EXPECT_FALSE(isSha256Hex(std::string(65, 'a')));
  EXPECT_FALSE(isSha256Hex(std::string(64, 'A')));
  EXPECT_FALSE(isSha256Hex(std::string(63, '0') + "g"));
}

} // namespace
