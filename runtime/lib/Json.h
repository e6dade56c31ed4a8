//===- Json.h - A small JSON reader for bundle manifests --------*- C++ -*-===//
//
// Internal to the runtime (not installed). Reads RFC 8259 JSON into a tree of
// values that remember their byte offset in the source, so manifest errors
// can point at the offending text. No external dependencies.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_JSON_H
#define CE_RUNTIME_JSON_H

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ce::json {

/// One JSON value. Objects keep their members in source order.
class Value {
public:
  enum class Kind { Null, Bool, Number, String, Array, Object };

  Kind kind() const { return valueKind; }
  bool isNull() const { return valueKind == Kind::Null; }
  bool isBool() const { return valueKind == Kind::Bool; }
  bool isNumber() const { return valueKind == Kind::Number; }
  bool isString() const { return valueKind == Kind::String; }
  bool isArray() const { return valueKind == Kind::Array; }
  bool isObject() const { return valueKind == Kind::Object; }

  bool getBool() const { return boolValue; }
  double getNumber() const { return numberValue; }
  /// The value of a number written without fraction or exponent that fits in
  /// an int64_t; std::nullopt for any other value.
  std::optional<int64_t> getInteger() const {
    if (valueKind == Kind::Number && isInteger)
      return integerValue;
    return std::nullopt;
  }
  const std::string &getString() const { return stringValue; }
  const std::vector<Value> &getArray() const { return elements; }

  /// Object members, in source order.
  const std::vector<std::string> &memberKeys() const { return keys; }
  const std::vector<Value> &memberValues() const { return elements; }
  /// The member named `key` of an object, or null if absent (or not an
  /// object).
  const Value *get(std::string_view key) const;

  /// Byte offset of the value's first character in the parsed text.
  size_t offset() const { return sourceOffset; }

  /// Human-readable kind ("string", "object", ...), for messages.
  static const char *kindName(Kind kind);

private:
  friend class Parser;

  Kind valueKind = Kind::Null;
  bool boolValue = false;
  bool isInteger = false;
  double numberValue = 0.0;
  int64_t integerValue = 0;
  std::string stringValue;
  /// Array elements, or object member values (paired with `keys`).
  std::vector<Value> elements;
  std::vector<std::string> keys;
  size_t sourceOffset = 0;
};

/// Where and why parsing failed.
struct ParseError {
  std::string message;
  size_t offset = 0; ///< Byte offset of the problem.
  size_t line = 1;   ///< 1-based.
  size_t column = 1; ///< 1-based, in bytes.
};

/// Parses `text` as one JSON document (surrounding whitespace allowed).
/// Returns false and fills `error` on malformed or truncated input, a
/// duplicate member name, a string that is not well-formed UTF-8, a number
/// outside a double's range, or arrays and objects nested more than 128
/// deep.
bool parse(std::string_view text, Value &result, ParseError &error);

} // namespace ce::json

#endif // CE_RUNTIME_JSON_H
