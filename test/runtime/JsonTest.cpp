//===- JsonTest.cpp - The manifest's JSON reader, error by error ----------===//
//
// runtime/lib/Json.cpp on its own (compiled into the test from the runtime's
// sources): every kind of malformed text fails with its own message at the
// byte offset of the problem (and the right line and column); a manifest cut
// at any byte fails at the cut with "unexpected end of input"; duplicate
// member names, control characters and ill-formed UTF-8 in strings, numbers
// outside a double's range and nesting past 128 levels are errors; what is
// accepted is decoded exactly (escapes, UTF-8, integers to int64's limits).
//
//===----------------------------------------------------------------------===//

#include "Json.h"
#include "TestBundle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using namespace ce;
using namespace ce::test;
using ::testing::HasSubstr;

namespace {

/// Parses `text`, expecting an error; returns it.
json::ParseError parseFails(const std::string &text) {
  json::Value value;
  json::ParseError error;
  EXPECT_FALSE(json::parse(text, value, error)) << "parsed: " << text;
  return error;
}

/// The value of `text`, expected to parse.
json::Value parseOk(const std::string &text) {
  json::Value value;
  json::ParseError error;
  EXPECT_TRUE(json::parse(text, value, error))
      << error.message << " at byte " << error.offset << " of: " << text;
  return value;
}

/// The 1-based line and byte column of `offset` in `text`.
std::pair<size_t, size_t> lineColumn(const std::string &text, size_t offset) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return {line, column};
}

struct ErrorCase {
  std::string text;
  size_t offset;
  std::string message;
};

void expectErrors(const std::vector<ErrorCase> &cases) {
  for (const ErrorCase &c : cases) {
    SCOPED_TRACE("text: " + c.text);
    json::ParseError error = parseFails(c.text);
    EXPECT_EQ(error.offset, c.offset) << error.message;
    EXPECT_THAT(error.message, HasSubstr(c.message));
    auto [line, column] = lineColumn(c.text, c.offset);
    EXPECT_EQ(error.line, line);
    EXPECT_EQ(error.column, column);
  }
}

const std::string kEnd = "unexpected end of input (truncated file?), ";

TEST(Json, StructureErrors) {
  expectErrors({
      {"", 0, kEnd + "expected a value"},
      {"   \n ", 5, kEnd + "expected a value"},
      {"[1,]", 3, "unexpected ']', expected a value"},
      {"{\"a\": 1,}", 8, "unexpected '}', expected a member name string"},
      {"{\"a\" 1}", 5, "unexpected '1', expected ':'"},
      {"{a: 1}", 1, "unexpected 'a', expected a member name string"},
      {"{'a': 1}", 1, "unexpected ''', expected a member name string"},
      {"[1 2]", 3, "unexpected '2', expected ',' or ']'"},
      {"{\"a\": 1 \"b\": 2}", 8, "unexpected '\"', expected ',' or '}'"},
      {"[1] 2", 4, "unexpected text after the JSON value"},
      {std::string("[1]\0", 4), 3, "unexpected text after the JSON value"},
      {"// a comment\n1", 0, "unexpected '/', expected a value"},
      {"/* a comment */ 1", 0, "unexpected '/', expected a value"},
      {"{\"a\": [1, 2}", 11, "unexpected '}', expected ',' or ']'"},
      {"[1, 2", 5, kEnd + "expected ',' or ']'"},
      {"{\"a\"", 4, kEnd + "expected ':'"},
      {"{\"a\":", 5, kEnd + "expected a value"},
      {"{", 1, kEnd + "expected a member name string"},
  });
}

TEST(Json, LiteralErrors) {
  expectErrors({
      {"tru", 3, kEnd + "expected 'true'"},
      {"trux", 3, "unexpected 'x', expected 'true'"},
      {"True", 0, "unexpected 'T', expected a value"},
      {"nul", 3, kEnd + "expected 'null'"},
      {"nulll", 4, "unexpected text after the JSON value"},
      {"fals", 4, kEnd + "expected 'false'"},
      {"NaN", 0, "unexpected 'N', expected a value"},
      {"Infinity", 0, "unexpected 'I', expected a value"},
      {"-Infinity", 1, "unexpected 'I', expected a digit"},
  });
}

