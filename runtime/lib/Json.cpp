//===- Json.cpp - A small JSON reader for bundle manifests ----------------===//
//
// A recursive-descent reader for RFC 8259 JSON. It is strict (no comments,
// no trailing commas, no NaN literals, no duplicate member names, strings of
// well-formed UTF-8 only, numbers within a double's range) because a
// manifest is written by a program, and a lenient reader would hide a broken
// writer. Every error has the byte offset of the problem; a truncated text
// always fails at its end with "unexpected end of input".
//
//===----------------------------------------------------------------------===//

#include "Json.h"

#include <algorithm>
#include <charconv>
#include <initializer_list>
#include <cmath>
#include <system_error>

namespace ce::json {

const Value *Value::get(std::string_view key) const {
  if (valueKind != Kind::Object)
    return nullptr;
  for (size_t i = 0; i < keys.size(); ++i)
    if (keys[i] == key)
      return &elements[i];
  return nullptr;
}

const char *Value::kindName(Kind kind) {
  switch (kind) {
  case Kind::Null:
    return "null";
  case Kind::Bool:
    return "boolean";
  case Kind::Number:
    return "number";
  case Kind::String:
    return "string";
  case Kind::Array:
    return "array";
  case Kind::Object:
    return "object";
  }
  return "?";
}

/// Holds the cursor; every method returns false after recording an error.
class Parser {
public:
  explicit Parser(std::string_view text) : text(text) {}

  bool parseDocument(Value &result) {
    skipWhitespace();
    if (!parseValue(result, /*depth=*/0))
      return false;
    skipWhitespace();
    if (pos != text.size())
      return fail("unexpected text after the JSON value");
    return true;
  }

  ParseError takeError() {
    ParseError result;
    result.message = std::move(errorMessage);
    result.offset = errorOffset;
    for (size_t i = 0; i < errorOffset && i < text.size(); ++i) {
      if (text[i] == '\n') {
        ++result.line;
        result.column = 1;
      } else {
        ++result.column;
      }
    }
    return result;
  }

private:
  /// Arrays and objects nested deeper than this are rejected rather than
  /// risking the stack (each level is a few frames of recursion).
  static constexpr int maxDepth = 128;

  bool fail(std::string message) { return failAt(pos, std::move(message)); }
  bool failAt(size_t offset, std::string message) {
    errorOffset = offset;
    errorMessage = std::move(message);
    return false;
  }
  bool atEnd() const { return pos >= text.size(); }
  bool failUnexpected(const char *expected) {
    if (atEnd())
      return fail(std::string("unexpected end of input (truncated file?), "
                              "expected ") +
                  expected);
    char c = text[pos];
    std::string shown = (c >= 0x20 && c < 0x7f)
                            ? std::string("'") + c + "'"
                            : "byte 0x" + hex(static_cast<unsigned char>(c));
    return fail("unexpected " + shown + ", expected " + expected);
  }
  static std::string hex(unsigned value) {
    static const char digits[] = "0123456789abcdef";
    return std::string(1, digits[(value >> 4) & 15]) + digits[value & 15];
  }

  void skipWhitespace() {
    while (!atEnd() && (text[pos] == ' ' || text[pos] == '\t' ||
                        text[pos] == '\n' || text[pos] == '\r'))
      ++pos;
  }

  /// `depth` is the number of arrays and objects around the value.
  bool parseValue(Value &result, int depth) {
    result.sourceOffset = pos;
    if (atEnd())
      return failUnexpected("a value");
    if ((text[pos] == '{' || text[pos] == '[') && depth >= maxDepth)
      return fail("arrays and objects nested more than " +
                  std::to_string(maxDepth) + " levels deep");
    switch (text[pos]) {
    case '{':
      return parseObject(result, depth);
    case '[':
      return parseArray(result, depth);
    case '"':
      result.valueKind = Value::Kind::String;
      return parseString(result.stringValue);
    case 't':
      result.valueKind = Value::Kind::Bool;
      result.boolValue = true;
      return parseLiteral("true");
    case 'f':
      result.valueKind = Value::Kind::Bool;
      return parseLiteral("false");
    case 'n':
      result.valueKind = Value::Kind::Null;
      return parseLiteral("null");
    default:
      if (text[pos] == '-' || (text[pos] >= '0' && text[pos] <= '9'))
        return parseNumber(result);
      return failUnexpected("a value");
    }
  }

