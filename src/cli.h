// cli.h: the trainer's command line as a function. trainer's main() (src/main.cpp) is this call alone;
// the test executable calls it too, in the processes its zygote forks for trainer runs (tests/zygote.h).
#pragma once

namespace sl {

// Parses argv (CLI11: train, plan, export, sample), runs the command and returns the exit code
// (src/errors.h); a command's errors are printed on stderr and mapped to their codes here.
int run_cli(int argc, char** argv);

}  // namespace sl
