# Writes OUT, a header defining SUBLINEAR_COMMIT (the commit the checkout at SOURCE_DIR is at:
# `git describe --always --dirty`, e.g. 3656bbe or 3656bbe-dirty) and SUBLINEAR_BUILD_TYPE (BUILD_TYPE);
# the commit is "unknown" without git or when SOURCE_DIR is not the top of a git checkout (a source
# archive unpacked inside another repository). CMakeLists.txt runs it at every build; the file is
# rewritten only when its text changes, so a build at the same commit recompiles nothing and a build
# after a new commit (or an edit that makes the tree dirty) carries the new one.
# Usage: cmake -DSOURCE_DIR=<repo> -DOUT=<header> -DBUILD_TYPE=<type> -P cmake/build_commit.cmake
find_package(Git QUIET)
set(commit "unknown")
if(GIT_FOUND)
  # --no-optional-locks: never take the index lock, so a build beside a running `git commit` cannot fail it.
  execute_process(COMMAND "${GIT_EXECUTABLE}" --no-optional-locks -C "${SOURCE_DIR}" rev-parse --show-toplevel
                  OUTPUT_VARIABLE top RESULT_VARIABLE top_rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  file(REAL_PATH "${SOURCE_DIR}" source_real)
  if(top_rc EQUAL 0 AND top)
    file(REAL_PATH "${top}" top_real)
  endif()
  if(top_rc EQUAL 0 AND top_real STREQUAL source_real)
    execute_process(COMMAND "${GIT_EXECUTABLE}" --no-optional-locks -C "${SOURCE_DIR}" describe --always --dirty
                    OUTPUT_VARIABLE described RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(rc EQUAL 0 AND described)
      set(commit "${described}")
    endif()
  endif()
endif()
set(text "// Generated at build time by cmake/build_commit.cmake; not part of the source tree.\n#pragma once\n#define SUBLINEAR_COMMIT \"${commit}\"\n#define SUBLINEAR_BUILD_TYPE \"${BUILD_TYPE}\"\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
