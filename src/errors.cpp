// Names of the exit codes, as written into summary.json.
#include "errors.h"

namespace sl {

void throw_as(int code, const std::string& what) {
  switch (code) {
    case kExitConfig: throw ConfigError(what);
    case kExitData: throw DataError(what);
    case kExitOom: throw OomError(what);
    case kExitNonFinite: throw NonFiniteError(what);
    case kExitIo: throw IoError(what);
    default: throw Error(code, what);
  }
}

const char* exit_code_name(int code) {
  switch (code) {
    case kExitOk: return "ok";
    case kExitInternal: return "internal_error";
    case kExitConfig: return "config_error";
    case kExitData: return "data_error";
    case kExitOom: return "out_of_memory";
    case kExitDistributed: return "distributed_failure";
    case kExitNonFinite: return "non_finite";
    case kExitIo: return "io_error";
    case kExitSigint: return "interrupted_sigint";
    case kExitSigterm: return "interrupted_sigterm";
    default: return "error";
  }
}

}  // namespace sl