TEST(Json, WhitespaceIsTheFourJsonBytesOnly) {
  EXPECT_TRUE(parseOk(" \t\r\n1 \t\r\n").isNumber());
  expectErrors({
      {"\f1", 0, "unexpected byte 0x0c, expected a value"},
      {"\v1", 0, "unexpected byte 0x0b, expected a value"},
      {"\xa0"
       "1",
       0, "unexpected byte 0xa0, expected a value"},
      // A byte-order mark: not JSON text (RFC 8259 lets a reader refuse it).
      {"\xef\xbb\xbf{}", 0, "unexpected byte 0xef, expected a value"},
  });
}

TEST(Json, NumberErrors) {
  expectErrors({
      {"-", 1, kEnd + "expected a digit"},
      {"-a", 1, "unexpected 'a', expected a digit"},
      {"1.", 2, kEnd + "expected a digit after '.'"},
      {"1.e5", 2, "unexpected 'e', expected a digit after '.'"},
      {".5", 0, "unexpected '.', expected a value"},
      {"+1", 0, "unexpected '+', expected a value"},
      {"1e", 2, kEnd + "expected a digit in the exponent"},
      {"1e+", 3, kEnd + "expected a digit in the exponent"},
      {"01", 1, "unexpected text after the JSON value"},
      {"{\"a\": 01}", 7, "unexpected '1', expected ',' or '}'"},
      {"0x10", 1, "unexpected text after the JSON value"},
      {"1.5.2", 3, "unexpected text after the JSON value"},
  });
}

TEST(Json, NumbersOutsideADoubleAreErrors) {
  std::string huge(400, '9'); // about 1e400, an integer
  expectErrors({
      {"1e400", 0, "number 1e400 is outside the range of a double"},
      {"-1e400", 0, "number -1e400 is outside the range of a double"},
      {"[0.5, 1E+309]", 6, "number 1E+309 is outside the range of a double"},
      // Underflow to zero is as lossy as overflow.
      {"1e-400", 0, "number 1e-400 is outside the range of a double"},
      // A long literal is shortened in the message.
      {huge, 0, "number " + huge.substr(0, 40) + "... is outside the range"},
  });
  // The largest and smallest doubles are in range.
  EXPECT_EQ(parseOk("1.7976931348623157e308").getNumber(),
            std::numeric_limits<double>::max());
  EXPECT_EQ(parseOk("4.9406564584124654e-324").getNumber(),
            std::numeric_limits<double>::denorm_min());
}

TEST(Json, IntegersAreExactToInt64sLimits) {
  struct Case {
    const char *text;
    std::optional<int64_t> integer;
    double number;
  } cases[] = {
      {"0", 0, 0.0},
      {"-0", 0, -0.0},
      {"42", 42, 42.0},
      {"9223372036854775807", std::numeric_limits<int64_t>::max(),
       9223372036854775807.0},
      {"-9223372036854775808", std::numeric_limits<int64_t>::min(),
       -9223372036854775808.0},
      {"9007199254740993", 9007199254740993, 9007199254740992.0},
      // Past int64: a number, not an integer.
      {"9223372036854775808", std::nullopt, 9223372036854775808.0},
      {"-9223372036854775809", std::nullopt, -9223372036854775808.0},
      // A fraction or an exponent makes a number that is not an integer,
      // even where its value is whole.
      {"1.0", std::nullopt, 1.0},
      {"1e2", std::nullopt, 100.0},
      {"0.1", std::nullopt, 0.1},
      {"-2.5E-3", std::nullopt, -2.5e-3},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.text);
    json::Value value = parseOk(c.text);
    ASSERT_TRUE(value.isNumber());
    EXPECT_EQ(value.getInteger(), c.integer);
    EXPECT_EQ(value.getNumber(), c.number);
  }
  EXPECT_EQ(parseOk("\"1\"").getInteger(), std::nullopt);
  EXPECT_EQ(parseOk("true").getInteger(), std::nullopt);
}

