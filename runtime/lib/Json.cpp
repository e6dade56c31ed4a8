//===- Json.cpp - A small JSON reader for bundle manifests ----------------===//
//
// A recursive-descent reader for RFC 8259 JSON. It is strict (no comments,
// no trailing commas, no NaN literals) because a manifest is written by a
// program, and a lenient reader would hide a broken writer.
//
//===----------------------------------------------------------------------===//

#include "Json.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

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
  /// Nesting deeper than this is rejected rather than risking the stack.
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

  bool parseValue(Value &result, int depth) {
    if (depth > maxDepth)
      return fail("JSON nested more than " + std::to_string(maxDepth) +
                  " levels deep");
    result.sourceOffset = pos;
    if (atEnd())
      return failUnexpected("a value");
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

  bool parseString(std::string &out) {
    size_t start = pos;
    ++pos; // '"'
    while (true) {
      if (atEnd())
        return failAt(pos, "unexpected end of input inside the string that "
                           "starts at byte " +
                               std::to_string(start) + " (truncated file?)");
      char c = text[pos];
      if (c == '"') {
        ++pos;
        return true;
      }
      if (static_cast<unsigned char>(c) < 0x20)
        return fail("control character inside a string (missing '\"'?)");
      if (c != '\\') {
        out += c;
        ++pos;
        continue;
      }
      ++pos;
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
          if (text.substr(pos, 2) != "\\u")
            return fail("unpaired UTF-16 surrogate in \\u escape");
          pos += 2;
          if (!parseHex4(low))
            return false;
          if (low < 0xdc00 || low >= 0xe000)
            return fail("unpaired UTF-16 surrogate in \\u escape");
          code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
        } else if (code >= 0xdc00 && code < 0xe000) {
          return fail("unpaired UTF-16 surrogate in \\u escape");
        }
        appendUtf8(out, code);
        break;
      }
      default:
        --pos;
        return fail(std::string("invalid escape '\\") + escape + "'");
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
    std::string literal(text.substr(start, pos - start));
    result.valueKind = Value::Kind::Number;
    result.numberValue = std::strtod(literal.c_str(), nullptr);
    if (integral) {
      errno = 0;
      long long value = std::strtoll(literal.c_str(), nullptr, 10);
      if (errno == 0) {
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
