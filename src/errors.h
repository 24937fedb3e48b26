// Error types that library code throws; only main() turns them into exit codes (see README "Exit codes").
#pragma once
#include <stdexcept>
#include <string>

namespace sl {

enum ExitCode : int {
  kExitOk = 0,
  kExitInternal = 1,     // a consistency check failed (e.g. a recompute differs from its forward)
  kExitConfig = 2,       // usage or recipe error
  kExitData = 3,         // data file missing, malformed or incompatible
  kExitOom = 4,          // out of memory (real or simulated)
  kExitDistributed = 5,  // rendezvous, collective timeout, peer died
  kExitNonFinite = 6,    // loss or gradients became NaN/Inf (or fp16 kept skipping) and the run aborted
  kExitIo = 7,           // a file could not be written (disk full, permissions); earlier records stay valid
  kExitSigint = 130,     // interrupted by SIGINT after writing the summary
  kExitSigterm = 143,    // interrupted by SIGTERM after writing the summary
};

// Base: every error carries the exit code main() should return.
struct Error : std::runtime_error {
  int code;
  Error(int exit_code, const std::string& what) : std::runtime_error(what), code(exit_code) {}
};
struct ConfigError : Error {
  explicit ConfigError(const std::string& what) : Error(kExitConfig, what) {}
};
struct DataError : Error {
  explicit DataError(const std::string& what) : Error(kExitData, what) {}
};
struct NonFiniteError : Error {
  explicit NonFiniteError(const std::string& what) : Error(kExitNonFinite, what) {}
};
struct IoError : Error {
  explicit IoError(const std::string& what) : Error(kExitIo, what) {}
};
struct OomError : Error {
  explicit OomError(const std::string& what) : Error(kExitOom, what) {}
};

// Throws the Error of exit code `code` (ConfigError for kExitConfig, IoError for kExitIo, ...; Error
// itself for the others): how an error one rank hit is raised again on the ranks that agreed on it.
[[noreturn]] void throw_as(int code, const std::string& what);

// Short name of an exit code for logs ("ok", "config_error", ...).
const char* exit_code_name(int code);

}  // namespace sl
