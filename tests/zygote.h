// zygote.h: trainer runs without a trainer process start each. A process start costs ~0.4-1 CPU-s of
// LibTorch loading (operator registration, relocations, page faults) and the suite starts several
// hundred trainers. The test executable links the trainer's command line (src/cli.h), so at its start,
// before any case runs, it forks a zygote: a copy of itself with every library loaded and nothing run
// (no tensor, no thread, no CUDA). For each run the zygote forks a waiter, the waiter forks the run,
// and the run sets the environment, directory and output the shell would have set and calls
// sl::run_cli(argc, argv), then exit() with its value, as the trainer binary's main() does. The run is
// a process of its own (its own pid, memory, exit status; signals reach it), in a fresh copy of the
// loaded libraries, so it starts from the state a trainer process starts from.
//
// What a run may differ in from the zygote: only what the trainer reads when it runs, not what the
// libraries read when they load. A command whose environment differs from the test process's at start
// in any variable outside kRunTimeVariables (OMP_NUM_THREADS, MKL_*, LD_*, ... are read at load time)
// goes to the shell as before, and so does every command that is not a plain trainer run (pipes,
// redirections, subshells, `$(...)`, another program). SUBLINEAR_TEST_EXEC=1 sends every run to the shell
// (the trainer binary itself); so does a trainer named by SUBLINEAR_TRAINER (bench/gpu.sh's carried one).
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace sl::test::zygote {

// A trainer run taken apart from its shell command line.
struct Command {
  std::string cwd;                 // `cd DIR &&`; empty: the test process's directory
  std::vector<std::string> env;    // the whole environment of the run, NAME=VALUE
  std::vector<std::string> argv;   // argv[0]: the trainer's path
};

// Variables a trainer reads while it runs (never while its libraries load): a run may set or unset them.
// Prefixes end in '_'.
inline const std::vector<std::string> kRunTimeVariables = {
    "SUBLINEAR_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};

// Forks the zygote (tests/main.cpp, first thing in main). `trainer`: the path runs must name.
void start(const std::string& trainer);
bool running();

// The words of `s` as the shell splits and unquotes them (wordexp: quotes, `$VAR`, globs; no command
// substitution); nullopt for a pipe, redirection, list, subshell, command substitution or newline.
std::optional<std::vector<std::string>> words(const std::string& s);

// `cmd` (a `sh -c` line) as a run the zygote may take: `[cd DIR &&] [NAME=VALUE...] [env [-u NAME |
// NAME=VALUE]...] TRAINER ARGS...`, words split and unquoted as the shell does (wordexp, no command
// substitution), the environment this process's with those changes, within kRunTimeVariables of the
// zygote's. nullopt for anything else.
std::optional<Command> parse(const std::string& cmd);

// A run started by the zygote: its pid, and where its exit status arrives.
struct Run {
  int pid = -1;
  int reply = -1;
};
// Starts `c` with stdout and stderr on `out_fd`; nullopt when the zygote is not running.
std::optional<Run> spawn(const Command& c, int out_fd);
// Waits for the run's end: its exit code, or 128 + the signal that ended it (as the shell reports it).
int wait(Run& run);

// The whole of a run: exit status and stdout+stderr together; nullopt when the zygote cannot take it.
struct Output {
  int code;
  std::string text;
};
std::optional<Output> run(const std::string& cmd);

}  // namespace sl::test::zygote
