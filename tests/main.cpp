// Catch2 entry point shared by every test executable (Catch2 2.x or 3.x, see catch.h).
#if !__has_include(<catch2/catch_all.hpp>)
#define CATCH_CONFIG_RUNNER
#endif
#include "catch.h"

int main(int argc, char** argv) { return Catch::Session().run(argc, argv); }
