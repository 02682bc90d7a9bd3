// tigon/core/status.hpp - the result of every launcher: success, a named bad argument, or a CUDA
// error. Launchers never throw and never abort.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "config.hpp"

TIGON_NAMESPACE_BEGIN

enum class Errc : int {
  success = 0,
  null_pointer,         // a required pointer is null
  invalid_size,         // a size is zero, negative or out of the supported range
  invalid_stride,       // a row stride is smaller than the row
  invalid_value,        // a scalar is out of range (eps < 0, ...)
  aliasing,             // an output overlaps an input where the op does not allow it
  workspace_too_small,  // the caller's workspace is smaller than *_workspace_bytes() asked for
  unsupported,          // a valid request this build or device cannot serve
  cuda_error,           // the CUDA runtime reported an error (see Status::cuda())
};

constexpr const char* errc_name(Errc e) noexcept {
  switch (e) {
    case Errc::success: return "success";
    case Errc::null_pointer: return "null pointer";
    case Errc::invalid_size: return "invalid size";
    case Errc::invalid_stride: return "invalid stride";
    case Errc::invalid_value: return "invalid value";
    case Errc::aliasing: return "aliasing";
    case Errc::workspace_too_small: return "workspace too small";
    case Errc::unsupported: return "unsupported";
    case Errc::cuda_error: return "CUDA error";
  }
  return "unknown";
}

// A status names the operation, the argument at fault and why, so that a message reads
// "tigon::rms_norm_backward: invalid stride: argument 'dy_stride': row stride 100 is smaller than
// the row (4096)".
// The strings it points to are string literals (op, argument) or held inline (detail).
// Launchers are [[nodiscard]]: a status is meant to be looked at.
class Status {
 public:
  constexpr Status() noexcept = default;

  static constexpr Status ok_status() noexcept { return Status(); }

  static Status error(Errc code, const char* op, const char* arg, std::string detail) {
    Status s;
    s.code_ = code;
    s.op_ = op;
    s.arg_ = arg;
    s.detail_ = std::move(detail);
    return s;
  }

  static Status from_cuda(cudaError_t e, const char* op, const char* what) {
    if (e == cudaSuccess) return Status();
    Status s;
    s.code_ = Errc::cuda_error;
    s.op_ = op;
    s.cuda_ = e;
    s.detail_ = what;
    return s;
  }

  constexpr bool ok() const noexcept { return code_ == Errc::success; }
  constexpr explicit operator bool() const noexcept { return ok(); }
  constexpr Errc code() const noexcept { return code_; }
  constexpr cudaError_t cuda() const noexcept { return cuda_; }
  constexpr const char* op() const noexcept { return op_; }
  // The argument at fault, or "" when the error is not about one argument.
  constexpr const char* argument() const noexcept { return arg_; }
  const std::string& detail() const noexcept { return detail_; }

  std::string message() const {
    if (ok()) return "success";
    std::string m = "tigon::";
    m += op_;
    m += ": ";
    m += errc_name(code_);
    if (arg_[0] != '\0') {
      m += ": argument '";
      m += arg_;
      m += "'";
    }
    if (!detail_.empty()) {
      m += ": ";
      m += detail_;
    }
    if (code_ == Errc::cuda_error && cuda_ != cudaSuccess) {  // a library's own status has no CUDA error
      m += ": ";
      m += cudaGetErrorName(cuda_);
      m += " (";
      m += cudaGetErrorString(cuda_);
      m += ")";
    }
    return m;
  }

 private:
  Errc code_ = Errc::success;
  cudaError_t cuda_ = cudaSuccess;
  const char* op_ = "";
  const char* arg_ = "";
  std::string detail_;
};

// Run checks in order and return the first failure.
#define TIGON_CHECK(expr)                  \
  do {                                     \
    ::tigon::Status tigon_status_ = (expr); \
    if (!tigon_status_.ok()) return tigon_status_; \
  } while (0)

TIGON_NAMESPACE_END