TEST(Json, StringEscapeErrors) {
  expectErrors({
      {"\"abc", 4, "unexpected end of input inside the string that starts "
                   "at byte 0 (truncated file?)"},
      {"[\"a\", \"b", 8, "inside the string that starts at byte 6"},
      {"\"a\\", 3, kEnd + "expected an escape character"},
      {"\"\\q\"", 1, "invalid escape '\\q'"},
      {"\"ab\\x41\"", 3, "invalid escape '\\x'"},
      {"\"\\u12g4\"", 5, "unexpected 'g', expected a hex digit"},
      {"\"\\u12", 5, kEnd + "expected a hex digit"},
      {"\"\\ud800\"", 1, "unpaired UTF-16 surrogate in \\u escape"},
      {"\"\\ud800x\"", 1, "unpaired UTF-16 surrogate in \\u escape"},
      {"\"\\ud800\\n\"", 1, "unpaired UTF-16 surrogate in \\u escape"},
      {"\"\\ud800\\u0041\"", 1, "unpaired UTF-16 surrogate in \\u escape"},
      {"\"\\ud800\\ud800\"", 1, "unpaired UTF-16 surrogate in \\u escape"},
      {"\"\\udc00\"", 1, "unpaired UTF-16 surrogate in \\u escape"},
      // Cut inside a surrogate pair: the end of input, like any other cut.
      {"\"\\ud800", 7, kEnd + "expected the low surrogate's \\u escape"},
      {"\"\\ud800\\", 8, kEnd + "expected the low surrogate's \\u escape"},
      {"\"\\ud800\\u", 9, kEnd + "expected a hex digit"},
  });
}

TEST(Json, ControlCharactersInStrings) {
  std::vector<ErrorCase> cases;
  for (int byte = 0; byte < 0x20; ++byte) {
    static const char digits[] = "0123456789abcdef";
    std::string hex = {digits[byte >> 4], digits[byte & 15]};
    cases.push_back({"\"ab" + std::string(1, char(byte)) + "\"", 3,
                     "control character (byte 0x" + hex +
                         ") inside a string (missing '\"'?)"});
  }
  expectErrors(cases);
  // DEL is not a control character to JSON.
  EXPECT_EQ(parseOk("\"\x7f\"").getString(), "\x7f");
}

TEST(Json, StringsMustBeWellFormedUtf8) {
  struct Case {
    const char *bytes; ///< After `"ab`.
    const char *lead;  ///< The offending byte, as the message shows it.
  } cases[] = {
      {"\x80", "0x80"},             // a continuation byte alone
      {"\xbf", "0xbf"},             //
      {"\xc0\x80", "0xc0"},         // overlong U+0000
      {"\xc1\xbf", "0xc1"},         // overlong U+007F
      {"\xc3x", "0xc3"},            // a lead byte without its continuation
      {"\xe0\x80\x80", "0xe0"},     // overlong U+0000
      {"\xe0\x9f\xbf", "0xe0"},     // overlong U+07FF
      {"\xed\xa0\x80", "0xed"},     // U+D800, a UTF-16 surrogate
      {"\xed\xbf\xbf", "0xed"},     // U+DFFF
      {"\xe2\x82x", "0xe2"},        // cut short by ASCII
      {"\xe2\x82\"", "0xe2"},       // cut short by the closing quote
      {"\xf0\x80\x80\x80", "0xf0"}, // overlong U+0000
      {"\xf0\x8f\xbf\xbf", "0xf0"}, // overlong U+FFFF
      {"\xf4\x90\x80\x80", "0xf4"}, // U+110000
      {"\xf5\x80\x80\x80", "0xf5"}, // past U+10FFFF
      {"\xf8\x88\x80\x80\x80", "0xf8"},
      {"\xfe", "0xfe"},
      {"\xff", "0xff"},
      {"\xf0\x9f\x98x", "0xf0"}, // a 4-byte sequence cut short
  };
  for (const Case &c : cases) {
    std::string text = std::string("\"ab") + c.bytes + "\"";
    SCOPED_TRACE(c.lead);
    json::ParseError error = parseFails(text);
    EXPECT_EQ(error.offset, 3u);
    EXPECT_THAT(error.message, HasSubstr(std::string("invalid UTF-8 (byte ") +
                                         c.lead + ") inside a string"));
  }
  // The shortest and longest sequences of each length, kept byte for byte.
  const std::string good = "\xc2\x80\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf"
                           "\xed\x9f\xbf\xee\x80\x80\xf0\x90\x80\x80"
                           "\xf4\x8f\xbf\xbf\xc3\xa9\xe2\x82\xac";
  EXPECT_EQ(parseOk("\"" + good + "\"").getString(), good);
  EXPECT_EQ(parseOk("{\"" + good + "\": 1}").memberKeys().at(0), good);
  // Outside strings, any byte >= 0x80 is unexpected.
  expectErrors({{"[\xc3\xa9]", 1, "unexpected byte 0xc3, expected a value"}});
}