  bool parseLiteral(std::string_view literal) {
    for (char c : literal) {
      if (atEnd() || text[pos] != c)
        return failUnexpected(("'" + std::string(literal) + "'").c_str());
      ++pos;
    }
    return true;
  }

  bool parseObject(Value &result, int depth) {
    result.valueKind = Value::Kind::Object;
    ++pos; // '{'
    skipWhitespace();
    if (!atEnd() && text[pos] == '}') {
      ++pos;
      return true;
    }
    while (true) {
      skipWhitespace();
      if (atEnd() || text[pos] != '"')
        return failUnexpected("a member name string");
      size_t keyOffset = pos;
      std::string key;
      if (!parseString(key))
        return false;
      if (result.get(key))
        return failAt(keyOffset, "duplicate member name \"" + key + "\"");
      skipWhitespace();
      if (atEnd() || text[pos] != ':')
        return failUnexpected("':'");
      ++pos;
      skipWhitespace();
      Value member;
      if (!parseValue(member, depth + 1))
        return false;
      result.keys.push_back(std::move(key));
      result.elements.push_back(std::move(member));
      skipWhitespace();
      if (!atEnd() && text[pos] == ',') {
        ++pos;
        continue;
      }
      if (!atEnd() && text[pos] == '}') {
        ++pos;
        return true;
      }
      return failUnexpected("',' or '}'");
    }
  }

  bool parseArray(Value &result, int depth) {
    result.valueKind = Value::Kind::Array;
    ++pos; // '['
    skipWhitespace();
    if (!atEnd() && text[pos] == ']') {
      ++pos;
      return true;
    }
    while (true) {
      skipWhitespace();
      Value element;
      if (!parseValue(element, depth + 1))
        return false;
      result.elements.push_back(std::move(element));
      skipWhitespace();
      if (!atEnd() && text[pos] == ',') {
        ++pos;
        continue;
      }
      if (!atEnd() && text[pos] == ']') {
        ++pos;
        return true;
      }
      return failUnexpected("',' or ']'");
    }
  }

  bool parseHex4(unsigned &code) {
    code = 0;
    for (int i = 0; i < 4; ++i, ++pos) {
      if (atEnd())
        return failUnexpected("a hex digit");
      char c = text[pos];
      unsigned digit;
      if (c >= '0' && c <= '9')
        digit = c - '0';
      else if (c >= 'a' && c <= 'f')
        digit = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        digit = c - 'A' + 10;
      else
        return failUnexpected("a hex digit");
      code = code * 16 + digit;
    }
    return true;
  }

  static void appendUtf8(std::string &out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xc0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xe0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    }
  }

  /// The length of the well-formed UTF-8 sequence `bytes` starts with
  /// (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF);
  /// 0 if it does not start with one; -1 if `bytes` ends inside what would
  /// otherwise be one (a truncated text).
  static int utf8SequenceLength(std::string_view bytes) {
    unsigned lead = static_cast<unsigned char>(bytes[0]);
    // The range of the second byte depends on the lead byte (RFC 3629,
    // section 4); every later byte is 0x80..0xbf.
    int length;
    unsigned low = 0x80, high = 0xbf;
    if (lead >= 0xc2 && lead <= 0xdf) {
      length = 2;
    } else if (lead >= 0xe0 && lead <= 0xef) {
      length = 3;
      if (lead == 0xe0)
        low = 0xa0; // not overlong
      else if (lead == 0xed)
        high = 0x9f; // not a UTF-16 surrogate
    } else if (lead >= 0xf0 && lead <= 0xf4) {
      length = 4;
      if (lead == 0xf0)
        low = 0x90; // not overlong
      else if (lead == 0xf4)
        high = 0x8f; // not past U+10FFFF
    } else {
      return 0; // a continuation byte, 0xc0, 0xc1 or 0xf5..0xff
    }
    for (int i = 1; i < length; ++i) {
      if (static_cast<size_t>(i) >= bytes.size())
        return -1;
      unsigned byte = static_cast<unsigned char>(bytes[i]);
      if (i == 1 ? byte < low || byte > high : byte < 0x80 || byte > 0xbf)
        return 0;
    }
    return length;
  }

