//===- Status.h - Error values inside the runtime ---------------*- C++ -*-===//
//
// Internal to the runtime (not installed). The C++ layers report failures as
// a ce::Status (a ce_status code plus a message); the C API turns it into a
// return code and the thread-local last-error message.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_STATUS_H
#define CE_RUNTIME_STATUS_H

#include "ce/runtime/ce_runtime.h"

#include <cstdint>
#include <string>
#include <utility>

namespace ce {

/// A ce_status and, when it is not CE_OK, why.
class [[nodiscard]] Status {
public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status error(ce_status code, std::string message) {
    Status status;
    status.statusCode = code;
    status.text = std::move(message);
    return status;
  }
  static Status invalidArgument(std::string message) {
    return error(CE_ERROR_INVALID_ARGUMENT, std::move(message));
  }
  static Status bundleError(std::string message) {
    return error(CE_ERROR_BUNDLE, std::move(message));
  }

  bool isOk() const { return statusCode == CE_OK; }
  ce_status code() const { return statusCode; }
  const std::string &message() const { return text; }

private:
  ce_status statusCode = CE_OK;
  std::string text;
};

/// Formats "[a, b, c]" for sizes and strides in messages.
std::string formatDims(const int64_t *values, int count);

} // namespace ce

#endif // CE_RUNTIME_STATUS_H