TEST(Json, EscapesAreDecoded) {
  json::Value value = parseOk(
      R"("\"\\\/\b\f\n\r\t\u0041\u00e9\u20ac\ud83d\ude00\uDBFF\uDFFF\u0000")");
  EXPECT_EQ(value.getString(),
            std::string("\"\\/\b\f\n\r\tA\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"
                        "\xf4\x8f\xbf\xbf\0",
                        23));
}

TEST(Json, DuplicateMemberNamesAreErrors) {
  // RFC 8259 leaves duplicates to the reader; readers differ on which value
  // wins, so a manifest with one is refused, at the second name.
  expectErrors({
      {"{\"a\": 1, \"a\": 2}", 9, "duplicate member name \"a\""},
      // The same name after escapes are decoded.
      {"{\"a\": 1, \"\\u0061\": 2}", 9, "duplicate member name \"a\""},
      {"{\"o\": {\"x\": 1, \"y\": 2, \"x\": 3}}", 23,
       "duplicate member name \"x\""},
      {"[{}, {\"k\": null, \"k\": null}]", 17, "duplicate member name \"k\""},
      {"{\"\": 1, \"\": 2}", 8, "duplicate member name \"\""},
  });
  // Names that differ, in case or in their object, are not duplicates.
  json::Value value = parseOk("{\"a\": 1, \"A\": 2, \"o\": {\"a\": 3}}");
  EXPECT_EQ(value.memberKeys(), (std::vector<std::string>{"a", "A", "o"}));
  EXPECT_EQ(parseOk("[{\"a\": 1}, {\"a\": 2}]").getArray().size(), 2u);
}

TEST(Json, NestingIsBoundedAt128Levels) {
  auto arrays = [](size_t depth) {
    return std::string(depth, '[') + std::string(depth, ']');
  };
  auto objects = [](size_t depth) {
    std::string text;
    for (size_t i = 0; i < depth; ++i)
      text += "{\"a\":";
    return text + "1" + std::string(depth, '}');
  };
  EXPECT_TRUE(parseOk(arrays(128)).isArray());
  EXPECT_TRUE(parseOk(objects(128)).isObject());
  const std::string message =
      "arrays and objects nested more than 128 levels deep";
  expectErrors({
      {arrays(129), 128, message},
      {objects(129), 128 * 5, message},
      {"{\"a\": " + arrays(128) + "}", 6 + 127, message},
  });
  // Far deeper text fails at the same place, without using the stack.
  json::ParseError error = parseFails(std::string(1 << 20, '['));
  EXPECT_EQ(error.offset, 128u);
  EXPECT_THAT(error.message, HasSubstr(message));
}