  bool parseString(std::string &out) {
    size_t start = pos;
    ++pos; // '"'
    while (true) {
      int sequence = 0;
      if (!atEnd() && static_cast<unsigned char>(text[pos]) >= 0x80)
        sequence = utf8SequenceLength(text.substr(pos));
      if (atEnd() || sequence < 0)
        return failAt(text.size(),
                      "unexpected end of input inside the string that "
                      "starts at byte " +
                          std::to_string(start) + " (truncated file?)");
      char c = text[pos];
      if (c == '"') {
        ++pos;
        return true;
      }
      unsigned char byte = static_cast<unsigned char>(c);
      if (byte < 0x20)
        return fail("control character (byte 0x" + hex(byte) +
                    ") inside a string (missing '\"'?); JSON escapes it");
      if (byte >= 0x80) {
        if (sequence == 0)
          return fail("invalid UTF-8 (byte 0x" + hex(byte) +
                      ") inside a string");
        out.append(text.substr(pos, sequence));
        pos += sequence;
        continue;
      }
      if (c != '\\') {
        out += c;
        ++pos;
        continue;
      }
      size_t backslash = pos++;
      if (atEnd())
        return failUnexpected("an escape character");
      char escape = text[pos++];
      switch (escape) {
      case '"':
      case '\\':
      case '/':
        out += escape;
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'u': {
        unsigned code;
        if (!parseHex4(code))
          return false;
        if (code >= 0xd800 && code < 0xdc00) {
          // A high surrogate must be followed by an escaped low surrogate.
          unsigned low = 0;
          for (char expected : {'\\', 'u'}) {
            if (atEnd())
              return failUnexpected("the low surrogate's \\u escape");
            if (text[pos] != expected)
              return failAt(backslash,
                            "unpaired UTF-16 surrogate in \\u escape");
            ++pos;
          }
          if (!parseHex4(low))
            return false;
          if (low < 0xdc00 || low >= 0xe000)
            return failAt(backslash,
                          "unpaired UTF-16 surrogate in \\u escape");
          code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
        } else if (code >= 0xdc00 && code < 0xe000) {
          return failAt(backslash, "unpaired UTF-16 surrogate in \\u escape");
        }
        appendUtf8(out, code);
        break;
      }
      default:
        return failAt(backslash, std::string("invalid escape '\\") +
                                     escape + "'");
      }
    }
  }

  bool parseNumber(Value &result) {
    size_t start = pos;
    bool integral = true;
    if (text[pos] == '-')
      ++pos;
    auto digits = [&] {
      size_t first = pos;
      while (!atEnd() && text[pos] >= '0' && text[pos] <= '9')
        ++pos;
      return pos - first;
    };
    if (atEnd() || !(text[pos] >= '0' && text[pos] <= '9'))
      return failUnexpected("a digit");
    if (text[pos] == '0')
      ++pos;
    else
      digits();
    if (!atEnd() && text[pos] == '.') {
      integral = false;
      ++pos;
      if (digits() == 0)
        return failUnexpected("a digit after '.'");
    }
    if (!atEnd() && (text[pos] == 'e' || text[pos] == 'E')) {
      integral = false;
      ++pos;
      if (!atEnd() && (text[pos] == '+' || text[pos] == '-'))
        ++pos;
      if (digits() == 0)
        return failUnexpected("a digit in the exponent");
    }
    // std::from_chars reads the C locale's spelling whatever the process's
    // locale is (strtod would stop at the '.' under a "," locale).
    const char *first = text.data() + start, *last = text.data() + pos;
    double number = 0.0;
    std::from_chars_result parsed = std::from_chars(first, last, number);
    if (parsed.ec != std::errc() || parsed.ptr != last ||
        !std::isfinite(number)) {
      std::string shown(text.substr(start, std::min<size_t>(pos - start, 40)));
      return failAt(start, "number " + shown + (pos - start > 40 ? "..." : "") +
                               " is outside the range of a double");
    }
    result.valueKind = Value::Kind::Number;
    result.numberValue = number;
    if (integral) {
      int64_t value = 0;
      parsed = std::from_chars(first, last, value);
      if (parsed.ec == std::errc() && parsed.ptr == last) {
        result.isInteger = true;
        result.integerValue = value;
      }
    }
    return true;
  }

  std::string_view text;
  size_t pos = 0;
  size_t errorOffset = 0;
  std::string errorMessage;
};

bool parse(std::string_view text, Value &result, ParseError &error) {
  Parser parser(text);
  result = Value();
  if (parser.parseDocument(result))
    return true;
  error = parser.takeError();
  return false;
}

} // namespace ce::json