TEST(Json, ValuesKeepTheirOffsetsAndOrder) {
  const std::string text =
      "{\"n\": null, \"t\": true, \"f\": false, \"i\": -12, \"d\": 2.5,\n"
      " \"s\": \"x\", \"a\": [1, \"y\"], \"o\": {}}";
  json::Value root = parseOk(text);
  ASSERT_TRUE(root.isObject());
  EXPECT_EQ(root.offset(), 0u);
  EXPECT_EQ(root.memberKeys(),
            (std::vector<std::string>{"n", "t", "f", "i", "d", "s", "a", "o"}));
  struct Member {
    const char *key, *valueText;
    json::Value::Kind kind;
  } members[] = {
      {"n", "null", json::Value::Kind::Null},
      {"t", "true", json::Value::Kind::Bool},
      {"f", "false", json::Value::Kind::Bool},
      {"i", "-12", json::Value::Kind::Number},
      {"d", "2.5", json::Value::Kind::Number},
      {"s", "\"x\"", json::Value::Kind::String},
      {"a", "[1", json::Value::Kind::Array},
      {"o", "{}", json::Value::Kind::Object},
  };
  for (const Member &m : members) {
    SCOPED_TRACE(m.key);
    const json::Value *value = root.get(m.key);
    ASSERT_NE(value, nullptr);
    EXPECT_EQ(value->kind(), m.kind);
    EXPECT_EQ(value->offset(),
              text.find(std::string("\"") + m.key + "\": " + m.valueText) +
                  5);
  }
  EXPECT_TRUE(root.get("t")->getBool());
  EXPECT_FALSE(root.get("f")->getBool());
  EXPECT_EQ(root.get("i")->getInteger(), -12);
  EXPECT_EQ(root.get("s")->getString(), "x");
  const json::Value &array = *root.get("a");
  ASSERT_EQ(array.getArray().size(), 2u);
  EXPECT_EQ(array.getArray()[1].offset(), text.find("\"y\""));
  EXPECT_EQ(root.get("missing"), nullptr);
  EXPECT_EQ(array.get("a"), nullptr); // not an object
  EXPECT_STREQ(json::Value::kindName(json::Value::Kind::Object), "object");
}

TEST(Json, LineAndColumnCountBytesAfterTheLastNewline) {
  std::string text = "{\n  \"a\": 1,\n  \"b\": x\n}";
  json::ParseError error = parseFails(text);
  EXPECT_EQ(error.offset, text.find('x'));
  EXPECT_EQ(error.line, 3u);
  EXPECT_EQ(error.column, 8u);
  text = "{\r\n\"\xc3\xa9\": x}"; // CRLF; a column counts bytes
  error = parseFails(text);
  EXPECT_EQ(error.offset, 9u);
  EXPECT_EQ(error.line, 2u);
  EXPECT_EQ(error.column, 7u);
}

/// A manifest with two kernels and strings that hold escapes, surrogate
/// pairs and multi-byte UTF-8, which a cut may split.
std::string richManifest() {
  KernelVariantKey backward = forwardKey(LabelLayout::SbvSb);
  backward.op = KernelOp::Backward;
  std::string text = manifestJson(
      {{forwardKey(), "fake_forward_flat", {}}, {backward, "b", {}}});
  size_t at = text.find("runtime_bundle_test");
  text.insert(at + 19, " \\\"\\u00e9\\ud83d\\ude00 \xc3\xa9\xf0\x9f\x98\x80"
                       " -12.5e-3");
  return sealManifest(text);
}

TEST(Json, AManifestCutAtEveryByteFailsAtTheCut) {
  const std::string text = richManifest();
  size_t last = text.rfind('}');
  ASSERT_NE(last, std::string::npos);
  size_t failures = 0;
  for (size_t length = 0; length <= last; ++length) {
    std::string cut = text.substr(0, length);
    json::Value value;
    json::ParseError error;
    bool parsed = json::parse(cut, value, error);
    auto [line, column] = lineColumn(text, length);
    bool ok = !parsed && error.offset == length &&
              error.message.find("unexpected end of input") !=
                  std::string::npos &&
              error.line == line && error.column == column;
    if (!ok && ++failures <= 10)
      ADD_FAILURE() << "cut to " << length << " bytes (..."
                    << cut.substr(cut.size() > 20 ? cut.size() - 20 : 0)
                    << "): "
                    << (parsed ? "parsed"
                               : error.message + " at byte " +
                                     std::to_string(error.offset));
  }
  EXPECT_EQ(failures, 0u);
  // Whole, and with only trailing whitespace cut, it parses.
  for (size_t length = last + 1; length <= text.size(); ++length)
    EXPECT_TRUE(parseOk(text.substr(0, length)).isObject());
}

} // namespace
